// training/driver/trainer_driver.h — the Trainer: the driver of a job (trainer.h's
// run_trainer). Private to the driver's files; nothing else includes it.
//
// The Trainer's parts, one file each, every one with its contract at its top:
// - trainer.cc             the step driver: the command window, run_job's loop, the end;
// - trainer_start.cc       starting a job: resume, run directory, store, epoch 0;
// - trainer_procs.h        JobStore, ProcessSupervisor: start, kill, reap the workers; exits,
//                          Downs and heartbeats (the failure detector);
// - trainer_membership.cc  membership and recovery: failures the workers report, plans,
//                          epochs, recover, rescale, replace;
// - trainer_checkpoints.h  CheckpointCoordinator: the only judge of whether a snapshot or
//                          checkpoint is due (workers obey its orders), commits, restores;
// - trainer_requests.h     OperatorRequests: the one channel of scale, replace and drain;
// - trainer_status.h       EventLog, StragglerTracker; status.json in trainer_status.cc.
// The classes of the .h parts hold their own state; the .cc parts are the Trainer's
// member functions grouped by role (they share its plan, processes and store).
//
// Every distributed job runs under it; there is no non-elastic mode.
//
// Detection, each an event in <run dir>/events.jsonl with its wall time (ts_ms):
// - exit: a worker process ends (waitpid, polled every few ms: the launcher is the parent);
// - heartbeat: a worker's heartbeat key stops changing for elastic.heartbeat_timeout_ms
//   (default 2000; a SIGSTOPped or wedged process), the worker is then killed (last resort).
//   Before a new worker's first beat (exec, loading, connecting: seconds on a loaded
//   machine) the bound is elastic.join_timeout_ms instead: it has not started yet;
// - comm_error: a worker reports a data-plane failure and no process died or went silent
//   within elastic.comm_error_grace_ms (default 300): the world is rebuilt, nobody replaced;
// - watchdog: a command runs past elastic.step_watchdog_ms (default 60000) with every
//   worker alive and beating (a hang inside the data plane): rebuilt likewise;
// - join_timeout: a worker does not join the new epoch within elastic.join_timeout_ms
//   (default 30000; e.g. its step thread is wedged): killed and replaced (last resort).
// Recovery: a plan for epoch e+1 (a new slot per lost worker, or fewer dp replicas when no
// spare is left and elastic.min_dp allows), the replacements are started, every worker
// restores the newest complete in-memory snapshot (snapshot_ledger.h; else the last
// checkpoint), and the steps after it run again. Recorded: detection_ms (from the injected
// fault's time where known), recovery_ms (detection to the next completed command) and
// steps_lost.
// Operator requests (trainer_requests.h: the job store's request keys, written by
// `troupe scale|replace|drain` and the scheduler's health policy; test.scale_at for
// scripted ones) are served at the next step boundary:
// Rescale: dp=N (elastic.min_dp <= N <= elastic.max_dp, default 1 and the configured dp);
// the global batch (train.global_batch) and so the data order stay the same: each replica
// takes global_batch / (micro_batch_size * dp) micro-batches.
// Replace: a slot's worker is replaced (a planned recovery from a snapshot of that step:
// no step lost); with "avoid" (troupe drain) its replacement lands on another agent.
// Stragglers: a rank whose compute time exceeds elastic.straggler_ratio (default 1.5) times
// the median of its peers for elastic.straggler_window (default 5) consecutive steps is
// flagged (event, console, <run dir>/status.json); elastic.straggler_policy = "replace"
// replaces it like a failed worker.
#pragma once

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "checkpoint/file_io.h"
#include "checkpoint/reader.h"
#include "checkpoint/snapshot_keeper.h"
#include "checkpoint/writer.h"
#include "comm/control/host_addr.h"
#include "core/env.h"
#include "core/exit_status.h"
#include "core/job_env.h"
#include "core/parallel_layout.h"
#include "training/checkpointing/checkpointing.h"
#include "training/checkpointing/snapshot_ledger.h"
#include "training/control.h"
#include "training/driver/run_metrics.h"
#include "training/driver/trainer.h"
#include "training/driver/trainer_checkpoints.h"
#include "training/driver/trainer_procs.h"
#include "training/driver/trainer_requests.h"
#include "training/role_actors.h"
#include "training/worker/elastic.h"

extern char** environ;

