// training/driver/trainer_status.cc — reporting: EventLog and StragglerTracker
// (trainer_status.h; their contract is there), and the Trainer's status.json.
// Trainer::write_status owns status.json and the job's status key (one attempt, skipped
// while the scheduler is out) and the actor table; it never changes membership.
// Invariants: status.json is replaced atomically (written aside, then renamed); the actor
// table is asked at most once a second, and at every failure and new epoch.
#include "training/driver/trainer_status.h"

#include "training/driver/run_metrics.h"
#include "training/driver/trainer_driver.h"

namespace troupe::training {

Status EventLog::open(const std::string& path, bool append) {
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) return io_error("cannot write {}", path);
  return ok_status();
}

void EventLog::event(nlohmann::json e) {
  e["ts_ms"] = wall_ms();
  out_ << e.dump() << "\n";
  out_.flush();
  if (metrics_ != nullptr) metrics_->on_event(e);
}

std::optional<int> StragglerTracker::track(const std::vector<nlohmann::json>& replies,
                                           const std::vector<int>& slots, int64_t step) {
  std::optional<int> replace;
  std::vector<double> compute;
  for (const auto& r : replies) compute.push_back(r.value("compute_ms", 0.0));
  if (compute.size() < 2) return replace;
  for (size_t i = 0; i < replies.size(); ++i) {
    std::vector<double> peers;
    for (size_t j = 0; j < compute.size(); ++j) {
      if (j != i) peers.push_back(compute[j]);
    }
    std::sort(peers.begin(), peers.end());
    const double median = peers[peers.size() / 2];
    const int slot = slots[i];
    const bool slow = median > 0 && compute[i] > ratio_ * median && compute[i] - median > 20.0;
    int& streak = slow_streak_[slot];
    streak = slow ? streak + 1 : 0;
    if (streak >= window_ && !flagged_.count(slot)) {
      flagged_.insert(slot);
      log_.event({{"event", "straggler"},
                  {"slot", slot},
                  {"rank", i},
                  {"step", step},
                  {"compute_ms", compute[i]},
                  {"peer_median_ms", median},
                  {"window", window_}});
      fmt::print(
          "elastic: straggler: slot {} (rank {}) compute {:.0f} ms vs peers' median {:.0f} ms for {} "
          "steps{}\n",
          slot, i, compute[i], median, streak, replace_ ? "; replacing it" : "");
      std::fflush(stdout);
      if (replace_ && !replace) replace = slot;
    }
  }
  return replace;
}

void Trainer::write_status(int64_t step, bool ask_actors) {
  nlohmann::json workers = nlohmann::json::array();
  for (size_t r = 0; r < plan_.slots.size(); ++r) {
    const int s = plan_.slots[r];
    const bool lost = recovering_since_ms_ && std::find(recovering_slots_.begin(), recovering_slots_.end(),
                                                        s) != recovering_slots_.end();
    workers.push_back({{"slot", s},
                       {"rank", r},
                       {"pid", procs_.proc(s).pid},
                       {"host", procs_.proc(s).host},
                       {"alive", procs_.alive(s) && !lost},
                       {"straggler", stragglers_.flagged(s)}});
    // The last step's wall, compute and comm time of this rank (troupe top), and its
    // process's peak resident memory.
    if (last_step_replies_.size() == plan_.slots.size()) {
      for (const char* k : {"step_ms", "compute_ms", "comm_ms", "rss_peak_bytes"}) {
        if (last_step_replies_[r].contains(k)) workers.back()[k] = last_step_replies_[r][k];
      }
    }
  }
  // The actors of the job, with their own answers (troupe status --actors): asked once per
  // step boundary.
  // At most once a second (each answer is a round trip to every actor; status.json is
  // for people and `troupe status`), and at every failure and new epoch.
  const bool due = step < 0 || plan_.epoch != actors_epoch_ || actor_table_.empty() ||
                   (step != actors_step_ && Clock::now() - actors_asked_ >= std::chrono::seconds(1));
  if (ask_actors && actors_ && due) {
    actors_asked_ = Clock::now();
    actors_->set_trainer_state(
        step < 0 ? "failed" : "training", step < 0 ? last_step_ : step,
        last_step_replies_.empty() ? 0.0 : last_step_replies_[0].value("step_ms", 0.0));
    actor_table_ = nlohmann::json::array();
    for (const ActorEntry& e : actors_->query(std::chrono::milliseconds(300))) {
      const int slot = e.slot;
      actor_table_.push_back({{"id", e.id},
                              {"role", e.role},
                              {"rank", e.rank},
                              {"worker", slot < 0 ? std::string("driver") : fmt::format("worker-{}", slot)},
                              {"node", e.node},
                              {"host", e.last.host},
                              {"device", e.last.device},
                              {"state", e.last.state},
                              {"steps_done", e.last.steps_done},
                              {"last_step_ms", e.last.last_step_ms},
                              {"params", e.last.params},
                              {"pid", e.last.pid}});
    }
    actors_step_ = step;
    actors_epoch_ = plan_.epoch;
  }
  const nlohmann::json snaps = ckpt_.status_json();
  nlohmann::json st{{"step", step < 0 ? last_step_ : step},
                    {"epoch", plan_.epoch},
                    {"failed", step < 0},
                    {"dp", plan_.dp},
                    {"grad_accum", plan_.grad_accum},
                    {"recoveries", recoveries_},
                    {"snapshots", snaps},
                    {"workers", workers},
                    {"actors", actor_table_}};
  if (recovering_since_ms_) {
    st["recovering"] = {
        {"cause", recovering_cause_}, {"slots", recovering_slots_}, {"since_ms", *recovering_since_ms_}};
  }
  if (step >= 0) last_step_ = step;
  if (scheduled_ && !store_out()) (void)poll_set(key("status"), st.dump());  // troupe status <job>
  const std::string tmp = run_dir_ + "/status.json.tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << st.dump(1) << "\n";
  }
  std::error_code ec;
  fs::rename(tmp, run_dir_ + "/status.json", ec);
}

