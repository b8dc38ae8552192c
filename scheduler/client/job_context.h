// scheduler/client/job_context.h — defines what a job process (driver or worker) uses to talk to
// the scheduler that started it: JobContext (its TROUPE_* environment, parsed),
// SchedulerSession (hello + heartbeats + status queries over its own connection) and
// HeartbeatThread (beats from a background thread for apps without a main loop to beat
// from; note that a hung main thread then still looks alive — beat from the main loop
// when hangs must be detected).
//
// The variables themselves, each with what it means, are named in core/job_env.h (the
// scheduler and its agents set them through the same constants).
#pragma once

#include <atomic>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "comm/control/transport.h"
#include "core/status.h"
#include "scheduler/client/transport.h"

namespace troupe::sched {

struct JobContext {
  std::string role;
  std::string job_id;
  std::string name;
  std::string scheduler;
  std::string layout;
  std::string backend;
  std::string node;
  std::string checkpoint_dir;
  // TROUPE_AGENT_RELAY: the ipc:// endpoint of the agent that started this process, which
  // carries this process's scheduler sessions over its own connection (agent.h); empty:
  // connect to `scheduler` directly (with `security`).
  std::string relay;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int slot = -1;
  uint64_t epoch = 0;
  int restarts = 0;
  int driver_restarts = 0;
  int heartbeat_ms = 500;
  int heartbeat_timeout_ms = 3000;
  ClientSecurity security;

  bool is_driver() const { return role == "driver"; }
  // Where this process's scheduler sessions go: the agent's relay when there is one (no
  // CURVE: the endpoint is a socket in the agent's 0700 directory, and the agent admits
  // only its own user), else the scheduler with `security`.
  std::string session_endpoint() const { return relay.empty() ? scheduler : relay; }
  ClientSecurity session_security() const { return relay.empty() ? security : ClientSecurity{}; }
  // nullopt when the process was not started by Troupe (no TROUPE_JOB_ID); an error when
  // the variables are there but malformed.
  static Result<std::optional<JobContext>> from_env();
};

// The control-plane options for a job process's own actor system (actors/actor_system.h):
// it binds this process's host address (TROUPE_HOST_ADDR, from an agent's --host-addr;
// else loopback) unless `bind` is false (connect-only), and when the scheduler runs CURVE
// it uses the job's key pair (TROUPE_JOB_PUBLIC_KEY / TROUPE_JOB_SECRET_KEY_FILE), accepting
// only the job's own processes; that also permits a non-loopback address.
// TROUPE_INSECURE=1 (an agent's --insecure) permits one without keys.
control::TransportOptions job_actor_network(const std::string& node_id, bool bind);
// The public key a job process's actor system serves with ("" without CURVE): pass it to
// ActorSystem::connect.
std::string job_actor_server_key();

class SchedulerSession {
 public:
  static Result<std::unique_ptr<SchedulerSession>> connect(const JobContext& ctx);
  // The first beat is the hello that starts heartbeat monitoring of this process.
  bool beat();
  // The address of this process's own actor system, sent with every following beat
  // (the driver's actor placement resolves actors to it).
  void set_actor_address(std::string node, std::string endpoint);
  // Driver: places actors (name -> process name, e.g. "worker-3") for `epoch` (the job's
  // current one: a restarted job's workers are in a later epoch than the driver's own
  // TROUPE_EPOCH); the reply lists each actor's process, agent, actor-system node and
  // endpoint. `layout` (e.g. "pp=2,dp=2,n=1"; empty: not said): the layout the driver runs
  // the workers as, recorded by the scheduler as the job's layout (its events, status).
  Result<nlohmann::json> place_actors(uint64_t epoch,
                                      const std::vector<std::pair<std::string, std::string>>& placements,
                                      std::chrono::milliseconds timeout, const std::string& layout = "");
  // The status document of this job (the same as `troupe status <job> --json`).
  Result<nlohmann::json> job_status(std::chrono::milliseconds timeout);
  ClientEndpoint& endpoint() { return *conn_; }

 private:
  SchedulerSession(JobContext ctx, std::unique_ptr<ClientEndpoint> c) : ctx_(std::move(ctx)), conn_(std::move(c)) {}
  JobContext ctx_;
  std::unique_ptr<ClientEndpoint> conn_;
  bool said_hello_ = false;
  std::string actor_node_;
  std::string actor_endpoint_;
};

class HeartbeatThread {
 public:
  static Result<std::unique_ptr<HeartbeatThread>> start(const JobContext& ctx);
  // Beats over `session` (which the caller may go on using for requests from another
  // thread: a process has one session, one node id) every `interval_ms`.
  static std::unique_ptr<HeartbeatThread> start(std::shared_ptr<SchedulerSession> session, int interval_ms);
  ~HeartbeatThread();

 private:
  HeartbeatThread() = default;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace troupe::sched