namespace troupe::training {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline constexpr int kMaxFailuresWithoutProgress = 6;
inline constexpr std::chrono::milliseconds kFailureBatchWindow{150};

class Trainer {
 public:
  // `scheduled`: the driver of a troupe-scheduler job (its workers are started, killed and
  // watched by the scheduler through `store`); else the standalone launcher.
  Trainer(const TrainerOptions& o, std::string run_dir, const layers::TrainConfig& tc,
          std::unique_ptr<comm::RendezvousStore> store = nullptr)
      : o_(o), run_dir_(std::move(run_dir)), tc_(tc), scheduled_(store != nullptr) {
    // A store outage (the scheduler restarting) must not end the job, up to its limit.
    if (store) {
      TolerantStore::Options so;
      so.outage_limit = std::chrono::milliseconds(tc.elastic.scheduler_outage_limit_ms);
      so.who = "driver";
      so.where = env::get_or(job_env::kScheduler);
      auto t = std::make_unique<TolerantStore>(std::move(store), so);
      TolerantStore* tolerant = t.get();
      store_.own(std::move(t), tolerant);
    }
  }
  ~Trainer() {
    // A worker thread wedged past the wait still uses the actor system: it is left alive.
    if (procs_.kill_all()) (void)actors_.release();
  }

  Status run();

 private:
  // What starting the job (start_job, trainer_start.cc) hands the step loop.
  struct JobStart {
    int64_t start_step = 0;   // the step the job starts after
    int64_t tokens_seen = 0;  // tokens seen up to it (the data position)
    bool resumed = false;     // from a checkpoint or a restarted driver's snapshot
  };
  // Resume source, run directory, store, actors and epoch 0 with every worker ready.
  Result<JobStart> start_job();
  Status run_job();
  std::string key(const std::string& rest) const { return store_.key(rest); }
  void event(nlohmann::json e) { log_.event(std::move(e)); }
  Result<std::optional<Failure>> check_errors(Clock::time_point& first_err);
  Status wait_ready(const ElasticPlan& plan, std::optional<Failure>& failure);
  Status open_epoch(ElasticPlan plan, const std::vector<int>& spawn_slots, const std::vector<int>& leaving);
  Status recover(Failure f, int64_t step_done, int64_t failed_step);
  // ---- commands in flight (train.steps_in_flight) ----
  // A command sent to every rank of the epoch, and the replies that came back.
  struct InFlight {
    int64_t seq = 0;
    Command::Kind kind = Command::Kind::kStep;
    int64_t step = 0;
    std::vector<nlohmann::json> replies;  // by rank; null until that rank replied
    int remaining = 0;
    Clock::time_point sent;
  };
  Status issue(Command::Kind kind, int64_t step);
  int64_t steps_in_flight() const;
  // Files the replies that arrived under their commands; every step reply is also kept
  // by (epoch, step) for a restore that moves past the last step recorded.
  void collect_replies();
  // Waits until the oldest command in flight has every rank's reply, or a failure is
  // detected (both may hold: a worker lost just after it replied).
  Status await_oldest(std::optional<Failure>& failure);
  // The bookkeeping of a command every rank completed (recovery noted, replicas,
  // checkpoints).
  Status on_completed(InFlight& c);
  // One command after the window drained; nullopt: the job went back to an older step (a
  // checkpoint restore); rewound_to_ says which.
  Result<std::optional<nlohmann::json>> call(Command::Kind kind, int64_t step);
  // A one-process run: what a failure means there (its worker cannot be replaced).
  Status one_process_failure(const Failure& f) const;
  // Operator requests at the boundary after step_done (nothing in flight): takes each
  // from requests_, acts on it and records its outcome (answered after write_status).
  Status serve_requests(int64_t step_done);
  // A request's outcome: the event logged for it (scaled, replaced, or a refusal).
  Result<nlohmann::json> replace_on_request(const std::string& text, int64_t step_done);
  Result<nlohmann::json> rescale_on_request(std::string text, int64_t step_done);
  // status.json (and the job's store key): the workers, their pids and hosts, the
  // recovery in progress; with `ask_actors`, the actor table is refreshed when the step or
  // epoch changed (a query of every actor, bounded at 300 ms).
  void write_status(int64_t step, bool ask_actors = true);
  // Takes a snapshot of `step` (the step just completed) off the schedule and waits until
  // it is committed (a planned membership change goes back to it: no step lost). False
  // when it was not (a failure meanwhile was recovered from, or no snapshots are taken).
  Result<bool> snapshot_now(int64_t step);
  Result<ElasticPlan> plan_for(int64_t dp, const std::vector<int>& keep_dp, int64_t step_done,
                               const std::string& why, std::vector<int>& spawn_slots,
                               std::vector<int>& leaving);

