// training/driver/trainer.cc — the step driver: the command window.
// Owns: the commands in flight (train.steps_in_flight), the step loop of run_job (the
// window refill, evaluations, metrics.jsonl records, the time limit) and the job's end
// (the final checkpoint, stop, reaping); the free entry points of trainer.h.
// May call: every part; membership changes only at a step boundary with the window empty.
// Invariants: commands go out in seq order and every rank answers them in that order; a
// command counts as complete only with every rank's reply; after a recovery the window
// restarts from the step every rank restored.
#include "core/env.h"
#include "core/job_env.h"
#include "core/peak_flops.h"
#include "training/driver/trainer_driver.h"

namespace troupe::training {

Status Trainer::issue(Command::Kind kind, int64_t step) {
  InFlight c;
  c.seq = seq_++;
  c.kind = kind;
  c.step = step;
  c.replies.assign(plan_.slots.size(), nlohmann::json());
  c.remaining = static_cast<int>(plan_.slots.size());
  c.sent = Clock::now();
  if (inflight_.empty()) oldest_since_ = c.sent;
  // To every stage actor of the epoch; a worker that cannot be reached is found by the
  // failure detection (its exit, its actors' Down, its heartbeat).
  const Status sent =
      actors_->send_command(plan_.slots, StepCommand{c.seq, static_cast<uint8_t>(kind), step, plan_.epoch,
                                                     static_cast<uint8_t>(ckpt_.snapshot_order(kind, step))});
  if (!sent.ok())
    fmt::print(stderr, "trainer: command {} not sent to every worker: {}\n", c.seq, sent.to_string());
  inflight_.push_back(std::move(c));
  return ok_status();
}

int64_t Trainer::steps_in_flight() const {
  return std::count_if(inflight_.begin(), inflight_.end(),
                       [](const InFlight& c) { return c.kind == Command::Kind::kStep; });
}

void Trainer::collect_replies() {
  const int world = static_cast<int>(plan_.slots.size());
  for (const StepReply& rep : actors_->take_replies()) {
    // Replies of this epoch's commands; anything else is a late reply of an abandoned one.
    if (rep.epoch != plan_.epoch || rep.rank < 0 || rep.rank >= world) continue;
    for (InFlight& c : inflight_) {
      if (c.seq != rep.seq) continue;
      nlohmann::json& slot = c.replies[static_cast<size_t>(rep.rank)];
      if (slot.is_null()) {
        slot = step_reply_json(rep);
        --c.remaining;
      }
      break;
    }
  }
}

Status Trainer::await_oldest(std::optional<Failure>& failure) {
  InFlight& c = inflight_.front();
  auto last_slow_check = Clock::now();
  Clock::time_point first_err{};
  while (true) {
    TROUPE_RETURN_IF_ERROR(ckpt_.poll());
    collect_replies();
    if (c.remaining == 0) return ok_status();
    if ((failure = procs_.check_processes())) {
      // A worker that replied and then ended (after "stop") is not a failure: its reply
      // may have been queued behind the news of its end.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      collect_replies();
      if (c.kind == Command::Kind::kStop) {
        bool replied = !failure->slots.empty();
        for (int s : failure->slots) {
          const int r = plan_.rank_of_slot(s);
          replied &= r >= 0 && c.replies[static_cast<size_t>(r)].is_object();
        }
        if (replied) {
          failure.reset();
          continue;
        }
      }
      return ok_status();
    }
    if (Clock::now() - last_slow_check > std::chrono::milliseconds(50)) {
      last_slow_check = Clock::now();
      TROUPE_RETURN_IF_ERROR(past_outage_limit());
      if ((failure = procs_.check_heartbeats())) return ok_status();
      TROUPE_ASSIGN_OR_RETURN(failure, check_errors(first_err));
      if (failure) return ok_status();
      // The watchdog times the oldest command from when it became the oldest: the ones
      // queued behind it wait for it by design.
      if (Clock::now() - std::max(c.sent, oldest_since_) > watchdog_) {
        failure =
            Failure{"watchdog",
                    {},
                    fmt::format("command {} ran past the {} ms step watchdog", c.seq, watchdog_.count()),
                    wall_ms()};
        return ok_status();
      }
    }
    // Woken by the next reply at once; the failure checks above run at least every poll_.
    actors_->wait_for_reply(poll_);
  }
}

Status Trainer::on_completed(InFlight& c) {
  if (recovering_since_ms_) {
    const int64_t now = wall_ms();
    const double recovery_s = static_cast<double>(now - *recovering_since_ms_) / 1e3;
    event({{"event", "recovered"},
           {"cause", recovering_cause_},
           {"step", c.step},
           {"recovery_s", recovery_s},
           {"steps_lost", recovering_steps_lost_},
           {"epoch", plan_.epoch},
           {"plan_by_message", epoch_plan_messages_}});
    fmt::print("elastic: recovered ({}) — {} {} completed {:.2f} s after detection, steps lost {}\n",
               recovering_cause_, command_kind_name(c.kind), c.step, recovery_s, recovering_steps_lost_);
    std::fflush(stdout);
    recovering_since_ms_.reset();
  }
  // The step thread's longest time for this command's snapshot over the ranks (a
  // checkpoint step's stall).
  double snap_ms = -1;
  for (const auto& r : c.replies) {
    if (r.value("snapshot", int64_t{-1}) >= 0) snap_ms = std::max(snap_ms, r.value("snapshot_ms", 0.0));
  }
  if (snap_ms >= 0 && !c.replies.empty()) c.replies[0]["snapshot_ms_max"] = snap_ms;
  last_replies_ = c.replies;
  if (c.kind == Command::Kind::kStep) {
    last_step_replies_ = c.replies;
    step_done_now_ = c.step;
    ckpt_.note_step(c.step, c.replies[0].value("step_tokens", int64_t{0}), tokens_seen_);
  }
  if (c.kind == Command::Kind::kStep && c.step > max_step_completed_) {
    max_step_completed_ = c.step;
    failures_without_progress_ = 0;
  }
  TROUPE_RETURN_IF_ERROR(ckpt_.note_replies(c.replies));
  return ckpt_.poll();
}

Result<std::optional<nlohmann::json>> Trainer::call(Command::Kind kind, int64_t step) {
  TROUPE_CHECK(inflight_.empty(), "call({}) with {} commands in flight", command_kind_name(kind),
               inflight_.size());
  // The state every rank can restore if this command fails: after the last step all of
  // them completed.
  const int64_t step_done = kind == Command::Kind::kStep ? step - 1 : step;
  while (true) {
    TROUPE_RETURN_IF_ERROR(issue(kind, step));
    std::optional<Failure> failure;
    TROUPE_RETURN_IF_ERROR(await_oldest(failure));
    InFlight c = std::move(inflight_.front());
    inflight_.pop_front();
    const bool complete = c.remaining == 0;
    // Workers end after "stop": an exit then is no failure.
    if (failure && complete && kind == Command::Kind::kStop) failure.reset();
    // Every rank completed the command and a worker was lost just after: the command
    // counts, and the worker is replaced from the state after it.
    std::optional<Failure> after;
    if (failure && complete) after = std::exchange(failure, std::nullopt);
    if (!failure) {
      TROUPE_RETURN_IF_ERROR(on_completed(c));
      if (after) {
        const int64_t done = kind == Command::Kind::kStep ? step : step_done;
        if (after->cause == "straggler") {
          // Everyone is alive: a snapshot of this step first, so the replacement loses
          // nothing (a failure meanwhile was recovered from: the straggler waits).
          const uint64_t epoch = plan_.epoch;
          TROUPE_ASSIGN_OR_RETURN(const bool snapped, snapshot_now(done));
          if (!snapped && plan_.epoch != epoch) {
            if (rewound_to_) return std::optional<nlohmann::json>{};
            return std::optional<nlohmann::json>(c.replies[0]);
          }
        }
        TROUPE_RETURN_IF_ERROR(recover(*after, done, done + 1));
        if (rewound_to_) return std::optional<nlohmann::json>{};
      }
      return std::optional<nlohmann::json>(c.replies[0]);
    }
    TROUPE_RETURN_IF_ERROR(recover(*failure, step_done, step));
    if (rewound_to_) return std::optional<nlohmann::json>{};
  }
}

Status Trainer::run_job() {
  TROUPE_ASSIGN_OR_RETURN(const JobStart js, start_job());
  int64_t start_step = js.start_step;
  int64_t tokens_seen = js.tokens_seen;
  std::ofstream& metrics = metrics_;
  TROUPE_ASSIGN_OR_RETURN(std::optional<nlohmann::json> v0o, call(Command::Kind::kEval, start_step));
  if (!v0o) return aborted("elastic: rewound before the first step");
  double last_val = v0o->value("val_loss", 0.0);
  const double val0 = last_val;
  const bool resumed = js.resumed;
  fmt::print("{}step {} | val_loss {:.4f}\n", resumed ? "resumed | " : "", start_step, val0);
  nlohmann::json rec0{{"step", start_step}, {"val_loss", val0}, {"tokens", tokens_seen}};
  if (resumed) rec0["resumed"] = true;
  metrics << rec0.dump() << "\n";
  metrics.flush();
  const auto t_start = Clock::now();
  max_step_logged_ = start_step;
  const int64_t tokens_before = tokens_seen;

  // ---- the steps, up to train.steps_in_flight of them in flight ------------------------
  // Commands go out in order: step k, then its evaluation where one is due, then step
  // k+1 ... The window is refilled as each step's replies arrive, so the workers find
  // their next command queued. What needs the workers at a step boundary with nothing in
  // flight (a rescale or replacement) stops the sending until the window has drained.
  const int64_t window = tc_.train.steps_in_flight;
  const auto eval_due = [&](int64_t s) {
    return (tc_.train.eval_every > 0 && s % tc_.train.eval_every == 0) || s == tc_.train.steps;
  };
  int64_t done = start_step;              // every rank reported this step and the ones before
  int64_t next = start_step + 1;          // the next step to send
  int64_t last = tc_.train.steps;         // the last step to send (the time limit lowers it)
  std::set<int64_t> eval_sent;            // steps whose evaluation was sent after them
  std::optional<nlohmann::json> waiting;  // step `done`'s record, waiting for its evaluation
  bool hold = false;                      // a boundary action is due: send nothing new
  std::optional<Failure> straggler;       // to replace at the next boundary (policy "replace")
  bool out_of_time = false;
  int64_t last_step_tokens = 0;
  auto t_prev = Clock::now();  // when the last step completed (the next one's wall time starts)

  // A step's record: its metrics (rank 0's reply; the loss and norms are the world's),
  // throughput since the step before, the GPU figures where measured.
  const auto step_record = [&](int64_t step, nlohmann::json rec,
                               Clock::time_point sent) -> Result<nlohmann::json> {
    const auto now = Clock::now();
    const double wall_s = std::chrono::duration<double>(now - std::max(t_prev, sent)).count();
    t_prev = now;
    const double loss = rec.value("loss", NAN);
    if (!std::isfinite(loss)) return aborted("step {}: the loss is {} (diverged)", step, loss);
    const int64_t step_tokens = rec.value("step_tokens", int64_t{0});
    last_step_tokens = step_tokens;
    tokens_seen = tokens_seen_ = ckpt_.tokens_after(step).value_or(0);  // on_completed counted it
    // A checkpoint step's stall: the longest time a rank's step thread spent on its snapshot.
    if (ckpt_.on_checkpoint_schedule(step) && rec.contains("snapshot_ms_max"))
      rec["ckpt_stall_ms"] = rec["snapshot_ms_max"];
    for (const char* k : {"step_tokens", "rank", "slot", "ckpt_started", "ckpt_blocked_ms", "ckpt_bytes",
                          "durable", "ckpt_errors", "snapshot_errors", "snapshot_ms_max"})
      rec.erase(k);
    rec["tokens"] = tokens_seen;
    rec["tokens_per_s"] = static_cast<double>(step_tokens) / wall_s;
    rec["driver_step_ms"] = wall_s * 1e3;
    rec["dp"] = plan_.dp;
    // Load imbalance: the busiest expert's count over the mean, worst MoE block.
    double imbalance = 0;
    for (const auto& block : rec.value("expert_load", nlohmann::json::array())) {
      int64_t total = 0, mx = 0;
      for (const auto& v : block) {
        total += v.get<int64_t>();
        mx = std::max(mx, v.get<int64_t>());
      }
      if (total > 0) {
        imbalance = std::max(imbalance, static_cast<double>(mx) * static_cast<double>(block.size()) /
                                            static_cast<double>(total));
      }
    }
    if (!rec.value("expert_load", nlohmann::json::array()).empty()) rec["load_imbalance"] = imbalance;
    if (rec.contains("peak_bytes")) rec["peak_gib"] = rec["peak_bytes"].get<double>() / 1073741824.0;
    if (o_.flops_per_token > 0) {
      rec["mfu"] = static_cast<double>(step_tokens) / wall_s * o_.flops_per_token /
                   (kPeakBf16FlopsPerGpu * static_cast<double>(plan_.slots.size()));
    }
    if (step <= max_step_logged_) rec["replayed"] = true;  // after a checkpoint restore
    max_step_logged_ = std::max(max_step_logged_, step);
    return rec;
  };
  // Writes a step's record and its console line.
  const auto finish_record = [&](const nlohmann::json& rec) {
    const int64_t step = rec.value("step", int64_t{0});
    metrics << rec.dump() << "\n";
    metrics.flush();
    run_metrics_->on_step(rec);
    const bool val = rec.contains("val_loss");
    if (val) last_val = rec["val_loss"].get<double>();
    if (step % tc_.train.log_every == 0 || step == 1 || val) {
      std::string gpu;
      if (rec.contains("mfu")) gpu += fmt::format(" | mfu {:.1f}%", 100.0 * rec["mfu"].get<double>());
      if (rec.contains("activation_bytes"))
        gpu += fmt::format(" | act {:.2f} GiB", rec["activation_bytes"].get<double>() / 1073741824.0);
      if (rec.contains("peak_gib")) gpu += fmt::format(" | peak {:.2f} GiB", rec["peak_gib"].get<double>());
      if (rec.contains("host_syncs")) gpu += fmt::format(" | syncs {}", rec["host_syncs"].get<int64_t>());
      fmt::print(
          "step {}/{} | loss {:.4f} | lm {:.4f} | aux {:.4f} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s | "
          "{:.0f} ms{}{}{}{}\n",
          step, tc_.train.steps, rec.value("loss", 0.0), rec.value("lm_loss", 0.0),
          rec.value("aux_loss", 0.0), rec.value("lr", 0.0), rec.value("grad_norm", 0.0),
          rec.value("tokens_per_s", 0.0), rec.value("driver_step_ms", 0.0),
          rec.contains("load_imbalance")
              ? fmt::format(" | load max/mean {:.2f}", rec["load_imbalance"].get<double>())
              : "",
          plan_.slots.size() > 1 ? fmt::format(" | dp {}", plan_.dp) : "", gpu,
          val ? fmt::format(" | val_loss {:.4f}", last_val) : "");
      std::fflush(stdout);
    }
    write_status(step);
  };
  // After a recovery: go on from the step the workers restored (at or before `done`: a
  // snapshot or checkpoint of a step every rank reported, or the live state after `done`).
  const auto after_recovery = [&]() -> Status {
    inflight_.clear();
    if (rewound_to_) {  // back to a snapshot or a checkpoint: run the steps after it again
      const int64_t to = *rewound_to_;
      rewound_to_.reset();
      fmt::print("elastic: rewound to step {}; steps {}..{} run again\n", to, to + 1, done);
      done = to;
      if (std::optional<int64_t> t = ckpt_.tokens_after(done)) tokens_seen = tokens_seen_ = *t;
      waiting.reset();
    }
    next = done + 1;
    eval_sent.erase(eval_sent.upper_bound(done - 1), eval_sent.end());
    if (waiting) {  // the evaluation after `done` again
      TROUPE_RETURN_IF_ERROR(issue(Command::Kind::kEval, done));
      eval_sent.insert(done);
    }
    t_prev = Clock::now();
    return ok_status();
  };
  const auto restore = [&](const Failure& f) -> Status {
    TROUPE_RETURN_IF_ERROR(recover(f, done, done + 1));
    return after_recovery();
  };

  // Sends steps (each followed by its evaluation when one is due) until the window is
  // full; never past a scripted rescale after a step later than `completed`.
  const auto fill_window = [&](int64_t completed) -> Status {
    while (!hold && next <= last && steps_in_flight() < window) {
      if (next - 1 > completed && requests_->scripted_after(next - 1)) break;
      TROUPE_RETURN_IF_ERROR(issue(Command::Kind::kStep, next));
      if (eval_due(next)) {
        TROUPE_RETURN_IF_ERROR(issue(Command::Kind::kEval, next));
        eval_sent.insert(next);
      }
      ++next;
    }
    return ok_status();
  };

  while (done < last || waiting || !inflight_.empty()) {
    TROUPE_RETURN_IF_ERROR(fill_window(done));
    if (inflight_.empty()) {
      // The window drained at a step boundary: membership changes (each a new epoch).
      if (straggler) {
        const Failure f = *std::exchange(straggler, std::nullopt);
        const uint64_t epoch = plan_.epoch;
        TROUPE_ASSIGN_OR_RETURN(const bool snapped, snapshot_now(done));
        (void)snapped;  // without a snapshot the replacement restores the newest one there is
        bool member = false;
        for (int sl : f.slots) member |= plan_.rank_of_slot(sl) >= 0;
        // A failure meanwhile was recovered from (the straggler may be gone with it).
        if (plan_.epoch == epoch && member) TROUPE_RETURN_IF_ERROR(restore(f));
      }
      TROUPE_RETURN_IF_ERROR(serve_requests(done));
      write_status(done);  // the membership after this boundary's changes
      requests_->send_answer();
      hold = false;
      if (rewound_to_) TROUPE_RETURN_IF_ERROR(after_recovery());
      if (done >= last && !waiting) break;
      continue;
    }
    std::optional<Failure> failure;
    TROUPE_RETURN_IF_ERROR(await_oldest(failure));
    if (inflight_.front().remaining > 0) {  // a failure before every rank completed it
      TROUPE_RETURN_IF_ERROR(restore(*failure));
      continue;
    }
    InFlight c = std::move(inflight_.front());
    inflight_.pop_front();
    oldest_since_ = Clock::now();
    // train.time_limit_s: past it, the steps already sent are the last (then the final
    // validation and checkpoint).
    if (c.kind == Command::Kind::kStep && !out_of_time && tc_.train.time_limit_s > 0 &&
        std::chrono::duration<double>(Clock::now() - t_start).count() > tc_.train.time_limit_s &&
        c.step < tc_.train.steps) {
      out_of_time = true;
      last = next - 1;
      if (eval_sent.count(last) == 0) {
        TROUPE_RETURN_IF_ERROR(issue(Command::Kind::kEval, last));
        eval_sent.insert(last);
      }
    }
    // A membership change asked for stops the sending first: it waits only for the steps
    // already in flight.
    if (c.kind == Command::Kind::kStep && c.step < last) {
      hold |= requests_->waiting(c.step);
    }
    // The next step goes out before this one's bookkeeping (metrics, status): the workers
    // must not wait for the driver's own work. (Not past a scripted rescale after it.)
    if (!failure && c.kind == Command::Kind::kStep && !requests_->scripted_after(c.step)) {
      TROUPE_RETURN_IF_ERROR(fill_window(c.step));
    }
    // Every rank completed the command and a worker was lost (or flagged) just after: the
    // command counts, and the worker is replaced from the state after it.
    std::optional<Failure> after = std::move(failure);
    if (!after && c.kind == Command::Kind::kStep) {
      if (std::optional<int> slot = stragglers_.track(c.replies, plan_.slots, c.step))
        after = Failure{"straggler", {*slot}, fmt::format("slot {} is a straggler", *slot), wall_ms()};
    }
    if (after && after->cause == "straggler") {
      // Everyone is alive: the straggler is replaced at the boundary after the steps in
      // flight, from a snapshot of that step taken first (no step lost).
      straggler = std::move(after);
      after.reset();
      hold = true;
    }
    TROUPE_RETURN_IF_ERROR(on_completed(c));
    if (c.kind == Command::Kind::kStep) {
      TROUPE_ASSIGN_OR_RETURN(nlohmann::json rec, step_record(c.step, c.replies[0], c.sent));
      done = c.step;
      if (eval_sent.count(done) != 0) {
        waiting = std::move(rec);
      } else {
        finish_record(rec);
      }
    } else if (c.kind == Command::Kind::kEval && waiting && c.step == done) {
      (*waiting)["val_loss"] = c.replies[0].value("val_loss", NAN);
      finish_record(*waiting);
      waiting.reset();
    }
    if (after) TROUPE_RETURN_IF_ERROR(restore(*after));
  }
  const int64_t final_step = done;
  if (out_of_time) {
    fmt::print("trainer: time limit of {:.0f}s reached after step {}; stopping\n", tc_.train.time_limit_s,
               final_step);
  }
  // The last step's checkpoint (checkpoint.final; taken after the step when it is on the
  // every-K schedule, else now), made durable before the workers stop. A job resumed with
  // nothing left to train saves the state it loaded, in its own layout (unless that very
  // checkpoint is in its checkpoint directory). A save that fails is tried once more (a
  // disk freed meanwhile); failing at the same point twice is permanent: a restarted
  // driver would run the steps since the last checkpoint again only to meet it a third time.
  const bool final_ckpt = ckpt_.want_final(final_step, start_step);
  for (int attempt = 1; final_ckpt && !ckpt_.committed(final_step); ++attempt) {
    ckpt_.ask_final(final_step, tokens_seen_);
    TROUPE_ASSIGN_OR_RETURN(std::optional<nlohmann::json> saved, call(Command::Kind::kSave, final_step));
    if (!saved) {
      return aborted(
          "a failure during the final checkpoint sent the job back to step {}; continue it with --resume",
          *rewound_to_);
    }
    if (ckpt_.committed(final_step)) break;
    const FailedSave why = ckpt_.clean_failed(final_step);
    event({{"event", "final_checkpoint_failed"},
           {"step", final_step},
           {"attempt", attempt},
           {"disk_full", why.disk_full},
           {"free_bytes", why.free_bytes},
           {"needed_bytes", why.needed_bytes},
           {"why", why.text}});
    fmt::print(stderr, "checkpoint: the final checkpoint (step {}) failed (attempt {} of 2): {}\n",
               final_step, attempt, why.text);
    std::fflush(stderr);
    if (attempt == 2) {
      const std::string msg =
          fmt::format("the final checkpoint (step {}) could not be written twice: {}", final_step, why.text);
      return why.disk_full ? resource_exhausted("{}", msg) : data_loss("{}", msg);
    }
  }
  TROUPE_RETURN_IF_ERROR(call(Command::Kind::kStop, 0).status());
  // Saves that failed along the way leave nothing behind (every worker is done writing now).
  ckpt_.clean_all_failed();
  // Every worker exits after "stop"; reap them (bounded). Under the scheduler it does.
  const auto deadline = Clock::now() + std::chrono::milliseconds(30000);
  procs_.reap_all(deadline);
  if (!actor_table_.empty()) {  // the trainer's own row: the job is over
    actor_table_[0]["state"] = "finished";
    actors_step_ = final_step;
    write_status(final_step);
  }
  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  event({{"event", "job_finished"}, {"recoveries", recoveries_}, {"seconds", total_s}});
  fmt::print(
      "{}: done in {:.1f}s ({:.0f} tokens/s); val_loss {:.4f} -> {:.4f}; {} recoveries{}\n", o_.app, total_s,
      static_cast<double>(tokens_seen - tokens_before) / std::max(total_s, 1e-9), val0, last_val, recoveries_,
      final_ckpt ? fmt::format("; weights in the checkpoint of step {} in {}", final_step, ckpt_.dir()) : "");
  return ok_status();
}

bool runs_in_one_process(const layers::TrainConfig& tc, bool scheduled) {
  return !scheduled && tc.parallel.world() == 1 && !tc.elastic.isolate_workers;
}

Status check_one_process(const layers::TrainConfig& tc) {
  // What needs worker processes, refused by name rather than half done.
  const char* why = !tc.elastic.inject.empty() ? "test.inject (faults are injected into worker processes)"
                    : tc.elastic.max_dp > 1 ? "elastic.max_dp > 1 (growing the job starts worker processes)"
                    : !tc.elastic.scale_at.empty()
                        ? "test.scale_at (rescaling starts or stops worker processes)"
                        : nullptr;
  if (why == nullptr) return ok_status();
  return invalid_argument(
      "{}: {} needs the worker in a process of its own: set elastic.isolate_workers = true (this layout "
      "1x1x1 otherwise runs the Trainer and its worker in one process)",
      tc.source, why);
}

Status run_trainer(const TrainerOptions& o, const layers::TrainConfig& tc,
                   std::unique_ptr<comm::RendezvousStore> scheduled_store) {
  std::error_code ec;
  fs::create_directories(o.run_dir, ec);
  if (ec) return io_error("cannot create run directory {}: {}", o.run_dir, ec.message());
  Trainer t(o, o.run_dir, tc, std::move(scheduled_store));
  return t.run();
}

Status run_worker_process(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& store, std::function<void()> cut_control,
                          const layers::Ctx& ctx, observe::StepProbe* steps) {
  std::optional<std::string> job = env::get(job_env::kJobId);
  if (!job) return invalid_argument("worker: {} is not set", job_env::kJobId);
  // A worker's rank is its slot (the scheduler's and the standalone launcher's alike); a
  // worker the driver asked for later is also told the membership epoch it joins.
  TROUPE_ASSIGN_OR_RETURN(const int64_t slot, env::get_int(job_env::kRank, -1, -1, INT32_MAX));
  if (slot < 0) return invalid_argument("worker: {} is not set", job_env::kRank);
  TROUPE_ASSIGN_OR_RETURN(const int64_t epoch, env::get_int(job_env::kMembershipEpoch, 0, 0));
  return run_elastic_worker(tc, program, store, *job, static_cast<int>(slot), static_cast<uint64_t>(epoch),
                            std::move(cut_control), ctx, /*driver_system=*/nullptr, steps);
}

}  // namespace troupe::training
