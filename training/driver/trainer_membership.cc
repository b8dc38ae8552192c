// training/driver/trainer_membership.cc — membership and recovery.
// Owns: plan_ (the current epoch's ElasticPlan), slot numbering, spares, the recovery in
// progress (recovering_*), the give-up counters, the failures workers report (check_errors).
// May call: process supervision (procs_: spawn, terminate, check_*), the checkpoint coordinator
// (ckpt_: the plan's snapshot policy, open_epoch, choose_restore, recommit_restored), the
// command window (call: a snapshot off the schedule before a planned change), the store
// (plan and ready keys), the ActorDirectory (plans, attach), event(), write_status().
// Invariants: epochs only grow; every plan is published in the store before any worker of
// it is started; a recovery restores what choose_restore chose (a live state only when
// nobody was lost and the layout is unchanged); a rescale or replacement happens only at a
// step boundary with no command in flight, after a snapshot of that step committed.
#include "training/driver/trainer_driver.h"

namespace troupe::training {

Result<std::optional<Failure>> Trainer::check_errors(Clock::time_point& first_err) {
  // Failures the workers reported to the trainer actor (typed: code, actor, text).
  for (const WorkerFailure& f : actors_->take_failures()) {
    if (f.epoch != plan_.epoch) continue;
    if (f.snapshot_step >= 0 && f.snapshot_step == plan_.snapshot_step) {
      // A part of the snapshot this epoch restores is lost or damaged: the next recovery
      // goes back to an older one.
      if (ckpt_.mark_unrestorable(f.snapshot_step, f.text)) {
        event({{"event", "snapshot_unusable"},
               {"step", f.snapshot_step},
               {"slot", f.slot},
               {"rank", f.rank},
               {"error", f.text}});
        fmt::print(stderr,
                   "elastic: the snapshot of step {} cannot be restored (slot {}: {}); going back further\n",
                   f.snapshot_step, f.slot, f.text);
        std::fflush(stderr);
      }
    }
    if (!epoch_failure_.empty()) continue;
    epoch_failure_ = fmt::format("slot {} ({}): {}", f.slot, f.actor, f.text);
    // A snapshot a restore could not use is not the job's end: the next recovery goes back
    // to an older one, or to the checkpoint.
    epoch_failure_permanent_ =
        f.snapshot_step < 0 && is_permanent_failure(Status(static_cast<StatusCode>(f.code), f.text));
    event({{"event", "worker_failure"},
           {"epoch", f.epoch},
           {"slot", f.slot},
           {"rank", f.rank},
           {"actor", f.actor},
           {"code", f.code},
           {"text", f.text},
           {"failed_ms", f.ts_ms}});
  }
  const std::string what = epoch_failure_;
  if (what.empty()) return std::optional<Failure>{};
  if (epoch_failure_permanent_) {
    Failure f{"worker_failure", {}, what, wall_ms()};
    f.permanent = true;
    return std::optional<Failure>(f);
  }
  if (first_err == Clock::time_point{}) first_err = Clock::now();
  // A peer's death or silence explains most data-plane errors: give exit/heartbeat
  // detection the grace period first.
  if (Clock::now() - first_err < err_grace_) return std::optional<Failure>{};
  return std::optional<Failure>(Failure{"comm_error", {}, what, wall_ms()});
}

Status Trainer::wait_ready(const ElasticPlan& plan, std::optional<Failure>& failure) {
  const auto deadline = Clock::now() + procs_.join_timeout();
  std::set<int> pending(plan.slots.begin(), plan.slots.end());
  restored_parts_ = nlohmann::json::object();
  Clock::time_point first_err{};
  auto last_hb_check = Clock::now();
  while (!pending.empty()) {
    for (auto it = pending.begin(); it != pending.end();) {
      TROUPE_ASSIGN_OR_RETURN(bool has,
                              store_.raw().contains(key(fmt::format("ready/{}/{}", plan.epoch, *it))));
      it = has ? pending.erase(it) : std::next(it);
    }
    if (pending.empty()) break;
    if ((failure = procs_.check_processes())) return ok_status();
    if (Clock::now() - last_hb_check > std::chrono::milliseconds(100)) {
      last_hb_check = Clock::now();
      TROUPE_RETURN_IF_ERROR(past_outage_limit());
      if ((failure = procs_.check_heartbeats())) return ok_status();
      TROUPE_ASSIGN_OR_RETURN(failure, check_errors(first_err));
      if (failure) return ok_status();
    }
    if (Clock::now() > deadline) {
      // Wedged workers (e.g. a step thread that never returns): replaced (last resort).
      // The ones that never took the plan over are the culprits; the others wait on them.
      std::vector<int> wedged;
      for (int s : pending) {
        TROUPE_ASSIGN_OR_RETURN(bool adopted,
                                store_.raw().contains(key(fmt::format("adopted/{}/{}", plan.epoch, s))));
        if (!adopted) wedged.push_back(s);
      }
      if (wedged.empty()) wedged.assign(pending.begin(), pending.end());
      failure =
          Failure{"join_timeout", wedged,
                  fmt::format("{} worker(s) did not join epoch {} within {} ms, {} never took the plan over",
                              pending.size(), plan.epoch, procs_.join_timeout().count(), wedged.size()),
                  wall_ms()};
      return ok_status();
    }
    std::this_thread::sleep_for(std::max(poll_, std::chrono::milliseconds(5)));
  }
  // Every worker joined: monitor the actors placed on them for this epoch, and record
  // the placement (actor id -> worker) with the scheduler.
  // Each worker's ready record names the roles it hosts (its program's parameters) and
  // how it learned the plan.
  std::vector<std::vector<std::string>> roles(plan.slots.size());
  epoch_plan_messages_ = 0;
  for (size_t r = 0; r < plan.slots.size(); ++r) {
    TROUPE_ASSIGN_OR_RETURN(std::string text,
                            store_.raw().get(key(fmt::format("ready/{}/{}", plan.epoch, plan.slots[r])),
                                             comm::deadline_in(std::chrono::milliseconds(10000))));
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_object()) {
      // The scheduler started the worker: its ready record says which process it is.
      ProcessSupervisor::Proc& p = procs_.proc(plan.slots[r]);
      if (scheduled_ && j.contains("pid") && j["pid"].is_number_integer()) p.pid = j["pid"].get<pid_t>();
      if (j.contains("host") && j["host"].is_string()) p.host = j["host"].get<std::string>();
    }
    if (j.is_object() && j.contains("roles") && j["roles"].is_array()) {
      for (const auto& x : j["roles"]) {
        if (x.is_string()) roles[r].push_back(x.get<std::string>());
      }
    }
    if (j.is_object() && j.value("plan_via", "") == "message") ++epoch_plan_messages_;
    // Every rank restored the step the plan names.
    if (j.is_object() && j.contains("step_done") && j["step_done"].is_number_integer() &&
        j["step_done"].get<int64_t>() != plan.step_done) {
      return data_loss("epoch {}: worker slot {} restored step {}, the plan says {}", plan.epoch,
                       plan.slots[r], j["step_done"].get<int64_t>(), plan.step_done);
    }
    if (j.is_object() && j.contains("parts")) restored_parts_[std::to_string(plan.slots[r])] = j["parts"];
    if (roles[r].empty() || roles[r].front() != "stage") {
      return data_loss("worker slot {}: its ready record for epoch {} names no stage actor: {}",
                       plan.slots[r], plan.epoch, text.substr(0, 200));
    }
  }
  TROUPE_RETURN_IF_ERROR(actors_->attach(
      plan.slots, roles, store_.raw(), [this](int s) { return key(fmt::format("actors/{}", s)); },
      std::chrono::milliseconds(30000)));
  if (o_.publish_placement) {
    std::vector<std::pair<std::string, std::string>> placement{{"trainer", "driver"}};
    for (size_t r = 0; r < plan.slots.size(); ++r) {
      for (const std::string& role : roles[r]) {
        placement.emplace_back(actor_id(role, static_cast<int>(r)), fmt::format("worker-{}", plan.slots[r]));
      }
    }
    Status st = o_.publish_placement(
        placement, fmt::format("pp={},dp={},n={}", tc_.parallel.pp, plan.dp, tc_.parallel.n));
    if (!st.ok()) {
      event({{"event", "placement_not_recorded"}, {"epoch", plan.epoch}, {"error", st.to_string()}});
      fmt::print(stderr, "trainer: the scheduler did not record the actor placement of epoch {}: {}\n",
                 plan.epoch, st.to_string());
    }
  }
  return ok_status();
}

