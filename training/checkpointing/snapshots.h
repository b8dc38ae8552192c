// training/checkpointing/snapshots.h — defines Snapshotter, one rank's in-memory snapshots (the
// worker's side of docs/elastic.md "Snapshots"), and restore_snapshot, a rank's way back
// to one.
//
// On the Trainer's order (the command's SnapshotOrder: every elastic.snapshot_every steps
// and at each checkpoint step, or off the schedule), right after the step, the rank's state
// (Stage::snapshot_tensors: parameters, optimizer moments, router biases; with its rank state: step, data
// position, RNG seed) is copied into one of the two generation segments its node's keeper handed it
// (checkpoint/snapshot_keeper.h) — on a GPU device -> pinned host on a side stream, on the CPU by a copier
// thread, which first asks the keeper's leave to overwrite the generation — while the next step runs. The
// snapshot thread then checksums every slice, seals the part (checkpoint/snapshot_segment.h), tells the
// keeper and the Trainer (SnapshotLanded). Once every rank's part landed the Trainer commits the snapshot
// (SnapshotCommitted, the second phase): the keeper copies the part to its node's copy target, and at a
// checkpoint step the writer thread writes the part's saved tensors to disk as this
// rank's checkpoint shard (never on the step thread).
//
// Generations: a snapshot goes into the generation that holds neither the newest
// committed snapshot nor a landed one still waiting for its commit (or its abandonment),
// and that is not being written to disk; when neither generation qualifies, the step thread waits for one
// (the wait is reported as snapshot_wait_ms; a checkpoint's stall) up to a limit, then skips the snapshot
// with an error note.
//
// Threads: after_step, save, snapshot_off_schedule and report on the worker's step thread;
// on_commit on the stage actor's thread; cancel on any; the snapshot thread and the writer
// thread inside.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/snapshot_client.h"
#include "checkpoint/snapshot_segment.h"
#include "training/messages.h"
#include "training/stage/stage.h"

namespace troupe::training {

struct SnapshotterOptions {
  std::string job;
  int rank = 0, slot = 0;
  uint64_t epoch = 0;
  std::string ckpt_dir;
  uint64_t ckpt_bytes_per_s = 0;  // checkpoint.max_mb_per_s
  // The snapshot the rank restored (or -1): committed, so it is never overwritten first.
  int64_t restored_step = -1;
  // How long a snapshot waits for a free generation before it is skipped (well inside the
  // step watchdog's default 60 s: a wait this long means a commit is not coming).
  std::chrono::milliseconds wait_limit{30000};
  // Sends a landed part (or its failure) to the Trainer; called on the snapshot thread.
  std::function<void(const SnapshotLanded&)> send_landed;
};

class Snapshotter {
 public:
  // Attaches to the keeper (the rank's two generations, sized for `stage`'s state) and
  // starts the snapshot and writer threads.
  static Result<std::unique_ptr<Snapshotter>> create(std::shared_ptr<checkpoint::SnapshotClient> keeper,
                                                     Stage& stage, SnapshotterOptions options);
  ~Snapshotter();  // waits for the copy, checksums and disk write in flight
  Snapshotter(const Snapshotter&) = delete;
  Snapshotter& operator=(const Snapshotter&) = delete;

  // After step `step` completed on this rank (right after Stage::run_step), on the
  // Trainer's order: starts its snapshot; `checkpoint`: the step's checkpoint will be
  // written from it once committed. Notes snapshot, snapshot_ms and snapshot_wait_ms (or
  // an error) in `reply`.
  void after_step(int64_t step, bool checkpoint, StepReply& reply);
  // The Trainer committed the snapshot of c.step (any thread).
  void on_commit(const SnapshotCommitted& c);
  // Notes what finished since the last call: checkpoint parts now durable (durable), their
  // failures (ckpt_errors), parts that could not be made (snapshot_errors), the newest
  // step copied to another node (snapshot_replicated). `wait_ckpt`: first waits (bounded)
  // for every checkpoint this rank snapshotted to be written — the job's end.
  void report(StepReply& reply, bool wait_ckpt);

