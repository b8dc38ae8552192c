// training/worker/elastic_worker.h — ElasticWorker: one worker process's side of the
// membership protocol (elastic.h): it joins each epoch's plan, runs the Trainer's
// commands on its Stage and takes the snapshots the Trainer orders. Private to the elastic
// worker's files: elastic.cc (the command loop), elastic_join.cc (joining an epoch,
// restoring, the snapshot keeper).
#pragma once

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "checkpoint/snapshot_client.h"
#include "checkpoint/snapshot_keeper.h"
#include "comm/control/host_addr.h"
#include "core/process_memory.h"
#include "data/token_data.h"
#include "training/checkpointing/checkpointing.h"
#include "training/checkpointing/snapshots.h"
#include "training/control.h"
#include "training/driver/trainer.h"
#include "training/role_actors.h"
#include "training/stage/stage.h"
#include "training/worker/elastic_faults.h"

namespace troupe::training {

using Clock = std::chrono::steady_clock;

// The config of `tc` in the plan's layout (its dp and micro-batches per replica).
layers::TrainConfig layout_config(const layers::TrainConfig& tc, const ElasticPlan& plan);

// The store the Stage's communicators rendezvous through: waits are cut into short slices
// and give up (kAborted) once `cancel` is set — a worker joining an epoch that failed
// while it joined (a peer died during the rebuild) must not wait out the init timeout.
class CancellableStore final : public comm::RendezvousStore {
 public:
  CancellableStore(comm::RendezvousStore& base, const std::atomic<bool>& cancel)
      : base_(base), cancel_(cancel) {}
  Status set(std::string_view key, std::string_view value) override { return base_.set(key, value); }
  Result<std::string> get(std::string_view key, comm::Deadline deadline) override {
    while (true) {
      if (cancel_.load())
        return aborted("rendezvous on '{}' cancelled: a newer membership epoch opened", key);
      Result<std::string> r =
          base_.get(key, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
      if (r.ok() || r.status().code() != StatusCode::kDeadlineExceeded || Clock::now() >= deadline) return r;
    }
  }
  Status wait(const std::vector<std::string>& keys, comm::Deadline deadline) override {
    while (true) {
      if (cancel_.load()) return aborted("rendezvous cancelled: a newer membership epoch opened");
      Status st = base_.wait(keys, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
      if (st.ok() || st.code() != StatusCode::kDeadlineExceeded || Clock::now() >= deadline) return st;
    }
  }
  Result<bool> contains(std::string_view key) override { return base_.contains(key); }

 private:
  comm::RendezvousStore& base_;
  const std::atomic<bool>& cancel_;
};

class ElasticWorker {
 public:
  ElasticWorker(const layers::TrainConfig& tc, ProgramFactory program, TolerantStore& store, std::string job,
                int slot, uint64_t epoch, const layers::Ctx& ctx, actors::ActorSystem* driver_system,
                observe::StepProbe* steps)
      : driver_system_(driver_system),
        tc_(tc),
        program_(std::move(program)),
        store_(store),
        job_(std::move(job)),
        slot_(slot),
        epoch_(epoch),
        ctx_(ctx),
        steps_(steps),
        comm_store_(store, cancel_) {}
  ~ElasticWorker() {
    stop_watcher_ = true;
    if (watcher_.joinable()) watcher_.join();
    actors_.reset();       // no plan or commit handler runs on a half-destroyed worker
    snapshotter_.reset();  // before the Stage it copies
  }

  Status run();
  // Fault injection (step thread): aborts this worker's communicators.
  void cut_connections() {
    if (stage_) stage_->abort_comms("fault injection: connections cut");
  }
  // Fault injection: damages the newest intact snapshot part this rank holds.
  void corrupt_snapshot() {
    std::lock_guard<std::mutex> lock(mu_);
    if (snapshotter_) snapshotter_->corrupt_newest();
  }

 private:
  std::string key(const std::string& rest) const { return elastic_key(job_, rest); }
  Result<ElasticPlan> read_plan(uint64_t epoch, std::chrono::milliseconds timeout);
  // The stage actor got the plan of a new epoch: remember it, and if it opens the next
  // epoch, abort the communicators as the watcher would (a step in progress unwinds).
  void on_plan(const ElasticPlan& plan);
  // Aborts the communicators for the opening of epoch `next` (once; caller holds mu_).
  void abort_for(uint64_t next, const char* how);
  bool has_plan(uint64_t epoch);
  Result<std::unique_ptr<Stage>> make_stage(const ElasticPlan& plan, int rank);
  // Adopts `plan` (stage built or rebuilt, state synced), then places this worker's actors
  // for its rank.
  Status join(const ElasticPlan& plan);
  Status join_epoch(const ElasticPlan& plan);
  // The keeper of this node's snapshots (TROUPE_SNAPSHOT_KEEPER, else one in this process).
  Status connect_keeper();
  // This epoch's snapshots of this rank (after a restore of `restored_step`, or -1).
  Status start_snapshots(int64_t restored_step);
  void watch();
  // Moves the commands the Trainer sent into queue_ (waiting at most `wait` for the
  // first): those of the current epoch from `seq` on, in order; older ones are dropped.
  void take_commands(std::chrono::milliseconds wait, int64_t seq);
  // Whether the Trainer ordered a snapshot after cmd's step (and this worker takes them).
  bool snapshot_ordered(const Command& cmd) const;
  // Runs step `cmd.step` into `reply`: launches it (unless it was launched ahead), launches
  // the next queued step ahead of finishing it where the Stage and this step allow (no
  // snapshot due after it), then finishes it and starts its snapshot when one is due.
  Status run_step_command(const Command& cmd, StepReply& reply);

  actors::ActorSystem* driver_system_;  // a worker in the driver's process: its system (else null)
  layers::TrainConfig tc_;
  ProgramFactory program_;  // the app's stage program
  TolerantStore& store_;
  std::string job_;
  int slot_;
  std::mutex mu_;              // guards stage_ swaps, epoch_/adopting_ against the watcher
  uint64_t epoch_;             // current epoch (main thread writes under mu_)
  layers::Ctx ctx_;            // where the Stage lives (the CPU, or this worker's GPU)
  observe::StepProbe* steps_;  // step timings for the health reports (may be null)
  uint64_t adopting_ = 0;      // highest epoch whose plan the main thread took over
  uint64_t aborted_for_ = 0;   // highest epoch whose opening aborted the communicators (under mu_)
  // Plans the Trainer sent the stage actor (ElasticPlan messages), by epoch (under mu_);
  // the store's record is the fallback.
  std::map<uint64_t, ElasticPlan> sent_plans_;
  bool plan_via_message_ = false;  // the last plan read came as a message
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<WorkerActors> actors_;  // the actors placed on this worker (role_actors.h)
  nlohmann::json ready_info_;             // what join_epoch tells the Trainer with "ready"
  int rank_ = -1;
  int64_t dp_ = 0;
  // Whether the job takes checkpoints (into ckpt_dir_, from committed snapshots) and
  // in-memory snapshots: a keeper is connected then. Which steps is the Trainer's order.
  int64_t ckpt_every_ = 0;
  int64_t snapshot_every_ = 0;
  std::string ckpt_dir_;
  std::unique_ptr<checkpoint::SnapshotKeeper> own_keeper_;  // when no node keeper serves this worker
  std::shared_ptr<checkpoint::SnapshotClient> keeper_;
  std::unique_ptr<Snapshotter> snapshotter_;  // swapped under mu_ (the commit handler reads it)
  int64_t failed_snapshot_ = -1;              // the snapshot a failed join could not restore
  std::thread watcher_;
  std::atomic<bool> stop_watcher_{false};
  // Commands of the current epoch received and not yet served, in seq order (the Trainer
  // keeps up to train.steps_in_flight steps in flight), and the step launched ahead of its
  // command being served (-1: none).
  std::deque<StepCommand> queue_;
  int64_t launched_ahead_ = -1;
  // The device time of the last step (ms): how long the next command may be waited for
  // while the device is busy with a step (run_step_command).
  double last_device_ms_ = 0;
  std::atomic<bool> cancel_{false};  // set when epoch_+1 opened: in-progress rendezvous give up
  CancellableStore comm_store_;
};

}  // namespace troupe::training