nlohmann::json step_reply_json(const StepReply& r) {
  nlohmann::json j{{"rank", r.rank}, {"slot", r.slot}, {"epoch", r.epoch}};
  switch (static_cast<Command::Kind>(r.kind)) {
    case Command::Kind::kStep:
      j.update(nlohmann::json{{"step", r.step},
                              {"loss", r.loss},
                              {"lm_loss", r.lm_loss},
                              {"aux_loss", r.aux_loss},
                              {"grad_norm", r.grad_norm},
                              {"lr", r.lr},
                              {"step_tokens", r.step_tokens},
                              {"expert_load", r.expert_load},
                              {"step_ms", r.step_ms},
                              {"comm_ms", r.comm_ms},
                              {"compute_ms", r.compute_ms},
                              {"comm_ms_mean", r.comm_ms_mean},
                              {"comm_by_kind_ms", r.comm_by_kind_ms}});
      if (r.peak_bytes >= 0) {
        j["peak_bytes"] = r.peak_bytes;
        j["peak_gib"] = static_cast<double>(r.peak_bytes) / 1073741824.0;
      }
      if (r.host_syncs >= 0) j["host_syncs"] = r.host_syncs;
      if (r.rss_peak_bytes >= 0) j["rss_peak_bytes"] = r.rss_peak_bytes;
      if (r.upload_waits >= 0) j["upload_waits"] = r.upload_waits;
      if (r.activation_bytes >= 0) j["activation_bytes"] = r.activation_bytes;
      if (r.device_ms >= 0) j["device_ms"] = r.device_ms;
      if (r.device_gap_ms >= 0) j["device_gap_ms"] = r.device_gap_ms;
      // The worker's queue: was it kept ahead of its driver?
      j["launched_ahead"] = r.launched_ahead;
      j["next_queued"] = r.next_queued;
      j["command_wait_ms"] = r.command_wait_ms;
      break;
    case Command::Kind::kEval:
      j["val_loss"] = r.val_loss;
      break;
    case Command::Kind::kStop:
      j["stopped"] = true;
      break;
    case Command::Kind::kSave:
    case Command::Kind::kSnapshot:
      break;
  }
  if (r.ckpt_started >= 0) {
    j["ckpt_started"] = r.ckpt_started;
    j["ckpt_blocked_ms"] = r.ckpt_blocked_ms;
    j["ckpt_bytes"] = r.ckpt_bytes;
  }
  if (!r.durable.empty()) j["durable"] = r.durable;
  for (const auto& [step, text] : r.ckpt_errors)
    j["ckpt_errors"].push_back({{"step", step}, {"error", text}});
  if (r.snapshot >= 0) {
    j["snapshot"] = r.snapshot;
    j["snapshot_ms"] = r.snapshot_ms;
  }
  if (r.snapshot_wait_ms >= 0) j["snapshot_wait_ms"] = r.snapshot_wait_ms;
  if (r.snapshot_replicated >= 0) j["snapshot_replicated"] = r.snapshot_replicated;
  for (const auto& [step, text] : r.snapshot_errors)
    j["snapshot_errors"].push_back({{"step", step}, {"error", text}});
  return j;
}

nlohmann::json data_position_json(const layers::TrainConfig& tc, int64_t step, int64_t tokens_seen) {
  return nlohmann::json{{"next_step", step + 1},       {"samples_consumed", step * tc.global_batch()},
                        {"tokens_seen", tokens_seen},  {"global_batch", tc.global_batch()},
                        {"seq_len", tc.train.seq_len}, {"seed", tc.train.seed}};
}

}  // namespace troupe::training
