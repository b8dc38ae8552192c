// scheduler/daemons/scheduler.h — defines Scheduler, the troupe-scheduler daemon as a library
// (the executable and `troupe run` both embed it): a registry of agents and their slots,
// jobs and their processes (one driver + N workers per job), placement, the rendezvous
// store, health (exits reported by agents, heartbeat timeouts of agents and of job
// processes), the restart policy, durable state in SQLite and events.jsonl per job.
//
// Threading: run()/run_once() drive everything on the calling thread; stop() may be
// called from any thread (or a signal handler through request_stop()).
// The scheduler knows nothing of models: a job is a command.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "observe/metrics_server.h"
#include "observe/peer_detector.h"
#include "scheduler/client/protocol.h"
#include "scheduler/client/transport.h"
#include "scheduler/daemons/event_log.h"
#include "scheduler/daemons/health_monitor.h"
#include "scheduler/daemons/placement.h"
#include "scheduler/daemons/receive_lag.h"
#include "scheduler/daemons/rendezvous.h"
#include "scheduler/daemons/scheduler_metrics.h"
#include "scheduler/daemons/secrets.h"
#include "scheduler/daemons/state_store.h"

namespace troupe::sched {

struct SchedulerOptions {
  std::string listen = "tcp://127.0.0.1:0";  // loopback unless told otherwise
  std::string advertise;                      // address job processes use; empty: the bound one
  std::string state_dir;                      // scheduler.db, jobs/<id>/events.jsonl
  ServerSecurity security;
  int agent_timeout_ms = 3000;                // agent declared dead after this silence
  int agent_heartbeat_ms = 300;               // told to agents
  int poll_ms = 20;                           // loop granularity (timers)
  // ZeroMQ I/O threads of the server socket. With CURVE each connecting client costs
  // about 0.3 ms of I/O-thread CPU (handshake), so 10,000 job processes connecting at once
  // need seconds of one thread; a host with cores to spare can spread that. On the 2-core
  // bench machine two made no difference with CURVE and made the restart without CURVE
  // miss (bench/RESULTS.md, 2026-11-24), hence one by default.
  int io_threads = 1;
  // Prometheus /metrics (scheduler/daemons/scheduler_metrics.h); an empty `listen`: not served.
  observe::MetricsServerOptions metrics;
  // The faulty-machine detector's thresholds (observe/peer_detector.h; --detector k=v).
  observe::DetectorOptions detector;
};

class Scheduler {
 public:
  using Clock = std::chrono::steady_clock;

  static Result<std::unique_ptr<Scheduler>> create(SchedulerOptions opts);
  ~Scheduler();

  const std::string& endpoint() const { return endpoint_; }
  // The /metrics URL ("" when not served).
  std::string metrics_url() const;
  void run();                                   // until stop()
  void run_once(std::chrono::milliseconds timeout);
  void stop() { stop_.store(true); }
  bool stopping() const { return stop_.load(); }

 private:
  struct Agent {
    AgentRecord rec;
    std::string peer;
    Clock::time_point last_seen;
    bool alive = false;
    AgentHeartbeat last_beat;  // its snapshot keeper's figures (troupe status)
  };
  struct Proc {
    ProcRecord rec;
    std::string peer;                 // the process's own session, after its hello
    Clock::time_point last_beat;
    bool beating = false;             // heartbeat monitoring starts with the hello
    bool reattached = false;          // proc_reattached logged in this incarnation
    // Added to the process's environment (elastic replacements: their slot and epoch).
    std::vector<std::pair<std::string, std::string>> extra_env;
    std::string avoid_agent;  // elastic replacement: not on this agent (troupe drain)
  };
  struct Job {
    JobRecord rec;
    std::map<std::string, Proc> procs;  // by name
    std::vector<std::pair<std::string, std::string>> actors;  // this epoch's placement: actor -> proc
    std::optional<EventLog> log;
    std::set<std::string> retired;  // elastic: failed workers the driver replaced
    // The layout the job's driver reported with its actor placement (PlaceActors): the
    // job's real layout when it was submitted without --layout. Empty: none reported.
    std::string reported_layout;
    // The layout the job runs as far as the scheduler knows: the spec's --layout, else
    // the driver's report, else empty (a job of nproc workers and no known layout).
    std::string known_layout() const {
      return !rec.spec.layout.empty() ? rec.spec.parsed_layout().to_string() : reported_layout;
    }
  };
  // How long heartbeats (agents' and job processes') waited between arriving at the
  // scheduler's inbox and being handled by its loop: a cumulative histogram, reported by
  // `status` under scheduler.beat_latency (bench/scale takes percentiles of its deltas).
  struct LatencyHistogram {
    static constexpr int kBuckets = 96;           // bucket i holds latencies <= 10 us * 2^(i/4)
    std::array<uint64_t, kBuckets + 1> counts{};  // the last one: above every bound
    uint64_t max_us = 0;
    void add(std::chrono::nanoseconds d);
    nlohmann::json to_json() const;
  };
  struct PendingReply {
    std::string peer;
    uint64_t request_id;
  };

