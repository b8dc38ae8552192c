// training/driver/trainer_checkpoints.h — CheckpointCoordinator: the Trainer's checkpoint
// and snapshot coordinator.
//
// Owns: the schedule (checkpoint.every, elastic.snapshot_every), the snapshot ledger (what
// landed, what is committed: <run dir>/snapshots.json), the checkpoints waiting for their
// ranks' durable parts, the checkpoint directory and its commits, the data position
// after every step, and the standalone launcher's snapshot keeper.
// It is the only judge of "due": snapshot_order() decides what each command orders after
// its step (nothing, a snapshot, or a snapshot a checkpoint is written from) and
// checkpoint_wanted() whether a committed snapshot becomes a checkpoint; workers obey the
// order the command carries (StepCommand::snapshot, ElasticPlan::snapshot_start) and never
// read the schedule themselves.
// May call: the ActorDirectory (commits, abandons), checkpoint:: (finalize, open, clean),
// the EventLog. It reads the driver's current plan and the step every rank completed
// (references given at construction); it never sends a command or changes membership.
// Invariants: a snapshot commits only after the driver saw its step complete (its data
// position is known); a checkpoint is finalized only once every rank of its epoch
// reported its part durable, or at a membership change when every part is on disk.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/snapshot_keeper.h"
#include "checkpoint/writer.h"
#include "core/status.h"
#include "training/checkpointing/checkpointing.h"
#include "training/checkpointing/snapshot_ledger.h"
#include "training/control.h"
#include "training/driver/trainer_status.h"
#include "training/messages.h"
#include "training/run_config.h"

namespace troupe::training {

class ActorDirectory;
struct TrainerOptions;

class CheckpointCoordinator {
 public:
  // `plan` and `step_done`: the driver's current plan and the step every rank completed
  // in the current timeline; both outlive this object.
  CheckpointCoordinator(const layers::TrainConfig& tc, std::string run_dir, const ElasticPlan& plan,
                        const int64_t& step_done, EventLog& log)
      : tc_(tc), run_dir_(std::move(run_dir)), plan_(plan), step_done_now_(step_done), log_(log) {}
  void set_actors(ActorDirectory* actors) { actors_ = actors; }

  // ---- starting a job (trainer_start.cc) ----
  // `snapshot_every`: 0 in a one-process run (nothing would restore from a snapshot).
  void set_schedule(int64_t snapshot_every) {
    snapshot_every_ = snapshot_every;
    ckpt_every_ = tc_.checkpoint.every;
  }
  // A restarted driver: the snapshots its predecessor committed (<run dir>/snapshots.json);
  // the newest usable one, or null.
  const SnapshotRecord* load_committed(SnapshotLedger ledger);
  // The checkpoint directory (checkpoint.every or checkpoint.final), stale checkpoints
  // after `start_step` moved aside, and what every checkpoint records besides the parts.
  Status open_checkpoint_dir(const TrainerOptions& o, int64_t start_step, uint64_t resumed_bytes);
  // Removes an earlier run's snapshot records (not when a restarted driver read them).
  void forget_earlier_snapshots();
  // The standalone launcher holds its workers' snapshots itself (one node: no copy
  // elsewhere); the workers it forks find the keeper in their environment.
  Status start_keeper();
  // The job starts after `step`, with `tokens` seen.
  void start_at(int64_t step, int64_t tokens);

  // ---- the only judge of "due" ----
  // What a command orders after its step: the schedule for kStep, a snapshot off it for
  // kSnapshot, the checkpoint for kSave.
  SnapshotOrder snapshot_order(Command::Kind kind, int64_t step) const;
  bool on_checkpoint_schedule(int64_t step) const { return ckpt_every_ > 0 && step % ckpt_every_ == 0; }
  // Whether the commit of step's snapshot writes its checkpoint: on the schedule or asked
  // for (kSave), and not on disk already.
  bool checkpoint_wanted(int64_t step) const;
  // The plan's snapshot and checkpoint policy (what the workers need to take the orders,
  // and the order for a starting state no snapshot holds). p.step_done must be final.
  void set_policy(ElasticPlan& p) const;
  bool takes_snapshots() const { return snapshot_every_ > 0 || ckpt_every_ > 0; }
  bool checkpoints_on_schedule() const { return ckpt_every_ > 0; }

