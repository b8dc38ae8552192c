// training/worker/elastic.cc — the elastic plan's helpers, and the elastic worker's
// command loop (ElasticWorker::run, elastic_worker.h) and entry point (elastic.h).
// Joining an epoch is in elastic_join.cc; fault injection in elastic_faults.cc.
#include "training/worker/elastic.h"

#include "core/env.h"
#include "core/job_env.h"
#include "training/worker/elastic_worker.h"

namespace troupe::training {

using Clock = std::chrono::steady_clock;

nlohmann::json ElasticPlan::event_json() const {
  nlohmann::json parts = nlohmann::json::array();
  for (const PartSource& s : snapshot_parts)
    parts.push_back({{"endpoints", s.endpoints}, {"xxh64", s.xxh64}});
  return nlohmann::json{{"epoch", epoch},
                        {"dp", dp},
                        {"grad_accum", grad_accum},
                        {"slots", slots},
                        {"has_state", has_state},
                        {"step_done", step_done},
                        {"seq", seq},
                        {"reason", reason},
                        {"checkpoint", checkpoint},
                        {"ckpt_every", ckpt_every},
                        {"ckpt_dir", ckpt_dir},
                        {"snapshot_step", snapshot_step},
                        {"snapshot_every", snapshot_every},
                        {"snapshot_dp", snapshot_dp},
                        {"snapshot_committed", snapshot_committed},
                        {"snapshot_parts", parts}};
}

int ElasticPlan::rank_of_slot(int slot) const {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] == slot) return static_cast<int>(i);
  }
  return -1;
}

std::string elastic_key(const std::string& job, const std::string& rest) { return job + "/elastic/" + rest; }

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

void fill_step_reply(const StepReport& r, StepReply& m) {
  m.step = r.step;
  m.loss = r.loss;
  m.lm_loss = r.lm_loss;
  m.aux_loss = r.aux_loss;
  m.grad_norm = r.grad_norm;
  m.lr = r.lr;
  m.step_tokens = r.tokens;
  m.expert_load = r.expert_load;
  m.step_ms = r.step_ms;
  m.comm_ms = r.comm_ms;
  m.compute_ms = r.compute_ms;
  m.comm_ms_mean = r.comm_ms_mean;
  m.comm_by_kind_ms = r.comm_by_kind_ms;
  m.peak_bytes = r.peak_bytes;
  m.host_syncs = r.host_syncs;
  m.upload_waits = r.upload_waits;
  m.activation_bytes = r.activation_bytes;
  m.rss_peak_bytes = r.rss_peak_bytes;
  m.device_ms = r.device_ms;
  m.device_gap_ms = r.device_gap_ms;
}

}  // namespace

void ElasticWorker::watch() {
  int64_t beat = 0;
  // Polls: one attempt each, skipped while the store is out (TolerantStore), so an outage
  // never holds the worker, nor its exit, in a retry loop.
  while (!stop_watcher_) {
    (void)store_.try_set(key(fmt::format("hb/{}", slot_)), std::to_string(++beat));
    uint64_t next = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      next = epoch_ + 1;
    }
    Result<bool> has = store_.try_contains(key(fmt::format("plan/{}", next)));
    if (has.ok() && has.value()) {
      std::lock_guard<std::mutex> lock(mu_);
      abort_for(next, "store");
    }
    std::this_thread::sleep_for(kHeartbeatInterval);
  }
}

void ElasticWorker::take_commands(std::chrono::milliseconds wait, int64_t seq) {
  // Commands of an older epoch, or already served, are dropped; so is wake()'s marker.
  const auto keep = [&](const StepCommand& c) {
    const int64_t next = queue_.empty() ? seq : queue_.back().seq + 1;
    return c.epoch == epoch_ && c.seq >= next;
  };
  std::optional<StepCommand> c = actors_->next_command(wait);
  while (c) {
    if (keep(*c)) queue_.push_back(*c);
    c = actors_->next_command(std::chrono::milliseconds(0));
  }
}

bool ElasticWorker::snapshot_ordered(const Command& cmd) const {
  return snapshotter_ && static_cast<SnapshotOrder>(cmd.snapshot) != SnapshotOrder::kNone;
}

