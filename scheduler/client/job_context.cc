// scheduler/client/job_context.cc — JobContext::from_env, SchedulerSession, HeartbeatThread.
#include "scheduler/client/job_context.h"

#include <unistd.h>

#include <charconv>
#include <cstdlib>

#include "comm/control/host_addr.h"

namespace troupe::sched {
namespace {

std::string env_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

template <typename T>
Status env_int(const char* name, T* out) {
  const char* v = std::getenv(name);
  if (!v) return ok_status();
  std::string s(v);
  T x{};
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc() || p != s.data() + s.size()) return invalid_argument("{}='{}' is not an integer", name, s);
  *out = x;
  return ok_status();
}

}  // namespace

Result<std::optional<JobContext>> JobContext::from_env() {
  if (!std::getenv("TROUPE_JOB_ID")) return std::optional<JobContext>();
  JobContext c;
  c.role = env_or("TROUPE_ROLE", "worker");
  c.job_id = env_or("TROUPE_JOB_ID");
  c.name = env_or("TROUPE_PROC_NAME");
  c.scheduler = env_or("TROUPE_SCHEDULER");
  c.layout = env_or("TROUPE_LAYOUT");
  c.backend = env_or("TROUPE_BACKEND", "cpu");
  c.node = env_or("TROUPE_NODE");
  c.checkpoint_dir = env_or("TROUPE_CHECKPOINT_DIR");
  c.relay = env_or("TROUPE_AGENT_RELAY");
  if (!c.relay.empty() && c.relay.rfind("ipc://", 0) != 0) {
    return invalid_argument("TROUPE_AGENT_RELAY='{}' is not an ipc:// endpoint", c.relay);
  }
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_RANK", &c.rank));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_WORLD_SIZE", &c.world_size));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_LOCAL_RANK", &c.local_rank));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_LOCAL_WORLD_SIZE", &c.local_world_size));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_SLOT", &c.slot));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_EPOCH", &c.epoch));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_RESTARTS", &c.restarts));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_DRIVER_RESTARTS", &c.driver_restarts));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_HEARTBEAT_MS", &c.heartbeat_ms));
  TROUPE_RETURN_IF_ERROR(env_int("TROUPE_HEARTBEAT_TIMEOUT_MS", &c.heartbeat_timeout_ms));
  if (c.role != "driver" && c.role != "worker") return invalid_argument("TROUPE_ROLE='{}' (driver or worker)", c.role);
  if (c.scheduler.empty()) return invalid_argument("TROUPE_JOB_ID is set but TROUPE_SCHEDULER is not");
  std::string server_key = env_or("TROUPE_SCHEDULER_PUBLIC_KEY");
  if (!server_key.empty()) {
    c.security.server_public_key = server_key;
    std::string key_file = env_or("TROUPE_CURVE_KEY");
    if (key_file.empty()) return invalid_argument("TROUPE_SCHEDULER_PUBLIC_KEY is set but TROUPE_CURVE_KEY is not");
    TROUPE_ASSIGN_OR_RETURN(auto keys, read_key_file(key_file));
    c.security.client_keys = keys;
  }
  return std::optional<JobContext>(std::move(c));
}

Result<std::unique_ptr<SchedulerSession>> SchedulerSession::connect(const JobContext& ctx) {
  std::string id = fmt::format("proc:{}:{}:{}:{}", ctx.job_id, ctx.name, ctx.epoch, getpid());
  TROUPE_ASSIGN_OR_RETURN(auto conn,
                          ClientEndpoint::connect(ctx.session_endpoint(), ctx.session_security(), id));
  return std::unique_ptr<SchedulerSession>(new SchedulerSession(ctx, std::move(conn)));
}

bool SchedulerSession::beat() {
  bool hello = !said_hello_;
  said_hello_ = true;
  return conn_->send(Message{0, ProcBeat{ctx_.job_id, ctx_.name, ctx_.epoch, static_cast<int32_t>(getpid()),
                                         hello, actor_node_, actor_endpoint_, wall_ms()}});
}

void SchedulerSession::set_actor_address(std::string node, std::string endpoint) {
  actor_node_ = std::move(node);
  actor_endpoint_ = std::move(endpoint);
}

Result<nlohmann::json> SchedulerSession::place_actors(
    uint64_t epoch, const std::vector<std::pair<std::string, std::string>>& placements,
    std::chrono::milliseconds timeout, const std::string& layout) {
  TROUPE_ASSIGN_OR_RETURN(Reply r,
                          conn_->request(PlaceActors{ctx_.job_id, epoch, placements, layout}, timeout));
  TROUPE_RETURN_IF_ERROR(r.status());
  try {
    return nlohmann::json::parse(r.body);
  } catch (const std::exception& e) {
    return data_loss("placement reply is not JSON: {}", e.what());
  }
}

Result<nlohmann::json> SchedulerSession::job_status(std::chrono::milliseconds timeout) {
  TROUPE_ASSIGN_OR_RETURN(Reply r, conn_->request(StatusQuery{ctx_.job_id}, timeout));
  TROUPE_RETURN_IF_ERROR(r.status());
  try {
    return nlohmann::json::parse(r.body);
  } catch (const std::exception& e) {
    return data_loss("status reply is not JSON: {}", e.what());
  }
}

Result<std::unique_ptr<HeartbeatThread>> HeartbeatThread::start(const JobContext& ctx) {
  TROUPE_ASSIGN_OR_RETURN(auto session, SchedulerSession::connect(ctx));
  return start(std::shared_ptr<SchedulerSession>(std::move(session)), ctx.heartbeat_ms);
}

std::unique_ptr<HeartbeatThread> HeartbeatThread::start(std::shared_ptr<SchedulerSession> session,
                                                        int interval_ms) {
  std::unique_ptr<HeartbeatThread> t(new HeartbeatThread());
  const int interval = std::max(20, interval_ms);
  t->thread_ = std::thread([stop = &t->stop_, s = std::move(session), interval]() {
    while (!stop->load()) {
      s->beat();
      std::this_thread::sleep_for(std::chrono::milliseconds(interval));
    }
  });
  return t;
}

HeartbeatThread::~HeartbeatThread() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

control::TransportOptions job_actor_network(const std::string& node_id, bool bind) {
  control::TransportOptions t;
  t.node_id = node_id;
  t.bind_endpoint = bind ? control::host_bind_endpoint() : "";
  if (auto kp = control::job_curve_from_env()) {
    t.curve.own = *kp;
    t.curve.allowed_client_keys = {kp->public_key};
    t.allow_non_loopback = true;
  } else if (const char* insecure = std::getenv("TROUPE_INSECURE");
             insecure && std::string(insecure) == "1") {
    t.allow_non_loopback = true;
  }
  return t;
}

std::string job_actor_server_key() {
  auto kp = control::job_curve_from_env();
  return kp ? kp->public_key : std::string();
}

}  // namespace troupe::sched
