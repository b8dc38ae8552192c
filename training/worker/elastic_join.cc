// training/worker/elastic_join.cc — ElasticWorker (elastic_worker.h): reading and
// taking over a plan, joining an epoch (the Stage built or rebuilt, its state restored
// from a peer, a snapshot or a checkpoint), the node's snapshot keeper and this rank's
// Snapshotter.
#include "core/env.h"
#include "core/job_env.h"
#include "training/worker/elastic_worker.h"

namespace troupe::training {

layers::TrainConfig layout_config(const layers::TrainConfig& tc, const ElasticPlan& plan) {
  layers::TrainConfig out = tc;
  out.parallel.dp = plan.dp;
  out.train.grad_accum = plan.grad_accum;
  return out;
}

Result<ElasticPlan> ElasticWorker::read_plan(uint64_t epoch, std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = sent_plans_.find(epoch); it != sent_plans_.end()) {
      plan_via_message_ = true;
      return it->second;
    }
  }
  TROUPE_ASSIGN_OR_RETURN(std::string text,
                          store_.get(key(fmt::format("plan/{}", epoch)), comm::deadline_in(timeout)));
  plan_via_message_ = false;
  return decode_elastic_plan(text);
}

bool ElasticWorker::has_plan(uint64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sent_plans_.count(epoch) != 0) return true;
  }
  // During a store outage the plan can only come as a message: the step thread does not
  // wait for the store to answer.
  if (store_.in_outage()) return false;
  Result<bool> has = store_.try_contains(key(fmt::format("plan/{}", epoch)));
  return has.ok() && has.value();
}

void ElasticWorker::abort_for(uint64_t next, const char* how) {
  if (aborted_for_ >= next) return;
  if (epoch_ + 1 == next) cancel_ = true;
  // The step thread may wait on this epoch's snapshot commits (a save's checkpoint): they
  // will not come.
  if (snapshotter_) snapshotter_->cancel();
  // Only while the main thread has not taken the plan over (it rebuilds the
  // communicators, which must not be aborted).
  if (adopting_ < next && stage_)
    stage_->abort_comms(fmt::format("membership epoch {} opened ({})", next, how));
  aborted_for_ = next;
}

void ElasticWorker::on_plan(const ElasticPlan& plan) {
  std::lock_guard<std::mutex> lock(mu_);
  if (plan.epoch <= epoch_) return;  // an old plan (taken over already)
  sent_plans_.emplace(plan.epoch, plan);
  if (plan.epoch == epoch_ + 1) abort_for(plan.epoch, "message");
  // Wakes the idle loop: a command of a later epoch, dropped once it sees the plan.
  actors_->wake();
}

Result<std::unique_ptr<Stage>> ElasticWorker::make_stage(const ElasticPlan& plan, int rank) {
  const layers::TrainConfig tc = layout_config(tc_, plan);
  TROUPE_ASSIGN_OR_RETURN(layers::TokenShards train, layers::TokenShards::open(tc.data.dir, "train"));
  TROUPE_ASSIGN_OR_RETURN(layers::TokenShards val, layers::TokenShards::open(tc.data.dir, "val"));
  comm::StoreNamespace ns;
  ns.job = job_;
  ns.epoch = plan.epoch;
  return Stage::create(tc, rank, program_, comm_store_, ns, std::move(train), std::move(val), ctx_);
}

