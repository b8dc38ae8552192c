// actors/training/trainer_checkpoints.cc — the checkpoint and snapshot coordinator.
// Owns: the schedule (checkpoint.every, elastic.snapshot_every), the snapshot ledger
// (snaps_), the checkpoints waiting for durable parts, the commits (snapshots.json and the
// finalized checkpoint directories).
// It is the only judge of "due": snapshot_order() decides what each step command orders
// (nothing, a snapshot, or a snapshot a checkpoint is written from) and checkpoint_due()
// whether a committed snapshot becomes a checkpoint; workers obey the order the command
// carries (StepCommand::snapshot) and never read the schedule themselves.
// May call: the ActorDirectory (commits, abandons), checkpoint:: (finalize, open), event().
// Invariants: a snapshot commits only after the driver saw its step complete (its data
// position is known); a checkpoint is finalized only once every rank of its epoch reported
// its part durable, or at a membership change when every part is on disk.
#include "actors/training/trainer_driver.h"

namespace troupe::training {

bool Trainer::on_checkpoint_schedule(int64_t step) const { return ckpt_every_ > 0 && step % ckpt_every_ == 0; }

bool Trainer::checkpoint_wanted(int64_t step) const {
  // A step run again after a rewind whose checkpoint exists already (the same state: the
  // run is deterministic) is not written twice.
  std::error_code ec;
  return !ckpt_dir_.empty() && (on_checkpoint_schedule(step) || forced_ckpts_.count(step) > 0) &&
         !fs::exists(fs::path(ckpt_dir_) / checkpoint::step_dir_name(step), ec);
}

SnapshotOrder Trainer::snapshot_order(Command::Kind kind, int64_t step) const {
  switch (kind) {
    case Command::Kind::kStep:  // the schedule: checkpoint.every, elastic.snapshot_every
      if (on_checkpoint_schedule(step)) return SnapshotOrder::kCheckpoint;
      if (snapshot_every_ > 0 && step % snapshot_every_ == 0) return SnapshotOrder::kSnapshot;
      return SnapshotOrder::kNone;
    case Command::Kind::kSnapshot:  // off the schedule (a planned membership change)
      return on_checkpoint_schedule(step) ? SnapshotOrder::kCheckpoint : SnapshotOrder::kSnapshot;
    case Command::Kind::kSave:  // the job's last checkpoint
      return SnapshotOrder::kCheckpoint;
    case Command::Kind::kEval:
    case Command::Kind::kStop:
      return SnapshotOrder::kNone;
  }
  return SnapshotOrder::kNone;
}

void Trainer::set_snapshot_policy(ElasticPlan& p) const {
  p.ckpt_every = ckpt_every_;
  p.ckpt_dir = ckpt_dir_;
  p.snapshot_every = snapshot_every_;
  // A starting state no snapshot holds is snapshotted at once (not in a one-process run,
  // whose snapshot_every_ is 0: nothing would restore from it).
  p.snapshot_start = static_cast<uint8_t>(snapshot_every_ <= 0                ? SnapshotOrder::kNone
                                          : on_checkpoint_schedule(p.step_done) ? SnapshotOrder::kCheckpoint
                                                                                : SnapshotOrder::kSnapshot);
}

void Trainer::expect_checkpoint(int64_t step, int64_t tokens) {
  PendingCheckpoint& p = pending_ckpts_[step];
  p.epoch = plan_.epoch;
  p.dp = plan_.dp;
  p.grad_accum = plan_.grad_accum;
  p.world = static_cast<int>(plan_.slots.size());
  p.tokens = tokens;
  p.durable.clear();
}

Status Trainer::poll_snapshots() {
  const int world = static_cast<int>(plan_.slots.size());
  for (const SnapshotLanded& l : actors_->take_landed()) {
    if (!l.error.empty() && l.epoch == plan_.epoch && l.step != last_snapshot_failed_) {
      last_snapshot_failed_ = l.step;
      event({{"event", "snapshot_failed"}, {"step", l.step}, {"rank", l.rank}, {"error", l.error}});
      fmt::print(stderr, "snapshot: rank {} could not make its part of step {}: {}\n", l.rank, l.step,
                 l.error);
      std::fflush(stderr);
      abandon_snapshot(l.step);
    }
    if (std::optional<int64_t> s = snaps_.landed(l, plan_.epoch, world, plan_.dp, plan_.grad_accum)) {
      snaps_complete_.insert(*s);
    }
  }
  // Committed once the driver has seen the step complete (its data position is known).
  while (!snaps_complete_.empty() && *snaps_complete_.begin() <= step_done_now_) {
    const int64_t s = *snaps_complete_.begin();
    snaps_complete_.erase(snaps_complete_.begin());
    auto tok = tokens_after_.find(s);
    if (tok == tokens_after_.end()) continue;
    // The starting state's snapshot is no new checkpoint (a fresh job's step 0, or the
    // checkpoint it resumed from), unless a save asked for it (a resumed job with nothing
    // left to train saves the state it loaded in its own layout).
    // A step run again after a rewind whose checkpoint exists already (the same state: the
    // run is deterministic) is not written twice.
    const bool ckpt = checkpoint_wanted(s) && (s > start_step_ || forced_ckpts_.count(s) > 0);
    const SnapshotCommitted c = snaps_.commit(s, tok->second, ckpt);
    // The manifest first (a restarted driver finds it: the store's keys do not outlive the
    // scheduler epoch a driver restart ends), then the workers.
    {
      const std::string path = run_dir_ + "/snapshots.json", tmp = path + ".tmp";
      std::ofstream(tmp, std::ios::trunc) << snaps_.committed_json().dump(1) << "\n";
      std::error_code ec;
      fs::rename(tmp, path, ec);
      if (ec) return io_error("cannot write {}: {}", path, ec.message());
    }
    if (Status st = actors_->send_committed(plan_.slots, c); !st.ok()) {
      fmt::print(stderr, "trainer: the commit of snapshot {} did not reach every worker: {}\n", s,
                 st.to_string());
    }
    if (ckpt) expect_checkpoint(s, tok->second);
  }
  return ok_status();
}

void Trainer::abandon_snapshot(int64_t step) {
  if (snaps_.find(step) != nullptr && snaps_.find(step)->committed) return;
  snaps_.mark_unusable(step, "a part could not be made");
  SnapshotCommitted c;
  c.epoch = plan_.epoch;
  c.step = step;
  c.abandoned = true;
  (void)actors_->send_committed(plan_.slots, c);
}

Result<bool> Trainer::snapshot_now(int64_t step) {
  if (snapshot_every_ <= 0 && ckpt_every_ <= 0) return false;
  if (snaps_.newest_committed() == step) return true;
  const uint64_t epoch = plan_.epoch;
  TROUPE_ASSIGN_OR_RETURN(std::optional<nlohmann::json> r, call(Command::Kind::kSnapshot, step));
  if (!r || plan_.epoch != epoch) return false;  // a failure was recovered from meanwhile
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  Clock::time_point first_err{};
  while (snaps_.newest_committed() < step) {
    TROUPE_RETURN_IF_ERROR(poll_snapshots());
    if (const SnapshotRecord* rec = snaps_.find(step); rec && !rec->unusable.empty()) return false;
    std::optional<Failure> failure = check_processes();
    if (!failure) failure = check_heartbeats();
    if (!failure) {
      TROUPE_ASSIGN_OR_RETURN(failure, check_errors(first_err));
    }
    if (failure) {
      TROUPE_RETURN_IF_ERROR(recover(*failure, step, step + 1));
      return false;
    }
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::max(poll_, std::chrono::milliseconds(5)));
  }
  return true;
}