Status ElasticWorker::run_step_command(const Command& cmd, StepReply& reply) {
  if (g_faults != nullptr) g_faults->step = cmd.step;
  actors_->set_state("training");
  // A snapshot (and a checkpoint, written from it) after this step copies the state this
  // step leaves: the next step cannot be enqueued before the copy is, so it is not
  // launched ahead. Nor on the CPU, where launch_step runs the whole step: a step launched
  // ahead there would only hold this step's report back by a step (and a failure in it
  // would lose the report).
  const bool ahead_ok = ctx_.on_device() && stage_->can_launch_ahead() && !snapshot_ordered(cmd);
  if (launched_ahead_ == cmd.step) {
    reply.launched_ahead = true;  // enqueued while the step before was finishing
  } else {
    stage_->launch_step(cmd.step);
  }
  launched_ahead_ = -1;
  if (ahead_ok) {
    // The device is busy with this step (about last_device_ms_), and the host would only
    // wait for it in finish_step: the next command may take that long to arrive without
    // costing anything. It usually comes within a round trip: with two commands in flight
    // the driver sends step k+2 on step k's report, sent just before this step began — a
    // look without waiting missed it, and every other step then ran without a step
    // launched behind it (a gap on the device between them).
    const auto wait =
        std::chrono::milliseconds(queue_.empty() ? static_cast<int64_t>(last_device_ms_ / 2) : 0);
    take_commands(wait, cmd.seq + 1);
    const bool next_is_step = !queue_.empty() && queue_.front().seq == cmd.seq + 1 &&
                              static_cast<Command::Kind>(queue_.front().kind) == Command::Kind::kStep &&
                              queue_.front().step == cmd.step + 1;
    if (next_is_step) {
      // The fault points met while it is enqueued are that step's.
      if (g_faults != nullptr) g_faults->step = cmd.step + 1;
      stage_->launch_step(cmd.step + 1);
      launched_ahead_ = cmd.step + 1;
    }
  }
  const StepReport rep = stage_->finish_step(cmd.step);
  last_device_ms_ = rep.device_ms;
  actors_->step_done(cmd.step, rep.step_ms);
  if (steps_ != nullptr) steps_->record_step(rep.step_ms, rep.compute_ms, rep.comm_ms);
  fill_step_reply(rep, reply);
  if (snapshotter_) {
    // The snapshot's copy runs while the next step does (nothing was launched ahead of it).
    if (snapshot_ordered(cmd)) {
      snapshotter_->after_step(cmd.step,
                               static_cast<SnapshotOrder>(cmd.snapshot) == SnapshotOrder::kCheckpoint, reply);
    }
    // The step thread's time on it: what a checkpoint step stalls training by.
    if (reply.snapshot >= 0 && steps_ != nullptr) steps_->record_io(reply.snapshot_ms);
    fault_point(fmt::format("snapshot of step {}", cmd.step));
  }
  // The peak with this step's snapshot staging in it.
  reply.rss_peak_bytes = peak_resident_bytes();
  return ok_status();
}