Result<ElasticPlan> Trainer::plan_for(int64_t dp, const std::vector<int>& keep_dp, int64_t step_done,
                                      const std::string& why, std::vector<int>& spawn_slots,
                                      std::vector<int>& leaving) {
  const int pp = static_cast<int>(tc_.parallel.pp), n = static_cast<int>(tc_.parallel.n);
  TROUPE_ASSIGN_OR_RETURN(ParallelLayout old_l, ParallelLayout::make(pp, static_cast<int>(plan_.dp), n));
  TROUPE_ASSIGN_OR_RETURN(ParallelLayout new_l, ParallelLayout::make(pp, static_cast<int>(dp), n));
  // The global batch stays the config's: each replica takes more or fewer micro-batches.
  TROUPE_ASSIGN_OR_RETURN(const int64_t micro, layers::micro_batches_per_replica(tc_.train, dp));
  ElasticPlan p;
  p.epoch = plan_.epoch + 1;
  p.dp = dp;
  p.grad_accum = micro;
  p.step_done = step_done;
  p.seq = seq_;
  p.reason = why;
  std::set<int> kept_slots;
  for (int r = 0; r < new_l.world_size(); ++r) {
    const ParallelCoord c = new_l.coord(r);
    if (static_cast<size_t>(c.dp) < keep_dp.size()) {
      ParallelCoord oc = c;
      oc.dp = keep_dp[static_cast<size_t>(c.dp)];
      const int slot = plan_.slots[static_cast<size_t>(old_l.rank_of(oc))];
      p.slots.push_back(slot);
      p.has_state.push_back(false);
      kept_slots.insert(slot);
    } else {
      p.slots.push_back(next_slot_);
      p.has_state.push_back(false);
      spawn_slots.push_back(next_slot_++);
    }
  }
  for (int s : plan_.slots) {
    if (!kept_slots.count(s)) leaving.push_back(s);
  }
  return p;
}

