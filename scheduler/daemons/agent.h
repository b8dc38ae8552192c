// scheduler/daemons/agent.h — defines Agent, the troupe-agent daemon as a library (the executable
// and `troupe run` embed it): registers this node's slots with the scheduler, spawns job
// processes with their TROUPE_* environment, writes each one's stdout/stderr to
// <work dir>/jobs/<job>/logs/<name>.log, reports every exit at once (pidfds in the poll
// set), kills process groups on command (SIGTERM, then SIGKILL after the grace period),
// heartbeats, and registers again with a restarted scheduler, reporting what it runs.
//
// Relay (on by default): the agent binds ipc://<private dir>/relay (a fresh 0700 directory
// troupe-agent-XXXXXX under $TMPDIR or /tmp, removed when the agent ends; directories of
// this user's agents that died without removing theirs, whose socket refuses connections,
// are removed at start) and gives its processes TROUPE_AGENT_RELAY. Their scheduler
// sessions (hello, beats, store, placement, status) go there, and the agent carries each
// message over its own scheduler connection in a Relay message naming the session; the
// scheduler answers through the agent. So the scheduler holds one CURVE connection per
// host, not one per process (docs/architecture.md, "Worker sessions through the agent").
// The local hop has no CURVE: only this agent's user can reach a socket in that directory,
// and the relay's ZAP handler admits only peers of this process's uid (SO_PEERCRED).
//
// Snapshots (on by default): the agent runs its node's snapshot keeper
// (checkpoint/snapshot_keeper.h): training workers write their in-memory snapshots into
// memory it holds (TROUPE_SNAPSHOT_KEEPER names its socket), so they survive the worker,
// and it copies them to another node's keeper (TCP on the host address), so they survive
// the node. Its figures ride on the agent's heartbeats into `troupe status`.
//
// Threading: run()/run_once() on one thread (the loop); stop() from any thread. Process
// starts run on a thread of their own (the starter): the job key file, the log file's
// directory and open, fork and the wait for the exec can each stall on a busy disk or a
// loaded machine, and the loop must go on beating, relaying and killing meanwhile. The loop
// prepares a start, queues it, and adopts its outcome when the starter wakes it (an
// eventfd in the poll set): it then reports ProcStarted (or ProcExited with the error), as
// before. A kill for a process still being started is applied the moment it is adopted.
// The starter also removes the key files of processes that ended (an unlink waits for a
// busy disk's journal too).
// Children get PR_SET_PDEATHSIG, so they die with the starter thread, which lives as long
// as the agent: no orphans if the agent dies.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/snapshot_keeper.h"
#include "core/status.h"
#include "scheduler/client/protocol.h"
#include "scheduler/client/transport.h"
#include "scheduler/daemons/spawner.h"

namespace troupe::sched {

struct AgentOptions {
  std::string scheduler;            // endpoint of troupe-scheduler
  ClientSecurity security;
  std::string key_file;             // passed to job processes (TROUPE_CURVE_KEY) when CURVE is on
  std::string agent_id;             // empty: the host name
  int slots = -1;                   // -1: the GPU count, or the CPU count when there is no GPU
  std::string work_dir;             // logs go under <work_dir>/jobs/<job>/logs
  int heartbeat_ms = 300;
  int poll_ms = 50;
  int stop_grace_ms = 2000;  // run() returning: SIGTERM, then SIGKILL after this
  // The address this node's job processes bind and advertise (TROUPE_HOST_ADDR; the
  // agent's own connection to the scheduler leaves from it too). Empty: loopback.
  std::string host_addr;
  // Let processes bind a non-loopback host_addr without CURVE (TROUPE_INSECURE=1).
  bool insecure = false;
  // Relay the job processes' scheduler sessions (see above); false: each process opens
  // its own connection to the scheduler.
  bool relay = true;
  // Run the node's snapshot keeper (see above); false: workers keep their snapshots in
  // their own process (they do not survive it).
  bool snapshots = true;
};

// The first IPv4 address of network interface `iface` (for --iface).
Result<std::string> interface_address(const std::string& iface);

// GPUs visible through the CUDA runtime (0 in CPU builds or when CUDA reports an error).
int detect_gpus();

class Agent {
 public:
  using Clock = std::chrono::steady_clock;

  static Result<std::unique_ptr<Agent>> create(AgentOptions opts);
  ~Agent();  // kills and reaps every child that is still running

