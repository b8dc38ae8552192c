// training/messages.h — defines the typed messages of the training actors (each
// worker's "stage.<rank>", "attention.<rank>" and "experts.<rank>", placed on its slot, and
// the driver's "trainer"): ActorStatusQuery and its reply ActorStatus; StepCommand,
// ElasticPlan and SnapshotCommitted (trainer -> stage actors), StepReply, WorkerFailure and
// SnapshotLanded (worker -> trainer). They travel
// as Cap'n Proto structs
// (training/messages.capnp, encoded in messages_codec.cc); decoding never throws —
// malformed, truncated or oversized input is a DataLoss status naming the message.
//
// Type ids: the training layer's prefix 0x7A1E (actors/message.h).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace troupe::training {

struct ActorStatusQuery {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0101ull;
  std::string requester;
};

struct ActorStatus {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0102ull;
  std::string id, role;
  int32_t rank = -1, slot = -1;
  uint64_t epoch = 0;
  std::string state;
  int64_t steps_done = 0;
  double last_step_ms = 0;
  int64_t params = 0;
  std::string device, host;
  int32_t pid = 0;
};

struct StepCommand {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0103ull;
  int64_t seq = 0;
  uint8_t kind = 0;  // Command::Kind
  int64_t step = 0;
  uint64_t epoch = 0;
};

struct StepReply {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0104ull;
  int64_t seq = 0;
  uint64_t epoch = 0;
  int32_t rank = -1, slot = -1;
  uint8_t kind = 0;
  // kind step: rank 0's metrics are the whole step's.
  int64_t step = 0;
  double loss = 0, lm_loss = 0, aux_loss = 0, grad_norm = 0, lr = 0;
  int64_t step_tokens = 0;
  std::vector<std::vector<int64_t>> expert_load;
  double step_ms = 0, comm_ms = 0, compute_ms = 0, comm_ms_mean = 0;
  std::map<std::string, double> comm_by_kind_ms;
  int64_t peak_bytes = -1;
  double val_loss = 0;  // kind evaluate
  int64_t ckpt_started = -1;
  double ckpt_blocked_ms = 0;
  int64_t ckpt_bytes = 0;
  std::vector<int64_t> durable;
  std::vector<std::pair<int64_t, std::string>> ckpt_errors;  // step, text
  // Snapshots: the step whose snapshot this rank started after the command (-1: none), the
  // step thread's time to start it, its wait for a free generation (-1: none), the newest
  // step whose copy landed on another node, and parts that could not be made.
  int64_t snapshot = -1;
  double snapshot_ms = 0;
  double snapshot_wait_ms = -1;
  int64_t snapshot_replicated = -1;
  std::vector<std::pair<int64_t, std::string>> snapshot_errors;  // step, text
  int64_t host_syncs = -1;  // device runs: this rank's device->host reads in the step
  int64_t rss_peak_bytes = -1;  // the rank's process: peak resident host memory (-1: unknown)
  // Device runs (-1 on the CPU): uploads that waited for their copy, the allocator's
  // high-water mark above the step's start, the step's device time (its first to its last
  // enqueued op) and the device's idle time before its first op since the previous
  // step's last (what the device waited for the host or the driver).
  int64_t upload_waits = -1, activation_bytes = -1;
  double device_ms = -1, device_gap_ms = -1;
  // The worker's command queue (elastic.cc): this step was launched before the previous
  // one was finished; the next command was already queued when this reply was sent (the
  // driver kept the worker ahead); how long the worker waited for this command after
  // serving the one before.
  bool launched_ahead = false, next_queued = false;
  double command_wait_ms = 0;
};

struct WorkerFailure {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0105ull;
  uint64_t epoch = 0;
  int32_t slot = -1, rank = -1;
  uint16_t code = 0;
  std::string actor, text;
  int64_t ts_ms = 0;
  int64_t snapshot_step = -1;  // a restore of this snapshot failed: its part is lost or damaged
};

// A rank's snapshot part landed in its node's keeper (checkpoint/snapshot_keeper.h); sent
// as soon as it did, by the worker's snapshot thread.
struct SnapshotLanded {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0107ull;
  uint64_t epoch = 0;
  int32_t rank = -1, slot = -1;
  int64_t step = -1;
  uint64_t xxh64 = 0;          // of the part's manifest (which holds every slice's checksum)
  uint64_t bytes = 0;          // the segment
  std::string node, endpoint;  // the keeper holding it, and where other keepers reach it
  std::string error;           // non-empty: the part could not be made
};