Status Trainer::choose_restore(ElasticPlan& p, bool keep, const std::string& why) {
  p.snapshot_step = -1;
  p.snapshot_dp = 0;
  p.snapshot_parts.clear();
  p.checkpoint.clear();
  p.has_state.assign(p.slots.size(), keep);
  if (keep) return ok_status();
  (void)poll_snapshots();
  if (const SnapshotRecord* s = snaps_.newest_usable(p.step_done)) {
    p.snapshot_step = s->step;
    p.snapshot_dp = s->dp;
    p.snapshot_parts = s->sources();
    p.step_done = s->step;
    std::set<std::string> nodes;
    for (const SnapshotPartRecord& part : s->parts) nodes.insert(part.node);
    event({{"event", "restore_from_snapshot"},
           {"step", s->step},
           {"bytes", s->bytes()},
           {"parts", s->parts.size()},
           {"nodes", std::vector<std::string>(nodes.begin(), nodes.end())},
           {"every", snapshot_every_}});
    fmt::print("elastic: every rank goes back to the in-memory snapshot of step {}\n", s->step);
    std::fflush(stdout);
    return ok_status();
  }
  if (ckpt_dir_.empty()) {
    return aborted(
        "elastic: no usable snapshot holds the state and no checkpoint is kept (checkpoint.every): {}", why);
  }
  finalize_written_or_abandon();  // a checkpoint written but not yet committed counts
  Result<std::unique_ptr<checkpoint::CheckpointReader>> rd =
      checkpoint::CheckpointReader::open_latest_valid(ckpt_dir_, checkpoint::VerifyMode::kChecksums);
  if (!rd.ok() && ckpt_every_ <= 0) {
    // Only the final checkpoint is kept (checkpoint.final), and there is none yet.
    return aborted(
        "elastic: no usable snapshot holds the state and no checkpoint is kept (checkpoint.every): {}", why);
  }
  if (!rd.ok()) {
    return aborted("elastic: no usable snapshot holds the state and no valid checkpoint exists: {}",
                   rd.status().to_string());
  }
  if (rd.value()->step() > p.step_done) {
    return aborted("elastic: the newest checkpoint (step {}) is past the step every rank completed ({})",
                   rd.value()->step(), p.step_done);
  }
  p.checkpoint = rd.value()->path();
  p.step_done = rd.value()->step();
  event({{"event", "restore_from_checkpoint"}, {"path", p.checkpoint}, {"step", p.step_done}});
  fmt::print("elastic: no usable snapshot; restoring step {} from {}\n", p.step_done, p.checkpoint);
  std::fflush(stdout);
  return ok_status();
}

