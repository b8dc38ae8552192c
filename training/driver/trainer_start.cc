// training/driver/trainer_start.cc — starting a job.
// Owns: the choice of what the job starts from (a checkpoint for --resume, a restarted
// driver's snapshot or checkpoint, or nothing), the run directory's files, the store, the
// actor directory and epoch 0 with every worker ready.
// May call: every part (it wires them), checkpoint:: readers.
// Invariants: the store and actors exist before any worker is started; epoch 0's plan is
// published before its workers start; an earlier run's request files, snapshot records and
// stale checkpoints never leak into this one.
#include "core/env.h"
#include "core/job_env.h"
#include "training/driver/trainer_driver.h"

namespace troupe::training {

Status Trainer::run() {
  const Status st = run_job();
  if (!st.ok() && log_.is_open()) {
    event({{"event", "job_failed"}, {"error", st.to_string()}});
    write_status(-1);
  }
  return st;
}
Result<Trainer::JobStart> Trainer::start_job() {
  if (scheduled_) {
    std::optional<std::string> job = env::get(job_env::kJobId);
    if (!job) return invalid_argument("elastic driver: {} is not set", job_env::kJobId);
    store_.set_job(*job);
    poll_ = std::chrono::milliseconds(20);
  } else {
    store_.set_job(
        fmt::format("elastic-{}-{}", getpid(), std::chrono::system_clock::now().time_since_epoch().count()));
  }
  one_process_ = runs_in_one_process(tc_, scheduled_);
  if (one_process_) {
    TROUPE_RETURN_IF_ERROR(check_one_process(tc_));
    if (!o_.program) return invalid_argument("one-process run: the Trainer was given no stage program");
  }
  // Knobs: [elastic] of the config.
  const layers::ElasticOptions& eo = tc_.elastic;
  procs_.configure(one_process_, scheduled_, poll_);
  err_grace_ = std::chrono::milliseconds(eo.comm_error_grace_ms);
  watchdog_ = std::chrono::milliseconds(eo.step_watchdog_ms);
  spares_left_ = eo.spares;
  // A one-process run cannot outlive its worker (a failure ends the job): no in-memory
  // snapshots are taken there; checkpoints are still written from a snapshot the worker's
  // own keeper holds (elastic.cc, connect_keeper).
  ckpt_.set_schedule(one_process_ ? 0 : eo.snapshot_every);
  std::error_code ec;
  // --resume: any checkpoint of Troupe's format (a normal run's or an elastic one's, any
  // layout); epoch 0's plan names it and every worker loads it (ElasticWorker::join).
  std::unique_ptr<checkpoint::CheckpointReader> resume;
  std::string resume_from = o_.resume;
  // A driver the scheduler restarted after its predecessor died or went silent
  // (scheduler.cc, restart_driver): its workers were restarted with it, so it goes on from
  // the newest snapshot the job's keepers still hold (<run dir>/snapshots.json, written by
  // its predecessor), else from the job's newest valid checkpoint.
  TROUPE_ASSIGN_OR_RETURN(const int64_t driver_restarts,
                          scheduled_ ? env::get_int(job_env::kDriverRestarts, 0, 0) : Result<int64_t>(0));
  const SnapshotRecord* resume_snapshot = nullptr;
  if (resume_from.empty() && driver_restarts > 0) {
    // The snapshots its predecessor committed (<run dir>/snapshots.json).
    if (Result<std::string> text = checkpoint::read_whole_file(run_dir_ + "/snapshots.json"); text.ok()) {
      Result<SnapshotLedger> l = SnapshotLedger::from_json(*text);
      if (l.ok()) {
        resume_snapshot = ckpt_.load_committed(std::move(l).value());
      } else {
        fmt::print(stderr, "{}: restarted driver: the job's snapshot records are unreadable: {}\n", o_.app,
                   l.status().to_string());
      }
    }
    const std::string dir = checkpoint_dir_for(tc_, run_dir_);
    if (resume_snapshot != nullptr) {
      fmt::print("{}: restarted driver: resuming from the in-memory snapshot of step {} its keepers hold\n",
                 o_.app, resume_snapshot->step);
    } else if (!checkpoint::list_checkpoints(dir).empty()) {
      resume_from = dir;
    } else {
      fmt::print("{}: restarted driver: no snapshot and no checkpoint in {}: the job starts over\n", o_.app,
                 dir);
    }
  }
  if (!resume_from.empty()) {
    TROUPE_ASSIGN_OR_RETURN(resume, open_resume_checkpoint(resume_from));
    TROUPE_RETURN_IF_ERROR(check_resume_compatible(resume->manifest(), tc_));
    fmt::print("{}: resuming from {} (step {}, saved with layout {}) with elastic layout pp={} dp={} n={}\n",
               o_.app, resume->path(), resume->step(), resume->layout().to_string(), tc_.parallel.pp,
               tc_.parallel.dp, tc_.parallel.n);
    TROUPE_RETURN_IF_ERROR(trim_metrics(run_dir_ + "/metrics.jsonl", resume->step()));
  }
  int64_t start_step = resume ? resume->step() : resume_snapshot ? resume_snapshot->step : 0;
  if (resume_snapshot != nullptr)
    TROUPE_RETURN_IF_ERROR(trim_metrics(run_dir_ + "/metrics.jsonl", start_step));
  TROUPE_RETURN_IF_ERROR(
      ckpt_.open_checkpoint_dir(o_, start_step, resume ? resume->manifest().total_bytes() : 0));
  // An earlier run's snapshots are not this one's (a restarted driver read them above).
  if (resume_snapshot == nullptr) ckpt_.forget_earlier_snapshots();
  if (one_process_) {
    store_.own(std::make_unique<comm::MemoryStore>());  // the worker is a thread of this process
  } else if (!scheduled_) {
    fs::remove_all(run_dir_ + "/rendezvous", ec);
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::FileStore> fstore,
                            comm::FileStore::open(run_dir_ + "/rendezvous"));
    store_.own(std::move(fstore));
    // The standalone launcher holds its workers' snapshots itself: it outlives them as a
    // node's agent does.
    TROUPE_RETURN_IF_ERROR(ckpt_.start_keeper());
  }
  // Operator requests arrive through the job's store, whoever owns it (a fresh standalone
  // store, or the scheduler's for this job: no request of an earlier run is seen).
  requests_ = std::make_unique<OperatorRequests>(
      OperatorRequests::Store{
          .key = [this](const std::string& rest) { return key(rest); },
          .contains = [this](const std::string& k) { return poll_contains(k); },
          .get = [this](const std::string& k) { return poll_get(k, std::chrono::milliseconds(5000)); },
          .set = [this](const std::string& k, const std::string& v) { return poll_set(k, v); },
          .out = [this] { return store_out(); }},
      tc_.elastic.scale_at);
  // The record of a run goes on across resumes and driver restarts: appended, never cut.
  TROUPE_RETURN_IF_ERROR(log_.open(run_dir_ + "/events.jsonl", resume || driver_restarts > 0));
  TROUPE_ASSIGN_OR_RETURN(run_metrics_, RunMetrics::open(tc_.observe, run_dir_));
  log_.set_metrics(run_metrics_.get());
  if (driver_restarts > 0) {
    event({{"event", "driver_restarted"},
           {"driver_restarts", driver_restarts},
           {"pid", getpid()},
           {"resumed_from", resume ? resume->path() : std::string()},
           {"resumed_from_snapshot", resume_snapshot != nullptr ? resume_snapshot->step : int64_t{-1}},
           {"step", start_step}});
  }
  metrics_.open(run_dir_ + "/metrics.jsonl",
                resume || resume_snapshot != nullptr ? std::ios::app : std::ios::trunc);
  if (!metrics_) return io_error("cannot write {}/metrics.jsonl", run_dir_);