  // ---- the step loop ----
  // Step `step` completed with `step_tokens` tokens: its data position.
  void note_step(int64_t step, int64_t step_tokens, int64_t tokens_before_start);
  std::optional<int64_t> tokens_after(int64_t step) const;
  // Notes the snapshot failures and durable parts the workers report in `replies`, and
  // finalizes every checkpoint all of whose parts are durable.
  Status note_replies(const std::vector<nlohmann::json>& replies);
  // Takes the parts the workers reported landed, commits every complete snapshot of a step
  // the driver has seen completed, and announces it.
  Status poll();
  int64_t newest_committed() const { return snaps_.newest_committed(); }
  // Whether the snapshot of `step` can no longer commit or be restored.
  bool unusable(int64_t step) const;
  // A rank could not restore its part of the snapshot of `step`: the next recovery goes
  // back to an older one. False when it was marked so already.
  bool mark_unrestorable(int64_t step, const std::string& why);

  // ---- membership changes ----
  // A new epoch opens: the old one's incomplete snapshots are dropped and its checkpoints
  // finalized (every part on disk) or abandoned.
  void open_epoch();
  // What every rank of plan `p` restores (p.step_done is the newest step it may go back
  // to): its live state when nobody was lost (`keep`), else the newest usable snapshot,
  // else the newest valid checkpoint. Sets p.step_done to it.
  Status choose_restore(ElasticPlan& p, bool keep, const std::string& why);
  // After a restore of the current plan's snapshot: a checkpoint of its step that the
  // failure interrupted is written again, from that snapshot.
  void recommit_restored();

  // ---- the job's end ----
  const std::string& dir() const { return ckpt_dir_; }
  // Whether the job ends with a checkpoint of `final_step` (checkpoint.final), and asks for
  // it: from the committed snapshot of that step, or from a new one (kSave).
  bool want_final(int64_t final_step, int64_t start_step) const;
  void ask_final(int64_t final_step, int64_t tokens_fallback);
  bool committed(int64_t step) const { return last_ckpt_committed_ >= step; }
  // Removes a failed save's leftovers; what is known about why it failed (a full disk).
  FailedSave clean_failed(int64_t step) const;
  // Saves that failed along the way leave nothing behind (every worker is done writing).
  void clean_all_failed() const;
  // For status.json: the schedule, the newest committed snapshot, what the keeper holds.
  nlohmann::json status_json() const;

 private:
  void event(nlohmann::json e) { log_.event(std::move(e)); }
  // The snapshot of `step` never commits (a rank could not make its part, or skipped it):
  // every worker frees the generation holding it.
  void abandon(int64_t step);
  // Waits for every rank's durable part of step's checkpoint (this epoch's layout).
  void expect_checkpoint(int64_t step, int64_t tokens);
  // Checkpoints still waiting for durable-part notes when the membership changes: one
  // whose every part is on disk (each rank writes its part file after its shard) is
  // finalized; the others are abandoned (a part will never come).
  void finalize_written_or_abandon();
  struct PendingCheckpoint {
    uint64_t epoch = 0;
    int64_t dp = 1, grad_accum = 1, tokens = 0;
    int world = 0;
    std::set<int> durable;  // ranks whose part is durable
  };
  Status finalize_pending(int64_t step, const PendingCheckpoint& p);

  const layers::TrainConfig& tc_;
  const std::string run_dir_;
  const ElasticPlan& plan_;
  const int64_t& step_done_now_;
  EventLog& log_;
  ActorDirectory* actors_ = nullptr;
  int64_t ckpt_every_ = 0, snapshot_every_ = 0;
  std::string ckpt_dir_;
  int64_t start_step_ = 0;
  // Checkpoints whose snapshots were taken, waiting for every part to be durable. Those
  // of an earlier epoch are abandoned when a new one opens (a part may never come).
  std::map<int64_t, PendingCheckpoint> pending_ckpts_;
  int64_t last_ckpt_committed_ = -1, last_ckpt_failed_ = -1;
  uint64_t last_ckpt_bytes_ = 0;         // the size of the last committed checkpoint
  std::set<int64_t> failed_ckpt_steps_;  // saves that failed (their .tmp is removed)
  SnapshotLedger snaps_;
  std::set<int64_t> snaps_complete_;   // complete, waiting for their step's reply to commit
  std::set<int64_t> forced_ckpts_;     // checkpoints asked for off the schedule (kSave)
  int64_t last_snapshot_failed_ = -1;  // reported once, not by every rank
  std::unique_ptr<checkpoint::SnapshotKeeper> keeper_;
  // Tokens seen after each step (a snapshot's and a checkpoint's data position).
  std::map<int64_t, int64_t> tokens_after_;
  // What every checkpoint records besides the workers' parts (config text, tokenizer,
  // run metadata: the same as a normal run's CheckpointCommitter).
  checkpoint::CheckpointInfo ckpt_info_;
};

}  // namespace troupe::training
