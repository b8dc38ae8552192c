// training/driver/trainer_procs.cc — JobStore and ProcessSupervisor (trainer_procs.h,
// where the contract is): starting, killing and reaping the workers; exits, Downs and
// heartbeats.
#include "training/driver/trainer_procs.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "core/env.h"
#include "core/exit_status.h"
#include "core/job_env.h"
#include "training/driver/trainer.h"
#include "training/role_actors.h"
#include "training/worker/elastic.h"

extern char** environ;

namespace troupe::training {

namespace {

// Waits for the child `p` to exit, polling every 5 ms; past `deadline` it is SIGKILLed.
// Returns true when it had to be killed.
bool reap_by(ProcessSupervisor::Proc& p, ProcessSupervisor::Clock::time_point deadline) {
  while (p.alive) {
    int status = 0;
    if (waitpid(p.pid, &status, WNOHANG) == p.pid) {
      p.alive = false;
      return false;
    }
    if (ProcessSupervisor::Clock::now() > deadline) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &status, 0);
      p.alive = false;
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

}  // namespace

void ProcessSupervisor::configure(bool one_process, bool scheduled, std::chrono::milliseconds poll) {
  one_process_ = one_process;
  scheduled_ = scheduled;
  poll_ = poll;
  // The heartbeat timeout defaults to the job's own (handed over by the scheduler,
  // `--heartbeat-timeout-ms`), else 2 s.
  const layers::ElasticOptions& eo = tc_.elastic;
  // A malformed value is the scheduler's bug: named, and the default kept.
  Result<int64_t> job_hb =
      scheduled_ ? env::get_int(job_env::kHeartbeatTimeoutMs, 2000, 1) : Result<int64_t>(2000);
  if (!job_hb.ok()) fmt::print(stderr, "trainer: {}; heartbeat timeout 2000 ms\n", job_hb.status().message());
  hb_timeout_ = std::chrono::milliseconds(eo.heartbeat_timeout_ms > 0 ? eo.heartbeat_timeout_ms
                                                                      : (job_hb.ok() ? *job_hb : 2000));
  join_timeout_ = std::chrono::milliseconds(eo.join_timeout_ms);
}

Status ProcessSupervisor::await_leaving(const std::vector<int>& slots) {
  for (int s : slots) {
    Proc& p = procs_[s];
    const auto deadline = Clock::now() + std::chrono::milliseconds(10000);
    if (scheduled_) {
      while (p.alive) {
        TROUPE_ASSIGN_OR_RETURN(bool gone, store_.raw().contains(store_.key(fmt::format("exit/{}", s))));
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
  return ok_status();
}

void ProcessSupervisor::reap_all(Clock::time_point deadline) {
  for (auto& [slot, p] : procs_) {
    if (scheduled_) break;  // the scheduler does
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
}

Status ProcessSupervisor::spawn(int slot, uint64_t epoch, const std::string& avoid) {
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
    comm::RendezvousStore* store = &store_.raw();
    w->thread = std::thread([this, w, sys, store, slot, epoch] {
      Status st = ok_status();
      try {
        st = run_elastic_worker(tc_, o_.program, *store, store_.job(), slot, epoch, {}, o_.worker_ctx, sys);
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
      if (!avoid.empty()) req["avoid"] = avoid;  // troupe drain
      TROUPE_RETURN_IF_ERROR(store_.raw().set(store_.key(fmt::format("spawn/{}", slot)), req.dump()));
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
  envs.push_back(fmt::format("{}={}", job_env::kJobId, store_.job()));
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

void ProcessSupervisor::terminate(int slot, const std::string& why) {
  Proc& p = procs_[slot];
  if (!p.alive) return;
  if (p.local) return;  // a thread cannot be killed: a one-process run ends instead (recover)
  if (scheduled_) {
    (void)store_.raw().set(store_.key(fmt::format("kill/{}", slot)), why);
  } else {
    kill(p.pid, SIGKILL);
    int status = 0;
    waitpid(p.pid, &status, 0);
  }
  p.alive = false;
  event({{"event", "worker_killed"}, {"slot", slot}, {"pid", p.pid}, {"why", why}});
}

bool ProcessSupervisor::kill_all() {
  stop_probe();                  // before the store may be leaked below
  if (scheduled_) return false;  // the scheduler owns the processes
  // A worker thread still running (the job failed): a plan without it makes it leave
  // (its communicators aborted, its step unwound). One wedged past the wait is left
  // running, and what it uses (the store, the actor system) is kept alive with it: the
  // process is about to end with the job's error.
  bool wedged = false;
  for (auto& [slot, p] : procs_) {
    if (!p.local) continue;
    if (!p.local->done && store_.has()) {
      ElasticPlan leave = plan_;
      leave.epoch = plan_.epoch + 1;
      leave.slots.clear();
      leave.has_state.clear();
      leave.reason = "the driver ended";
      (void)store_.raw().set(store_.key(fmt::format("plan/{}", leave.epoch)), encode_elastic_plan(leave));
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
  if (wedged) store_.leak();
  for (auto& [slot, p] : procs_) {
    if (!p.alive) continue;
    kill(p.pid, SIGKILL);
    int status = 0;
    waitpid(p.pid, &status, 0);
    p.alive = false;
  }
  return wedged;
}

std::optional<Failure> ProcessSupervisor::check_processes() {
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
    if (scheduled_) {              // the scheduler reports every worker that ends
      if (store_.out()) continue;  // no news while the scheduler is out (actor Downs still count)
      const std::string k = store_.key(fmt::format("exit/{}", slot));
      Result<bool> has = store_.poll_contains(k);
      if (!has.ok() || !has.value()) continue;
      Result<std::string> v = store_.poll_get(k, std::chrono::milliseconds(1000));
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

namespace {
// A store write that takes longer than this stalled (check_heartbeats, start_probe).
constexpr auto kProbeStall = std::chrono::milliseconds(500);
int64_t steady_ns(ProcessSupervisor::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
}  // namespace

void ProcessSupervisor::start_probe() {
  if (probe_.joinable() || probe_stop_) return;  // running, or stopped for good (kill_all)
  probe_ = std::thread([this, key = store_.key("hb/probe")] {
    uint64_t seq = 0;
    std::unique_lock lock(probe_mu_);
    while (!probe_stop_) {
      lock.unlock();
      const auto t0 = Clock::now();
      probe_since_ns_.store(steady_ns(t0));
      (void)store_.poll_set(key, std::to_string(++seq));
      if (Clock::now() - t0 > kProbeStall) probe_slow_.store(true);
      probe_since_ns_.store(0);
      lock.lock();
      probe_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return probe_stop_; });
    }
  });
}

void ProcessSupervisor::stop_probe() {
  if (!probe_.joinable()) return;
  {
    std::lock_guard lock(probe_mu_);
    probe_stop_ = true;
  }
  probe_cv_.notify_all();
  probe_.join();
}

void ProcessSupervisor::mark_start(int slot, uint64_t epoch) {
  Proc& p = procs_[slot];
  p.start_mark = fmt::format("starting in epoch {}", epoch);
  // Best effort: if the store refuses it, a predecessor's stale value passes for a first
  // beat and the heartbeat timeout applies from then on (as before the mark existed).
  (void)store_.raw().set(store_.key(fmt::format("hb/{}", slot)), p.start_mark);
  p.last_hb = p.start_mark;
  p.hb_seen = Clock::now();
}

std::optional<Failure> ProcessSupervisor::check_heartbeats() {
  std::optional<Failure> f;
  // While the store is out (the scheduler restarting or unreachable) silence proves
  // nothing: the timers restart from fresh evidence once it answers again, after a grace.
  if (store_.tolerant() != nullptr && (store_.out() || store_.tolerant()->outages_ended() != outages_seen_)) {
    if (!store_.out()) {
      outages_seen_ = store_.tolerant()->outages_ended();
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
  // A store that answers slowly (a loaded scheduler) is no proof of silence either. The
  // workers' beats are writes: with a file store the probe writes too, since a busy disk
  // stalls file creation and renames (its journal) while reads still answer at once; it
  // writes on a thread of its own (start_probe), and a write under way or finished past
  // kProbeStall since the last check counts. Under the scheduler one thread answers reads
  // and writes, and a read costs it no disk.
  bool store_stalled = false;
  if (scheduled_) {
    const auto t_probe = Clock::now();
    (void)store_.poll_contains(store_.key("hb/probe"));
    store_stalled = Clock::now() - t_probe > kProbeStall;
  } else {
    start_probe();
    const int64_t since = probe_since_ns_.load();
    store_stalled =
        probe_slow_.exchange(false) ||
        (since != 0 && steady_ns(Clock::now()) - since > std::chrono::nanoseconds(kProbeStall).count());
  }
  if (store_stalled || Clock::now() - last_hb_check_ > hb_timeout_ / 2 ||
      Clock::now() < liveness_grace_until_) {
    for (auto& [slot, p] : procs_) p.hb_seen = Clock::now();
    // One event a stall (the checks come every poll while it lasts).
    if (store_stalled && !stall_reported_)
      event({{"event", "heartbeat_timers_reset"}, {"why", "the store stalled"}});
  }
  stall_reported_ = store_stalled;
  last_hb_check_ = Clock::now();
  const auto now = Clock::now();
  for (int slot : plan_.slots) {
    Proc& p = procs_[slot];
    if (!p.alive) continue;
    if (store_.out()) return std::nullopt;  // went out meanwhile: the next check resets the timers
    Result<bool> has = store_.poll_contains(store_.key(fmt::format("hb/{}", slot)));
    if (has.ok() && has.value()) {
      Result<std::string> v =
          store_.poll_get(store_.key(fmt::format("hb/{}", slot)), std::chrono::milliseconds(100));
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

}  // namespace troupe::training