  const int world = static_cast<int>(tc_.parallel.world());
  plan_.epoch = 0;
  plan_.dp = tc_.parallel.dp;
  plan_.grad_accum = tc_.train.grad_accum;
  for (int r = 0; r < world; ++r) {
    plan_.slots.push_back(r);
    plan_.has_state.push_back(false);
  }
  next_slot_ = world;
  plan_.reason = "start";
  if (resume) {
    plan_.checkpoint = fs::absolute(resume->path()).string();
    plan_.step_done = start_step;
    plan_.reason = "start (resumed)";
  } else if (resume_snapshot != nullptr) {
    plan_.snapshot_step = resume_snapshot->step;
    plan_.snapshot_dp = resume_snapshot->dp;
    plan_.snapshot_parts = resume_snapshot->sources();
    plan_.step_done = start_step;
    plan_.reason = "start (restarted driver, from a snapshot)";
  }
  ckpt_.set_policy(plan_);
  // Under the scheduler: from now on a lost worker is reported to this driver (a key of
  // the job's store) instead of restarting every worker of the job.
  // The run directory rides along, so the scheduler's record of the job names it
  // (`troupe run` keeps the scheduler's event log there).
  if (scheduled_) {
    const nlohmann::json claim{{"pid", getpid()}, {"run_dir", fs::absolute(run_dir_).string()}};
    TROUPE_RETURN_IF_ERROR(store_.raw().set(key("claim"), claim.dump()));
  }
  TROUPE_RETURN_IF_ERROR(store_.raw().set(key("plan/0"), encode_elastic_plan(plan_)));
  if (one_process_) {
    TROUPE_ASSIGN_OR_RETURN(actors_, ActorDirectory::start_local(store_.raw(), key("actors/driver")));
  } else {
    TROUPE_ASSIGN_OR_RETURN(actors_,
                            ActorDirectory::start(control::host_addr(), store_.raw(), key("actors/driver")));
  }
  ckpt_.set_actors(actors_.get());
  procs_.set_actors(actors_.get());
  event({{"event", "job_started"},
         {"job", store_.job()},
         {"plan", plan_.event_json()},
         {"one_process", one_process_},
         {"steps_in_flight", tc_.train.steps_in_flight},
         {"heartbeat_timeout_ms", procs_.heartbeat_timeout().count()}});
  if (resume_snapshot != nullptr) {
    event({{"event", "restore_from_snapshot"},
           {"step", resume_snapshot->step},
           {"bytes", resume_snapshot->bytes()},
           {"parts", resume_snapshot->parts.size()},
           {"why", "restarted driver"}});
  }
  fmt::print(
      "trainer: layout pp={} dp={} n={} ({}, dispatch {}, compression {}), {} parameters, {} tokens/step, {} "
      "steps, {} step(s) in flight, heartbeat timeout {} ms, run dir {}\n",
      tc_.parallel.pp, tc_.parallel.dp, tc_.parallel.n,
      one_process_ ? "one process: the worker is a thread of the Trainer's"
                   : fmt::format("{} workers", world),
      tc_.parallel.dispatch, tc_.parallel.compression ? "bf16" : "off", tc_.model.num_params(),
      tc_.tokens_per_step(), tc_.train.steps, tc_.train.steps_in_flight, procs_.heartbeat_timeout().count(),
      run_dir_);
  std::fflush(stdout);
  for (int r = 0; r < world; ++r) TROUPE_RETURN_IF_ERROR(procs_.spawn(r, 0));
  int64_t tokens_seen = resume ? resume->manifest().data_position.value("tokens_seen", int64_t{0})
                        : resume_snapshot != nullptr ? resume_snapshot->tokens
                                                     : 0;
  tokens_seen_ = tokens_seen;
  ckpt_.start_at(start_step, tokens_seen);
  step_done_now_ = start_step;
  {
    std::optional<Failure> failure;
    TROUPE_RETURN_IF_ERROR(wait_ready(plan_, failure));
    if (failure && failure->permanent) {
      return failed_precondition("elastic: a worker failed while the job started: {} (a permanent failure)",
                                 failure->detail);
    }
    if (failure && resume_snapshot == nullptr) {
      return aborted("elastic: a worker failed while the job started: {}", failure->detail);
    }
    if (failure) {
      // The snapshot a restarted driver went back to could not be restored everywhere (a
      // keeper holding a part is gone): an older one, else the newest checkpoint.
      TROUPE_RETURN_IF_ERROR(recover(*failure, start_step, start_step + 1));
      if (rewound_to_) {
        start_step = *rewound_to_;
        rewound_to_.reset();
        TROUPE_RETURN_IF_ERROR(trim_metrics(run_dir_ + "/metrics.jsonl", start_step));
        if (std::optional<int64_t> t = ckpt_.tokens_after(start_step)) tokens_seen = tokens_seen_ = *t;
        ckpt_.start_at(start_step, tokens_seen);
      }
    }
  }
  return JobStart{start_step, tokens_seen, resume || resume_snapshot != nullptr};
}

}  // namespace troupe::training
