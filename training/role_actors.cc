// training/role_actors.cc — the training actors (role_actors.h): RoleActor, the
// worker's WorkerActors and the driver's ActorDirectory.
#include "training/role_actors.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "actors/actor.h"
#include "comm/control/host_addr.h"

namespace troupe::training {

namespace {

using Clock = std::chrono::steady_clock;

// One training actor: answers status queries from its worker's view; a stage actor also
// takes the Trainer's commands (into `commands`, which the worker's step thread serves),
// the trainer actor the workers' replies and failures. Unknown or malformed messages are
// dropped by the actor system with a logged error (an ask gets an error reply).
// What an actor accepts besides status queries (null: not this one's).
struct RoleInputs {
  // A stage actor: the Trainer's commands, plans and snapshot commits.
  std::shared_ptr<Inbox<StepCommand>> commands;
  std::shared_ptr<std::function<void(const ElasticPlan&)>> plans;
  std::shared_ptr<std::function<void(const SnapshotCommitted&)>> commits;
  // The trainer actor: what the workers send.
  std::shared_ptr<Inbox<StepReply>> replies;
  std::shared_ptr<Inbox<WorkerFailure>> failures;
  std::shared_ptr<Inbox<SnapshotLanded>> landed;
};

class RoleActor final : public actors::Actor {
 public:
  RoleActor(std::string role, std::shared_ptr<const WorkerView> view, const RoleInputs& in = {})
      : role_(std::move(role)), view_(std::move(view)) {
    handle<ActorStatusQuery>([this](const ActorStatusQuery&) { return status(); });
    if (auto commands = in.commands)
      handle<StepCommand>([commands](const StepCommand& c) { commands->push(c); });
    if (auto plans = in.plans) {
      handle<ElasticPlan>([plans](const ElasticPlan& p) {
        if (*plans) (*plans)(p);
      });
    }
    if (auto commits = in.commits) {
      handle<SnapshotCommitted>([commits](const SnapshotCommitted& c) {
        if (*commits) (*commits)(c);
      });
    }
    if (auto replies = in.replies) handle<StepReply>([replies](const StepReply& r) { replies->push(r); });
    if (auto failures = in.failures)
      handle<WorkerFailure>([failures](const WorkerFailure& f) { failures->push(f); });
    if (auto landed = in.landed)
      handle<SnapshotLanded>([landed](const SnapshotLanded& l) { landed->push(l); });
  }

