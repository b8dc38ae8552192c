// training/driver/trainer.cc — the Trainer (trainer.h): the job's driver, the supervisor of
// its workers and the driver's side of the membership protocol (training/worker/elastic.h).
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
// Rescale: writing "N" to <run dir>/scale_request asks for dp=N at the next step boundary
// (test.scale_at = "<step>:<dp>,..." writes it after the given steps)
// (elastic.min_dp <= N <= elastic.max_dp, default 1 and the configured dp);
// the global batch (train.global_batch) and so the data order stay the same: each replica
// takes global_batch / (micro_batch_size * dp) micro-batches.
// Replace: "<slot>" in <run dir>/replace_request replaces that worker at the next step
// boundary (a planned recovery: no step lost). `troupe scale|replace|status <run dir>`
// write and read these files (scheduler/cli/cli_elastic.cc).
// Stragglers: a rank whose compute time exceeds elastic.straggler_ratio (default 1.5) times
// the median of its peers for elastic.straggler_window (default 5) consecutive steps is
// flagged (event, console, <run dir>/status.json); elastic.straggler_policy = "replace"
// replaces it like a failed worker.
#include "training/driver/trainer.h"

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
#include "core/peak_flops.h"
#include "training/checkpointing/checkpointing.h"
#include "training/checkpointing/snapshot_ledger.h"
#include "training/control.h"
#include "training/driver/run_metrics.h"
#include "training/role_actors.h"
#include "training/worker/elastic.h"

extern char** environ;

namespace troupe::training {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxFailuresWithoutProgress = 6;
constexpr std::chrono::milliseconds kFailureBatchWindow{150};

// A worker in the Trainer's own process (a one-process run): its thread and how it ended.
struct LocalWorker {
  std::thread thread;
  std::atomic<bool> done{false};
  Status result;  // written before done is set
};

struct Proc {
  // Its process id (the launcher's child, or under the scheduler what the worker's ready
  // record says) and host: troupe status shows them.
  pid_t pid = -1;
  std::string host;
  bool alive = false;
  std::shared_ptr<LocalWorker> local;  // a one-process run's worker thread (else null)
  int gpu = -1;  // standalone launcher, GPU workers: the device index it was given
  std::string last_hb;
  Clock::time_point hb_seen;
  // What the trainer wrote into the worker's heartbeat key when it started it: until the
  // key holds something else, the process has not beaten yet (a dead predecessor's last
  // value would otherwise pass for a beat).
  std::string start_mark;
  bool started() const { return last_hb != start_mark; }
};

// Waits for the child `p` to exit, polling every 5 ms; past `deadline` it is SIGKILLed.
// Returns true when it had to be killed.
bool reap_by(Proc& p, Clock::time_point deadline) {
  while (p.alive) {
    int status = 0;
    if (waitpid(p.pid, &status, WNOHANG) == p.pid) {
      p.alive = false;
      return false;
    }
    if (Clock::now() > deadline) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &status, 0);
      p.alive = false;
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

struct Failure {
  std::string cause;       // exit, heartbeat, comm_error, watchdog, straggler
  std::vector<int> slots;  // workers to replace (empty: rebuild only), each once
  std::string detail;
  int64_t ts_ms = 0;
  // A failure a replacement would meet again (a worker that exited with
  // kExitPermanentFailure, or reported a permanent error): the job ends, nobody is replaced.
  bool permanent = false;
};

// A worker seen failing twice (its actor's Down message and its exit) is one lost worker.
void add_slot(Failure& f, int slot) {
  if (std::find(f.slots.begin(), f.slots.end(), slot) == f.slots.end()) f.slots.push_back(slot);
}

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
      tolerant_ = t.get();
      store_ = std::move(t);
    }
  }
  ~Trainer() { kill_all(); }

  Status run();

 private:
  Status run_job();
  std::string key(const std::string& rest) const { return elastic_key(job_, rest); }
  void event(nlohmann::json e);
  Status spawn(int slot, uint64_t epoch);
  // Writes the start mark into slot's heartbeat key (Proc::start_mark) and starts its
  // silence clock.
  void mark_start(int slot, uint64_t epoch);
  void kill_all();
  void terminate(int slot, const std::string& why);  // kill a worker (it is then gone)
  std::optional<Failure> check_processes();
  std::optional<Failure> check_heartbeats();
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
  // Some rank's reply to step `step` of epoch `epoch`, waiting up to `wait` for one.
  // A one-process run: what a failure means there (its worker cannot be replaced).
  Status one_process_failure(const Failure& f) const;
  // Checkpoints: notes the snapshots and durable parts the workers report in `replies`,
  // and finalizes every checkpoint all of whose parts are durable.
  Status note_checkpoints(Command::Kind kind, int64_t step, const std::vector<nlohmann::json>& replies);
  struct PendingCheckpoint;
  Status finalize_pending(int64_t step, const PendingCheckpoint& p);
  // Checkpoints still waiting for durable-part notes when the membership changes: one
  // whose every part is on disk (each rank writes its part file after its shard) is
  // finalized; the others are abandoned (a part will never come).
  void finalize_written_or_abandon();
  Status maybe_rescale(int64_t step_done);
  Status maybe_replace(int64_t step_done);
  // Scheduler jobs: `troupe scale|replace <job id>` requests arrive as store keys
  // "request/<k>" {op, dp|slot}; each is turned into the run directory's request file and
  // answered at "answer/<k>" with the outcome.
  Status take_store_request();
  Status answer_store_request();
  void track_stragglers(const std::vector<nlohmann::json>& replies, int64_t step,
                        std::optional<Failure>& failure);
  // status.json (and the job's store key): the workers, their pids and hosts, the
  // recovery in progress; with `ask_actors`, the actor table is refreshed when the step or
  // epoch changed (a query of every actor, bounded at 300 ms).
  void write_status(int64_t step, bool ask_actors = true);
  // Snapshots: takes the parts the workers reported landed, commits every complete
  // snapshot of a step this driver has seen completed, and announces it.
  Status poll_snapshots();
  // The snapshot of `step` never commits (a rank could not make its part, or skipped
  // it): every worker frees the generation holding it.
  void abandon_snapshot(int64_t step);
  // Takes a snapshot of `step` (the step just completed) off the schedule and waits until
  // it is committed (a planned membership change goes back to it: no step lost). False
  // when it was not (a failure meanwhile was recovered from, or no snapshots are taken).
  Result<bool> snapshot_now(int64_t step);
  // What every rank of plan `p` restores (p.step_done is the newest step it may go back
  // to): its live state when nobody was lost (`keep`), else the newest usable snapshot,
  // else the newest valid checkpoint. Sets p.step_done to it.
  Status choose_restore(ElasticPlan& p, bool keep, const std::string& why);
  Result<ElasticPlan> plan_for(int64_t dp, const std::vector<int>& keep_dp, int64_t step_done,
                               const std::string& why, std::vector<int>& spawn_slots,
                               std::vector<int>& leaving);

  const TrainerOptions& o_;
  std::string run_dir_;
  layers::TrainConfig tc_;
  std::string job_;
  bool one_process_ = false;  // the worker is a thread of this process (runs_in_one_process)
  std::deque<InFlight> inflight_;
  Clock::time_point oldest_since_ = Clock::now();  // when the oldest command in flight became the oldest
  std::unique_ptr<comm::RendezvousStore> store_;
  // Under the scheduler: store_ itself, which tells when the scheduler is out (polls skip
  // the store then: training goes on; liveness verdicts wait for fresh evidence).
  TolerantStore* tolerant_ = nullptr;
  bool store_out() const { return tolerant_ != nullptr && tolerant_->in_outage(); }
  // Outages seen to end (TolerantStore::outages_ended) and the end of the grace after the
  // last one: a worker's first beat after an outage may wait for its own request, sent
  // while the scheduler was out, to time out (12 s): until then nobody is judged silent.
  uint64_t outages_seen_ = 0;
  Clock::time_point liveness_grace_until_{};
  // The store as polls use it: one attempt, no retry through an outage (tolerant_store.h).
  Result<bool> poll_contains(const std::string& k) {
    return tolerant_ != nullptr ? tolerant_->try_contains(k) : store_->contains(k);
  }
  Result<std::string> poll_get(const std::string& k, std::chrono::milliseconds wait) {
    return tolerant_ != nullptr ? tolerant_->try_get(k, comm::deadline_in(wait))
                                : store_->get(k, comm::deadline_in(wait));
  }
  Status poll_set(const std::string& k, const std::string& v) {
    return tolerant_ != nullptr ? tolerant_->try_set(k, v) : store_->set(k, v);
  }
  Status past_outage_limit() const {
    return tolerant_ != nullptr && tolerant_->past_limit() ? tolerant_->limit_status() : ok_status();
  }
  std::unique_ptr<ActorDirectory> actors_;  // the "trainer" actor and the workers' actors                //
                                            // the "trainer" actor and the workers' actors
  nlohmann::json actor_table_ = nlohmann::json::array();  // their last answers (status.json)
  int64_t actors_step_ = -2;                              // the step and epoch they were asked at
  uint64_t actors_epoch_ = 0;
  Clock::time_point actors_asked_{};  // and when
  bool scheduled_ = false;
  std::chrono::milliseconds poll_{2};  // scheduled: 20 (every probe is a round trip)
  std::ofstream events_;
  std::map<int, Proc> procs_;
  ElasticPlan plan_;
  int next_slot_ = 0;
  int64_t seq_ = 0;
  int64_t spares_left_ = -1;  // -1: unlimited
  std::chrono::milliseconds hb_timeout_{2000}, err_grace_{300}, watchdog_{60000}, join_timeout_{30000};
  // The recovery in progress: its detection time, reported at the next completed command.
  std::optional<int64_t> recovering_since_ms_;
  std::string recovering_cause_;
  std::vector<int> recovering_slots_;  // the workers it replaces (status.json)
  int64_t recovering_steps_lost_ = 0;
  int epoch_plan_messages_ = 0;  // workers of the current epoch that took its plan as a message
  // Straggler tracking: consecutive slow steps per slot, flagged slots.
  std::map<int, int> slow_streak_;
  std::set<int> flagged_;
  double straggler_ratio_ = 1.5;
  int straggler_window_ = 5;
  bool straggler_replace_ = false;
  int64_t recoveries_ = 0;
  std::vector<nlohmann::json> last_replies_;
  std::vector<nlohmann::json> last_step_replies_;  // of the last step command (status.json's times)
  std::optional<int64_t> rewound_to_;
  int64_t max_step_logged_ = 0;
  int64_t last_step_ = 0;
  int64_t next_request_ = 0;
  std::optional<int64_t> pending_answer_;
  nlohmann::json last_answer_;
  std::string avoid_node_;  // a drained node replacements must not land on
  Clock::time_point last_hb_check_ = Clock::now();
  int64_t ckpt_every_ = 0;
  std::string ckpt_dir_;
  // Checkpoints whose snapshots were taken, waiting for every part to be durable. Those
  // of an earlier epoch are abandoned when a new one opens (a part may never come).
  struct PendingCheckpoint {
    uint64_t epoch = 0;
    int64_t dp = 1, grad_accum = 1, tokens = 0;
    int world = 0;
    std::set<int> durable;  // ranks whose part is durable
  };
  std::map<int64_t, PendingCheckpoint> pending_ckpts_;
  int64_t last_ckpt_committed_ = -1, last_ckpt_failed_ = -1;
  uint64_t last_ckpt_bytes_ = 0;         // the size of the last committed checkpoint
  std::set<int64_t> failed_ckpt_steps_;  // saves that failed (their .tmp is removed)
  // Failures since the job last completed a step it had never completed before: a fault
  // that comes back every time (a bad disk, a deterministic crash) must end the job, not
  // loop through recoveries.
  int failures_without_progress_ = 0;
  // In-memory snapshots (elastic.snapshot_every): what landed and what is committed; the
  // standalone launcher's keeper (under the scheduler each node's agent runs one).
  int64_t snapshot_every_ = 0;
  SnapshotLedger snaps_;
  std::set<int64_t> snaps_complete_;  // complete, waiting for their step's reply to commit
  std::set<int64_t> forced_ckpts_;    // checkpoints asked for off the schedule (kSave)
  std::unique_ptr<checkpoint::SnapshotKeeper> keeper_;
  // The step every rank has completed in the current timeline (rewinds go back), and the
  // step the job started from.
  int64_t step_done_now_ = 0;
  int64_t start_step_ = 0;
  // Tokens seen after each step (a snapshot's and a checkpoint's data position).
  std::map<int64_t, int64_t> tokens_after_;
  // A rebuild with nobody lost lets every rank keep its live state; once such an epoch
  // failed, recoveries restore a snapshot until one succeeds.
  bool keep_failed_ = false;
  nlohmann::json restored_parts_;      // the last epoch's snapshot parts, by slot: where they were read
  int64_t last_snapshot_failed_ = -1;  // reported once, not by every rank
  std::string epoch_failure_;  // the first failure a worker reported in the current epoch
  bool epoch_failure_permanent_ = false;  // ... and whether a retry would meet it again
  int64_t max_step_completed_ = 0;
  // What every checkpoint records besides the workers' parts (config text, tokenizer,
  // run metadata: the same as a normal run's CheckpointCommitter), and the tokens seen
  // up to the last completed step (its data position).
  checkpoint::CheckpointInfo ckpt_info_;
  int64_t tokens_seen_ = 0;
  std::unique_ptr<RunMetrics> run_metrics_;  // TensorBoard and Prometheus ([observe])
};