Status ElasticWorker::join(const ElasticPlan& plan) {
  actors_->set_state(plan.epoch == 0 ? "joining" : "recovering");
  TROUPE_RETURN_IF_ERROR(join_epoch(plan));
  // The actors of this rank exist before the Trainer learns the worker is ready (its
  // first command goes to stage.<rank>).
  const std::map<std::string, int64_t> params = stage_->params_by_role();
  TROUPE_RETURN_IF_ERROR(actors_->place(rank_, plan.epoch, params));
  actors_->step_done(stage_->steps_done(), 0.0);
  ready_info_["roles"] = hosted_roles(params);  // the actors the Trainer monitors
  // Which process this is, where (troupe status lists them; under the scheduler the
  // Trainer did not start it).
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
  ready_info_["pid"] = static_cast<int64_t>(getpid());
  ready_info_["host"] = std::string(host);
  ready_info_["plan_via"] = plan.epoch == 0 ? "start" : plan_via_message_ ? "message" : "store";
  return store_.set(key(fmt::format("ready/{}/{}", plan.epoch, slot_)), ready_info_.dump());
}

Status ElasticWorker::join_epoch(const ElasticPlan& plan) {
  // Tells the driver this worker took the plan over (a worker that never does is wedged).
  TROUPE_RETURN_IF_ERROR(
      store_.set(key(fmt::format("adopted/{}/{}", plan.epoch, slot_)), std::to_string(wall_ms())));
  const int rank = plan.rank_of_slot(slot_);
  comm::StoreNamespace ns;
  ns.job = job_;
  ns.epoch = plan.epoch;
  // The snapshots of the old epoch end first (a copy in flight lands before the state
  // changes; outside the lock: the watcher beats meanwhile).
  std::unique_ptr<Snapshotter> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::move(snapshotter_);
  }
  old.reset();
  // The Stage of this epoch: the same one with its communicators rebuilt when the rank
  // and dp stay, else a new one.
  const bool kept = stage_ && plan.epoch > 0 && plan.dp == dp_ && rank == rank_;
  if (kept) {
    TROUPE_RETURN_IF_ERROR(stage_->rebuild_comms(ns));
  } else {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<Stage> s, make_stage(plan, rank));
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = std::move(s);
  }
  rank_ = rank;
  dp_ = plan.dp;
  ready_info_ = nlohmann::json{{"ts_ms", wall_ms()}, {"rank", rank}};
  int64_t restored = -1;
  if (plan.snapshot_step >= 0) {
    // Every rank goes back to the snapshot, from its node's keeper (or through it from
    // the keeper holding the part's copy); a survivor ahead of it (steps in flight) too.
    const auto t0 = Clock::now();
    if (!keeper_)
      return failed_precondition("elastic: the plan restores a snapshot but this worker has no keeper");
    std::vector<std::string> parts;
    if (Status st = restore_snapshot(*keeper_, job_, plan, rank, *stage_, &parts); !st.ok()) {
      failed_snapshot_ = plan.snapshot_step;
      return Status(StatusCode::kDataLoss, st.message());
    }
    restored = plan.snapshot_step;
    ready_info_["from"] = fmt::format("snapshot {}", plan.snapshot_step);
    ready_info_["parts"] = parts;
    ready_info_["restore_ms"] = std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
  } else if (!plan.checkpoint.empty()) {
    // Every rank goes back to the checkpoint (no usable snapshot; or a resumed job).
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                            checkpoint::CheckpointReader::open(plan.checkpoint));
    if (reader->step() != plan.step_done) {
      return failed_precondition("elastic: checkpoint {} is of step {}, the plan says {}", plan.checkpoint,
                                 reader->step(), plan.step_done);
    }
    // Any saved layout (the job may have changed dp since the save): each rank reads its
    // owned slices.
    const int64_t adam = reader->manifest().metadata.value("adam_steps", reader->step());
    TROUPE_RETURN_IF_ERROR(stage_->restore(slice_source(*reader), adam));
    ready_info_["from"] = plan.checkpoint;
  } else if (plan.epoch > 0) {
    // Nobody was lost: a rank keeps its live state if it is exactly after step_done (the
    // interrupted command's optimizer, the first writer of the state, had not run; with
    // steps in flight a rank may have completed a later step: then it refuses, and the
    // Trainer restores a snapshot).
    if (!kept || stage_->steps_done() != plan.step_done) {
      // Aborted, not a permanent failure: the Trainer's next attempt restores a snapshot.
      return aborted(
          "elastic: rank {} cannot keep its state for epoch {}: it {} (the plan goes back to step {})", rank,
          plan.epoch,
          kept ? fmt::format("has run {} steps", stage_->steps_done()) : std::string("has a new stage"),
          plan.step_done);
    }
    stage_->clear_interrupted_step();
    ready_info_["from"] = "kept";
    restored = plan.snapshot_committed;  // the newest committed snapshot stays in this rank's memory
  } else if (plan.step_done == 0) {
    // A fresh start: a run started from a Hugging Face model (train.init_from) reads its
    // slices of it.
    TROUPE_RETURN_IF_ERROR(init_from_hf(*stage_, layout_config(tc_, plan)));
  }
  ready_info_["step_done"] = stage_->steps_done();
  TROUPE_RETURN_IF_ERROR(start_snapshots(restored));
  // A state that no snapshot holds yet (a fresh start, a checkpoint) is snapshotted at
  // once when the Trainer orders it (plan.snapshot_start): a failure before the first
  // ordered snapshot then loses no more than the steps since.
  const auto start = static_cast<SnapshotOrder>(plan.snapshot_start);
  if (snapshotter_ && restored < 0 && start != SnapshotOrder::kNone) {
    StepReply r;
    snapshotter_->after_step(plan.step_done, start == SnapshotOrder::kCheckpoint, r);
    if (!r.snapshot_errors.empty())
      fmt::print(stderr, "elastic: slot {}: no snapshot of the starting state\n", slot_);
  }
  return ok_status();
}