  void run();  // until stop(); then kills every child (opts.stop_grace_ms)
  void run_once(std::chrono::milliseconds timeout);
  void stop() { stop_.store(true); }
  const std::string& id() const { return opts_.agent_id; }
  int slots() const { return opts_.slots; }
  bool registered() const { return registered_; }
  // The relay's endpoint (ipc://...), empty without a relay.
  std::string relay_endpoint() const { return relay_ ? relay_->bound_endpoint() : std::string(); }
  // The node's snapshot keeper (null with snapshots off).
  const checkpoint::SnapshotKeeper* keeper() const { return keeper_.get(); }
  size_t running() const { return children_.size(); }
  // Kills every child (SIGTERM, SIGKILL after `grace`) and reaps them; blocks.
  void kill_all(std::chrono::milliseconds grace);
  // SIGKILLs the process group of every child now, from any thread (a last resort for a
  // process about to _exit: the loop thread may be busy); does not reap.
  void kill_all_now();

 private:
  struct Child {
    ProcStatus status;        // job, name, epoch, pid
    ChildProcess proc;
    std::optional<Clock::time_point> kill_at;  // SIGKILL deadline after a SIGTERM
  };

  // A process start handed to the starter thread: what the loop prepared, then the outcome.
  struct PendingStart {
    ProcStatus status;  // job, name, epoch
    SpawnOptions options;
    std::string key_dir, key_path, key;  // the job's secret key, written first (key empty: none)
    int kill_signal = 0;                 // a kill asked for while it was being started (0: none)
    int kill_grace_ms = 0;
    bool dropped = false;               // the agent stopped before starting it
    std::optional<ChildProcess> child;  // started
    std::string error;                  // why it could not start
  };

  explicit Agent(AgentOptions opts) : opts_(std::move(opts)) {}
  void handle(const Message& m);
  void send_register();
  void on_spawn(const SpawnRequest& req);
  void starter_loop();
  void start_one(PendingStart& p);
  // Marks the starts of `job` (and `name`, unless empty) not yet adopted with a kill.
  void kill_pending(const std::string& job, const std::string& name, int sig, int grace_ms);
  // On the loop: reports and adopts the starts the starter finished.
  void collect_starts();
  bool starts_pending();
  // Drops the queued starts and waits (at most `bound`) for the one under way.
  void quiesce_starts(std::chrono::milliseconds bound);
  void on_kill(const KillRequest& req);
  void on_logs(uint64_t rid, const LogsRequest& req);
  Status open_relay();
  void relay_up();                           // local sessions -> the scheduler
  void relay_down(const RelayedMessage& r);  // the scheduler -> a local session
  void reap();
  std::string log_path(const std::string& job, const std::string& name) const;
  // Where the job's CURVE secret key is handed to a process (0600; removed when it ends).
  std::string job_key_path(const std::string& job, const std::string& name, uint64_t epoch) const;

  AgentOptions opts_;
  std::unique_ptr<ClientEndpoint> conn_;
  std::unique_ptr<ServerEndpoint> relay_;
  std::string relay_dir_;  // removed by the destructor
  std::unique_ptr<checkpoint::SnapshotKeeper> keeper_;
  std::string host_;
  int gpus_ = 0;
  std::map<pid_t, Child> children_;
  std::vector<ProcStatus> unacked_exits_;  // resent on registration until acknowledged
  uint64_t incarnation_ = 0;
  bool registered_ = false;
  Clock::time_point last_beat_{};
  Clock::time_point last_register_{};
  Clock::time_point next_ask_expiry_{};
  std::atomic<bool> stop_{false};
  std::mutex live_mu_;
  std::set<pid_t> live_pgids_;  // children not yet reaped, for kill_all_now()
  // The starter thread and what it shares with the loop (under start_mu_).
  std::mutex start_mu_;
  std::condition_variable start_cv_;
  std::deque<std::shared_ptr<PendingStart>> start_queue_;
  std::shared_ptr<PendingStart> starting_;              // under way
  std::vector<std::shared_ptr<PendingStart>> started_;  // finished, not yet adopted
  std::vector<std::string> removals_;  // key files of ended processes, removed by the starter
  bool start_stop_ = false;
  int start_wake_fd_ = -1;  // eventfd: the starter finished a start
  std::thread starter_;
};

}  // namespace troupe::sched