void Trainer::event(nlohmann::json e) {
  e["ts_ms"] = wall_ms();
  events_ << e.dump() << "\n";
  events_.flush();
  if (run_metrics_) run_metrics_->on_event(e);
}

Status Trainer::spawn(int slot, uint64_t epoch) {
  // Before the worker can beat (an epoch-0 worker of the scheduler may beat already: its
  // next beat replaces the mark).
  mark_start(slot, epoch);
  if (one_process_) {
    // The worker's thread: its actors join this process's system, its store is ours.
    auto w = std::make_shared<LocalWorker>();
    Proc& p = procs_[slot];
    p.pid = getpid();
    p.alive = true;
    p.local = w;
    actors::ActorSystem* sys = &actors_->system();
    comm::RendezvousStore* store = store_.get();
    w->thread = std::thread([this, w, sys, store, slot, epoch] {
      Status st = ok_status();
      try {
        st = run_elastic_worker(tc_, o_.program, *store, job_, slot, epoch, {}, o_.worker_ctx, sys);
      } catch (const std::exception& e) {
        st = internal_error("worker thread: {}", e.what());
      }
      w->result = st;
      w->done = true;
    });
    event({{"event", "worker_started"},
           {"slot", slot},
           {"pid", p.pid},
           {"epoch", epoch},
           {"in_process", true}});
    return ok_status();
  }
  if (scheduled_) {
    // The scheduler started the workers of epoch 0; later ones on request.
    if (epoch > 0) {
      nlohmann::json req{{"epoch", epoch}};
      if (!avoid_node_.empty()) req["avoid"] = avoid_node_;  // troupe drain
      TROUPE_RETURN_IF_ERROR(store_->set(key(fmt::format("spawn/{}", slot)), req.dump()));
    }
    Proc& p = procs_[slot];
    p.pid = 0;
    p.alive = true;
    event({{"event", epoch > 0 ? "worker_requested" : "worker_started"}, {"slot", slot}, {"epoch", epoch}});
    return ok_status();
  }
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string v(*e);
    bool ours = false;
    for (const char* k : {job_env::kRole, job_env::kRank, job_env::kLocalRank, job_env::kWorldSize,
                          job_env::kJobId, job_env::kEpoch, job_env::kMembershipEpoch}) {
      ours |= v.rfind(std::string(k) + "=", 0) == 0;
    }
    if (!ours) envs.push_back(v);
  }
  // The same variables the scheduler hands its workers (core/job_env.h): the rank is the slot.
  envs.push_back(fmt::format("{}=worker", job_env::kRole));
  envs.push_back(fmt::format("{}={}", job_env::kRank, slot));
  envs.push_back(fmt::format("{}={}", job_env::kJobId, job_));
  envs.push_back(fmt::format("{}={}", job_env::kMembershipEpoch, epoch));
  // GPU workers of the standalone launcher see every GPU: each takes the lowest device
  // index no live worker holds (a replacement takes its predecessor's, which was reaped).
  int gpu = -1;
  if (o_.gpu) {
    std::set<int> held;
    for (const auto& [s, q] : procs_) {
      if (q.alive && q.gpu >= 0) held.insert(q.gpu);
    }
    gpu = 0;
    while (held.count(gpu) != 0) ++gpu;
    envs.push_back(fmt::format("{}={}", job_env::kLocalRank, gpu));
  }
  std::vector<char*> cargv, cenv;
  for (const auto& a : o_.argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return io_error("cannot fork worker slot {}", slot);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(125);
    execve("/proc/self/exe", cargv.data(), cenv.data());
    _exit(127);
  }
  Proc& p = procs_[slot];
  p.pid = pid;
  p.alive = true;
  p.gpu = gpu;
  nlohmann::json started{{"event", "worker_started"}, {"slot", slot}, {"pid", pid}, {"epoch", epoch}};
  if (gpu >= 0) started["gpu"] = gpu;
  event(std::move(started));
  return ok_status();
}