void Trainer::finalize_written_or_abandon() {
  for (const auto& [step, p] : pending_ckpts_) {
    if (Status st = finalize_pending(step, p); !st.ok()) {
      event({{"event", "checkpoint_abandoned"}, {"step", step}, {"parts", p.world}, {"why", st.to_string()}});
    }
  }
  pending_ckpts_.clear();
}

Status Trainer::finalize_pending(int64_t step, const PendingCheckpoint& p) {
  // Finalized as a normal run's committer does, so `train_moe train --resume` and
  // `troupe checkpoints` read it like any other. The layout saved is that epoch's dp.
  checkpoint::FinalizeOptions fo;
  fo.world_size = p.world;
  fo.keep_last = static_cast<int>(tc_.checkpoint.keep);
  fo.info = ckpt_info_;
  fo.info.data_position = data_position_json(tc_, step, p.tokens);
  fo.info.metadata["adam_steps"] = step;
  fo.info.metadata["saved_layout"] = fmt::format("pp={},dp={},n={}", tc_.parallel.pp, p.dp, tc_.parallel.n);
  fo.info.metadata["elastic"] =
      nlohmann::json{{"epoch", p.epoch}, {"dp", p.dp}, {"grad_accum", p.grad_accum}};
  TROUPE_ASSIGN_OR_RETURN(checkpoint::FinalizeResult fr,
                          checkpoint::finalize_checkpoint(ckpt_dir_, step, fo));
  event({{"event", "checkpoint_committed"}, {"step", step}, {"path", fr.path}, {"bytes", fr.bytes}});
  last_ckpt_committed_ = std::max(last_ckpt_committed_, step);
  last_ckpt_bytes_ = fr.bytes;
  return ok_status();
}

Status Trainer::note_checkpoints(Command::Kind kind, int64_t step,
                                 const std::vector<nlohmann::json>& replies) {
  (void)kind;
  (void)step;
  // Snapshot parts a rank could not make (or a snapshot it had to skip): that snapshot
  // never commits; training goes on.
  for (const auto& r : replies) {
    for (const auto& e : r.value("snapshot_errors", nlohmann::json::array())) {
      const int64_t s = e.value("step", int64_t{-1});
      if (s == last_snapshot_failed_) continue;
      last_snapshot_failed_ = s;
      event({{"event", "snapshot_failed"},
             {"step", s},
             {"rank", r.value("rank", -1)},
             {"error", e.value("error", "")}});
      abandon_snapshot(s);
    }
  }
  if (ckpt_dir_.empty() || replies.empty()) return ok_status();
  // Parts that became durable (a rank says so in a later reply, or at "stop"), and writes
  // that failed: that checkpoint is abandoned (training goes on).
  for (const auto& r : replies) {
    for (const auto& e : r.value("ckpt_errors", nlohmann::json::array())) {
      const int64_t s = e.value("step", int64_t{-1});
      const std::string why = e.value("error", "");
      pending_ckpts_.erase(s);
      if (s != last_ckpt_failed_) {  // reported once, not by every rank
        // Its unfinished directory goes at once (a full disk must not stay full of it).
        const FailedSave fs_note = clean_failed_save(ckpt_dir_, s, last_ckpt_bytes_);
        failed_ckpt_steps_.insert(s);
        event({{"event", "checkpoint_failed"},
               {"step", s},
               {"rank", r.value("rank", -1)},
               {"error", why},
               {"disk_full", fs_note.disk_full},
               {"free_bytes", fs_note.free_bytes},
               {"needed_bytes", fs_note.needed_bytes}});
        fmt::print(stderr, "checkpoint: step {} was not committed: rank {} could not save it: {}; {}\n", s,
                   r.value("rank", -1), why, fs_note.text);
        std::fflush(stderr);
      }
      last_ckpt_failed_ = s;
    }
    for (const auto& d : r.value("durable", nlohmann::json::array())) {
      auto it = pending_ckpts_.find(d.get<int64_t>());
      if (it == pending_ckpts_.end() || it->second.epoch != plan_.epoch) continue;
      it->second.durable.insert(r.value("rank", -1));
    }
  }
  for (auto it = pending_ckpts_.begin(); it != pending_ckpts_.end();) {
    const PendingCheckpoint& p = it->second;
    if (static_cast<int>(p.durable.size()) < p.world) {
      ++it;
      continue;
    }
    TROUPE_RETURN_IF_ERROR(finalize_pending(it->first, p));
    it = pending_ckpts_.erase(it);
  }
  return ok_status();
}

}  // namespace troupe::training