 private:
  ActorStatus status() const {
    std::lock_guard lock(view_->mu);
    ActorStatus s;
    s.id = self().name();
    s.role = role_;
    s.rank = view_->rank;
    s.slot = view_->slot;
    s.epoch = view_->epoch;
    s.state = view_->state;
    s.steps_done = view_->steps_done;
    s.last_step_ms = view_->last_step_ms;
    auto it = view_->params.find(role_);
    s.params = it == view_->params.end() ? 0 : it->second;
    s.device = view_->device;
    s.host = view_->host;
    s.pid = static_cast<int32_t>(getpid());
    return s;
  }
  std::string role_;
  std::shared_ptr<const WorkerView> view_;
};

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// The job's actor systems bind the host address their launcher hands them
// (TROUPE_HOST_ADDR) and, with the job's CURVE key pair from the scheduler, accept only
// the job's own processes (docs/cluster.md, "Hosts"). Off loopback without keys the
// transport refuses to bind unless TROUPE_INSECURE=1.
Result<std::unique_ptr<actors::ActorSystem>> make_system(const std::string& node,
                                                         const std::string& bind_host) {
  actors::ActorSystemOptions o;
  o.node_id = node;
  o.threads = 1;
  if (bind_host.empty()) return actors::ActorSystem::create(std::move(o));  // no network
  o.network = control::job_transport("", fmt::format("tcp://{}:*", bind_host));
  return actors::ActorSystem::create(std::move(o));
}

using control::job_server_key;

}  // namespace

std::string actor_id(const std::string& role, int rank) {
  return fmt::format("{}.{}", role, rank);
}

std::vector<std::string> hosted_roles(const std::map<std::string, int64_t>& params) {
  std::vector<std::string> out{"stage"};
  for (const char* role : kWorkerRoles) {
    auto it = params.find(role);
    if (std::string(role) != "stage" && it != params.end() && it->second > 0) out.emplace_back(role);
  }
  return out;
}

// ---- WorkerActors --------------------------------------------------------------------

Result<std::unique_ptr<WorkerActors>> WorkerActors::start(int slot, const std::string& bind_host,
                                                          comm::RendezvousStore& store,
                                                          const std::string& endpoint_key,
                                                          std::string device) {
  std::unique_ptr<WorkerActors> w(new WorkerActors());
  w->node_ = fmt::format("w{}", slot);
  TROUPE_ASSIGN_OR_RETURN(w->own_sys_, make_system(w->node_, bind_host));
  w->sys_ = w->own_sys_.get();
  {
    std::lock_guard lock(w->view_->mu);
    w->view_->slot = slot;
    w->view_->device = std::move(device);
    w->view_->host = host_name();
  }
  const nlohmann::json ep{{"node", w->node_}, {"endpoint", w->sys_->endpoint()}, {"host", host_name()}};
  TROUPE_RETURN_IF_ERROR(store.set(endpoint_key, ep.dump()));
  return w;
}

Result<std::unique_ptr<WorkerActors>> WorkerActors::start_in(actors::ActorSystem& driver_system, int slot,
                                                             comm::RendezvousStore& store,
                                                             const std::string& endpoint_key,
                                                             std::string device) {
  std::unique_ptr<WorkerActors> w(new WorkerActors());
  w->node_ = driver_system.node_id();
  w->sys_ = &driver_system;
  {
    std::lock_guard lock(w->view_->mu);
    w->view_->slot = slot;
    w->view_->device = std::move(device);
    w->view_->host = host_name();
  }
  const nlohmann::json ep{{"node", w->node_}, {"endpoint", ""}, {"host", host_name()}};
  TROUPE_RETURN_IF_ERROR(store.set(endpoint_key, ep.dump()));
  return w;
}

WorkerActors::~WorkerActors() {
  if (own_sys_) {
    own_sys_->shutdown();
    return;
  }
  // In the driver's system: only this worker's actors go (the system is the driver's).
  for (const std::string& role : placed_roles_) {
    if (placed_rank_ >= 0) {
      (void)sys_->stop(actors::ActorRef(node_, actor_id(role, placed_rank_)), control::DownReason::kExit,
                       "the worker ended");
    }
  }
}

Status WorkerActors::place(int rank, uint64_t epoch, std::map<std::string, int64_t> params) {
  {
    std::lock_guard lock(view_->mu);
    view_->rank = rank;
    view_->epoch = epoch;
    view_->params = std::move(params);
  }
  std::vector<std::string> roles;
  {
    std::lock_guard lock(view_->mu);
    roles = hosted_roles(view_->params);
  }
  if (rank == placed_rank_ && roles == placed_roles_) return ok_status();
  for (const std::string& role : placed_roles_) {
    if (placed_rank_ >= 0) {
      (void)sys_->stop(actors::ActorRef(node_, actor_id(role, placed_rank_)), control::DownReason::kExit,
                       "moved to another rank");
    }
  }
  placed_rank_ = -1;
  placed_roles_.clear();
  for (const std::string& role : roles) {
    const bool stage = role == "stage";
    RoleInputs in;
    if (stage) {
      in.commands = commands_;
      in.plans = plan_handler_;
      in.commits = commit_handler_;
    }
    auto actor = std::make_unique<RoleActor>(role, view_, in);
    TROUPE_RETURN_IF_ERROR(sys_->spawn_actor(actor_id(role, rank), std::move(actor)).status());
  }
  placed_rank_ = rank;
  placed_roles_ = roles;
  return ok_status();
}

Status WorkerActors::connect_driver(comm::RendezvousStore& store, const std::string& key,
                                    std::chrono::milliseconds timeout) {
  if (!own_sys_) return ok_status();  // the driver's own system
  TROUPE_ASSIGN_OR_RETURN(std::string text, store.get(key, comm::deadline_in(timeout)));
  const nlohmann::json ep = nlohmann::json::parse(text, nullptr, false);
  if (!ep.is_object() || !ep.contains("endpoint") || !ep["endpoint"].is_string()) {
    return data_loss("the driver's actor endpoint record is malformed: {}", text.substr(0, 200));
  }
  return sys_->connect("driver", ep["endpoint"].get<std::string>(), job_server_key());
}

Status WorkerActors::send(const StepReply& r) {
  return sys_->tell(actors::ActorRef("driver", "trainer"), r);
}

Status WorkerActors::report(const WorkerFailure& f) {
  return sys_->tell(actors::ActorRef("driver", "trainer"), f);
}

Status WorkerActors::send(const SnapshotLanded& l) {
  return sys_->tell(actors::ActorRef("driver", "trainer"), l);
}

void WorkerActors::set_state(const std::string& state) {
  std::lock_guard lock(view_->mu);
  view_->state = state;
}

void WorkerActors::step_done(int64_t steps_done, double step_ms) {
  std::lock_guard lock(view_->mu);
  view_->steps_done = steps_done;
  view_->last_step_ms = step_ms;
  view_->state = "ready";
}

// ---- ActorDirectory ------------------------------------------------------------------

Result<std::unique_ptr<ActorDirectory>> ActorDirectory::start(const std::string& bind_host,
                                                              comm::RendezvousStore& store,
                                                              const std::string& endpoint_key) {
  std::unique_ptr<ActorDirectory> d(new ActorDirectory());
  TROUPE_ASSIGN_OR_RETURN(d->sys_, make_system("driver", bind_host));
  {
    std::lock_guard lock(d->trainer_view_->mu);
    d->trainer_view_->state = "starting";
    d->trainer_view_->params["trainer"] = 0;
    d->trainer_view_->device = "cpu";
    d->trainer_view_->host = host_name();
  }
  TROUPE_RETURN_IF_ERROR(
      d->sys_
          ->spawn_actor("trainer", std::make_unique<RoleActor>("trainer", d->trainer_view_,
                                                               RoleInputs{.replies = d->replies_,
                                                                          .failures = d->failures_,
                                                                          .landed = d->landed_}))
          .status());
  const nlohmann::json ep{{"node", "driver"}, {"endpoint", d->sys_->endpoint()}, {"host", host_name()}};
  TROUPE_RETURN_IF_ERROR(store.set(endpoint_key, ep.dump()));
  return d;
}

Result<std::unique_ptr<ActorDirectory>> ActorDirectory::start_local(comm::RendezvousStore& store,
                                                                    const std::string& endpoint_key) {
  return start("", store, endpoint_key);
}

ActorDirectory::~ActorDirectory() {
  if (sys_) sys_->shutdown();
}

Status ActorDirectory::attach(const std::vector<int>& slots,
                              const std::vector<std::vector<std::string>>& roles,
                              comm::RendezvousStore& store,
                              const std::function<std::string(int)>& endpoint_key,
                              std::chrono::milliseconds timeout) {
  uint64_t gen = 0;
  {
    std::lock_guard lock(mu_);
    gen = ++generation_;
    entries_.clear();
    downs_.clear();
  }
  std::vector<ActorEntry> entries;
  std::map<int, std::string> nodes;
  for (size_t r = 0; r < slots.size(); ++r) {
    const int slot = slots[r];
    TROUPE_ASSIGN_OR_RETURN(std::string text, store.get(endpoint_key(slot), comm::deadline_in(timeout)));
    const nlohmann::json ep = nlohmann::json::parse(text, nullptr, false);
    if (!ep.is_object() || !ep.contains("node") || !ep.contains("endpoint")) {
      return data_loss("worker slot {}: its actor endpoint record is malformed: {}", slot,
                       text.substr(0, 200));
    }
    const std::string node = ep["node"].get<std::string>();
    nodes[slot] = node;
    if (!sys_->is_node_up(node)) {
      TROUPE_RETURN_IF_ERROR(sys_->connect(node, ep["endpoint"].get<std::string>(), job_server_key()));
    }
    if (r >= roles.size()) return invalid_argument("attach: no roles given for rank {}", r);
    for (const std::string& role : roles[r]) {
      ActorEntry e;
      e.id = actor_id(role, static_cast<int>(r));
      e.role = role;
      e.rank = static_cast<int>(r);
      e.slot = slot;
      e.node = node;
      e.last.state = "placed";
      entries.push_back(e);
    }
  }
  {
    std::lock_guard lock(mu_);
    entries_ = entries;
    node_of_slot_ = nodes;
  }
  // Monitored from now on: a Down of this generation is a failure of its slot.
  for (const ActorEntry& e : entries) {
    const int slot = e.slot;
    TROUPE_RETURN_IF_ERROR(
        sys_->monitor(actors::ActorRef(e.node, e.id), [this, gen, slot](const control::Down& d) {
          std::lock_guard lock(mu_);
          if (gen == generation_) downs_.emplace_back(slot, d);
        }));
  }
  return ok_status();
}

std::vector<std::pair<int, control::Down>> ActorDirectory::take_downs() {
  std::lock_guard lock(mu_);
  return std::exchange(downs_, {});
}

std::vector<ActorEntry> ActorDirectory::query(std::chrono::milliseconds timeout) {
  std::vector<ActorEntry> entries;
  {
    std::lock_guard lock(mu_);
    entries = entries_;
  }
  std::vector<std::future<Result<ActorStatus>>> asks;
  for (const ActorEntry& e : entries) {
    asks.push_back(
        sys_->ask<ActorStatus>(actors::ActorRef(e.node, e.id), ActorStatusQuery{"trainer"}, timeout));
  }
  const auto deadline = Clock::now() + timeout + std::chrono::milliseconds(100);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (asks[i].wait_until(deadline) != std::future_status::ready) {
      entries[i].last.state = "unreachable";
      continue;
    }
    Result<ActorStatus> s = asks[i].get();
    if (s.ok()) {
      entries[i].last = *s;
    } else {
      entries[i].last.state = "unreachable";
    }
  }
  {
    std::lock_guard lock(mu_);
    if (entries.size() == entries_.size()) entries_ = entries;
  }
  // The trainer itself, first.
  ActorEntry t;
  t.id = "trainer";
  t.role = "trainer";
  t.node = "driver";
  {
    std::lock_guard lock(trainer_view_->mu);
    t.last.id = "trainer";
    t.last.role = "trainer";
    t.last.state = trainer_view_->state;
    t.last.steps_done = trainer_view_->steps_done;
    t.last.last_step_ms = trainer_view_->last_step_ms;
    t.last.device = trainer_view_->device;
    t.last.host = trainer_view_->host;
    t.last.pid = static_cast<int32_t>(getpid());
  }
  entries.insert(entries.begin(), t);
  return entries;
}