void Trainer::terminate(int slot, const std::string& why) {
  Proc& p = procs_[slot];
  if (!p.alive) return;
  if (p.local) return;  // a thread cannot be killed: a one-process run ends instead (recover)
  if (scheduled_) {
    (void)store_->set(key(fmt::format("kill/{}", slot)), why);
  } else {
    kill(p.pid, SIGKILL);
    int status = 0;
    waitpid(p.pid, &status, 0);
  }
  p.alive = false;
  event({{"event", "worker_killed"}, {"slot", slot}, {"pid", p.pid}, {"why", why}});
}

void Trainer::kill_all() {
  if (scheduled_) return;  // the scheduler owns the processes
  // A worker thread still running (the job failed): a plan without it makes it leave
  // (its communicators aborted, its step unwound). One wedged past the wait is left
  // running, and what it uses (the store, the actor system) is kept alive with it: the
  // process is about to end with the job's error.
  bool wedged = false;
  for (auto& [slot, p] : procs_) {
    if (!p.local) continue;
    if (!p.local->done && store_) {
      ElasticPlan leave = plan_;
      leave.epoch = plan_.epoch + 1;
      leave.slots.clear();
      leave.has_state.clear();
      leave.reason = "the driver ended";
      (void)store_->set(key(fmt::format("plan/{}", leave.epoch)), leave.to_json().dump());
    }
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!p.local->done && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (p.local->done) {
      p.local->thread.join();
    } else {
      p.local->thread.detach();
      wedged = true;
    }
    p.alive = false;
    p.local.reset();
  }
  if (wedged) {
    (void)store_.release();
    (void)actors_.release();
  }
  for (auto& [slot, p] : procs_) {
    if (!p.alive) continue;
    kill(p.pid, SIGKILL);
    int status = 0;
    waitpid(p.pid, &status, 0);
    p.alive = false;
  }
}

std::optional<Failure> Trainer::check_processes() {
  std::optional<Failure> f;
  // Downs of the actors placed on the workers: a worker whose control-plane connection
  // closed (its process died) or whose node stopped answering heartbeats.
  for (const auto& [slot, down] : actors_->take_downs()) {
    Proc& p = procs_[slot];
    // Only an abrupt end is a failure signal here: the connection lost, heartbeats missed,
    // a crashed handler. kExit (actors moved to another rank on a rescale) and kKilled
    // (the worker's actor system shutting down as its process ends) are not; a process
    // that ends is reported with its status by its exit.
    const bool abrupt = down.reason == control::DownReason::kConnectionLost ||
                        down.reason == control::DownReason::kHeartbeatTimeout ||
                        down.reason == control::DownReason::kCrash;
    if (!abrupt || !p.alive || plan_.rank_of_slot(slot) < 0) continue;
    if (f && std::find(f->slots.begin(), f->slots.end(), slot) != f->slots.end()) continue;
    if (!f)
      f = Failure{
          down.reason == control::DownReason::kHeartbeatTimeout ? "heartbeat" : "exit", {}, "", wall_ms()};
    add_slot(*f, slot);
    f->detail += fmt::format("{}slot {}: actor {} down ({}{}{})", f->detail.empty() ? "" : "; ", slot,
                             down.actor.to_string(), control::down_reason_name(down.reason),
                             down.text.empty() ? "" : ": ", down.text);
  }
  for (auto& [slot, p] : procs_) {
    if (!p.alive) continue;
    if (p.local) {  // a worker thread ends after "stop", or with its error
      if (!p.local->done) continue;
      p.alive = false;
      if (plan_.rank_of_slot(slot) < 0) continue;
      if (!f) f = Failure{"exit", {}, "", wall_ms()};
      f->slots.push_back(slot);
      f->detail += fmt::format("{}slot {} (in this process) ended: {}", f->detail.empty() ? "" : "; ", slot,
                               p.local->result.to_string());
      continue;
    }
    if (scheduled_) {  // the scheduler reports every worker that ends
      if (store_out()) continue;  // no news while the scheduler is out (actor Downs still count)
      const std::string k = key(fmt::format("exit/{}", slot));
      Result<bool> has = poll_contains(k);
      if (!has.ok() || !has.value()) continue;
      Result<std::string> v = poll_get(k, std::chrono::milliseconds(1000));
      p.alive = false;
      if (plan_.rank_of_slot(slot) < 0) continue;
      if (!f) f = Failure{"exit", {}, "", wall_ms()};
      add_slot(*f, slot);
      const nlohmann::json why = v.ok() ? nlohmann::json::parse(v.value(), nullptr, false) : nlohmann::json();
      const bool permanent = why.is_object() && why.value("exit_status", -1) == kExitPermanentFailure;
      f->permanent |= permanent;
      f->detail += fmt::format("{}slot {} {}{}", f->detail.empty() ? "" : "; ", slot,
                               why.is_object() ? why.value("why", v.value())
                               : v.ok()        ? v.value()
                                               : "ended",
                               permanent ? " (a permanent failure: its log says why)" : "");
      continue;
    }
    int status = 0;
    if (waitpid(p.pid, &status, WNOHANG) != p.pid) continue;
    p.alive = false;
    const bool permanent = WIFEXITED(status) && WEXITSTATUS(status) == kExitPermanentFailure;
    const std::string how = WIFEXITED(status)
                                ? fmt::format("exited with status {}{}", WEXITSTATUS(status),
                                              permanent ? " (a permanent failure: its output says why)" : "")
                                : fmt::format("was killed by signal {}", WTERMSIG(status));
    if (plan_.rank_of_slot(slot) < 0) continue;  // a worker that left the job
    if (!f) f = Failure{"exit", {}, "", wall_ms()};
    f->permanent |= permanent;
    add_slot(*f, slot);
    f->detail += fmt::format("{}slot {} (pid {}) {}", f->detail.empty() ? "" : "; ", slot, p.pid, how);
  }
  return f;
}

