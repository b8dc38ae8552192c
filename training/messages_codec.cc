// training/messages_codec.cc — the Cap'n Proto codec of training/messages.h.
// Compiled as C++17: Cap'n Proto 0.9.2 headers fail under GCC 13 in C++20 mode.

#include <memory>

#include "core/capnp_io.h"
#include "training/messages.capnp.h"
#include "training/messages.h"

namespace troupe::training {
namespace {

constexpr CapnpLimits kLimits{size_t{1} << 20, uint64_t{1} << 16};  // a status is a few hundred bytes

}  // namespace

std::string encode_actor_status_query(const ActorStatusQuery& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::ActorStatusQuery>();
  b.setRequester(m.requester);
  return to_flat_bytes(mb);
}

Result<ActorStatusQuery> decode_actor_status_query(std::string_view bytes) {
  return read_flat_message(bytes, "ActorStatusQuery", kLimits,
                           [](capnp::MessageReader& r) -> Result<ActorStatusQuery> {
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
  return to_flat_bytes(mb);
}

Result<ActorStatus> decode_actor_status(std::string_view bytes) {
  return read_flat_message(bytes, "ActorStatus", kLimits, [](capnp::MessageReader& r) -> Result<ActorStatus> {
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

std::string encode_elastic_plan(const ElasticPlan& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::ElasticPlan>();
  b.setEpoch(m.epoch);
  b.setDp(m.dp);
  b.setGradAccum(m.grad_accum);
  auto slots = b.initSlots(static_cast<unsigned>(m.slots.size()));
  for (size_t i = 0; i < m.slots.size(); ++i) slots.set(static_cast<unsigned>(i), m.slots[i]);
  auto has = b.initHasState(static_cast<unsigned>(m.has_state.size()));
  for (size_t i = 0; i < m.has_state.size(); ++i) has.set(static_cast<unsigned>(i), m.has_state[i]);
  b.setStepDone(m.step_done);
  b.setSeq(m.seq);
  b.setReason(m.reason);
  b.setCheckpoint(m.checkpoint);
  b.setCkptEvery(m.ckpt_every);
  b.setCkptDir(m.ckpt_dir);
  b.setSnapshotStep(m.snapshot_step);
  b.setSnapshotEvery(m.snapshot_every);
  b.setSnapshotDp(m.snapshot_dp);
  b.setSnapshotCommitted(m.snapshot_committed);
  auto parts = b.initSnapshotParts(static_cast<unsigned>(m.snapshot_parts.size()));
  for (size_t i = 0; i < m.snapshot_parts.size(); ++i) {
    const PartSource& src = m.snapshot_parts[i];
    auto ps = parts[static_cast<unsigned>(i)];
    auto eps = ps.initEndpoints(static_cast<unsigned>(src.endpoints.size()));
    for (size_t j = 0; j < src.endpoints.size(); ++j) eps.set(static_cast<unsigned>(j), src.endpoints[j]);
    ps.setXxh64(src.xxh64);
  }
  return to_flat_bytes(mb);
}

Result<ElasticPlan> decode_elastic_plan(std::string_view bytes) {
  return read_flat_message(bytes, "ElasticPlan", kLimits, [](capnp::MessageReader& r) -> Result<ElasticPlan> {
    auto p = r.getRoot<::ElasticPlan>();
    ElasticPlan m;
    m.epoch = p.getEpoch();
    m.dp = p.getDp();
    m.grad_accum = p.getGradAccum();
    for (int32_t s : p.getSlots()) m.slots.push_back(s);
    for (bool h : p.getHasState()) m.has_state.push_back(h);
    m.step_done = p.getStepDone();
    m.seq = p.getSeq();
    m.reason = p.getReason();
    m.checkpoint = p.getCheckpoint();
    m.ckpt_every = p.getCkptEvery();
    m.ckpt_dir = p.getCkptDir();
    m.snapshot_step = p.getSnapshotStep();
    m.snapshot_every = p.getSnapshotEvery();
    m.snapshot_dp = p.getSnapshotDp();
    m.snapshot_committed = p.getSnapshotCommitted();
    for (auto ps : p.getSnapshotParts()) {
      PartSource src;
      for (auto e : ps.getEndpoints()) src.endpoints.emplace_back(e);
      src.xxh64 = ps.getXxh64();
      m.snapshot_parts.push_back(std::move(src));
    }
    if (m.slots.size() != m.has_state.size() || m.dp < 1 || m.grad_accum < 1) {
      return data_loss(
          "ElasticPlan: inconsistent plan of epoch {} ({} slots, {} has_state, dp {}, grad_accum {})",
          m.epoch, m.slots.size(), m.has_state.size(), m.dp, m.grad_accum);
    }
    return m;
  });
}

std::string encode_step_command(const StepCommand& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::StepCommand>();
  b.setSeq(m.seq);
  b.setKind(m.kind);
  b.setStep(m.step);
  b.setEpoch(m.epoch);
  return to_flat_bytes(mb);
}

Result<StepCommand> decode_step_command(std::string_view bytes) {
  return read_flat_message(bytes, "StepCommand", kLimits, [](capnp::MessageReader& r) -> Result<StepCommand> {
    auto c = r.getRoot<::StepCommand>();
    if (c.getKind() > 4) return data_loss("StepCommand: unknown kind {}", c.getKind());
    return StepCommand{c.getSeq(), c.getKind(), c.getStep(), c.getEpoch()};
  });
}

std::string encode_step_reply(const StepReply& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::StepReply>();
  b.setSeq(m.seq);
  b.setEpoch(m.epoch);
  b.setRank(m.rank);
  b.setSlot(m.slot);
  b.setKind(m.kind);
  b.setStep(m.step);
  b.setLoss(m.loss);
  b.setLmLoss(m.lm_loss);
  b.setAuxLoss(m.aux_loss);
  b.setGradNorm(m.grad_norm);
  b.setLr(m.lr);
  b.setStepTokens(m.step_tokens);
  auto rows = b.initExpertLoad(static_cast<unsigned>(m.expert_load.size()));
  for (size_t i = 0; i < m.expert_load.size(); ++i) {
    auto c = rows[static_cast<unsigned>(i)].initCounts(static_cast<unsigned>(m.expert_load[i].size()));
    for (size_t j = 0; j < m.expert_load[i].size(); ++j) c.set(static_cast<unsigned>(j), m.expert_load[i][j]);
  }
  b.setStepMs(m.step_ms);
  b.setCommMs(m.comm_ms);
  b.setComputeMs(m.compute_ms);
  b.setCommMsMean(m.comm_ms_mean);
  auto kinds = b.initCommByKindMs(static_cast<unsigned>(m.comm_by_kind_ms.size()));
  unsigned k = 0;
  for (const auto& [name, v] : m.comm_by_kind_ms) {
    kinds[k].setName(name);
    kinds[k].setValue(v);
    ++k;
  }
  b.setPeakBytes(m.peak_bytes);
  b.setValLoss(m.val_loss);
  b.setCkptStarted(m.ckpt_started);
  b.setCkptBlockedMs(m.ckpt_blocked_ms);
  b.setCkptBytes(m.ckpt_bytes);
  auto durable = b.initDurable(static_cast<unsigned>(m.durable.size()));
  for (size_t i = 0; i < m.durable.size(); ++i) durable.set(static_cast<unsigned>(i), m.durable[i]);
  auto errs = b.initCkptErrors(static_cast<unsigned>(m.ckpt_errors.size()));
  for (size_t i = 0; i < m.ckpt_errors.size(); ++i) {
    errs[static_cast<unsigned>(i)].setStep(m.ckpt_errors[i].first);
    errs[static_cast<unsigned>(i)].setText(m.ckpt_errors[i].second);
  }
  b.setSnapshot(m.snapshot);
  b.setSnapshotMs(m.snapshot_ms);
  b.setSnapshotWaitMs(m.snapshot_wait_ms);
  b.setSnapshotReplicated(m.snapshot_replicated);
  auto serrs = b.initSnapshotErrors(static_cast<unsigned>(m.snapshot_errors.size()));
  for (size_t i = 0; i < m.snapshot_errors.size(); ++i) {
    serrs[static_cast<unsigned>(i)].setStep(m.snapshot_errors[i].first);
    serrs[static_cast<unsigned>(i)].setText(m.snapshot_errors[i].second);
  }
  b.setHostSyncs(m.host_syncs);
  b.setUploadWaits(m.upload_waits);
  b.setActivationBytes(m.activation_bytes);
  b.setDeviceMs(m.device_ms);
  b.setDeviceGapMs(m.device_gap_ms);
  b.setLaunchedAhead(m.launched_ahead);
  b.setNextQueued(m.next_queued);
  b.setCommandWaitMs(m.command_wait_ms);
  b.setRssPeakBytes(m.rss_peak_bytes);
  return to_flat_bytes(mb);
}

Result<StepReply> decode_step_reply(std::string_view bytes) {
  return read_flat_message(bytes, "StepReply", kLimits, [](capnp::MessageReader& r) -> Result<StepReply> {
    auto s = r.getRoot<::StepReply>();
    StepReply m;
    m.seq = s.getSeq();
    m.epoch = s.getEpoch();
    m.rank = s.getRank();
    m.slot = s.getSlot();
    m.kind = s.getKind();
    if (m.kind > 4) return data_loss("StepReply: unknown kind {}", m.kind);
    m.step = s.getStep();
    m.loss = s.getLoss();
    m.lm_loss = s.getLmLoss();
    m.aux_loss = s.getAuxLoss();
    m.grad_norm = s.getGradNorm();
    m.lr = s.getLr();
    m.step_tokens = s.getStepTokens();
    for (auto row : s.getExpertLoad()) {
      std::vector<int64_t> counts;
      for (int64_t c : row.getCounts()) counts.push_back(c);
      m.expert_load.push_back(std::move(counts));
    }
    m.step_ms = s.getStepMs();
    m.comm_ms = s.getCommMs();
    m.compute_ms = s.getComputeMs();
    m.comm_ms_mean = s.getCommMsMean();
    for (auto kv : s.getCommByKindMs()) m.comm_by_kind_ms[kv.getName()] = kv.getValue();
    m.peak_bytes = s.getPeakBytes();
    m.val_loss = s.getValLoss();
    m.ckpt_started = s.getCkptStarted();
    m.ckpt_blocked_ms = s.getCkptBlockedMs();
    m.ckpt_bytes = s.getCkptBytes();
    for (int64_t d : s.getDurable()) m.durable.push_back(d);
    for (auto e : s.getCkptErrors()) m.ckpt_errors.emplace_back(e.getStep(), std::string(e.getText()));
    m.snapshot = s.getSnapshot();
    m.snapshot_ms = s.getSnapshotMs();
    m.snapshot_wait_ms = s.getSnapshotWaitMs();
    m.snapshot_replicated = s.getSnapshotReplicated();
    for (auto e : s.getSnapshotErrors())
      m.snapshot_errors.emplace_back(e.getStep(), std::string(e.getText()));
    m.host_syncs = s.getHostSyncs();
    m.upload_waits = s.getUploadWaits();
    m.activation_bytes = s.getActivationBytes();
    m.device_ms = s.getDeviceMs();
    m.device_gap_ms = s.getDeviceGapMs();
    m.launched_ahead = s.getLaunchedAhead();
    m.next_queued = s.getNextQueued();
    m.command_wait_ms = s.getCommandWaitMs();
    m.rss_peak_bytes = s.getRssPeakBytes();
    return m;
  });
}

std::string encode_worker_failure(const WorkerFailure& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::WorkerFailure>();
  b.setEpoch(m.epoch);
  b.setSlot(m.slot);
  b.setRank(m.rank);
  b.setCode(m.code);
  b.setActor(m.actor);
  b.setText(m.text);
  b.setTsMs(m.ts_ms);
  b.setSnapshotStep(m.snapshot_step);
  return to_flat_bytes(mb);
}

Result<WorkerFailure> decode_worker_failure(std::string_view bytes) {
  return read_flat_message(
      bytes, "WorkerFailure", kLimits, [](capnp::MessageReader& r) -> Result<WorkerFailure> {
        auto f = r.getRoot<::WorkerFailure>();
        return WorkerFailure{f.getEpoch(), f.getSlot(), f.getRank(), f.getCode(),
                             f.getActor(), f.getText(), f.getTsMs(), f.getSnapshotStep()};
      });
}

std::string encode_snapshot_landed(const SnapshotLanded& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::SnapshotLanded>();
  b.setEpoch(m.epoch);
  b.setRank(m.rank);
  b.setSlot(m.slot);
  b.setStep(m.step);
  b.setXxh64(m.xxh64);
  b.setBytes(m.bytes);
  b.setNode(m.node);
  b.setEndpoint(m.endpoint);
  b.setError(m.error);
  return to_flat_bytes(mb);
}

Result<SnapshotLanded> decode_snapshot_landed(std::string_view bytes) {
  return read_flat_message(
      bytes, "SnapshotLanded", kLimits, [](capnp::MessageReader& r) -> Result<SnapshotLanded> {
        auto x = r.getRoot<::SnapshotLanded>();
        return SnapshotLanded{x.getEpoch(), x.getRank(), x.getSlot(),     x.getStep(), x.getXxh64(),
                              x.getBytes(), x.getNode(), x.getEndpoint(), x.getError()};
      });
}

std::string encode_snapshot_committed(const SnapshotCommitted& m) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<::SnapshotCommitted>();
  b.setEpoch(m.epoch);
  b.setStep(m.step);
  auto to = b.initCopyTo(static_cast<unsigned>(m.copy_to.size()));
  for (size_t i = 0; i < m.copy_to.size(); ++i) {
    to[static_cast<unsigned>(i)].setNode(m.copy_to[i].first);
    to[static_cast<unsigned>(i)].setEndpoint(m.copy_to[i].second);
  }
  b.setCheckpoint(m.checkpoint);
  b.setAbandoned(m.abandoned);
  return to_flat_bytes(mb);
}

Result<SnapshotCommitted> decode_snapshot_committed(std::string_view bytes) {
  return read_flat_message(bytes, "SnapshotCommitted", kLimits,
                           [](capnp::MessageReader& r) -> Result<SnapshotCommitted> {
                             auto x = r.getRoot<::SnapshotCommitted>();
                             SnapshotCommitted m;
                             m.epoch = x.getEpoch();
                             m.step = x.getStep();
                             for (auto t : x.getCopyTo())
                               m.copy_to.emplace_back(std::string(t.getNode()), std::string(t.getEndpoint()));
                             m.checkpoint = x.getCheckpoint();
                             m.abandoned = x.getAbandoned();
                             return m;
                           });
}

}  // namespace troupe::training