Status ActorDirectory::send_command(const std::vector<int>& slots, const StepCommand& c) {
  std::map<int, std::string> nodes;
  {
    std::lock_guard lock(mu_);
    nodes = node_of_slot_;
  }
  for (size_t r = 0; r < slots.size(); ++r) {
    auto it = nodes.find(slots[r]);
    const std::string node = it != nodes.end() ? it->second : fmt::format("w{}", slots[r]);
    TROUPE_RETURN_IF_ERROR(sys_->tell(actors::ActorRef(node, actor_id("stage", static_cast<int>(r))), c));
  }
  return ok_status();
}

Status ActorDirectory::send_committed(const std::vector<int>& slots, const SnapshotCommitted& c) {
  // The same nodes as the commands' (a worker in the driver's process is local).
  std::map<int, std::string> nodes;
  {
    std::lock_guard lock(mu_);
    nodes = node_of_slot_;
  }
  for (size_t r = 0; r < slots.size(); ++r) {
    auto it = nodes.find(slots[r]);
    const std::string node = it != nodes.end() ? it->second : fmt::format("w{}", slots[r]);
    TROUPE_RETURN_IF_ERROR(sys_->tell(actors::ActorRef(node, actor_id("stage", static_cast<int>(r))), c));
  }
  return ok_status();
}

int ActorDirectory::send_plan(const ElasticPlan& plan) {
  std::vector<ActorEntry> entries;
  {
    std::lock_guard lock(mu_);
    entries = entries_;
  }
  int sent = 0;
  for (const ActorEntry& e : entries) {
    // The survivors: workers of the old epoch that the new one keeps (a lost worker's node
    // may still look up for a moment after its process died).
    const bool kept = std::find(plan.slots.begin(), plan.slots.end(), e.slot) != plan.slots.end();
    if (e.role != "stage" || !kept || !sys_->is_node_up(e.node)) continue;
    if (sys_->tell(actors::ActorRef(e.node, e.id), plan).ok()) ++sent;
  }
  return sent;
}

void ActorDirectory::set_trainer_state(const std::string& state, int64_t steps_done, double last_step_ms) {
  std::lock_guard lock(trainer_view_->mu);
  trainer_view_->state = state;
  trainer_view_->steps_done = steps_done;
  trainer_view_->last_step_ms = last_step_ms;
}

}  // namespace troupe::training
