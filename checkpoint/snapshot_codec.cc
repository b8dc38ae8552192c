// checkpoint/snapshot_codec.cc — the Cap'n Proto codec of checkpoint/snapshot_protocol.h.
// Compiled as C++17: Cap'n Proto 0.9.2 headers fail under GCC 13 in C++20 mode.

#include <memory>

#include "checkpoint/snapshot.capnp.h"
#include "checkpoint/snapshot_protocol.h"
#include "core/capnp_io.h"

namespace troupe::checkpoint {
namespace {

constexpr CapnpLimits kLimits{size_t{4} << 20,
                              uint64_t{1} << 20};  // a query of many parts is a few hundred KB

struct RequestEncoder {
  ::SnapRequest::Builder b;
  void operator()(const SnapAttach& m) {
    auto x = b.initAttach();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setBytes(m.bytes);
  }
  void operator()(const SnapBegin& m) {
    auto x = b.initBegin();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setGen(m.gen);
    x.setStep(m.step);
  }
  void operator()(const SnapLanded& m) {
    auto x = b.initLanded();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setGen(m.gen);
    x.setStep(m.step);
  }
  void operator()(const SnapCommit& m) {
    auto x = b.initCommit();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setStep(m.step);
    x.setReplicateTo(m.replicate_to);
  }
  void operator()(const SnapFetch& m) {
    auto x = b.initFetch();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setStep(m.step);
    auto s = x.initSources(static_cast<unsigned>(m.sources.size()));
    for (size_t i = 0; i < m.sources.size(); ++i) s.set(static_cast<unsigned>(i), m.sources[i]);
  }
  void operator()(const SnapQuery& m) { b.initQuery().setJob(m.job); }
  void operator()(const SnapRelease& m) {
    auto x = b.initRelease();
    x.setJob(m.job);
    x.setRank(m.rank);
  }
  void operator()(const SnapPut& m) {
    auto x = b.initPut();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setStep(m.step);
    x.setBytes(m.bytes);
    x.setFromNode(m.from_node);
  }
  void operator()(const SnapGet& m) {
    auto x = b.initGet();
    x.setJob(m.job);
    x.setRank(m.rank);
    x.setStep(m.step);
  }
};

}  // namespace

std::string encode_snap_request(const SnapRequest& m) {
  capnp::MallocMessageBuilder mb;
  std::visit(RequestEncoder{mb.initRoot<::SnapRequest>()}, m);
  return to_flat_bytes(mb);
}

Result<SnapRequest> decode_snap_request(std::string_view bytes) {
  return read_flat_message(bytes, "SnapRequest", kLimits, [](capnp::MessageReader& r) -> Result<SnapRequest> {
    auto q = r.getRoot<::SnapRequest>();
    switch (q.which()) {
      case ::SnapRequest::ATTACH: {
        auto x = q.getAttach();
        return SnapRequest(SnapAttach{x.getJob(), x.getRank(), x.getBytes()});
      }
      case ::SnapRequest::BEGIN: {
        auto x = q.getBegin();
        return SnapRequest(SnapBegin{x.getJob(), x.getRank(), x.getGen(), x.getStep()});
      }
      case ::SnapRequest::LANDED: {
        auto x = q.getLanded();
        return SnapRequest(SnapLanded{x.getJob(), x.getRank(), x.getGen(), x.getStep()});
      }
      case ::SnapRequest::COMMIT: {
        auto x = q.getCommit();
        return SnapRequest(SnapCommit{x.getJob(), x.getRank(), x.getStep(), x.getReplicateTo()});
      }
      case ::SnapRequest::FETCH: {
        auto x = q.getFetch();
        SnapFetch f{x.getJob(), x.getRank(), x.getStep(), {}};
        for (auto s : x.getSources()) f.sources.emplace_back(s);
        return SnapRequest(std::move(f));
      }
      case ::SnapRequest::QUERY:
        return SnapRequest(SnapQuery{q.getQuery().getJob()});
      case ::SnapRequest::RELEASE: {
        auto x = q.getRelease();
        return SnapRequest(SnapRelease{x.getJob(), x.getRank()});
      }
      case ::SnapRequest::PUT: {
        auto x = q.getPut();
        return SnapRequest(SnapPut{x.getJob(), x.getRank(), x.getStep(), x.getBytes(), x.getFromNode()});
      }
      case ::SnapRequest::GET: {
        auto x = q.getGet();
        return SnapRequest(SnapGet{x.getJob(), x.getRank(), x.getStep()});
      }
    }
    return data_loss("SnapRequest: unknown request kind {}", static_cast<int>(q.which()));
  });
}

std::string encode_snap_reply(const SnapReply& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::SnapReply>();
  b.setCode(m.code);
  b.setText(m.text);
  b.setNode(m.node);
  b.setEndpoint(m.endpoint);
  auto gens = b.initGens(static_cast<unsigned>(m.gens.size()));
  for (size_t i = 0; i < m.gens.size(); ++i) {
    gens[static_cast<unsigned>(i)].setStep(m.gens[i].step);
    gens[static_cast<unsigned>(i)].setState(m.gens[i].state);
  }
  auto held = b.initHeld(static_cast<unsigned>(m.held.size()));
  for (size_t i = 0; i < m.held.size(); ++i) {
    const SnapHeld& h = m.held[i];
    auto x = held[static_cast<unsigned>(i)];
    x.setJob(h.job);
    x.setRank(h.rank);
    x.setStep(h.step);
    x.setBytes(h.bytes);
    x.setReplica(h.replica);
    x.setFromNode(h.from_node);
    x.setCommitted(h.committed);
    x.setReplicatedTo(h.replicated_to);
    x.setReplicatedStep(h.replicated_step);
  }
  b.setBytes(m.bytes);
  return to_flat_bytes(mb);
}

Result<SnapReply> decode_snap_reply(std::string_view bytes) {
  return read_flat_message(bytes, "SnapReply", kLimits, [](capnp::MessageReader& r) -> Result<SnapReply> {
    auto q = r.getRoot<::SnapReply>();
    SnapReply m;
    m.code = q.getCode();
    m.text = q.getText();
    m.node = q.getNode();
    m.endpoint = q.getEndpoint();
    for (auto g : q.getGens()) m.gens.push_back(SnapGen{g.getStep(), g.getState()});
    for (auto h : q.getHeld()) {
      m.held.push_back(SnapHeld{h.getJob(), h.getRank(), h.getStep(), h.getBytes(), h.getReplica(),
                                h.getFromNode(), h.getCommitted(), h.getReplicatedTo(),
                                h.getReplicatedStep()});
    }
    m.bytes = q.getBytes();
    return m;
  });
}

}  // namespace troupe::checkpoint