Status Trainer::open_epoch(ElasticPlan plan, const std::vector<int>& spawn_slots,
                           const std::vector<int>& leaving) {
  ckpt_.set_policy(plan);
  plan.snapshot_committed = ckpt_.newest_committed();
  epoch_failure_.clear();  // failures reported in the old epoch are handled by this one
  epoch_failure_permanent_ = false;
  // The old epoch's snapshots still landing and checkpoints still waiting for parts.
  ckpt_.open_epoch();
  TROUPE_RETURN_IF_ERROR(
      store_.raw().set(key(fmt::format("plan/{}", plan.epoch)), encode_elastic_plan(plan)));
  // The workers of the old epoch get the plan as a message too (they react at once; the
  // store record is where new and restarted workers read it).
  const int told = actors_->send_plan(plan);
  event({{"event", "epoch_opened"}, {"plan", plan.event_json()}, {"plan_messages", told}});
  plan_ = plan;
  for (int s : spawn_slots) TROUPE_RETURN_IF_ERROR(procs_.spawn(s, plan.epoch, avoid_node_));
  // Workers leaving on a scale-down exit by themselves once they see the plan.
  TROUPE_RETURN_IF_ERROR(procs_.await_leaving(leaving));
  return ok_status();
}

Status Trainer::one_process_failure(const Failure& f) const {
  return aborted(
      "{} failure ({}): the job runs in one process (layout 1x1x1, elastic.isolate_workers = false), so its "
      "worker cannot be replaced; continue from the last checkpoint with --resume, or set "
      "elastic.isolate_workers = true to run the worker as a child process that is replaced when it fails",
      f.cause, f.detail);
}

