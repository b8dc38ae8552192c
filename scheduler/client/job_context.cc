// scheduler/client/job_context.cc — JobContext::from_env, SchedulerSession, HeartbeatThread.
#include "scheduler/client/job_context.h"

#include <unistd.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "comm/control/host_addr.h"
#include "core/env.h"
#include "core/job_env.h"

namespace troupe::sched {
namespace {

template <typename T>
Status env_int(const char* name, T* out) {
  constexpr int64_t lo = std::is_signed_v<T> ? static_cast<int64_t>(std::numeric_limits<T>::min()) : 0;
  constexpr int64_t hi =
      static_cast<uint64_t>(std::numeric_limits<T>::max()) > static_cast<uint64_t>(INT64_MAX)
          ? INT64_MAX
          : static_cast<int64_t>(std::numeric_limits<T>::max());
  TROUPE_ASSIGN_OR_RETURN(int64_t v, env::get_int(name, static_cast<int64_t>(*out), lo, hi));
  *out = static_cast<T>(v);
  return ok_status();
}

}  // namespace

Result<std::optional<JobContext>> JobContext::from_env() {
  namespace je = job_env;
  if (!env::get(je::kJobId)) return std::optional<JobContext>();
  JobContext c;
  c.role = env::get_or(je::kRole, "worker");
  c.job_id = env::get_or(je::kJobId);
  c.name = env::get_or(je::kProcName);
  c.scheduler = env::get_or(je::kScheduler);
  c.layout = env::get_or(je::kLayout);
  c.backend = env::get_or(je::kBackend, "cpu");
  c.node = env::get_or(je::kNode);
  c.checkpoint_dir = env::get_or(je::kCheckpointDir);
  c.relay = env::get_or(je::kAgentRelay);
  if (!c.relay.empty() && c.relay.rfind("ipc://", 0) != 0) {
    return invalid_argument("{}='{}' is not an ipc:// endpoint", je::kAgentRelay, c.relay);
  }
  TROUPE_RETURN_IF_ERROR(env_int(je::kRank, &c.rank));
  TROUPE_RETURN_IF_ERROR(env_int(je::kWorldSize, &c.world_size));
  TROUPE_RETURN_IF_ERROR(env_int(je::kLocalRank, &c.local_rank));
  TROUPE_RETURN_IF_ERROR(env_int(je::kLocalWorldSize, &c.local_world_size));
  TROUPE_RETURN_IF_ERROR(env_int(je::kDeviceSlot, &c.slot));
  TROUPE_RETURN_IF_ERROR(env_int(je::kEpoch, &c.epoch));
  TROUPE_RETURN_IF_ERROR(env_int(je::kRestarts, &c.restarts));
  TROUPE_RETURN_IF_ERROR(env_int(je::kDriverRestarts, &c.driver_restarts));
  TROUPE_RETURN_IF_ERROR(env_int(je::kHeartbeatMs, &c.heartbeat_ms));
  TROUPE_RETURN_IF_ERROR(env_int(je::kHeartbeatTimeoutMs, &c.heartbeat_timeout_ms));
  if (c.role != "driver" && c.role != "worker") {
    return invalid_argument("{}='{}' (driver or worker)", je::kRole, c.role);
  }
  if (c.scheduler.empty()) return invalid_argument("{} is set but {} is not", je::kJobId, je::kScheduler);
  std::string server_key = env::get_or(je::kSchedulerPublicKey);
  if (!server_key.empty()) {
    c.security.server_public_key = server_key;
    std::string key_file = env::get_or(je::kCurveKey);
    if (key_file.empty())
      return invalid_argument("{} is set but {} is not", je::kSchedulerPublicKey, je::kCurveKey);
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
  return control::job_transport(node_id, bind ? control::host_bind_endpoint() : "");
}

std::string job_actor_server_key() {
  return control::job_server_key();
}

}  // namespace troupe::sched
