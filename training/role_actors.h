// training/role_actors.h — defines the actors of a training job and where they live:
//   WorkerActors (worker process): the worker's ActorSystem (node "w<slot>", ZeroMQ) and
//     the actors placed on its slot for its rank r: "stage.r" (the Stage: its pipeline
//     stage's blocks, the schedule, the optimizer shard), "attention.r" (its
//     sequence-parallel shard of the stage's attention) and "experts.r" (its E/n experts).
//     Each answers ActorStatusQuery with its ActorStatus (training/messages.h).
//   ActorDirectory (driver process): the driver's ActorSystem with the "trainer" actor; it
//     connects to every worker's system (endpoints through the job's store), monitors
//     their actors — a Down is a failure the Trainer handles like an exit — and asks them
//     for their status (`troupe status --actors`).
//
// Why the step itself is not an actor message: inside a step the workers run SPMD
// (collectives); the step commands and the membership plans travel through the job's
// store (training/worker/elastic.h), which a worker blocked in a collective still sees
// and which rides out a scheduler restart. The actors are the units of placement,
// ownership and supervision, and what an operator observes (docs/architecture.md).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/actor_system.h"
#include "comm/rendezvous_store.h"
#include "training/messages.h"

namespace troupe::actors {
template <>
struct MessageTraits<training::ActorStatusQuery> {
  static constexpr uint64_t kTypeId = training::ActorStatusQuery::kTypeId;
  static std::string encode(const training::ActorStatusQuery& m) {
    return training::encode_actor_status_query(m);
  }
  static Result<training::ActorStatusQuery> decode(std::string_view b) {
    return training::decode_actor_status_query(b);
  }
};
template <>
struct MessageTraits<training::ActorStatus> {
  static constexpr uint64_t kTypeId = training::ActorStatus::kTypeId;
  static std::string encode(const training::ActorStatus& m) { return training::encode_actor_status(m); }
  static Result<training::ActorStatus> decode(std::string_view b) { return training::decode_actor_status(b); }
};
#define TROUPE_TRAINING_MESSAGE_TRAITS(T, enc, dec)                                    \
  template <>                                                                          \
  struct MessageTraits<training::T> {                                                  \
    static constexpr uint64_t kTypeId = training::T::kTypeId;                          \
    static std::string encode(const training::T& m) { return training::enc(m); }       \
    static Result<training::T> decode(std::string_view b) { return training::dec(b); } \
  };
TROUPE_TRAINING_MESSAGE_TRAITS(StepCommand, encode_step_command, decode_step_command)
TROUPE_TRAINING_MESSAGE_TRAITS(StepReply, encode_step_reply, decode_step_reply)
TROUPE_TRAINING_MESSAGE_TRAITS(WorkerFailure, encode_worker_failure, decode_worker_failure)
TROUPE_TRAINING_MESSAGE_TRAITS(ElasticPlan, encode_elastic_plan, decode_elastic_plan)
TROUPE_TRAINING_MESSAGE_TRAITS(SnapshotLanded, encode_snapshot_landed, decode_snapshot_landed)
TROUPE_TRAINING_MESSAGE_TRAITS(SnapshotCommitted, encode_snapshot_committed, decode_snapshot_committed)
#undef TROUPE_TRAINING_MESSAGE_TRAITS
}  // namespace troupe::actors

namespace troupe::training {

// The roles a worker can host, in the order they are listed: every rank has a stage
// actor; an attention or experts actor where its stage program gives that role
// parameters (ProgramParam::role: train_moe's ranks have all three, dense_lm's no experts).
inline constexpr const char* kWorkerRoles[] = {"stage", "attention", "experts"};
std::string actor_id(const std::string& role, int rank);  // "stage.3"
// The roles hosted for `params` (parameters per role, as Stage::params_by_role gives):
// "stage", then every other role owning parameters, in kWorkerRoles order.
std::vector<std::string> hosted_roles(const std::map<std::string, int64_t>& params);

// A thread-safe queue between an actor's handler and a thread that is not an actor.
template <class T>
class Inbox {
 public:
  void push(T v) {
    {
      std::lock_guard lock(mu_);
      q_.push_back(std::move(v));
    }
    cv_.notify_one();
  }
  // The next item, waiting at most `wait`.
  std::optional<T> pop(std::chrono::milliseconds wait) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, wait, [this] { return !q_.empty(); })) return std::nullopt;
    T v = std::move(q_.front());
    q_.pop_front();
    return v;
  }
  // Waits at most `wait` until an item is queued (true) without taking it.
  bool wait_nonempty(std::chrono::milliseconds wait) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, wait, [this] { return !q_.empty(); });
  }
  std::vector<T> take_all() {
    std::lock_guard lock(mu_);
    std::vector<T> out(std::make_move_iterator(q_.begin()), std::make_move_iterator(q_.end()));
    q_.clear();
    return out;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> q_;
};