void Trainer::mark_start(int slot, uint64_t epoch) {
  Proc& p = procs_[slot];
  p.start_mark = fmt::format("starting in epoch {}", epoch);
  // Best effort: if the store refuses it, a predecessor's stale value passes for a first
  // beat and the heartbeat timeout applies from then on (as before the mark existed).
  (void)store_->set(key(fmt::format("hb/{}", slot)), p.start_mark);
  p.last_hb = p.start_mark;
  p.hb_seen = Clock::now();
}

std::optional<Failure> Trainer::check_heartbeats() {
  std::optional<Failure> f;
  // While the store is out (the scheduler restarting or unreachable) silence proves
  // nothing: the timers restart from fresh evidence once it answers again, after a grace.
  if (tolerant_ != nullptr && (store_out() || tolerant_->outages_ended() != outages_seen_)) {
    if (!store_out()) {
      outages_seen_ = tolerant_->outages_ended();
      liveness_grace_until_ = Clock::now() + std::max<Clock::duration>(hb_timeout_, std::chrono::seconds(15));
      event({{"event", "heartbeat_timers_reset"},
             {"why", "the scheduler answers again after an outage"},
             {"grace_ms",
              std::chrono::duration_cast<std::chrono::milliseconds>(liveness_grace_until_ - Clock::now())
                  .count()}});
    }
    for (auto& [slot, p] : procs_) p.hb_seen = Clock::now();
    last_hb_check_ = Clock::now();
    return f;
  }
  // A store that answers slowly (a loaded scheduler) is no proof of silence either.
  const auto t_probe = Clock::now();
  (void)poll_contains(key("hb/probe"));
  const bool store_stalled = Clock::now() - t_probe > std::chrono::milliseconds(500);
  if (store_stalled || Clock::now() - last_hb_check_ > hb_timeout_ / 2 ||
      Clock::now() < liveness_grace_until_) {
    for (auto& [slot, p] : procs_) p.hb_seen = Clock::now();
    if (store_stalled) event({{"event", "heartbeat_timers_reset"}, {"why", "the store stalled"}});
  }
  last_hb_check_ = Clock::now();
  const auto now = Clock::now();
  for (int slot : plan_.slots) {
    Proc& p = procs_[slot];
    if (!p.alive) continue;
    if (store_out()) return std::nullopt;  // went out meanwhile: the next check resets the timers
    Result<bool> has = poll_contains(key(fmt::format("hb/{}", slot)));
    if (has.ok() && has.value()) {
      Result<std::string> v = poll_get(key(fmt::format("hb/{}", slot)), std::chrono::milliseconds(100));
      if (v.ok() && v.value() != p.last_hb) {
        p.last_hb = v.value();
        p.hb_seen = now;
      }
    }
    const bool started = p.started();
    if (now - p.hb_seen > (started ? hb_timeout_ : std::max(hb_timeout_, join_timeout_))) {
      if (!f) f = Failure{"heartbeat", {}, "", wall_ms()};
      f->slots.push_back(slot);
      f->detail +=
          fmt::format("{}slot {} (pid {}) {} for {} ms", f->detail.empty() ? "" : "; ", slot, p.pid,
                      started ? "silent" : "started but never beat",
                      std::chrono::duration_cast<std::chrono::milliseconds>(now - p.hb_seen).count());
    }
  }
  return f;
}