// Every rank's part of `step` landed: the snapshot is committed. Each worker passes it to
// its keeper with its node's copy target; `checkpoint`: its rank also writes the part to
// disk as a checkpoint. `abandoned` instead: the snapshot of `step` never commits (a rank
// could not make its part), so the generation holding it is free again.
struct SnapshotCommitted {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0108ull;
  uint64_t epoch = 0;
  int64_t step = -1;
  std::vector<std::pair<std::string, std::string>> copy_to;  // node -> keeper endpoint
  bool checkpoint = false;
  bool abandoned = false;
};

// Where a snapshot's part can be fetched from (keeper endpoints: its node's, then its
// copy's) and the checksum of its manifest.
struct PartSource {
  std::vector<std::string> endpoints;
  uint64_t xxh64 = 0;
};

// The plan of membership epoch `epoch` (rebuild: who is in it, which state every rank
// restores). The Trainer records it in the job's store (<job>/elastic/plan/<e>, JSON:
// where a new or restarted worker reads it, durable across a scheduler restart) and sends
// it to the stage actor of every worker of the old epoch, which reacts at once (its
// watcher thread would otherwise see the store record within a heartbeat interval).
struct ElasticPlan {
  static constexpr uint64_t kTypeId = 0x7A1E'0000'0000'0106ull;
  uint64_t epoch = 0;
  int64_t dp = 1, grad_accum = 1;  // the layout's dp and the matching grad_accum
  std::vector<int> slots;          // slot of each world rank
  // Per rank: a survivor that keeps its live state. Only in a plan that restores nothing
  // (nobody was lost): each such rank must still hold the state after step_done.
  std::vector<bool> has_state;
  int64_t step_done = 0;           // the state every rank restores: after this step
  int64_t seq = 0;                 // first command seq of the epoch
  std::string reason;
  // Non-empty: every rank restores the state after step_done from this checkpoint
  // directory instead (no usable snapshot; or epoch 0 of a resumed job), through
  // Stage::restore (any saved layout).
  std::string checkpoint;
  // The job's periodic checkpoints: after every ckpt_every-th step each rank writes its
  // part into ckpt_dir (0: none).
  int64_t ckpt_every = 0;
  std::string ckpt_dir;
  // >= 0: every rank restores the snapshot of this step (step_done equals it), made in
  // layout dp = snapshot_dp: the part of each rank of that layout is at snapshot_parts[r].
  int64_t snapshot_step = -1;
  int64_t snapshot_dp = 0;
  std::vector<PartSource> snapshot_parts;
  // Snapshots after every snapshot_every-th step (0: none); the newest committed one, which
  // a rank keeping its memory must not overwrite first (-1: none).
  int64_t snapshot_every = 0;
  int64_t snapshot_committed = -1;

  // The store record and the events' copy (training/worker/elastic.cc).
  nlohmann::json to_json() const;
  static Result<ElasticPlan> from_json(const std::string& text);
  int rank_of_slot(int slot) const;  // -1: not in the plan
};
std::string encode_step_command(const StepCommand& m);
Result<StepCommand> decode_step_command(std::string_view bytes);
std::string encode_step_reply(const StepReply& m);
Result<StepReply> decode_step_reply(std::string_view bytes);
std::string encode_elastic_plan(const ElasticPlan& m);
Result<ElasticPlan> decode_elastic_plan(std::string_view bytes);
std::string encode_worker_failure(const WorkerFailure& m);
Result<WorkerFailure> decode_worker_failure(std::string_view bytes);
std::string encode_snapshot_landed(const SnapshotLanded& m);
Result<SnapshotLanded> decode_snapshot_landed(std::string_view bytes);
std::string encode_snapshot_committed(const SnapshotCommitted& m);
Result<SnapshotCommitted> decode_snapshot_committed(std::string_view bytes);

std::string encode_actor_status_query(const ActorStatusQuery& m);
Result<ActorStatusQuery> decode_actor_status_query(std::string_view bytes);
std::string encode_actor_status(const ActorStatus& m);
Result<ActorStatus> decode_actor_status(std::string_view bytes);

}  // namespace troupe::training