  explicit Scheduler(SchedulerOptions opts) : opts_(std::move(opts)) {}
  Status init();
  Status recover();

  void dispatch(const Incoming& in);
  // Queues `msg` for `peer`; it leaves after this turn's state is committed (run_once).
  void send(const std::string& peer, Message msg);
  void flush_sends();
  void reply(const std::string& peer, uint64_t request_id, Reply r);
  void on_register(const std::string& peer, const RegisterAgent& m);
  void on_agent_heartbeat(const std::string& peer, const AgentHeartbeat& m);
  void on_proc_started(const ProcStatus& p);
  void on_proc_exited(const std::string& peer, const ProcStatus& p);
  void on_proc_beat(const std::string& peer, const ProcBeat& b);
  void on_submit(const std::string& peer, uint64_t rid, const SubmitJob& m);
  void on_status(const std::string& peer, uint64_t rid, const StatusQuery& m);
  void on_cancel(const std::string& peer, uint64_t rid, const CancelJob& m);
  void on_logs(const std::string& peer, uint64_t rid, const LogsQuery& m);
  void on_store(const std::string& peer, uint64_t rid, const StoreRequest& m);
  void on_reply(const Message& m);
  void on_place_actors(const std::string& peer, uint64_t rid, const PlaceActors& m);
  // Worker health (scheduler/client/health_reporter.h): kept for status, Prometheus and the
  // detector; the detector's verdicts become events and the job's health_policy.
  void on_health(const HealthReport& r);
  void on_health_verdict(Job& job, const observe::Verdict& v);
  // Elastic jobs: a request to the driver as `troupe replace` writes it (the first free
  // "<job>/elastic/request/<k>" key of the job's store).
  void elastic_request(Job& job, const nlohmann::json& req);
  void refresh_metrics();
  // A job process's message relayed by its agent (protocol.h, RelayedMessage): handled as
  // from the virtual peer "relay:<agent peer>\n<session>", whose replies send() wraps
  // and hands to the agent. Malformed or nested relays are dropped with a logged error.
  void on_relay(const Incoming& in, const RelayedMessage& r);
  static constexpr std::string_view kRelayPeerPrefix = "relay:";

  void timers();
  void scan_health(Clock::time_point now);  // agent and process heartbeat timeouts
  void try_start(Job& job);
  Status spawn(Job& job, Proc& proc);
  void proc_failed(Job& job, Proc& proc, const std::string& reason);
  void restart_workers(Job& job, const std::string& reason);
  void restart_driver(Job& job, const std::string& reason);
  void finish_job(Job& job, JobState state, const std::string& message);
  void check_completion(Job& job);
  void kill_procs(Job& job, const std::string& name, int signal, int grace_ms);
  // Elastic jobs (JobSpec::elastic: claimed by the job's driver, or `--elastic`;
  // scheduler/daemons/scheduler_elastic.cc): the driver owns membership. A worker that
  // ends is reported to it through the job's store ("<job>/elastic/exit/<slot>") instead
  // of restarting the workers; the driver's store keys "<job>/elastic/spawn/<slot>" and
  // "kill/<slot>" start and kill worker processes.
  bool is_elastic(const Job& job) const;
  void elastic_worker_gone(Job& job, Proc& proc, const std::string& why, bool erase);
  void elastic_on_store(Job& job, const StoreRequest& m);
  void elastic_place_pending(Job& job);  // requested workers waiting for a free slot
  std::vector<AgentCapacity> capacity() const;