// What a worker's actors report; written by the worker's step thread, read by the actors.
struct WorkerView {
  mutable std::mutex mu;
  int rank = -1, slot = -1;
  uint64_t epoch = 0;
  std::string state = "joining";
  int64_t steps_done = 0;
  double last_step_ms = 0;
  std::map<std::string, int64_t> params;  // per role
  std::string device, host;
};

class WorkerActors {
 public:
  // Starts the worker's actor system (node "w<slot>", bound to `bind_host` on an
  // OS-assigned port) and publishes {node, endpoint} at `endpoint_key` of `store`.
  static Result<std::unique_ptr<WorkerActors>> start(int slot, const std::string& bind_host,
                                                     comm::RendezvousStore& store,
                                                     const std::string& endpoint_key, std::string device);
  // A worker in the driver's own process (a one-process run): its actors live in the
  // driver's system `driver_system` (no socket: the Trainer's commands and the replies are
  // local deliveries), which must outlive the WorkerActors; publishes {node, endpoint ""}.
  static Result<std::unique_ptr<WorkerActors>> start_in(actors::ActorSystem& driver_system, int slot,
                                                        comm::RendezvousStore& store,
                                                        const std::string& endpoint_key, std::string device);
  ~WorkerActors();

  // (Re)places this worker's actors for `rank` in `epoch` (a new rank stops the old ones
  // and spawns "<role>.<rank>" for each of hosted_roles(params)); `params`: the
  // parameters each role owns on this rank.
  Status place(int rank, uint64_t epoch, std::map<std::string, int64_t> params);
  void set_state(const std::string& state);
  void step_done(int64_t steps_done, double step_ms);
  const std::string& node() const { return node_; }

  // Opens the route to the driver's "trainer" actor (its endpoint at `key` of `store`);
  // nothing to open for a worker in the driver's process.
  Status connect_driver(comm::RendezvousStore& store, const std::string& key,
                        std::chrono::milliseconds timeout);
  // The next command the Trainer sent this worker's stage actor (waiting at most `wait`;
  // 0: only one already queued). Commands are queued in the order they were sent.
  std::optional<StepCommand> next_command(std::chrono::milliseconds wait) { return commands_->pop(wait); }
  // Called on the stage actor's thread with each plan (rebuild) the Trainer sends it. Set
  // before place(); the handler must not block.
  void on_plan(std::function<void(const ElasticPlan&)> handler) { *plan_handler_ = std::move(handler); }
  // Likewise with each snapshot commit (SnapshotCommitted) the Trainer sends.
  void on_commit(std::function<void(const SnapshotCommitted&)> handler) {
    *commit_handler_ = std::move(handler);
  }
  // Ends a next_command() wait at once with a command no epoch serves (seq -1, epoch
  // UINT64_MAX), which the caller drops.
  void wake() { commands_->push(StepCommand{-1, 0, 0, UINT64_MAX}); }
  // To the Trainer: a command's reply, a failure, a snapshot part that landed (any thread).
  Status send(const StepReply& r);
  Status report(const WorkerFailure& f);
  Status send(const SnapshotLanded& l);

 private:
  WorkerActors() = default;
  std::unique_ptr<actors::ActorSystem> own_sys_;  // null in the driver's process
  actors::ActorSystem* sys_ = nullptr;            // own_sys_, or the driver's system
  std::shared_ptr<WorkerView> view_ = std::make_shared<WorkerView>();
  std::shared_ptr<Inbox<StepCommand>> commands_ = std::make_shared<Inbox<StepCommand>>();
  std::shared_ptr<std::function<void(const ElasticPlan&)>> plan_handler_ =
      std::make_shared<std::function<void(const ElasticPlan&)>>();
  std::shared_ptr<std::function<void(const SnapshotCommitted&)>> commit_handler_ =
      std::make_shared<std::function<void(const SnapshotCommitted&)>>();
  std::string node_;
  int placed_rank_ = -1;
  std::vector<std::string> placed_roles_;
};