  const TrainerOptions& o_;
  std::string run_dir_;
  layers::TrainConfig tc_;
  bool one_process_ = false;  // the worker is a thread of this process (runs_in_one_process)
  std::deque<InFlight> inflight_;
  Clock::time_point oldest_since_ = Clock::now();  // when the oldest command in flight became the oldest
  JobStore store_;                                 // the job's store (trainer_procs.h)
  bool store_out() const { return store_.out(); }
  Result<bool> poll_contains(const std::string& k) { return store_.poll_contains(k); }
  Result<std::string> poll_get(const std::string& k, std::chrono::milliseconds wait) {
    return store_.poll_get(k, wait);
  }
  Status poll_set(const std::string& k, const std::string& v) { return store_.poll_set(k, v); }
  Status past_outage_limit() const { return store_.past_outage_limit(); }
  std::unique_ptr<ActorDirectory> actors_;                // the "trainer" actor and the workers' actors
  nlohmann::json actor_table_ = nlohmann::json::array();  // their last answers (status.json)
  int64_t actors_step_ = -2;                              // the step and epoch they were asked at
  uint64_t actors_epoch_ = 0;
  Clock::time_point actors_asked_{};  // and when
  bool scheduled_ = false;
  std::chrono::milliseconds poll_{2};  // scheduled: 20 (every probe is a round trip)
  ElasticPlan plan_;
  int next_slot_ = 0;
  int64_t seq_ = 0;
  int64_t spares_left_ = -1;  // -1: unlimited
  std::chrono::milliseconds err_grace_{300}, watchdog_{60000};
  // The recovery in progress: its detection time, reported at the next completed command.
  std::optional<int64_t> recovering_since_ms_;
  std::string recovering_cause_;
  std::vector<int> recovering_slots_;  // the workers it replaces (status.json)
  int64_t recovering_steps_lost_ = 0;
  int epoch_plan_messages_ = 0;  // workers of the current epoch that took its plan as a message
  int64_t recoveries_ = 0;
  std::vector<nlohmann::json> last_replies_;
  std::vector<nlohmann::json> last_step_replies_;  // of the last step command (status.json's times)
  std::optional<int64_t> rewound_to_;
  int64_t max_step_logged_ = 0;
  int64_t last_step_ = 0;
  std::unique_ptr<OperatorRequests> requests_;  // scale, replace, drain (trainer_requests.h)
  std::string avoid_node_;                      // a drained node replacements must not land on
  // Failures since the job last completed a step it had never completed before: a fault
  // that comes back every time (a bad disk, a deterministic crash) must end the job, not
  // loop through recoveries.
  int failures_without_progress_ = 0;
  // The step every rank has completed in the current timeline (rewinds go back).
  int64_t step_done_now_ = 0;
  // A rebuild with nobody lost lets every rank keep its live state; once such an epoch
  // failed, recoveries restore a snapshot until one succeeds.
  bool keep_failed_ = false;
  nlohmann::json restored_parts_;         // the last epoch's snapshot parts, by slot: where they were read
  std::string epoch_failure_;             // the first failure a worker reported in the current epoch
  bool epoch_failure_permanent_ = false;  // ... and whether a retry would meet it again
  int64_t max_step_completed_ = 0;
  // The tokens seen up to the last completed step (its data position).
  int64_t tokens_seen_ = 0;
  std::unique_ptr<RunMetrics> run_metrics_;  // TensorBoard and Prometheus ([observe])
  std::ofstream metrics_;                    // <run dir>/metrics.jsonl
  EventLog log_;                             // <run dir>/events.jsonl
  StragglerTracker stragglers_{tc_.elastic, log_};
  // The workers' processes and liveness (trainer_procs.h): reads plan_.
  ProcessSupervisor procs_{o_, tc_, store_, plan_, log_};
  // The checkpoint and snapshot coordinator (trainer_checkpoints.h): reads plan_ and
  // step_done_now_, declared above it.
  CheckpointCoordinator ckpt_{tc_, run_dir_, plan_, step_done_now_, log_};
};

}  // namespace troupe::training
