// training/messages_codec.cc — the Cap'n Proto codec of training/messages.h: one field table
// per message (core/capnp_fields.h copies both ways by it), plus the checks a decoded
// message must pass. Compiled as C++17: Cap'n Proto 0.9.2 headers fail under GCC 13 in
// C++20 mode.

#include "core/capnp_fields.h"
#include "training/messages.capnp.h"
#include "training/messages.h"

namespace troupe::training {
namespace {

namespace cc = capnp_codec;

constexpr CapnpLimits kLimits{size_t{1} << 20, uint64_t{1} << 16};  // a status is a few hundred bytes

// Field order is the order the encoder fills the message in: keep it, and the bytes stay
// those of earlier builds.
constexpr auto kActorStatusQuery = cc::fields(TROUPE_CAPNP_FIELD(requester, Requester));

constexpr auto kActorStatus = cc::fields(
    TROUPE_CAPNP_FIELD(id, Id), TROUPE_CAPNP_FIELD(role, Role), TROUPE_CAPNP_FIELD(rank, Rank),
    TROUPE_CAPNP_FIELD(slot, Slot), TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(state, State),
    TROUPE_CAPNP_FIELD(steps_done, StepsDone), TROUPE_CAPNP_FIELD(last_step_ms, LastStepMs),
    TROUPE_CAPNP_FIELD(params, Params), TROUPE_CAPNP_FIELD(device, Device), TROUPE_CAPNP_FIELD(host, Host),
    TROUPE_CAPNP_FIELD(pid, Pid));

constexpr auto kPartSource =
    cc::fields(TROUPE_CAPNP_FIELD(endpoints, Endpoints), TROUPE_CAPNP_FIELD(xxh64, Xxh64));

constexpr auto kElasticPlan = cc::fields(
    TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(dp, Dp), TROUPE_CAPNP_FIELD(grad_accum, GradAccum),
    TROUPE_CAPNP_FIELD(slots, Slots), TROUPE_CAPNP_FIELD(has_state, HasState),
    TROUPE_CAPNP_FIELD(step_done, StepDone), TROUPE_CAPNP_FIELD(seq, Seq), TROUPE_CAPNP_FIELD(reason, Reason),
    TROUPE_CAPNP_FIELD(checkpoint, Checkpoint), TROUPE_CAPNP_FIELD(ckpt_every, CkptEvery),
    TROUPE_CAPNP_FIELD(ckpt_dir, CkptDir), TROUPE_CAPNP_FIELD(snapshot_step, SnapshotStep),
    TROUPE_CAPNP_FIELD(snapshot_every, SnapshotEvery), TROUPE_CAPNP_FIELD(snapshot_start, SnapshotStart),
    TROUPE_CAPNP_FIELD(snapshot_dp, SnapshotDp), TROUPE_CAPNP_FIELD(snapshot_committed, SnapshotCommitted),
    TROUPE_CAPNP_LIST(snapshot_parts, SnapshotParts, kPartSource));

constexpr auto kStepCommand =
    cc::fields(TROUPE_CAPNP_FIELD(seq, Seq), TROUPE_CAPNP_FIELD(kind, Kind), TROUPE_CAPNP_FIELD(step, Step),
               TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(snapshot, Snapshot));

// A step's error: StepReply's ckptErrors and snapshotErrors.
constexpr auto kStepError = cc::fields(TROUPE_CAPNP_FIELD(first, Step), TROUPE_CAPNP_FIELD(second, Text));

constexpr auto kStepReply = cc::fields(
    TROUPE_CAPNP_FIELD(seq, Seq), TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(rank, Rank),
    TROUPE_CAPNP_FIELD(slot, Slot), TROUPE_CAPNP_FIELD(kind, Kind), TROUPE_CAPNP_FIELD(step, Step),
    TROUPE_CAPNP_FIELD(loss, Loss), TROUPE_CAPNP_FIELD(lm_loss, LmLoss),
    TROUPE_CAPNP_FIELD(aux_loss, AuxLoss), TROUPE_CAPNP_FIELD(grad_norm, GradNorm),
    TROUPE_CAPNP_FIELD(lr, Lr), TROUPE_CAPNP_FIELD(step_tokens, StepTokens),
    TROUPE_CAPNP_LIST(expert_load, ExpertLoad, cc::fields(TROUPE_CAPNP_WHOLE(Counts, cc::kPlain))),
    TROUPE_CAPNP_FIELD(step_ms, StepMs), TROUPE_CAPNP_FIELD(comm_ms, CommMs),
    TROUPE_CAPNP_FIELD(compute_ms, ComputeMs), TROUPE_CAPNP_FIELD(comm_ms_mean, CommMsMean),
    TROUPE_CAPNP_LIST(comm_by_kind_ms, CommByKindMs,
                      cc::fields(TROUPE_CAPNP_FIELD(first, Name), TROUPE_CAPNP_FIELD(second, Value))),
    TROUPE_CAPNP_FIELD(peak_bytes, PeakBytes), TROUPE_CAPNP_FIELD(val_loss, ValLoss),
    TROUPE_CAPNP_FIELD(ckpt_started, CkptStarted), TROUPE_CAPNP_FIELD(ckpt_blocked_ms, CkptBlockedMs),
    TROUPE_CAPNP_FIELD(ckpt_bytes, CkptBytes), TROUPE_CAPNP_FIELD(durable, Durable),
    TROUPE_CAPNP_LIST(ckpt_errors, CkptErrors, kStepError), TROUPE_CAPNP_FIELD(snapshot, Snapshot),
    TROUPE_CAPNP_FIELD(snapshot_ms, SnapshotMs), TROUPE_CAPNP_FIELD(snapshot_wait_ms, SnapshotWaitMs),
    TROUPE_CAPNP_FIELD(snapshot_replicated, SnapshotReplicated),
    TROUPE_CAPNP_LIST(snapshot_errors, SnapshotErrors, kStepError), TROUPE_CAPNP_FIELD(host_syncs, HostSyncs),
    TROUPE_CAPNP_FIELD(upload_waits, UploadWaits), TROUPE_CAPNP_FIELD(activation_bytes, ActivationBytes),
    TROUPE_CAPNP_FIELD(device_ms, DeviceMs), TROUPE_CAPNP_FIELD(device_gap_ms, DeviceGapMs),
    TROUPE_CAPNP_FIELD(launched_ahead, LaunchedAhead), TROUPE_CAPNP_FIELD(next_queued, NextQueued),
    TROUPE_CAPNP_FIELD(command_wait_ms, CommandWaitMs), TROUPE_CAPNP_FIELD(rss_peak_bytes, RssPeakBytes));

constexpr auto kWorkerFailure = cc::fields(
    TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(slot, Slot), TROUPE_CAPNP_FIELD(rank, Rank),
    TROUPE_CAPNP_FIELD(code, Code), TROUPE_CAPNP_FIELD(actor, Actor), TROUPE_CAPNP_FIELD(text, Text),
    TROUPE_CAPNP_FIELD(ts_ms, TsMs), TROUPE_CAPNP_FIELD(snapshot_step, SnapshotStep));

constexpr auto kSnapshotLanded = cc::fields(
    TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(rank, Rank), TROUPE_CAPNP_FIELD(slot, Slot),
    TROUPE_CAPNP_FIELD(step, Step), TROUPE_CAPNP_FIELD(xxh64, Xxh64), TROUPE_CAPNP_FIELD(bytes, Bytes),
    TROUPE_CAPNP_FIELD(node, Node), TROUPE_CAPNP_FIELD(endpoint, Endpoint), TROUPE_CAPNP_FIELD(error, Error));

constexpr auto kSnapshotCommitted = cc::fields(
    TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(step, Step),
    TROUPE_CAPNP_LIST(copy_to, CopyTo,
                      cc::fields(TROUPE_CAPNP_FIELD(first, Node), TROUPE_CAPNP_FIELD(second, Endpoint))),
    TROUPE_CAPNP_FIELD(checkpoint, Checkpoint), TROUPE_CAPNP_FIELD(abandoned, Abandoned));

constexpr uint8_t kLastCommandKind = 4;  // Command::Kind
constexpr auto kLastSnapshotOrder = static_cast<uint8_t>(SnapshotOrder::kCheckpoint);

Status check_plan(const ElasticPlan& m) {
  if (m.snapshot_start > kLastSnapshotOrder)
    return data_loss("ElasticPlan: unknown snapshot order {} of epoch {}", m.snapshot_start, m.epoch);
  if (m.slots.size() != m.has_state.size() || m.dp < 1 || m.grad_accum < 1) {
    return data_loss(
        "ElasticPlan: inconsistent plan of epoch {} ({} slots, {} has_state, dp {}, grad_accum {})", m.epoch,
        m.slots.size(), m.has_state.size(), m.dp, m.grad_accum);
  }
  return Status();
}

Status check_command(const StepCommand& c) {
  if (c.kind > kLastCommandKind) return data_loss("StepCommand: unknown kind {}", c.kind);
  if (c.snapshot > kLastSnapshotOrder) return data_loss("StepCommand: unknown snapshot order {}", c.snapshot);
  return Status();
}

Status check_reply(const StepReply& m) {
  if (m.kind > kLastCommandKind) return data_loss("StepReply: unknown kind {}", m.kind);
  return Status();
}

}  // namespace

TROUPE_CAPNP_CODEC(actor_status_query, ActorStatusQuery, kActorStatusQuery, kLimits, cc::kNoCheck)
TROUPE_CAPNP_CODEC(actor_status, ActorStatus, kActorStatus, kLimits, cc::kNoCheck)
TROUPE_CAPNP_CODEC(elastic_plan, ElasticPlan, kElasticPlan, kLimits, check_plan)
TROUPE_CAPNP_CODEC(step_command, StepCommand, kStepCommand, kLimits, check_command)
TROUPE_CAPNP_CODEC(step_reply, StepReply, kStepReply, kLimits, check_reply)
TROUPE_CAPNP_CODEC(worker_failure, WorkerFailure, kWorkerFailure, kLimits, cc::kNoCheck)
TROUPE_CAPNP_CODEC(snapshot_landed, SnapshotLanded, kSnapshotLanded, kLimits, cc::kNoCheck)
TROUPE_CAPNP_CODEC(snapshot_committed, SnapshotCommitted, kSnapshotCommitted, kLimits, cc::kNoCheck)

}  // namespace troupe::training
