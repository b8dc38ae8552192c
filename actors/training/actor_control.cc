// actors/training/actor_control.cc — StageActor and the actor StepServer / StepDriver.
#include "actors/training/actor_control.h"

#include <future>
#include <thread>

#include <fmt/format.h>

#include <cstdlib>

#include "comm/control/host_addr.h"

namespace troupe::training {

using Clock = std::chrono::steady_clock;

namespace {

std::string worker_node(int rank) { return fmt::format("w{}", rank); }

// The Stage's control role: runs each command through the handler (blocking its
// dedicated thread for the step) and answers with the reply.
class StageActor final : public actors::Actor {
 public:
  StageActor(StepServer::Handler handler, std::shared_ptr<std::atomic<bool>> stopped,
             std::shared_ptr<std::atomic<int64_t>> last_ns)
      : handler_(std::move(handler)), stopped_(std::move(stopped)), last_ns_(std::move(last_ns)) {
    handle<StageCommandMsg>([this](const StageCommandMsg& m) -> Result<StageReplyMsg> {
      touch();
      TROUPE_ASSIGN_OR_RETURN(Command cmd, command_from_json(m.json));
      if (cmd.seq != next_seq_) {
        return failed_precondition("stage: command {} arrived, expected {} (commands run in order)", cmd.seq, next_seq_);
      }
      ++next_seq_;
      StageReplyMsg reply{handler_(cmd).dump()};
      touch();
      if (cmd.kind == Command::Kind::kStop) stopped_->store(true);
      return reply;
    });
  }