Status ElasticWorker::run() {
  set_throw_on_comm_error(true);
  std::string device = "cpu";
  if (ctx_.on_device()) {
    device = fmt::format("cuda:{}", env::get_or("CUDA_VISIBLE_DEVICES", "0"));
  }
  if (driver_system_ != nullptr) {
    TROUPE_ASSIGN_OR_RETURN(
        actors_, WorkerActors::start_in(*driver_system_, slot_, store_, key(fmt::format("actors/{}", slot_)),
                                        std::move(device)));
  } else {
    TROUPE_ASSIGN_OR_RETURN(actors_,
                            WorkerActors::start(slot_, control::host_addr(), store_,
                                                key(fmt::format("actors/{}", slot_)), std::move(device)));
  }
  // Plans of new epochs the Trainer sends the stage actor (rebuild), and snapshot commits.
  actors_->on_plan([this](const ElasticPlan& p) { on_plan(p); });
  actors_->on_commit([this](const SnapshotCommitted& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (snapshotter_) snapshotter_->on_commit(c);
  });
  // Replies and failure reports go to the driver's trainer actor.
  TROUPE_RETURN_IF_ERROR(
      actors_->connect_driver(store_, key("actors/driver"), std::chrono::milliseconds(120000)));
  TROUPE_ASSIGN_OR_RETURN(ElasticPlan plan, read_plan(epoch_, std::chrono::milliseconds(120000)));
  if (plan.rank_of_slot(slot_) < 0) return invalid_argument("elastic: slot {} is not in the plan of epoch {}", slot_, epoch_);
  // The job's snapshots and checkpoints (the driver's choice, the same in every plan).
  ckpt_every_ = plan.ckpt_every;
  snapshot_every_ = plan.snapshot_every;
  ckpt_dir_ = plan.ckpt_dir;
  if (ckpt_every_ > 0 && ckpt_dir_.empty()) {
    return invalid_argument("elastic: the plan asks for checkpoints every {} steps but names no directory",
                            ckpt_every_);
  }
  TROUPE_RETURN_IF_ERROR(connect_keeper());
  adopting_ = epoch_;
  watcher_ = std::thread([this] { watch(); });
  bool healthy = true;
  // The last failure was the data plane's (CommFailure: a peer's loss, an aborted
  // communicator): this worker is sound and waits for the Trainer to re-form the job.
  bool peer_failure = false;
  Status st = ok_status();
  try {
    st = join(plan);
  } catch (const CommFailure& e) {
    st = unavailable("{}", e.what());
    peer_failure = true;
  }
  if (!st.ok()) healthy = false;
  int64_t seq = plan.seq;
  auto served_at = Clock::now();  // when the last command was served (its reply sent)
  while (true) {
    if (!healthy) {
      (void)actors_->report(WorkerFailure{epoch_, slot_, rank_, static_cast<uint16_t>(st.code()),
                                          actor_id("stage", rank_), st.to_string(), wall_ms(),
                                          std::exchange(failed_snapshot_, -1)});
      if (peer_failure) {
        fmt::print(
            "elastic: slot {} (rank {}): epoch {} lost a peer on the data plane ({}); waiting for the "
            "trainer to re-form the job\n",
            slot_, rank_, epoch_, st.message());
        std::fflush(stdout);
      } else {
        fmt::print(stderr, "elastic: slot {} (rank {}) failed in epoch {}: {}\n", slot_, rank_, epoch_,
                   st.to_string());
        std::fflush(stderr);
      }
      // What was queued or launched belongs to the failed epoch.
      queue_.clear();
      launched_ahead_ = -1;
    }
    // Wait for a command of this epoch or for the next epoch's plan.
    const auto idle_deadline = Clock::now() + std::chrono::milliseconds(600000);
    bool new_epoch = false;
    while (true) {
      if (has_plan(epoch_ + 1)) {
        new_epoch = true;
        break;
      }
      if (healthy && !queue_.empty()) break;
      // Commands come to this worker's stage actor; one of an older epoch, or one already
      // served, is dropped (take_commands).
      take_commands(std::chrono::milliseconds(healthy ? 50 : 20), seq);
      if (!healthy) queue_.clear();
      if (store_.past_limit()) return store_.limit_status();
      if (Clock::now() > idle_deadline) return deadline_exceeded("elastic: slot {}: no command for 600 s", slot_);
    }
    if (new_epoch) {
      TROUPE_ASSIGN_OR_RETURN(ElasticPlan p, read_plan(epoch_ + 1, std::chrono::milliseconds(10000)));
      {
        std::lock_guard<std::mutex> lock(mu_);
        adopting_ = p.epoch;
        if (stage_) stage_->abort_comms("adopting a new epoch");
        epoch_ = p.epoch;
        cancel_ = false;
      }
      queue_.clear();
      launched_ahead_ = -1;
      if (p.rank_of_slot(slot_) < 0) {
        fmt::print(stderr, "elastic: slot {} leaves the job in epoch {} ({})\n", slot_, p.epoch, p.reason);
        return ok_status();
      }
      peer_failure = false;
      try {
        st = join(p);
      } catch (const CommFailure& e) {
        st = unavailable("{}", e.what());
        peer_failure = true;
      }
      healthy = st.ok();
      seq = p.seq;
      served_at = Clock::now();
      continue;
    }
    const StepCommand next = queue_.front();
    queue_.pop_front();
    seq = next.seq;
    const Command cmd{next.seq, static_cast<Command::Kind>(next.kind), next.step, next.snapshot};
    StepReply reply;
    reply.seq = cmd.seq;
    reply.kind = next.kind;
    // Zero when the command was queued before the last one was served (the driver kept
    // this worker ahead), else what the worker idled waiting for it.
    reply.command_wait_ms = std::chrono::duration<double>(Clock::now() - served_at).count() * 1e3;
    try {
      switch (cmd.kind) {
        case Command::Kind::kStep:
          TROUPE_RETURN_IF_ERROR(run_step_command(cmd, reply));
          break;
        case Command::Kind::kEval:
          reply.val_loss = stage_->evaluate();
          break;
        case Command::Kind::kStop:
          break;
        case Command::Kind::kSave:      // the job's last checkpoint, made durable before the reply
        case Command::Kind::kSnapshot:  // a snapshot off the schedule (a planned membership change)
          if (stage_->steps_done() != cmd.step) {
            return failed_precondition("{} of step {}: this rank has run {} steps",
                                       command_kind_name(cmd.kind), cmd.step, stage_->steps_done());
          }
          if (!snapshotter_) {
            return failed_precondition("{} of step {}: this worker takes no snapshots",
                                       command_kind_name(cmd.kind), cmd.step);
          }
          // Either writes (or takes) the one snapshot of the step the Trainer commits: the
          // step's scheduled snapshot may still be landing when the command comes.
          if (cmd.kind == Command::Kind::kSnapshot) {
            snapshotter_->snapshot_off_schedule(
                cmd.step, static_cast<SnapshotOrder>(cmd.snapshot) == SnapshotOrder::kCheckpoint, reply);
          } else {
            snapshotter_->save(cmd.step, reply);
          }
          break;
      }
    } catch (const CommFailure& e) {
      st = unavailable("{}", e.what());
      healthy = false;
      peer_failure = true;
      continue;
    }
    if (snapshotter_) {
      if (cmd.kind != Command::Kind::kStep && reply.snapshot >= 0 && steps_ != nullptr)
        steps_->record_io(reply.snapshot_ms);
      snapshotter_->report(reply, cmd.kind == Command::Kind::kStop || cmd.kind == Command::Kind::kSave);
    }
    if (cmd.kind == Command::Kind::kStop && keeper_) {
      // The job is over: this rank's snapshots (and their copies) can go.
      (void)keeper_->release(job_, rank_);
    }
    reply.rank = rank_;
    reply.slot = slot_;
    reply.epoch = epoch_;
    take_commands(std::chrono::milliseconds(0), seq + 1);
    reply.next_queued = !queue_.empty();
    TROUPE_RETURN_IF_ERROR(actors_->send(reply));
    served_at = Clock::now();
    ++seq;
    if (cmd.kind == Command::Kind::kStop) return ok_status();
  }
}

