// training/driver/trainer_checkpoints.cc — CheckpointCoordinator (trainer_checkpoints.h,
// where its contract is): the only judge of "due", snapshot commits, checkpoint
// finalization, restores.
#include "training/driver/trainer_checkpoints.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "checkpoint/reader.h"
#include "core/env.h"
#include "core/job_env.h"
#include "training/driver/trainer.h"
#include "training/role_actors.h"

namespace troupe::training {

namespace fs = std::filesystem;

bool CheckpointCoordinator::checkpoint_wanted(int64_t step) const {
  // A step run again after a rewind whose checkpoint exists already (the same state: the
  // run is deterministic) is not written twice.
  std::error_code ec;
  return !ckpt_dir_.empty() && (on_checkpoint_schedule(step) || forced_ckpts_.count(step) > 0) &&
         !fs::exists(fs::path(ckpt_dir_) / checkpoint::step_dir_name(step), ec);
}

SnapshotOrder CheckpointCoordinator::snapshot_order(Command::Kind kind, int64_t step) const {
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

void CheckpointCoordinator::set_policy(ElasticPlan& p) const {
  p.ckpt_every = ckpt_every_;
  p.ckpt_dir = ckpt_dir_;
  p.snapshot_every = snapshot_every_;
  // A starting state no snapshot holds is snapshotted at once (not in a one-process run,
  // whose snapshot_every_ is 0: nothing would restore from it).
  p.snapshot_start = static_cast<uint8_t>(snapshot_every_ <= 0                  ? SnapshotOrder::kNone
                                          : on_checkpoint_schedule(p.step_done) ? SnapshotOrder::kCheckpoint
                                                                                : SnapshotOrder::kSnapshot);
}

void CheckpointCoordinator::expect_checkpoint(int64_t step, int64_t tokens) {
  PendingCheckpoint& p = pending_ckpts_[step];
  p.epoch = plan_.epoch;
  p.dp = plan_.dp;
  p.grad_accum = plan_.grad_accum;
  p.world = static_cast<int>(plan_.slots.size());
  p.tokens = tokens;
  p.durable.clear();
}

Status CheckpointCoordinator::poll() {
  const int world = static_cast<int>(plan_.slots.size());
  for (const SnapshotLanded& l : actors_->take_landed()) {
    if (!l.error.empty() && l.epoch == plan_.epoch && l.step != last_snapshot_failed_) {
      last_snapshot_failed_ = l.step;
      event({{"event", "snapshot_failed"}, {"step", l.step}, {"rank", l.rank}, {"error", l.error}});
      fmt::print(stderr, "snapshot: rank {} could not make its part of step {}: {}\n", l.rank, l.step,
                 l.error);
      std::fflush(stderr);
      abandon(l.step);
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

void CheckpointCoordinator::abandon(int64_t step) {
  if (snaps_.find(step) != nullptr && snaps_.find(step)->committed) return;
  snaps_.mark_unusable(step, "a part could not be made");
  SnapshotCommitted c;
  c.epoch = plan_.epoch;
  c.step = step;
  c.abandoned = true;
  (void)actors_->send_committed(plan_.slots, c);
}

Status CheckpointCoordinator::choose_restore(ElasticPlan& p, bool keep, const std::string& why) {
  p.snapshot_step = -1;
  p.snapshot_dp = 0;
  p.snapshot_parts.clear();
  p.checkpoint.clear();
  p.has_state.assign(p.slots.size(), keep);
  if (keep) return ok_status();
  (void)poll();
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

void CheckpointCoordinator::finalize_written_or_abandon() {
  for (const auto& [step, p] : pending_ckpts_) {
    if (Status st = finalize_pending(step, p); !st.ok()) {
      event({{"event", "checkpoint_abandoned"}, {"step", step}, {"parts", p.world}, {"why", st.to_string()}});
    }
  }
  pending_ckpts_.clear();
}

Status CheckpointCoordinator::finalize_pending(int64_t step, const PendingCheckpoint& p) {
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

Status CheckpointCoordinator::note_replies(const std::vector<nlohmann::json>& replies) {
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
      abandon(s);
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

const SnapshotRecord* CheckpointCoordinator::load_committed(SnapshotLedger ledger) {
  snaps_ = std::move(ledger);
  return snaps_.newest_usable(INT64_MAX);
}

Status CheckpointCoordinator::open_checkpoint_dir(const TrainerOptions& o, int64_t start_step,
                                                  uint64_t resumed_bytes) {
  // The job's checkpoints: every checkpoint.every steps and (checkpoint.final) after the
  // last one, in checkpoint.dir, else $TROUPE_CHECKPOINT_DIR (set by the scheduler), else
  // <run dir>/checkpoints, so `troupe checkpoints`, `train_moe sample --run` and
  // `--resume <run dir>` find them. The plans carry both to the workers.
  if (ckpt_every_ > 0 || tc_.checkpoint.final) {
    ckpt_dir_ = fs::absolute(checkpoint_dir_for(tc_, run_dir_)).string();
    // Checkpoints of an earlier run here after the starting step are stale (a fresh job:
    // all of them; the checkpoint resumed from is kept): moved aside, never deleted.
    // (A driver resuming from a snapshot keeps those at or before its step.)
    TROUPE_RETURN_IF_ERROR(prepare_checkpoint_dir(ckpt_dir_, start_step));
    // The tokenizer copied into the run directory by the caller (app.cc, prepare_run_dir).
    TROUPE_ASSIGN_OR_RETURN(ckpt_info_,
                            run_checkpoint_info(o.config, o.overrides, tc_, run_dir_ + "/tokenizer.json"));
  }
  last_ckpt_bytes_ = resumed_bytes;
  return ok_status();
}

void CheckpointCoordinator::forget_earlier_snapshots() {
  std::error_code ec;
  fs::remove(run_dir_ + "/snapshots.json", ec);
}

Status CheckpointCoordinator::start_keeper() {
  if (!takes_snapshots()) return ok_status();
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  TROUPE_ASSIGN_OR_RETURN(keeper_, checkpoint::SnapshotKeeper::start({.node = host, .host_addr = ""}));
  ::setenv(job_env::kSnapshotKeeper, keeper_->socket_path().c_str(), 1);
  return ok_status();
}

void CheckpointCoordinator::start_at(int64_t step, int64_t tokens) {
  start_step_ = step;
  tokens_after_[step] = tokens;
}

void CheckpointCoordinator::note_step(int64_t step, int64_t step_tokens, int64_t tokens_before_start) {
  auto prev = tokens_after_.find(step - 1);
  tokens_after_[step] = (prev != tokens_after_.end() ? prev->second : tokens_before_start) + step_tokens;
}

std::optional<int64_t> CheckpointCoordinator::tokens_after(int64_t step) const {
  auto it = tokens_after_.find(step);
  if (it == tokens_after_.end()) return std::nullopt;
  return it->second;
}

bool CheckpointCoordinator::unusable(int64_t step) const {
  const SnapshotRecord* rec = snaps_.find(step);
  return rec != nullptr && !rec->unusable.empty();
}

bool CheckpointCoordinator::mark_unrestorable(int64_t step, const std::string& why) {
  const SnapshotRecord* rec = snaps_.find(step);
  if (rec == nullptr || !rec->unusable.empty()) return false;
  snaps_.mark_unusable(step, why);
  return true;
}

void CheckpointCoordinator::open_epoch() {
  // Parts of the old epoch's snapshots still landing are of no use to the new one.
  snaps_.drop_incomplete();
  snaps_complete_.clear();
  finalize_written_or_abandon();
}

void CheckpointCoordinator::recommit_restored() {
  const int64_t s = plan_.snapshot_step;
  if (s < 0 || !checkpoint_wanted(s)) return;
  if (Status st = actors_->send_committed(plan_.slots, snaps_.recommit(s, plan_.epoch, true)); st.ok())
    expect_checkpoint(s, tokens_after(s).value_or(0));
}

bool CheckpointCoordinator::want_final(int64_t final_step, int64_t start_step) const {
  bool have_final = false;
  for (const auto& [s, d] : checkpoint::list_checkpoints(ckpt_dir_)) have_final |= s == final_step;
  return !ckpt_dir_.empty() && (final_step > start_step || !have_final);
}

void CheckpointCoordinator::ask_final(int64_t final_step, int64_t tokens_fallback) {
  // Written from the snapshot of the final step (the save command): the one being written
  // already (a checkpoint step), the committed snapshot of that step the workers hold (a
  // snapshot off the checkpoint schedule, or the second attempt), else a new one.
  if (snaps_.newest_committed() == final_step) {
    if (pending_ckpts_.count(final_step) == 0)
      expect_checkpoint(final_step, tokens_after(final_step).value_or(tokens_fallback));
  } else {
    forced_ckpts_.insert(final_step);
  }
}

FailedSave CheckpointCoordinator::clean_failed(int64_t step) const {
  return clean_failed_save(ckpt_dir_, step, last_ckpt_bytes_);
}

void CheckpointCoordinator::clean_all_failed() const {
  for (int64_t step : failed_ckpt_steps_) (void)clean_failed_save(ckpt_dir_, step, last_ckpt_bytes_);
}

nlohmann::json CheckpointCoordinator::status_json() const {
  nlohmann::json snaps{{"every", snapshot_every_}, {"newest_committed", snaps_.newest_committed()}};
  if (keeper_) {  // the standalone launcher's own keeper (under the scheduler: troupe status's agents)
    const checkpoint::KeeperTotals t = keeper_->totals();
    snaps["held"] = checkpoint::keeper_totals_text(t);
    snaps["bytes"] = t.bytes;
  }
  return snaps;
}

}  // namespace troupe::training