  void event(Job& job, const std::string& type, nlohmann::json fields);
  void save(Job& job);
  void save(Proc& proc);
  nlohmann::json job_json(const Job& job, bool with_procs) const;

  SchedulerOptions opts_;
  std::unique_ptr<ServerEndpoint> server_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<RendezvousTable> rendezvous_;
  // Seals the values of a job's environment before they are stored (secrets.h).
  std::optional<EnvSealer> sealer_;
  std::string endpoint_;
  std::string advertise_;
  uint64_t incarnation_ = 0;
  std::map<std::string, Agent> agents_;
  std::map<std::string, Job> jobs_;
  std::map<uint64_t, PendingReply> store_waiters_;   // rendezvous token -> client
  std::map<uint64_t, PendingReply> log_forwards_;    // request id sent to an agent -> client
  uint64_t next_token_ = 1;
  // After a restart: agents not back by recovered_until_ are lost. It is two agent
  // timeouts after the restart or after the latest agent's return, whichever is later,
  // but never past recovery_cap_ (kMaxRecoveryTimeouts agent timeouts after the restart).
  static constexpr int kMaxRecoveryTimeouts = 10;
  Clock::time_point recovered_until_{};
  Clock::time_point recovery_cap_{};
  LatencyHistogram beat_latency_;
  // Arrived, not yet handled: a turn handles at most kMaxTurnMessages of them, so answers
  // (and their commit) go out while a flood (10,000 peers reconnecting) is worked off.
  static constexpr size_t kMaxTurnMessages = 512;
  std::deque<Incoming> backlog_;
  // The longest wait (arrival -> handled) of a message in the last turn: while it is over
  // kMaxLoopLag the loop is behind, and silence is not held against peers.
  static constexpr std::chrono::milliseconds kMaxLoopLag{500};
  Clock::duration loop_lag_{};
  // The same rule for the path before the loop (kernel buffers, ZeroMQ I/O threads busy
  // with thousands of CURVE handshakes, transport and actor threads): while the beats
  // that arrive are typically over kMaxLoopLag late, silence is not held against peers.
  ReceiveLag receive_lag_;
  std::chrono::milliseconds receive_lag_now_{0};  // as of the last health-scan check
  bool verdicts_held_ = false;                    // logged once per episode
  Clock::time_point next_lag_prune_{};
  std::vector<std::pair<std::string, Message>> outbox_;  // sent after the turn's commit
  Clock::time_point next_health_scan_{};
  Clock::time_point next_ask_expiry_{};
  // try_start's placement, for spawn(): agent -> the epoch's worker ranks on it (sorted),
  // so a job of n workers costs O(n log n), not O(n^2). Empty outside try_start.
  std::map<std::string, std::vector<int>> placing_ranks_;
  // agent id -> (job id, process name) of unfinished jobs' processes placed on it, for
  // on_register (1,250 agents registering again after a restart, each scanning every
  // process, was quadratic). Built on first use in a turn; dropped at the end of the turn
  // and when placement changes (elastic placement only picks live agents, whose pending
  // processes are spawned at once).
  const std::vector<std::pair<std::string, std::string>>& procs_on_agent(const std::string& agent);
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> procs_by_agent_;
  bool procs_by_agent_built_ = false;
  std::atomic<bool> stop_{false};
  std::mt19937_64 rng_{std::random_device{}()};
  std::unique_ptr<HealthMonitor> health_;
  std::unique_ptr<SchedulerMetrics> metrics_;
  Clock::time_point next_metrics_refresh_{};
  std::map<uint64_t, Clock::time_point> parked_at_;  // rendezvous token -> when it parked (metrics)
  std::set<std::pair<std::string, std::string>> health_acted_;  // (job, worker) a policy acted on
};

}  // namespace troupe::sched