Status run_elastic_worker(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& base_store, const std::string& job, int slot, uint64_t epoch,
                          std::function<void()> cut_control, const layers::Ctx& ctx,
                          actors::ActorSystem* driver_system, observe::StepProbe* steps) {
  // A store outage (the scheduler restarting) must not end the worker, up to the job's limit.
  TolerantStore::Options so;
  so.outage_limit = std::chrono::milliseconds(tc.elastic.scheduler_outage_limit_ms);
  so.who = fmt::format("worker slot {}", slot);
  so.where = env::get_or(job_env::kScheduler);
  TolerantStore store(base_store, so);
  std::unique_ptr<FaultState> faults;
  if (!tc.elastic.inject.empty() && epoch == 0) {
    TROUPE_ASSIGN_OR_RETURN(std::vector<FaultSpec> specs, parse_faults(tc.elastic.inject));
    faults = std::make_unique<FaultState>();
    faults->specs = std::move(specs);
    faults->fired.assign(faults->specs.size(), false);
    faults->slowed_step.assign(faults->specs.size(), -1);
    faults->slot = slot;
    faults->store = &store;
    faults->job = job;
    faults->cut_control = std::move(cut_control);
    g_faults = faults.get();
    set_fault_hook(&fault_hook);
  }
  if (faults) {
    for (const FaultSpec& f : faults->specs) {
      if (f.phase != "start" || f.slot != slot) continue;
      // A worker slow to start (exec, loading, a busy host): no beat until it is up.
      const int64_t ms = 2 * tc.elastic.heartbeat_timeout_ms;
      fmt::print(stderr, "elastic: slot {} injects a slow start ({} ms before its first beat)\n", slot, ms);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
  }
  ElasticWorker w(tc, program, store, job, slot, epoch, ctx, driver_system, steps);
  if (faults) {
    faults->cut = [&w] { w.cut_connections(); };
    faults->corrupt = [&w] { w.corrupt_snapshot(); };
  }
  Status st = w.run();
  set_fault_hook(nullptr);
  g_faults = nullptr;
  return st;
}

}  // namespace troupe::training
