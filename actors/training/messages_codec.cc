// actors/training/messages_codec.cc — the Cap'n Proto codec of actors/training/messages.h.
// Compiled as C++17: Cap'n Proto 0.9.2 headers fail under GCC 13 in C++20 mode.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>
#include <memory>

#include "actors/training/messages.capnp.h"
#include "actors/training/messages.h"

namespace troupe::training {
namespace {

constexpr size_t kMaxBytes = size_t{1} << 20;  // a status is a few hundred bytes

std::string flat(capnp::MessageBuilder& mb) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(mb);
  auto b = words.asBytes();
  return std::string(reinterpret_cast<const char*>(b.begin()), b.size());
}

// Runs `read` over `bytes` as a Cap'n Proto message with tight limits; any exception
// (malformed, truncated, too deep) becomes DataLoss naming `what`.
template <class Fn>
auto read_message(std::string_view bytes, const char* what, Fn read) -> decltype(read(std::declval<capnp::MessageReader&>())) {
  if (bytes.size() > kMaxBytes) return data_loss("{}: {} bytes is over the {} byte limit", what, bytes.size(), kMaxBytes);
  if (bytes.empty() || bytes.size() % sizeof(capnp::word) != 0) {
    return data_loss("{}: {} bytes is not a whole number of 8-byte words", what, bytes.size());
  }
  // An aligned copy: frames carry no alignment guarantee.
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  capnp::ReaderOptions opt;
  opt.traversalLimitInWords = 1 << 16;
  opt.nestingLimit = 8;
  try {
    capnp::FlatArrayMessageReader reader(words.asPtr(), opt);
    return read(reader);
  } catch (const kj::Exception& e) {
    return data_loss("{}: malformed message: {}", what, std::string(e.getDescription().cStr()));
  }
}

}  // namespace

std::string encode_actor_status_query(const ActorStatusQuery& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::ActorStatusQuery>();
  b.setRequester(m.requester);
  return flat(mb);
}

Result<ActorStatusQuery> decode_actor_status_query(std::string_view bytes) {
  return read_message(bytes, "ActorStatusQuery", [](capnp::MessageReader& r) -> Result<ActorStatusQuery> {
    auto q = r.getRoot<::ActorStatusQuery>();
    ActorStatusQuery m;
    m.requester = q.getRequester();
    return m;
  });
}

std::string encode_actor_status(const ActorStatus& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::ActorStatus>();
  b.setId(m.id);
  b.setRole(m.role);
  b.setRank(m.rank);
  b.setSlot(m.slot);
  b.setEpoch(m.epoch);
  b.setState(m.state);
  b.setStepsDone(m.steps_done);
  b.setLastStepMs(m.last_step_ms);
  b.setParams(m.params);
  b.setDevice(m.device);
  b.setHost(m.host);
  b.setPid(m.pid);
  return flat(mb);
}

Result<ActorStatus> decode_actor_status(std::string_view bytes) {
  return read_message(bytes, "ActorStatus", [](capnp::MessageReader& r) -> Result<ActorStatus> {
    auto s = r.getRoot<::ActorStatus>();
    ActorStatus m;
    m.id = s.getId();
    m.role = s.getRole();
    m.rank = s.getRank();
    m.slot = s.getSlot();
    m.epoch = s.getEpoch();
    m.state = s.getState();
    m.steps_done = s.getStepsDone();
    m.last_step_ms = s.getLastStepMs();
    m.params = s.getParams();
    m.device = s.getDevice();
    m.host = s.getHost();
    m.pid = s.getPid();
    return m;
  });
}

}  // namespace troupe::training
