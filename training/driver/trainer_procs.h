// training/driver/trainer_procs.h — the Trainer's process supervision: JobStore (the job's
// store as the driver's parts use it) and ProcessSupervisor (the workers' processes and
// their liveness: the failure detector's exits and heartbeats).
//
// Owns: each worker's process or thread (pid, host, GPU, heartbeat; Proc), the heartbeat
// timers and the grace after a store outage.
// May call: the job's store (heartbeat, exit, kill and spawn keys), fork/exec/waitpid, the
// ActorDirectory's Downs, the EventLog. It reads the driver's current plan (a reference
// given at construction). It never plans an epoch or sends a command: it returns a
// Failure and membership (trainer_membership.cc) acts.
// Invariants: a worker is judged silent only on fresh evidence (never while the store is
// out, nor within the grace after an outage or a stalled probe); a slot appears at most
// once in a Failure; a worker that left the plan is never a failure.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/rendezvous_store.h"
#include "core/status.h"
#include "training/driver/trainer_status.h"
#include "training/messages.h"
#include "training/run_config.h"
#include "training/tolerant_store.h"
#include "training/worker/elastic.h"

namespace troupe::training {

class ActorDirectory;
struct TrainerOptions;

// A failure the driver acts on (trainer_membership.cc, recover).
struct Failure {
  std::string cause;       // exit, heartbeat, comm_error, watchdog, straggler, replace, join_timeout
  std::vector<int> slots;  // workers to replace (empty: rebuild only), each once
  std::string detail;
  int64_t ts_ms = 0;
  // A failure a replacement would meet again (a worker that exited with
  // kExitPermanentFailure, or reported a permanent error): the job ends, nobody is replaced.
  bool permanent = false;
};

// A worker seen failing twice (its actor's Down message and its exit) is one lost worker.
inline void add_slot(Failure& f, int slot) {
  if (std::find(f.slots.begin(), f.slots.end(), slot) == f.slots.end()) f.slots.push_back(slot);
}

// The job's store: its keys under "<job>/elastic/", and polls that make one attempt (no
// retry through an outage, tolerant_store.h) while the scheduler is out.
class JobStore {
 public:
  void set_job(std::string job) { job_ = std::move(job); }
  const std::string& job() const { return job_; }
  std::string key(const std::string& rest) const { return elastic_key(job_, rest); }
  // Under the scheduler `tolerant` is `store` itself (it tells when the scheduler is out).
  void own(std::unique_ptr<comm::RendezvousStore> store, TolerantStore* tolerant = nullptr) {
    store_ = std::move(store);
    tolerant_ = tolerant;
  }
  bool has() const { return store_ != nullptr; }
  comm::RendezvousStore& raw() { return *store_; }
  TolerantStore* tolerant() const { return tolerant_; }
  bool out() const { return tolerant_ != nullptr && tolerant_->in_outage(); }
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
  // A worker thread that never ended still uses the store: it is left alive with it.
  void leak() { (void)store_.release(); }

 private:
  std::string job_;
  std::unique_ptr<comm::RendezvousStore> store_;
  TolerantStore* tolerant_ = nullptr;
};

class ProcessSupervisor {
 public:
  using Clock = std::chrono::steady_clock;
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
    int gpu = -1;                        // standalone launcher, GPU workers: the device index it was given
    std::string last_hb;
    Clock::time_point hb_seen;
    // What the trainer wrote into the worker's heartbeat key when it started it: until the
    // key holds something else, the process has not beaten yet (a dead predecessor's last
    // value would otherwise pass for a beat).
    std::string start_mark;
    bool started() const { return last_hb != start_mark; }
  };

  ProcessSupervisor(const TrainerOptions& o, const layers::TrainConfig& tc, JobStore& store,
                    const ElasticPlan& plan, EventLog& log)
      : o_(o), tc_(tc), store_(store), plan_(plan), log_(log) {}
  ~ProcessSupervisor() { stop_probe(); }
  ProcessSupervisor(const ProcessSupervisor&) = delete;
  ProcessSupervisor& operator=(const ProcessSupervisor&) = delete;
  // How the workers are owned (trainer.h): a thread of this process, the scheduler's, or
  // this launcher's children; `poll`: the interval of store probes. Sets the timeouts.
  void configure(bool one_process, bool scheduled, std::chrono::milliseconds poll);
  void set_actors(ActorDirectory* actors) { actors_ = actors; }
  std::chrono::milliseconds heartbeat_timeout() const { return hb_timeout_; }
  std::chrono::milliseconds join_timeout() const { return join_timeout_; }

  // Starts the worker of `slot` for `epoch` (under the scheduler: asks for it; `avoid`: an
  // agent it must not land on, troupe drain).
  Status spawn(int slot, uint64_t epoch, const std::string& avoid = "");
  void terminate(int slot, const std::string& why);  // kill a worker (it is then gone)
  // Workers leaving on a scale-down exit by themselves once they see the plan: waits for
  // them (10 s each), then kills them.
  Status await_leaving(const std::vector<int>& slots);
  // The job's end: waits (bounded) for every worker to exit after "stop".
  void reap_all(Clock::time_point deadline);
  // The destructor's: a worker thread still running is told to leave and joined; child
  // processes are killed. True when a thread was wedged past the wait (it is left running
  // with what it uses: the caller must leak the store and the actor system).
  bool kill_all();

  // Exits and actor Downs of workers of the current plan since the last call.
  std::optional<Failure> check_processes();
  // Workers of the current plan silent past the heartbeat (or join) timeout.
  std::optional<Failure> check_heartbeats();

  Proc& proc(int slot) { return procs_[slot]; }
  bool alive(int slot) { return procs_[slot].alive; }

 private:
  void event(nlohmann::json e) { log_.event(std::move(e)); }
  // Writes the start mark into slot's heartbeat key (Proc::start_mark) and starts its
  // silence clock.
  void mark_start(int slot, uint64_t epoch);
  // The stall probe of a store that is not the scheduler's: a thread that writes
  // "hb/probe" every 100 ms, as the workers' beats write, so that check_heartbeats learns
  // a write stalled (a busy disk's journal) without ever waiting for one itself: a probe
  // on the checking thread held a worker's failure report back for the stall's length.
  void start_probe();
  void stop_probe();  // joins it (before the store can be leaked or go)

  const TrainerOptions& o_;
  const layers::TrainConfig& tc_;
  JobStore& store_;
  const ElasticPlan& plan_;
  EventLog& log_;
  ActorDirectory* actors_ = nullptr;
  bool one_process_ = false, scheduled_ = false;
  std::chrono::milliseconds poll_{2};
  std::chrono::milliseconds hb_timeout_{2000}, join_timeout_{30000};
  std::map<int, Proc> procs_;
  // Outages seen to end (TolerantStore::outages_ended) and the end of the grace after the
  // last one: a worker's first beat after an outage may wait for its own request, sent
  // while the scheduler was out, to time out (12 s): until then nobody is judged silent.
  uint64_t outages_seen_ = 0;
  Clock::time_point liveness_grace_until_{};
  Clock::time_point last_hb_check_ = Clock::now();
  std::thread probe_;
  std::mutex probe_mu_;
  std::condition_variable probe_cv_;
  bool probe_stop_ = false;
  std::atomic<int64_t> probe_since_ns_{0};  // steady clock when the write under way began (0: none)
  std::atomic<bool> probe_slow_{false};     // a write took over 500 ms since the last check
  bool stall_reported_ = false;             // the last check found the store stalled (and said so)
};

}  // namespace troupe::training