// One actor of the job as the driver sees it.
struct ActorEntry {
  std::string id, role;
  int rank = -1, slot = -1;
  std::string node;  // the worker's actor-system node ("w<slot>")
  ActorStatus last;  // its last status reply (state "unreachable" when it did not answer)
};

class ActorDirectory {
 public:
  // Starts the driver's system (node "driver") with the "trainer" actor and publishes its
  // {node, endpoint} at `endpoint_key` of `store`.
  static Result<std::unique_ptr<ActorDirectory>> start(const std::string& bind_host,
                                                       comm::RendezvousStore& store,
                                                       const std::string& endpoint_key);
  // The same without a network: for a one-process run, whose worker's actors join this
  // system (WorkerActors::start_in).
  static Result<std::unique_ptr<ActorDirectory>> start_local(comm::RendezvousStore& store,
                                                             const std::string& endpoint_key);
  ~ActorDirectory();
  actors::ActorSystem& system() { return *sys_; }

  // The workers of a new epoch: `slots[r]` is rank r's worker, hosting the actors of
  // `roles[r]` (hosted_roles). Reads each worker's endpoint from `endpoint_key(slot)`
  // (waiting up to `timeout`), connects, and monitors the actors of its rank.
  Status attach(const std::vector<int>& slots, const std::vector<std::vector<std::string>>& roles,
                comm::RendezvousStore& store, const std::function<std::string(int)>& endpoint_key,
                std::chrono::milliseconds timeout);
  // The slots whose actors went down since the last call (Down reason and text); only
  // for actors of the current epoch.
  std::vector<std::pair<int, control::Down>> take_downs();
  // Asks every actor for its status, waiting at most `timeout` in all; the table.
  std::vector<ActorEntry> query(std::chrono::milliseconds timeout);
  // The driver's own actor, for the table.
  void set_trainer_state(const std::string& state, int64_t steps_done, double last_step_ms);

  // Sends `c` to the stage actor of every rank (slots[r] hosts rank r); the workers must
  // have been attached.
  Status send_command(const std::vector<int>& slots, const StepCommand& c);
  // Sends the plan of a new epoch to the stage actor of every attached worker (those of
  // the epoch it replaces) that the plan keeps and whose node is up. Returns how many
  // were sent.
  int send_plan(const ElasticPlan& plan);
  // Sends a snapshot's commit to the stage actor of every rank (slots[r] hosts rank r).
  Status send_committed(const std::vector<int>& slots, const SnapshotCommitted& c);
  // What the workers sent the trainer actor since the last call.
  std::vector<StepReply> take_replies() { return replies_->take_all(); }
  // Waits at most `wait` for a reply to arrive (true: one is queued).
  bool wait_for_reply(std::chrono::milliseconds wait) { return replies_->wait_nonempty(wait); }
  std::vector<WorkerFailure> take_failures() { return failures_->take_all(); }
  std::vector<SnapshotLanded> take_landed() { return landed_->take_all(); }

 private:
  ActorDirectory() = default;
  std::unique_ptr<actors::ActorSystem> sys_;
  std::shared_ptr<Inbox<StepReply>> replies_ = std::make_shared<Inbox<StepReply>>();
  std::shared_ptr<Inbox<WorkerFailure>> failures_ = std::make_shared<Inbox<WorkerFailure>>();
  std::shared_ptr<Inbox<SnapshotLanded>> landed_ = std::make_shared<Inbox<SnapshotLanded>>();
  std::shared_ptr<WorkerView> trainer_view_ = std::make_shared<WorkerView>();
  std::mutex mu_;
  uint64_t generation_ = 0;  // bumped by attach(): Downs of older generations are ignored
  std::vector<ActorEntry> entries_;
  std::map<int, std::string> node_of_slot_;  // the attached workers' nodes
  std::vector<std::pair<int, control::Down>> downs_;
};

}  // namespace troupe::training