Result<std::optional<Failure>> Trainer::check_errors(Clock::time_point& first_err) {
  // Failures the workers reported to the trainer actor (typed: code, actor, text).
  for (const WorkerFailure& f : actors_->take_failures()) {
    if (f.epoch != plan_.epoch) continue;
    if (f.snapshot_step >= 0 && f.snapshot_step == plan_.snapshot_step) {
      // A part of the snapshot this epoch restores is lost or damaged: the next recovery
      // goes back to an older one.
      if (const SnapshotRecord* rec = snaps_.find(f.snapshot_step); rec && rec->unusable.empty()) {
        snaps_.mark_unusable(f.snapshot_step, f.text);
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
  const auto deadline = Clock::now() + join_timeout_;
  std::set<int> pending(plan.slots.begin(), plan.slots.end());
  restored_parts_ = nlohmann::json::object();
  Clock::time_point first_err{};
  auto last_hb_check = Clock::now();
  while (!pending.empty()) {
    for (auto it = pending.begin(); it != pending.end();) {
      TROUPE_ASSIGN_OR_RETURN(bool has, store_->contains(key(fmt::format("ready/{}/{}", plan.epoch, *it))));
      it = has ? pending.erase(it) : std::next(it);
    }
    if (pending.empty()) break;
    if ((failure = check_processes())) return ok_status();
    if (Clock::now() - last_hb_check > std::chrono::milliseconds(100)) {
      last_hb_check = Clock::now();
      TROUPE_RETURN_IF_ERROR(past_outage_limit());
      if ((failure = check_heartbeats())) return ok_status();
      TROUPE_ASSIGN_OR_RETURN(failure, check_errors(first_err));
      if (failure) return ok_status();
    }
    if (Clock::now() > deadline) {
      // Wedged workers (e.g. a step thread that never returns): replaced (last resort).
      // The ones that never took the plan over are the culprits; the others wait on them.
      std::vector<int> wedged;
      for (int s : pending) {
        TROUPE_ASSIGN_OR_RETURN(bool adopted,
                                store_->contains(key(fmt::format("adopted/{}/{}", plan.epoch, s))));
        if (!adopted) wedged.push_back(s);
      }
      if (wedged.empty()) wedged.assign(pending.begin(), pending.end());
      failure =
          Failure{"join_timeout", wedged,
                  fmt::format("{} worker(s) did not join epoch {} within {} ms, {} never took the plan over",
                              pending.size(), plan.epoch, join_timeout_.count(), wedged.size()),
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
                            store_->get(key(fmt::format("ready/{}/{}", plan.epoch, plan.slots[r])),
                                        comm::deadline_in(std::chrono::milliseconds(10000))));
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_object()) {
      // The scheduler started the worker: its ready record says which process it is.
      Proc& p = procs_[plan.slots[r]];
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
      plan.slots, roles, *store_, [this](int s) { return key(fmt::format("actors/{}", s)); },
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
  plan.ckpt_every = ckpt_every_;
  plan.ckpt_dir = ckpt_dir_;
  plan.snapshot_every = snapshot_every_;
  plan.snapshot_committed = snaps_.newest_committed();
  epoch_failure_.clear();  // failures reported in the old epoch are handled by this one
  epoch_failure_permanent_ = false;
  // Parts of the old epoch's snapshots still landing are of no use to the new one.
  snaps_.drop_incomplete();
  snaps_complete_.clear();
  // Checkpoints still waiting for durable-part notes: one whose every part is on disk
  // (each rank writes its part file after its shard) is finalized; the others are
  // abandoned (a part will never come).
  finalize_written_or_abandon();
  TROUPE_RETURN_IF_ERROR(store_->set(key(fmt::format("plan/{}", plan.epoch)), plan.to_json().dump()));
  // The workers of the old epoch get the plan as a message too (they react at once; the
  // store record is where new and restarted workers read it).
  const int told = actors_->send_plan(plan);
  event({{"event", "epoch_opened"}, {"plan", plan.to_json()}, {"plan_messages", told}});
  const ElasticPlan old = plan_;
  plan_ = plan;
  for (int s : spawn_slots) TROUPE_RETURN_IF_ERROR(spawn(s, plan.epoch));
  // Workers leaving on a scale-down exit by themselves once they see the plan.
  for (int s : leaving) {
    Proc& p = procs_[s];
    const auto deadline = Clock::now() + std::chrono::milliseconds(10000);
    if (scheduled_) {
      while (p.alive) {
        TROUPE_ASSIGN_OR_RETURN(bool gone, store_->contains(key(fmt::format("exit/{}", s))));
        if (gone) p.alive = false;
        if (p.alive && Clock::now() > deadline) terminate(s, "did not leave within 10 s");
        if (p.alive) std::this_thread::sleep_for(poll_);
      }
      continue;
    }
    if (reap_by(p, deadline)) {
      event({{"event", "worker_killed"}, {"slot", s}, {"why", "did not leave within 10 s"}});
    }
  }
  (void)old;
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
        if (std::optional<Failure> more = check_processes()) {
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
    for (int s : f.slots) terminate(s, f.cause);
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
      TROUPE_RETURN_IF_ERROR(choose_restore(p, keep, f.detail));
    }
    // Slots leaving because their replica shrank away are stopped by the plan itself; the
    // lost ones are already dead.
    std::vector<int> leaving_alive;
    for (int s : leaving) {
      if (procs_[s].alive) leaving_alive.push_back(s);
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
      const int64_t s = plan_.snapshot_step;
      std::error_code ec;
      if (s >= 0 && !ckpt_dir_.empty() &&
          ((ckpt_every_ > 0 && s % ckpt_every_ == 0) || forced_ckpts_.count(s)) &&
          !fs::exists(fs::path(ckpt_dir_) / checkpoint::step_dir_name(s), ec)) {
        if (Status st = actors_->send_committed(plan_.slots, snaps_.recommit(s, plan_.epoch, true));
            st.ok()) {
          PendingCheckpoint& p = pending_ckpts_[s];
          p.epoch = plan_.epoch;
          p.dp = plan_.dp;
          p.grad_accum = plan_.grad_accum;
          p.world = static_cast<int>(plan_.slots.size());
          p.tokens = tokens_after_.count(s) ? tokens_after_[s] : 0;
          p.durable.clear();
        }
      }
      if (recovering_steps_lost_ < 0) recovering_steps_lost_ = 0;
      return ok_status();
    }
    f = *again;  // a failure during the recovery: recover again from the same state
    if (f.permanent) return recover(f, step_done, failed_step);
  }
}

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
      actors_->send_command(plan_.slots, StepCommand{c.seq, static_cast<uint8_t>(kind), step, plan_.epoch});
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
    TROUPE_RETURN_IF_ERROR(poll_snapshots());
    collect_replies();
    if (c.remaining == 0) return ok_status();
    if ((failure = check_processes())) {
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
      if ((failure = check_heartbeats())) return ok_status();
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
    auto prev = tokens_after_.find(c.step - 1);
    tokens_after_[c.step] = (prev != tokens_after_.end() ? prev->second : tokens_seen_) +
                            c.replies[0].value("step_tokens", int64_t{0});
  }
  if (c.kind == Command::Kind::kStep && c.step > max_step_completed_) {
    max_step_completed_ = c.step;
    failures_without_progress_ = 0;
  }
  TROUPE_RETURN_IF_ERROR(note_checkpoints(c.kind, c.step, c.replies));
  return poll_snapshots();
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
    std::error_code ec;
    const bool ckpt =
        !ckpt_dir_.empty() &&
        ((s > start_step_ && ckpt_every_ > 0 && s % ckpt_every_ == 0) || forced_ckpts_.count(s) > 0) &&
        !fs::exists(fs::path(ckpt_dir_) / checkpoint::step_dir_name(s), ec);
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
    if (ckpt) {
      PendingCheckpoint& p = pending_ckpts_[s];
      p.epoch = plan_.epoch;
      p.dp = plan_.dp;
      p.grad_accum = plan_.grad_accum;
      p.world = world;
      p.tokens = tok->second;
      p.durable.clear();
    }
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

void Trainer::track_stragglers(const std::vector<nlohmann::json>& replies, int64_t step,
                               std::optional<Failure>& failure) {
  std::vector<double> compute;
  for (const auto& r : replies) compute.push_back(r.value("compute_ms", 0.0));
  if (compute.size() < 2) return;
  for (size_t i = 0; i < replies.size(); ++i) {
    std::vector<double> peers;
    for (size_t j = 0; j < compute.size(); ++j) {
      if (j != i) peers.push_back(compute[j]);
    }
    std::sort(peers.begin(), peers.end());
    const double median = peers[peers.size() / 2];
    const int slot = plan_.slots[i];
    const bool slow = median > 0 && compute[i] > straggler_ratio_ * median && compute[i] - median > 20.0;
    int& streak = slow_streak_[slot];
    streak = slow ? streak + 1 : 0;
    if (streak >= straggler_window_ && !flagged_.count(slot)) {
      flagged_.insert(slot);
      event({{"event", "straggler"},
             {"slot", slot},
             {"rank", i},
             {"step", step},
             {"compute_ms", compute[i]},
             {"peer_median_ms", median},
             {"window", straggler_window_}});
      fmt::print(
          "elastic: straggler: slot {} (rank {}) compute {:.0f} ms vs peers' median {:.0f} ms for {} "
          "steps{}\n",
          slot, i, compute[i], median, streak, straggler_replace_ ? "; replacing it" : "");
      std::fflush(stdout);
      if (straggler_replace_ && !failure) {
        failure = Failure{"straggler", {slot}, fmt::format("slot {} is a straggler", slot), wall_ms()};
      }
    }
  }
}

void Trainer::write_status(int64_t step, bool ask_actors) {
  nlohmann::json workers = nlohmann::json::array();
  for (size_t r = 0; r < plan_.slots.size(); ++r) {
    const int s = plan_.slots[r];
    const bool lost = recovering_since_ms_ && std::find(recovering_slots_.begin(), recovering_slots_.end(),
                                                        s) != recovering_slots_.end();
    workers.push_back({{"slot", s},
                       {"rank", r},
                       {"pid", procs_[s].pid},
                       {"host", procs_[s].host},
                       {"alive", procs_[s].alive && !lost},
                       {"straggler", flagged_.count(s) > 0}});
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
  nlohmann::json snaps{{"every", snapshot_every_}, {"newest_committed", snaps_.newest_committed()}};
  if (keeper_) {  // the standalone launcher's own keeper (under the scheduler: troupe status's agents)
    const checkpoint::KeeperTotals t = keeper_->totals();
    snaps["held"] = checkpoint::keeper_totals_text(t);
    snaps["bytes"] = t.bytes;
  }
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

Status Trainer::take_store_request() {
  if (pending_answer_ || store_out()) return ok_status();
  const std::string k = key(fmt::format("request/{}", next_request_));
  Result<bool> has = poll_contains(k);
  if (!has.ok() || !has.value()) return ok_status();  // none, or the scheduler is out: next boundary
  Result<std::string> got = poll_get(k, std::chrono::milliseconds(5000));
  if (!got.ok()) return ok_status();
  const std::string text = std::move(got).value();
  pending_answer_ = next_request_++;
  last_answer_ =
      nlohmann::json{{"event", "request_refused"}, {"why", "malformed request"}, {"request", text}};
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) return ok_status();
  const std::string op = j.value("op", "");
  if (op == "scale" && j.contains("dp") && j["dp"].is_number_integer()) {
    std::ofstream(run_dir_ + "/scale_request") << j["dp"].get<int64_t>() << "\n";
    last_answer_ = nlohmann::json{{"event", "scale_unchanged"}, {"dp", plan_.dp}};
  } else if (op == "replace" && j.contains("slot") && j["slot"].is_number_integer()) {
    std::ofstream(run_dir_ + "/replace_request") << j["slot"].get<int64_t>() << "\n";
    avoid_node_ = j.value("avoid", "");
  }
  return ok_status();
}

Status Trainer::answer_store_request() {
  avoid_node_.clear();
  if (!pending_answer_ || store_out()) return ok_status();
  // Kept for the next boundary when the scheduler does not take it now.
  if (!poll_set(key(fmt::format("answer/{}", *pending_answer_)), last_answer_.dump()).ok())
    return ok_status();
  pending_answer_.reset();
  return ok_status();
}

Status Trainer::maybe_replace(int64_t step_done) {
  // "<slot>" in <run dir>/replace_request (troupe replace): a planned replacement at this
  // step boundary, restored from a dp peer like a failure.
  const std::string req = run_dir_ + "/replace_request";
  std::error_code ec;
  if (!fs::exists(req, ec)) return ok_status();
  std::string text;
  {
    std::ifstream in(req);
    std::getline(in, text);
  }
  fs::remove(req, ec);
  if (one_process_) {
    last_answer_ = {{"event", "replace_refused"},
                    {"request", text},
                    {"why", "the worker runs in the Trainer's process (set elastic.isolate_workers = true)"}};
    event(last_answer_);
    fmt::print("elastic: replace request '{}' refused: the worker runs in the Trainer's process\n", text);
    return ok_status();
  }
  char* end = nullptr;
  const long slot = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || plan_.rank_of_slot(static_cast<int>(slot)) < 0) {
    last_answer_ = {{"event", "replace_refused"}, {"request", text}, {"why", "not a worker slot of the job"}};
    event(last_answer_);
    fmt::print("elastic: replace request '{}' refused: not a worker slot of the job\n", text);
    return ok_status();
  }
  // The worker's state must survive it: a snapshot of this step (taken now), or else the
  // last checkpoint.
  TROUPE_ASSIGN_OR_RETURN(const bool snapped, snapshot_now(step_done));
  if (plan_.rank_of_slot(static_cast<int>(slot)) < 0) return ok_status();  // gone meanwhile (recovered)
  if (!snapped && ckpt_every_ <= 0) {
    last_answer_ = {
        {"event", "replace_refused"},
        {"request", text},
        {"why", fmt::format("no snapshot of step {} could be taken and no checkpoint is kept", step_done)}};
    event(last_answer_);
    fmt::print("elastic: replace request for slot {} refused: no snapshot of step {} and no checkpoint\n",
               slot, step_done);
    return ok_status();
  }
  fmt::print("elastic: replacing slot {} on request after step {}\n", slot, step_done);
  std::fflush(stdout);
  const int64_t t0 = wall_ms();
  TROUPE_RETURN_IF_ERROR(recover(
      Failure{
          "replace", {static_cast<int>(slot)}, fmt::format("slot {} replaced on request", slot), wall_ms()},
      step_done, step_done + 1));
  last_answer_ = {{"event", "replaced"},
                  {"slot", slot},
                  {"after_step", step_done},
                  {"epoch", plan_.epoch},
                  {"ms", wall_ms() - t0}};
  return ok_status();
}

Status Trainer::maybe_rescale(int64_t step_done) {
  const std::string req = run_dir_ + "/scale_request";
  std::error_code ec;
  // test.scale_at = "<step>:<dp>[,...]": a scripted request after <step> (tests,
  // demos), through the same file a user writes.
  if (!tc_.elastic.scale_at.empty()) {
    const std::string& all = tc_.elastic.scale_at;
    size_t pos = 0;
    while (pos < all.size()) {
      size_t comma = all.find(',', pos);
      if (comma == std::string::npos) comma = all.size();
      const std::string item = all.substr(pos, comma - pos);
      pos = comma + 1;
      const size_t colon = item.find(':');
      if (colon == std::string::npos) continue;
      if (std::strtoll(item.substr(0, colon).c_str(), nullptr, 10) == step_done) {
        std::ofstream(req) << item.substr(colon + 1) << "\n";
      }
    }
  }
  if (!fs::exists(req, ec)) return ok_status();
  std::string text;
  {
    std::ifstream in(req);
    std::getline(in, text);
  }
  fs::remove(req, ec);
  if (text.rfind("dp=", 0) == 0) text = text.substr(3);
  char* end = nullptr;
  const long dp = std::strtol(text.c_str(), &end, 10);
  const int64_t min_dp = tc_.elastic.min_dp,
                max_dp = tc_.elastic.max_dp > 0 ? tc_.elastic.max_dp : tc_.parallel.dp;
  if (text.empty() || *end != '\0' || dp < min_dp || dp > max_dp) {
    last_answer_ = {{"event", "scale_refused"}, {"request", text}, {"min_dp", min_dp}, {"max_dp", max_dp}};
    event(last_answer_);
    fmt::print("elastic: scale request '{}' refused (dp must be in [{}, {}])\n", text, min_dp, max_dp);
    return ok_status();
  }
  if (dp == plan_.dp) return ok_status();
  // Every rank of the new layout restores a snapshot of this step (taken now).
  TROUPE_ASSIGN_OR_RETURN(const bool snapped, snapshot_now(step_done));
  if (step_done_now_ != step_done) return ok_status();  // a failure meanwhile sent the job back
  if (!snapped) {
    last_answer_ = {{"event", "scale_refused"},
                    {"request", text},
                    {"why", fmt::format("no snapshot of step {} could be taken (elastic.snapshot_every and "
                                        "checkpoint.every are 0, or a part failed)",
                                        step_done)}};
    event(last_answer_);
    fmt::print("elastic: scale request '{}' refused: no snapshot of step {} could be taken\n", text,
               step_done);
    return ok_status();
  }
  std::vector<int> keep;
  for (int d = 0; d < std::min<int>(static_cast<int>(dp), static_cast<int>(plan_.dp)); ++d) keep.push_back(d);
  std::vector<int> spawn_slots, leaving;
  Result<ElasticPlan> plan =
      plan_for(dp, keep, step_done, fmt::format("scale dp {} -> {}", plan_.dp, dp), spawn_slots, leaving);
  if (!plan.ok()) {
    last_answer_ = {{"event", "scale_refused"}, {"request", text}, {"why", plan.status().to_string()}};
    event(last_answer_);
    fmt::print("elastic: scale request refused: {}\n", plan.status().to_string());
    return ok_status();
  }
  TROUPE_RETURN_IF_ERROR(choose_restore(plan.value(), false, "rescale"));
  const int64_t t0 = wall_ms();
  const int64_t from = plan_.dp;
  TROUPE_RETURN_IF_ERROR(open_epoch(plan.value(), spawn_slots, leaving));
  std::optional<Failure> failure;
  TROUPE_RETURN_IF_ERROR(wait_ready(plan_, failure));
  if (failure) TROUPE_RETURN_IF_ERROR(recover(*failure, step_done, step_done + 1));
  last_answer_ = {{"event", "scaled"},       {"from_dp", from},
                  {"to_dp", plan_.dp},       {"grad_accum", plan_.grad_accum},
                  {"after_step", step_done}, {"ms", wall_ms() - t0}};
  event(last_answer_);
  fmt::print("elastic: scaled dp {} -> {} (grad_accum {}) after step {} in {} ms\n", from, plan_.dp,
             plan_.grad_accum, step_done, wall_ms() - t0);
  std::fflush(stdout);
  return ok_status();
}

Status Trainer::run() {
  const Status st = run_job();
  if (!st.ok() && events_.is_open()) {
    event({{"event", "job_failed"}, {"error", st.to_string()}});
    write_status(-1);
  }
  return st;
}

Status Trainer::run_job() {
  if (scheduled_) {
    std::optional<std::string> job = env::get(job_env::kJobId);
    if (!job) return invalid_argument("elastic driver: {} is not set", job_env::kJobId);
    job_ = *job;
    poll_ = std::chrono::milliseconds(20);
  } else {
    job_ =
        fmt::format("elastic-{}-{}", getpid(), std::chrono::system_clock::now().time_since_epoch().count());
  }
  one_process_ = runs_in_one_process(tc_, scheduled_);
  if (one_process_) {
    TROUPE_RETURN_IF_ERROR(check_one_process(tc_));
    if (!o_.program) return invalid_argument("one-process run: the Trainer was given no stage program");
  }
  // Knobs: [elastic] of the config. The heartbeat timeout defaults to the job's own
  // (handed over by the scheduler, `--heartbeat-timeout-ms`), else 2 s.
  const layers::ElasticOptions& eo = tc_.elastic;
  TROUPE_ASSIGN_OR_RETURN(
      const int64_t job_hb_timeout,
      scheduled_ ? env::get_int(job_env::kHeartbeatTimeoutMs, 2000, 1) : Result<int64_t>(2000));
  hb_timeout_ =
      std::chrono::milliseconds(eo.heartbeat_timeout_ms > 0 ? eo.heartbeat_timeout_ms : job_hb_timeout);
  err_grace_ = std::chrono::milliseconds(eo.comm_error_grace_ms);
  watchdog_ = std::chrono::milliseconds(eo.step_watchdog_ms);
  join_timeout_ = std::chrono::milliseconds(eo.join_timeout_ms);
  spares_left_ = eo.spares;
  straggler_ratio_ = eo.straggler_ratio;
  straggler_window_ = static_cast<int>(eo.straggler_window);
  straggler_replace_ = eo.straggler_policy == "replace";
  // A one-process run cannot outlive its worker (a failure ends the job): no in-memory
  // snapshots are taken there; checkpoints are still written from a snapshot the worker's
  // own keeper holds (elastic.cc, connect_keeper).
  snapshot_every_ = one_process_ ? 0 : eo.snapshot_every;
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
        snaps_ = std::move(l).value();
        resume_snapshot = snaps_.newest_usable(INT64_MAX);
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
  // The job's checkpoints: every checkpoint.every steps and (checkpoint.final) after the
  // last one, in checkpoint.dir, else $TROUPE_CHECKPOINT_DIR (set by the scheduler), else
  // <run dir>/checkpoints, so `troupe checkpoints`, `train_moe sample --run` and
  // `--resume <run dir>` find them. The plans carry both to the workers.
  ckpt_every_ = tc_.checkpoint.every;
  if (ckpt_every_ > 0 || tc_.checkpoint.final) {
    ckpt_dir_ = fs::absolute(checkpoint_dir_for(tc_, run_dir_)).string();
    // Checkpoints of an earlier run here after the starting step are stale (a fresh job:
    // all of them; the checkpoint resumed from is kept): moved aside, never deleted.
    // (A driver resuming from a snapshot keeps those at or before its step.)
    TROUPE_RETURN_IF_ERROR(prepare_checkpoint_dir(ckpt_dir_, start_step));
    // The tokenizer copied into the run directory by the caller (app.cc, prepare_run_dir).
    TROUPE_ASSIGN_OR_RETURN(ckpt_info_,
                            run_checkpoint_info(o_.config, o_.overrides, tc_, run_dir_ + "/tokenizer.json"));
  }
  if (resume) last_ckpt_bytes_ = resume->manifest().total_bytes();
  fs::remove(run_dir_ + "/scale_request", ec);
  // An earlier run's snapshots are not this one's (a restarted driver read them above).
  if (resume_snapshot == nullptr) fs::remove(run_dir_ + "/snapshots.json", ec);
  fs::remove(run_dir_ + "/replace_request", ec);
  if (one_process_) {
    store_ = std::make_unique<comm::MemoryStore>();  // the worker is a thread of this process
  } else if (!scheduled_) {
    fs::remove_all(run_dir_ + "/rendezvous", ec);
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::FileStore> fstore,
                            comm::FileStore::open(run_dir_ + "/rendezvous"));
    store_ = std::move(fstore);
    // The standalone launcher holds its workers' snapshots itself: it outlives them as a
    // node's agent does (one node: no copy elsewhere). The workers it forks find it in
    // their environment.
    if (snapshot_every_ > 0 || ckpt_every_ > 0) {
      char host[256] = {0};
      ::gethostname(host, sizeof(host) - 1);
      TROUPE_ASSIGN_OR_RETURN(keeper_, checkpoint::SnapshotKeeper::start({.node = host, .host_addr = ""}));
      ::setenv(job_env::kSnapshotKeeper, keeper_->socket_path().c_str(), 1);
    }
  }
  // The record of a run goes on across resumes and driver restarts: appended, never cut.
  events_.open(run_dir_ + "/events.jsonl", resume || driver_restarts > 0 ? std::ios::app : std::ios::trunc);
  if (!events_) return io_error("cannot write {}/events.jsonl", run_dir_);
  TROUPE_ASSIGN_OR_RETURN(run_metrics_, RunMetrics::open(tc_.observe, run_dir_));
  if (driver_restarts > 0) {
    event({{"event", "driver_restarted"},
           {"driver_restarts", driver_restarts},
           {"pid", getpid()},
           {"resumed_from", resume ? resume->path() : std::string()},
           {"resumed_from_snapshot", resume_snapshot != nullptr ? resume_snapshot->step : int64_t{-1}},
           {"step", start_step}});
  }
  std::ofstream metrics(run_dir_ + "/metrics.jsonl",
                        resume || resume_snapshot != nullptr ? std::ios::app : std::ios::trunc);
  if (!metrics) return io_error("cannot write {}/metrics.jsonl", run_dir_);

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
  plan_.ckpt_every = ckpt_every_;
  plan_.ckpt_dir = ckpt_dir_;
  plan_.snapshot_every = snapshot_every_;
  // Under the scheduler: from now on a lost worker is reported to this driver (a key of
  // the job's store) instead of restarting every worker of the job.
  // The run directory rides along, so the scheduler's record of the job names it
  // (`troupe run` keeps the scheduler's event log there).
  if (scheduled_) {
    const nlohmann::json claim{{"pid", getpid()}, {"run_dir", fs::absolute(run_dir_).string()}};
    TROUPE_RETURN_IF_ERROR(store_->set(key("claim"), claim.dump()));
  }
  TROUPE_RETURN_IF_ERROR(store_->set(key("plan/0"), plan_.to_json().dump()));
  if (one_process_) {
    TROUPE_ASSIGN_OR_RETURN(actors_, ActorDirectory::start_local(*store_, key("actors/driver")));
  } else {
    TROUPE_ASSIGN_OR_RETURN(actors_,
                            ActorDirectory::start(control::host_addr(), *store_, key("actors/driver")));
  }
  event({{"event", "job_started"},
         {"job", job_},
         {"plan", plan_.to_json()},
         {"one_process", one_process_},
         {"steps_in_flight", tc_.train.steps_in_flight},
         {"heartbeat_timeout_ms", hb_timeout_.count()}});
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
      tc_.tokens_per_step(), tc_.train.steps, tc_.train.steps_in_flight, hb_timeout_.count(), run_dir_);
  std::fflush(stdout);
  for (int r = 0; r < world; ++r) TROUPE_RETURN_IF_ERROR(spawn(r, 0));
  int64_t tokens_seen = resume ? resume->manifest().data_position.value("tokens_seen", int64_t{0})
                        : resume_snapshot != nullptr ? resume_snapshot->tokens
                                                     : 0;
  tokens_seen_ = tokens_seen;
  tokens_after_[start_step] = tokens_seen;
  step_done_now_ = start_step_ = start_step;
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
        start_step = start_step_ = *rewound_to_;
        rewound_to_.reset();
        TROUPE_RETURN_IF_ERROR(trim_metrics(run_dir_ + "/metrics.jsonl", start_step));
        if (auto it = tokens_after_.find(start_step); it != tokens_after_.end())
          tokens_seen = tokens_seen_ = it->second;
      }
    }
  }

  TROUPE_ASSIGN_OR_RETURN(std::optional<nlohmann::json> v0o, call(Command::Kind::kEval, start_step));
  if (!v0o) return aborted("elastic: rewound before the first step");
  double last_val = v0o->value("val_loss", 0.0);
  const double val0 = last_val;
  const bool resumed = resume || resume_snapshot != nullptr;
  fmt::print("{}step {} | val_loss {:.4f}\n", resumed ? "resumed | " : "", start_step, val0);
  nlohmann::json rec0{{"step", start_step}, {"val_loss", val0}, {"tokens", tokens_seen}};
  if (resumed) rec0["resumed"] = true;
  metrics << rec0.dump() << "\n";
  metrics.flush();
  const auto t_start = Clock::now();
  max_step_logged_ = start_step;
  const int64_t tokens_before = tokens_seen;
  resume.reset();
  resume_snapshot = nullptr;  // snaps_ changes from here on

  // ---- the steps, up to train.steps_in_flight of them in flight ------------------------
  // Commands go out in order: step k, then its evaluation where one is due, then step
  // k+1 ... The window is refilled as each step's replies arrive, so the workers find
  // their next command queued. What needs the workers at a step boundary with nothing in
  // flight (a rescale or replacement) stops the sending until the window has drained.
  const int64_t window = tc_.train.steps_in_flight;
  const auto eval_due = [&](int64_t s) {
    return (tc_.train.eval_every > 0 && s % tc_.train.eval_every == 0) || s == tc_.train.steps;
  };
  std::set<int64_t> scripted;  // steps after which test.scale_at rescales
  for (size_t pos = 0; pos < tc_.elastic.scale_at.size();) {
    size_t comma = tc_.elastic.scale_at.find(',', pos);
    if (comma == std::string::npos) comma = tc_.elastic.scale_at.size();
    scripted.insert(std::strtoll(tc_.elastic.scale_at.substr(pos, comma - pos).c_str(), nullptr, 10));
    pos = comma + 1;
  }
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
    tokens_seen = tokens_seen_ = tokens_after_[step];  // on_completed counted it
    // A checkpoint step's stall: the longest time a rank's step thread spent on its snapshot.
    if (ckpt_every_ > 0 && step % ckpt_every_ == 0 && rec.contains("snapshot_ms_max"))
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
  // A membership change asked for at this boundary: a scripted rescale, a request file
  // (troupe scale|replace <run dir>) or a request in the job's store.
  const auto boundary_wanted = [&](int64_t after) -> Result<bool> {
    if (scripted.count(after) != 0) return true;
    if (fs::exists(run_dir_ + "/scale_request", ec) || fs::exists(run_dir_ + "/replace_request", ec))
      return true;
    // A poll (one attempt, skipped while the scheduler is out): training goes on through
    // an outage and a request waits for the next boundary.
    if (scheduled_ && !pending_answer_ && !store_out()) {
      Result<bool> has = poll_contains(key(fmt::format("request/{}", next_request_)));
      return has.ok() && has.value();
    }
    return false;
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
      if (auto it = tokens_after_.find(done); it != tokens_after_.end())
        tokens_seen = tokens_seen_ = it->second;
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
      if (next - 1 > completed && scripted.count(next - 1) != 0) break;
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
      if (scheduled_) TROUPE_RETURN_IF_ERROR(take_store_request());
      TROUPE_RETURN_IF_ERROR(maybe_replace(done));
      TROUPE_RETURN_IF_ERROR(maybe_rescale(done));
      write_status(done);  // the membership after this boundary's changes
      if (scheduled_) TROUPE_RETURN_IF_ERROR(answer_store_request());
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
      TROUPE_ASSIGN_OR_RETURN(bool wanted, boundary_wanted(c.step));
      hold |= wanted;
    }
    // The next step goes out before this one's bookkeeping (metrics, status): the workers
    // must not wait for the driver's own work. (Not past a scripted rescale after it.)
    if (!failure && c.kind == Command::Kind::kStep && scripted.count(c.step) == 0) {
      TROUPE_RETURN_IF_ERROR(fill_window(c.step));
    }
    // Every rank completed the command and a worker was lost (or flagged) just after: the
    // command counts, and the worker is replaced from the state after it.
    std::optional<Failure> after = std::move(failure);
    if (!after && c.kind == Command::Kind::kStep) track_stragglers(c.replies, c.step, after);
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
  bool have_final = false;
  for (const auto& [s, d] : checkpoint::list_checkpoints(ckpt_dir_)) have_final |= s == final_step;
  const bool final_ckpt = !ckpt_dir_.empty() && (final_step > start_step || !have_final);
  for (int attempt = 1; final_ckpt && last_ckpt_committed_ < final_step; ++attempt) {
    // Written from the snapshot of the final step (the save command): the one being written
    // already (a checkpoint step), the committed snapshot of that step the workers hold (a
    // snapshot off the checkpoint schedule, or the second attempt), else a new one.
    if (snaps_.newest_committed() == final_step) {
      if (pending_ckpts_.count(final_step) == 0) {
        PendingCheckpoint& p = pending_ckpts_[final_step];
        p.epoch = plan_.epoch;
        p.dp = plan_.dp;
        p.grad_accum = plan_.grad_accum;
        p.world = static_cast<int>(plan_.slots.size());
        p.tokens = tokens_after_.count(final_step) ? tokens_after_[final_step] : tokens_seen_;
        p.durable.clear();
      }
    } else {
      forced_ckpts_.insert(final_step);
    }
    TROUPE_ASSIGN_OR_RETURN(std::optional<nlohmann::json> saved, call(Command::Kind::kSave, final_step));
    if (!saved) {
      return aborted(
          "a failure during the final checkpoint sent the job back to step {}; continue it with --resume",
          *rewound_to_);
    }
    if (last_ckpt_committed_ >= final_step) break;
    const FailedSave why = clean_failed_save(ckpt_dir_, final_step, last_ckpt_bytes_);
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
  for (int64_t step : failed_ckpt_steps_) (void)clean_failed_save(ckpt_dir_, step, last_ckpt_bytes_);
  // Every worker exits after "stop"; reap them (bounded). Under the scheduler it does.
  const auto deadline = Clock::now() + std::chrono::milliseconds(30000);
  for (auto& [slot, p] : procs_) {
    if (scheduled_) break;
    if (p.local) {
      while (!p.local->done && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      if (p.local->done) {
        p.local->thread.join();
        p.local.reset();
        p.alive = false;
      }
      continue;
    }
    (void)reap_by(p, deadline);
  }
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
      final_ckpt ? fmt::format("; weights in the checkpoint of step {} in {}", final_step, ckpt_dir_) : "");
  return ok_status();
}

}  // namespace

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