Status ElasticWorker::connect_keeper() {
  if (snapshot_every_ <= 0 && ckpt_dir_.empty()) return ok_status();
  const std::optional<std::string> path = env::get(job_env::kSnapshotKeeper);
  if (driver_system_ != nullptr || !path) {
    // Nobody holds this node's snapshots (a one-process run, whose worker cannot fail alone;
    // a launcher without a keeper): a keeper in this process still makes checkpoints, but
    // its snapshots die with the worker.
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    TROUPE_ASSIGN_OR_RETURN(own_keeper_,
                            checkpoint::SnapshotKeeper::start(
                                {.node = fmt::format("{}-worker{}", host, slot_), .host_addr = ""}));
    if (driver_system_ == nullptr) {
      fmt::print(
          stderr,
          "elastic: slot {}: no snapshot keeper serves this worker ({} is not set): its snapshots live "
          "in its own process and do not survive it\n",
          slot_, job_env::kSnapshotKeeper);
      std::fflush(stderr);
    }
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::SnapshotClient> c,
                            checkpoint::SnapshotClient::connect(own_keeper_->socket_path()));
    keeper_ = std::move(c);
    return ok_status();
  }
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::SnapshotClient> c,
                          checkpoint::SnapshotClient::connect(*path));
  keeper_ = std::move(c);
  return ok_status();
}

Status ElasticWorker::start_snapshots(int64_t restored_step) {
  if (!keeper_) return ok_status();
  SnapshotterOptions o;
  o.job = job_;
  o.rank = rank_;
  o.slot = slot_;
  o.epoch = epoch_;
  o.ckpt_dir = ckpt_dir_;
  o.ckpt_bytes_per_s = static_cast<uint64_t>(tc_.checkpoint.max_mb_per_s * 1e6);
  o.restored_step = restored_step;
  o.send_landed = [this](const SnapshotLanded& l) {
    if (!actors_->send(l).ok()) {
      fmt::print(stderr, "snapshot: slot {} could not tell the driver that step {} landed\n", slot_, l.step);
    }
  };
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<Snapshotter> s,
                          Snapshotter::create(keeper_, *stage_, std::move(o)));
  std::lock_guard<std::mutex> lock(mu_);
  snapshotter_ = std::move(s);
  return ok_status();
}

}  // namespace troupe::training