Status Trainer::recover(Failure f, int64_t step_done, int64_t failed_step) {
  if (f.permanent || one_process_) {
    event({{"event", "failure_detected"},
           {"cause", f.cause},
           {"slots", f.slots},
           {"detail", f.detail},
           {"epoch", plan_.epoch},
           {"step", failed_step},
           {"detected_ms", f.ts_ms},
           {"permanent", f.permanent}});
    if (!f.permanent) return one_process_failure(f);
    return failed_precondition(
        "elastic: {} ({}): a permanent failure, which a replacement would meet again: "
        "the job ends without a restart",
        f.detail, f.cause);
  }
  if (++failures_without_progress_ > kMaxFailuresWithoutProgress) {
    // The failure comes back every time: another driver would meet it too.
    return failed_precondition(
        "elastic: giving up after {} failures without completing a new step (the last: {}: {})",
        failures_without_progress_ - 1, f.cause, f.detail);
  }
  for (int attempt = 0;; ++attempt) {
    if (attempt >= 5) return aborted("elastic: giving up after {} failed recoveries: {}", attempt, f.detail);
    ++recoveries_;
    // Time of the injected fault, if the test injected one (detection latency).
    std::optional<int64_t> fault_ms;
    // A failure nobody is blamed for (comm_error, watchdog): any worker may have caused it.
    const std::vector<int> suspects = f.slots.empty() ? plan_.slots : f.slots;
    for (int s : store_out() ? std::vector<int>{} : suspects) {
      Result<bool> has = poll_contains(key(fmt::format("fault/{}", s)));
      if (has.ok() && has.value()) {
        Result<std::string> v = poll_get(key(fmt::format("fault/{}", s)), std::chrono::milliseconds(100));
        if (v.ok()) {
          const nlohmann::json j = nlohmann::json::parse(v.value(), nullptr, false);
          if (j.is_object() && j.contains("ts_ms"))
            fault_ms = std::max(fault_ms.value_or(0), j["ts_ms"].get<int64_t>());
        }
      }
    }
    nlohmann::json det{{"event", "failure_detected"}, {"cause", f.cause},     {"slots", f.slots},
                       {"detail", f.detail},          {"epoch", plan_.epoch}, {"step", failed_step},
                       {"detected_ms", f.ts_ms}};
    if (fault_ms) det["detection_ms"] = f.ts_ms - *fault_ms;
    event(det);
    fmt::print("elastic: failure detected ({}): {}{}\n", f.cause, f.detail,
               fault_ms ? fmt::format(" — {} ms after the fault", f.ts_ms - *fault_ms) : "");
    std::fflush(stdout);
    if (!recovering_since_ms_) {
      recovering_since_ms_ = f.ts_ms;
      recovering_cause_ = f.cause;
      recovering_slots_.clear();
    }
    for (int s : f.slots) {
      if (std::find(recovering_slots_.begin(), recovering_slots_.end(), s) == recovering_slots_.end())
        recovering_slots_.push_back(s);
    }
    // The failure is visible at once (troupe status, troupe top), not at the next step.
    write_status(last_step_, /*ask_actors=*/false);
    // Workers that die together (a node, one fault hitting several) die within a few ms
    // of each other: the exits seen in a short window are handled by one recovery.
    if (f.cause == "exit") {
      const auto until = Clock::now() + kFailureBatchWindow;
      while (Clock::now() < until) {
        if (std::optional<Failure> more = procs_.check_processes()) {
          for (int s : more->slots) {
            if (std::find(f.slots.begin(), f.slots.end(), s) != f.slots.end()) continue;
            f.slots.push_back(s);
            recovering_slots_.push_back(s);
            f.detail += "; " + more->detail;
            nlohmann::json e{{"event", "failure_detected"}, {"cause", more->cause}, {"slots", {s}},
                             {"detail", more->detail},      {"epoch", plan_.epoch}, {"step", failed_step},
                             {"detected_ms", more->ts_ms}};
            Result<std::string> v =
                store_out() ? Result<std::string>(unavailable("store out"))
                            : poll_get(key(fmt::format("fault/{}", s)), std::chrono::milliseconds(100));
            if (v.ok()) {
              const nlohmann::json j = nlohmann::json::parse(v.value(), nullptr, false);
              if (j.is_object() && j.contains("ts_ms"))
                e["detection_ms"] = more->ts_ms - j["ts_ms"].get<int64_t>();
            }
            event(e);
            fmt::print("elastic: failure detected ({}): {} (handled with the one before)\n", more->cause,
                       more->detail);
          }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    // The lost workers: make sure they are gone (a hung one is killed: the last resort).
    for (int s : f.slots) procs_.terminate(s, f.cause);
    // Replace each lost worker, or shrink dp when no spare is left.
    std::vector<int> spawn_slots, leaving;
    Result<ElasticPlan> plan = [&]() -> Result<ElasticPlan> {
      const int64_t need = static_cast<int64_t>(f.slots.size());
      if (spares_left_ < 0 || spares_left_ >= need) {
        if (spares_left_ > 0) spares_left_ -= need;
        ElasticPlan p = plan_;
        p.epoch = plan_.epoch + 1;
        p.step_done = step_done;
        p.seq = seq_;
        p.reason = f.cause;
        for (size_t r = 0; r < p.slots.size(); ++r) {
          if (std::find(f.slots.begin(), f.slots.end(), p.slots[r]) != f.slots.end()) {
            p.slots[r] = next_slot_;
            p.has_state[r] = false;
            spawn_slots.push_back(next_slot_++);
          }
        }
        return p;
      }
      // No spare: keep the dp replicas that lost nobody.
      TROUPE_ASSIGN_OR_RETURN(ParallelLayout l, ParallelLayout::make(static_cast<int>(tc_.parallel.pp),
                                                                     static_cast<int>(plan_.dp),
                                                                     static_cast<int>(tc_.parallel.n)));
      std::set<int> lost_dp;
      for (int s : f.slots) lost_dp.insert(l.coord(plan_.rank_of_slot(s)).dp);
      std::vector<int> keep;
      for (int d = 0; d < l.dp(); ++d) {
        if (!lost_dp.count(d)) keep.push_back(d);
      }
      const int64_t min_dp = tc_.elastic.min_dp;
      int64_t dp = static_cast<int64_t>(keep.size());
      while (dp >= min_dp && dp > 0 && !layers::micro_batches_per_replica(tc_.train, dp).ok()) --dp;
      if (dp < std::max<int64_t>(min_dp, 1)) {
        return aborted("elastic: no spare worker left and shrinking below dp={} is not allowed ({})", min_dp,
                       f.detail);
      }
      keep.resize(static_cast<size_t>(dp));
      return plan_for(dp, keep, step_done, f.cause + " (no spare: shrink)", spawn_slots, leaving);
    }();
    if (!plan.ok()) return plan.status();
    {
      // Nobody lost and the layout unchanged, in an epoch every rank had joined: every rank
      // may keep its live state (never after a failed attempt: that one restored nothing).
      ElasticPlan& p = plan.value();
      // With steps in flight a survivor may have completed a step after step_done (its
      // report had not arrived): only with at most one step command out is every rank at
      // step_done or in the interrupted step before its optimizer (a rank past it fails to
      // keep its state, and the next attempt restores a snapshot).
      const bool keep =
          attempt == 0 && f.slots.empty() && p.dp == plan_.dp && !keep_failed_ && steps_in_flight() <= 1;
      TROUPE_RETURN_IF_ERROR(ckpt_.choose_restore(p, keep, f.detail));
    }
    // Slots leaving because their replica shrank away are stopped by the plan itself; the
    // lost ones are already dead.
    std::vector<int> leaving_alive;
    for (int s : leaving) {
      if (procs_.alive(s)) leaving_alive.push_back(s);
    }
    const bool kept = plan->snapshot_step < 0 && plan->checkpoint.empty();
    TROUPE_RETURN_IF_ERROR(open_epoch(plan.value(), spawn_slots, leaving_alive));
    std::optional<Failure> again;
    TROUPE_RETURN_IF_ERROR(wait_ready(plan_, again));
    if (again && kept) keep_failed_ = true;  // some rank could not keep its state: restore next
    if (!again) {
      keep_failed_ = false;
      nlohmann::json ready{{"event", "epoch_ready"},
                           {"epoch", plan_.epoch},
                           {"ms_since_detection", wall_ms() - *recovering_since_ms_}};
      if (!restored_parts_.empty())
        ready["restored_parts"] = restored_parts_;  // by slot: where each part was
      event(std::move(ready));
      recovering_steps_lost_ = failed_step - 1 - plan_.step_done;
      if (plan_.step_done < step_done) rewound_to_ = plan_.step_done;
      step_done_now_ = plan_.step_done;
      // A checkpoint of the restored snapshot's step that the failure interrupted is
      // written again, from that snapshot.
      ckpt_.recommit_restored();
      if (recovering_steps_lost_ < 0) recovering_steps_lost_ = 0;
      return ok_status();
    }
    f = *again;  // a failure during the recovery: recover again from the same state
    if (f.permanent) return recover(f, step_done, failed_step);
  }
}

Status Trainer::serve_requests(int64_t step_done) {
  while (std::optional<OperatorRequest> r = requests_->take(step_done)) {
    nlohmann::json outcome;
    if (r->op == OperatorRequest::Op::kReplace) {
      avoid_node_ = r->avoid;  // troupe drain: the replacement lands elsewhere
      Result<nlohmann::json> o = replace_on_request(r->text, step_done);
      avoid_node_.clear();
      TROUPE_ASSIGN_OR_RETURN(outcome, std::move(o));
    } else {
      TROUPE_ASSIGN_OR_RETURN(outcome, rescale_on_request(r->text, step_done));
    }
    requests_->answer(std::move(outcome));
  }
  return ok_status();
}

Result<nlohmann::json> Trainer::replace_on_request(const std::string& text, int64_t step_done) {
  // A planned replacement at this step boundary, restored from a snapshot of this step.
  const auto refuse = [&](const std::string& why) {
    nlohmann::json a{{"event", "replace_refused"}, {"request", text}, {"why", why}};
    event(a);
    fmt::print("elastic: replace request '{}' refused: {}\n", text, why);
    return a;
  };
  char* end = nullptr;
  const long slot = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || plan_.rank_of_slot(static_cast<int>(slot)) < 0)
    return refuse("not a worker slot of the job");
  // The worker's state must survive it: a snapshot of this step (taken now), or else the
  // last checkpoint.
  TROUPE_ASSIGN_OR_RETURN(const bool snapped, snapshot_now(step_done));
  if (plan_.rank_of_slot(static_cast<int>(slot)) < 0)
    return refuse("the worker was lost meanwhile and replaced by the recovery");
  if (!snapped && !ckpt_.checkpoints_on_schedule())
    return refuse(fmt::format("no snapshot of step {} could be taken and no checkpoint is kept", step_done));
  fmt::print("elastic: replacing slot {} on request after step {}\n", slot, step_done);
  std::fflush(stdout);
  const int64_t t0 = wall_ms();
  TROUPE_RETURN_IF_ERROR(recover(
      Failure{
          "replace", {static_cast<int>(slot)}, fmt::format("slot {} replaced on request", slot), wall_ms()},
      step_done, step_done + 1));
  return nlohmann::json{{"event", "replaced"},     {"slot", slot},
                        {"after_step", step_done}, {"epoch", plan_.epoch},
                        {"ms", wall_ms() - t0},    {"steps_lost", recovering_steps_lost_}};
}

Result<nlohmann::json> Trainer::rescale_on_request(std::string text, int64_t step_done) {
  const auto refuse = [&](nlohmann::json a, const std::string& why) {
    a["event"] = "scale_refused";
    a["request"] = text;
    if (!why.empty()) a["why"] = why;
    event(a);
    fmt::print("elastic: scale request '{}' refused: {}\n", text, why);
    return a;
  };
  if (text.rfind("dp=", 0) == 0) text = text.substr(3);
  char* end = nullptr;
  const long dp = std::strtol(text.c_str(), &end, 10);
  const int64_t min_dp = tc_.elastic.min_dp,
                max_dp = tc_.elastic.max_dp > 0 ? tc_.elastic.max_dp : tc_.parallel.dp;
  if (text.empty() || *end != '\0' || dp < min_dp || dp > max_dp) {
    return refuse({{"min_dp", min_dp}, {"max_dp", max_dp}},
                  fmt::format("dp must be in [{}, {}]", min_dp, max_dp));
  }
  if (dp == plan_.dp) return nlohmann::json{{"event", "scale_unchanged"}, {"dp", plan_.dp}};
  // Every rank of the new layout restores a snapshot of this step (taken now).
  TROUPE_ASSIGN_OR_RETURN(const bool snapped, snapshot_now(step_done));
  if (step_done_now_ != step_done)
    return refuse({}, fmt::format("a failure meanwhile sent the job back to step {}", step_done_now_));
  if (!snapped) {
    return refuse({}, fmt::format("no snapshot of step {} could be taken (elastic.snapshot_every and "
                                  "checkpoint.every are 0, or a part failed)",
                                  step_done));
  }
  std::vector<int> keep;
  for (int d = 0; d < std::min<int>(static_cast<int>(dp), static_cast<int>(plan_.dp)); ++d) keep.push_back(d);
  std::vector<int> spawn_slots, leaving;
  Result<ElasticPlan> plan =
      plan_for(dp, keep, step_done, fmt::format("scale dp {} -> {}", plan_.dp, dp), spawn_slots, leaving);
  if (!plan.ok()) return refuse({}, plan.status().to_string());
  TROUPE_RETURN_IF_ERROR(ckpt_.choose_restore(plan.value(), false, "rescale"));
  const int64_t t0 = wall_ms();
  const int64_t from = plan_.dp;
  TROUPE_RETURN_IF_ERROR(open_epoch(plan.value(), spawn_slots, leaving));
  std::optional<Failure> failure;
  TROUPE_RETURN_IF_ERROR(wait_ready(plan_, failure));
  if (failure) TROUPE_RETURN_IF_ERROR(recover(*failure, step_done, step_done + 1));
  nlohmann::json a{{"event", "scaled"},       {"from_dp", from},
                   {"to_dp", plan_.dp},       {"grad_accum", plan_.grad_accum},
                   {"after_step", step_done}, {"ms", wall_ms() - t0}};
  event(a);
  fmt::print("elastic: scaled dp {} -> {} (grad_accum {}) after step {} in {} ms\n", from, plan_.dp,
             plan_.grad_accum, step_done, wall_ms() - t0);
  std::fflush(stdout);
  return a;
}

Result<bool> Trainer::snapshot_now(int64_t step) {
  if (!ckpt_.takes_snapshots()) return false;
  if (ckpt_.newest_committed() == step) return true;
  const uint64_t epoch = plan_.epoch;
  TROUPE_ASSIGN_OR_RETURN(std::optional<nlohmann::json> r, call(Command::Kind::kSnapshot, step));
  if (!r || plan_.epoch != epoch) return false;  // a failure was recovered from meanwhile
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  Clock::time_point first_err{};
  while (ckpt_.newest_committed() < step) {
    TROUPE_RETURN_IF_ERROR(ckpt_.poll());
    if (ckpt_.unusable(step)) return false;
    std::optional<Failure> failure = procs_.check_processes();
    if (!failure) failure = procs_.check_heartbeats();
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

}  // namespace troupe::training