  // The save command (the job's last checkpoint) of `step`, the step this rank completed
  // last: this rank's checkpoint part of it, from the one snapshot of the step the Trainer
  // commits. Nothing more when the part is under way or written (a checkpoint step); the
  // committed snapshot of the step is written now; a snapshot of the step still landing, or
  // landed with its commit not seen yet (the save overtook it), is written once that commit
  // comes; else a snapshot of the step is taken to write (noted in `reply` as after_step
  // does). Never a second snapshot of a step whose snapshot is on its way to a commit: the
  // Trainer takes parts of a committed step as late duplicates, so that one would never
  // commit and the save would wait for it (past the step watchdog).
  void save(int64_t step, StepReply& reply);
  // A newer membership epoch opened (any thread): nothing of this epoch commits now, so the
  // step thread's waits on commits (a free generation in after_step, report's checkpoints)
  // end at once instead of holding the rank out of the new epoch (the Trainer's join
  // timeout would replace it).
  void cancel();
  // The snapshot command (off the schedule, before a planned membership change) of `step`:
  // a snapshot of the step unless this rank holds one already (landing, landed or
  // committed: the step's scheduled snapshot; a second one would never commit).
  void snapshot_off_schedule(int64_t step, bool checkpoint, StepReply& reply);
  const std::string& node() const { return node_; }
  // Fault injection: flips a byte of the newest landed part this rank holds that is not
  // damaged yet (in its keeper's memory: a restore of it then fails its slice checksums),
  // once the checkpoints this rank has to write are written (bounded).
  void corrupt_newest();
  // The newest snapshot step this rank knows committed (-1: none).
  int64_t committed() const {
    std::lock_guard lock(mu_);
    return committed_;
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  Snapshotter(std::shared_ptr<checkpoint::SnapshotClient> keeper, Stage& stage, SnapshotterOptions o)
      : keeper_(std::move(keeper)), stage_(stage), o_(std::move(o)) {}
  Status layout();
  void snapshot_loop();
  void writer_loop();
  Status land(int gen, int64_t step, const nlohmann::json& rank_state);
  bool free_locked(int g) const;
  // The generation holding this rank's snapshot of `step` that is landing or landed and not
  // yet committed (its commit or abandonment is still to come), or -1.
  int pending_gen_locked(int64_t step) const;
  // Queues the committed snapshot of `step` for the writer (false: this rank's committed
  // snapshot is of another step).
  bool write_committed_locked(int64_t step);

  std::shared_ptr<checkpoint::SnapshotClient> keeper_;
  Stage& stage_;
  SnapshotterOptions o_;
  std::string node_, endpoint_;
  // The part's layout: tensors in snapshot order, their offsets in the shard bytes, the
  // shard's size and its saved prefix, and the part's manifest without checksums.
  std::vector<uint64_t> offsets_;
  uint64_t data_bytes_ = 0, saved_bytes_ = 0, segment_bytes_ = 0;
  checkpoint::ManifestPart part_;
  std::shared_ptr<checkpoint::SegmentMap> maps_[2];
  // Each generation's slice checksums as the CPU copier made them (Stage::snapshot_into):
  // written by the copier, read by land() after snapshot_wait(); empty on a GPU.
  std::vector<uint64_t> copy_sums_[2];

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t gen_step_[2] = {-1, -1};
  bool gen_uncommitted_[2] = {false, false};  // landed by this instance, commit not seen yet
  bool gen_on_disk_[2] = {false, false};      // being written as a checkpoint
  bool pinned_ = false;                       // the generations are page-locked (GPU; the CPU needs nothing)
  int landing_ = -1;                          // the generation being copied and sealed
  Status begin_status_;                       // the keeper's answer to the landing copy's begin
  int64_t committed_ = -1;                    // the newest committed step, and its generation
  int committed_gen_ = -1;
  struct Task {
    enum class Kind { kPin, kLand, kCommit } kind = Kind::kLand;
    int gen = -1;
    int64_t step = -1;
    nlohmann::json rank_state;
    std::string copy_to;
  };
  std::deque<Task> tasks_;
  std::deque<std::pair<int, int64_t>> disk_;  // (generation, step) to write
  std::set<int64_t> ckpt_expected_;           // checkpoint steps snapshotted, their commit not seen yet
  std::set<int64_t> ckpt_writing_;            // checkpoint steps committed, being written
  std::vector<int64_t> durable_;
  std::set<int64_t> written_;  // checkpoint steps this rank wrote
  // Steps whose save came while their snapshot was on its way to a commit: written once it
  // commits, whether or not that commit asks for a checkpoint (it may have been decided
  // before the save was).
  std::set<int64_t> save_on_commit_;
  std::vector<std::pair<int64_t, std::string>> ckpt_errors_, snap_errors_;
  bool stop_ = false;
  bool cancelled_ = false;       // cancel(): a newer epoch opened
  std::set<int64_t> corrupted_;  // parts damaged by fault injection
  std::thread snapshot_thread_, writer_thread_;
};

// Restores `stage` from the snapshot of plan.snapshot_step: fetches, through `keeper`,
// the parts of the snapshot's ranks this rank needs (its own when the layout is the
// snapshot's; else every rank of its (pp, n) column), checks each against the plan's
// manifest checksum and every slice's checksum, and imports them (Stage::restore). A part
// that cannot be had or is damaged is DataLoss naming the rank and the step.
// `sources` (may be null) gets one line per part read: where it was held ("rank 2's part:
// a copy on node a1 of node a2's").
Status restore_snapshot(checkpoint::SnapshotClient& keeper, const std::string& job, const ElasticPlan& plan,
                        int rank, Stage& stage, std::vector<std::string>* sources = nullptr);

}  // namespace troupe::training