 private:
  void touch() { last_ns_->store(Clock::now().time_since_epoch().count()); }
  StepServer::Handler handler_;
  std::shared_ptr<std::atomic<bool>> stopped_;
  std::shared_ptr<std::atomic<int64_t>> last_ns_;
  int64_t next_seq_ = 0;
};

// The control plane binds this process's address (TROUPE_HOST_ADDR, which a troupe-agent
// started with --host-addr hands its workers; else loopback) or nothing (`bind` false).
// With the job's CURVE key pair (TROUPE_JOB_*_KEY, given by a scheduler that runs
// CURVE) every connection is encrypted and only the job's own processes are accepted;
// that also permits a non-loopback address. TROUPE_INSECURE=1 permits one without keys.
control::TransportOptions network_options(bool bind) {
  control::TransportOptions t;
  t.bind_endpoint = bind ? control::host_bind_endpoint() : "";
  if (auto kp = control::job_curve_from_env()) {
    t.curve.own = *kp;
    t.curve.allowed_client_keys = {kp->public_key};
    t.allow_non_loopback = true;
  } else if (const char* insecure = std::getenv("TROUPE_INSECURE"); insecure && std::string(insecure) == "1") {
    t.allow_non_loopback = true;
  }
  return t;
}

// The public key a peer of this job serves with ("" without CURVE).
std::string job_server_key() {
  auto kp = control::job_curve_from_env();
  return kp ? kp->public_key : std::string();
}

}  // namespace

// ---- worker side --------------------------------------------------------------------

Result<std::unique_ptr<ActorStepServer>> ActorStepServer::start(comm::RendezvousStore& store, std::string prefix,
                                                                int rank) {
  std::unique_ptr<ActorStepServer> s(new ActorStepServer(store, std::move(prefix), rank));
  actors::ActorSystemOptions o;
  o.node_id = worker_node(rank);
  o.network = network_options(true);
  o.on_node_down = [lost = s->driver_lost_](const std::string& node, actors::DownReason, const std::string&) {
    if (node == "driver") lost->store(true);
  };
  TROUPE_ASSIGN_OR_RETURN(s->sys_, actors::ActorSystem::create(std::move(o)));
  return s;
}

ActorStepServer::~ActorStepServer() {
  if (sys_) sys_->shutdown();
}

Status ActorStepServer::serve(const Handler& handler, std::chrono::milliseconds idle_timeout) {
  auto stopped = std::make_shared<std::atomic<bool>>(false);
  auto last = std::make_shared<std::atomic<int64_t>>(Clock::now().time_since_epoch().count());
  actors::SpawnOptions so;
  so.dedicated_thread = true;
  TROUPE_RETURN_IF_ERROR(sys_->spawn_actor("stage", std::make_unique<StageActor>(handler, stopped, last), so).status());
  TROUPE_RETURN_IF_ERROR(store_.set(fmt::format("{}actors/{}", prefix_, worker_node(rank_)), sys_->endpoint()));
  while (!stopped->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (driver_lost_->load()) return unavailable("worker rank {}: the driver's node went down", rank_);
    const auto idle = Clock::now() - Clock::time_point(Clock::duration(last->load()));
    if (idle > idle_timeout) {
      return deadline_exceeded("worker rank {}: no command from the driver within {} ms", rank_, idle_timeout.count());
    }
  }
  // The stop reply is on its way; give the transport a moment to flush it.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  return ok_status();
}

// ---- driver side --------------------------------------------------------------------

Result<std::unique_ptr<ActorStepDriver>> ActorStepDriver::start(comm::RendezvousStore& store, std::string prefix,
                                                                int world, std::chrono::milliseconds connect_timeout,
                                                                const Supervisor& supervise) {
  std::unique_ptr<ActorStepDriver> d(new ActorStepDriver());
  d->world_ = world;
  actors::ActorSystemOptions o;
  o.node_id = "driver";
  o.network = network_options(false);  // connect-only: workers answer over our connections
  TROUPE_ASSIGN_OR_RETURN(d->sys_, actors::ActorSystem::create(std::move(o)));
  const auto deadline = Clock::now() + connect_timeout;
  for (int r = 0; r < world; ++r) {
    const std::string key = fmt::format("{}actors/{}", prefix, worker_node(r));
    while (true) {
      Result<std::string> ep = store.get(key, std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
      if (ep.ok()) {
        TROUPE_RETURN_IF_ERROR(d->sys_->connect(worker_node(r), ep.value(), job_server_key()));
        break;
      }
      if (ep.status().code() != StatusCode::kDeadlineExceeded) return ep.status();
      if (supervise) TROUPE_RETURN_IF_ERROR(supervise());
      if (Clock::now() >= deadline) {
        return deadline_exceeded("worker rank {} did not start its stage actor within {} ms", r, connect_timeout.count());
      }
    }
    std::weak_ptr<Shared> weak = d->shared_;
    TROUPE_RETURN_IF_ERROR(d->sys_->monitor(actors::ActorRef(worker_node(r), "stage"), [weak, r](const actors::Down& down) {
      auto sh = weak.lock();
      if (!sh) return;
      std::lock_guard<std::mutex> lock(sh->mu);
      if (sh->failure.empty()) {
        sh->failure = fmt::format("worker rank {}: stage actor down ({}): {}", r,
                                  control::down_reason_name(down.reason), down.text);
      }
    }));
  }
  return d;
}

ActorStepDriver::~ActorStepDriver() {
  if (sys_) sys_->shutdown();
}

Result<nlohmann::json> ActorStepDriver::call(const Command& cmd, std::chrono::milliseconds timeout,
                                             const Supervisor& supervise) {
  const StageCommandMsg msg{command_to_json(cmd).dump()};
  std::vector<std::future<Result<StageReplyMsg>>> replies;
  for (int r = 0; r < world_; ++r) {
    replies.push_back(sys_->ask<StageReplyMsg>(actors::ActorRef(worker_node(r), "stage"), msg, timeout));
  }
  const bool stopping = cmd.kind == Command::Kind::kStop;
  std::optional<nlohmann::json> rank0;
  for (int r = 0; r < world_; ++r) {
    auto& f = replies[static_cast<size_t>(r)];
    while (f.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
      if (!stopping) {
        std::lock_guard<std::mutex> lock(shared_->mu);
        if (!shared_->failure.empty()) return aborted("{}", shared_->failure);
      }
      if (supervise && !stopping) TROUPE_RETURN_IF_ERROR(supervise());
    }
    Result<StageReplyMsg> rep = f.get();
    if (!rep.ok()) {
      return rep.status().with_context(fmt::format("worker rank {} ({} {})", r, command_kind_name(cmd.kind), cmd.step));
    }
    if (r == 0) {
      nlohmann::json j = nlohmann::json::parse(rep.value().json, nullptr, false);
      if (j.is_discarded() || !j.is_object()) return data_loss("control: the reply of rank 0 is not a JSON object");
      rank0 = std::move(j);
    }
  }
  return *rank0;
}

}  // namespace troupe::training
