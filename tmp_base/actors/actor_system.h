// actors/actor_system.h — defines ActorSystem, the actors of one process ("node"): it
// spawns actors, delivers messages locally or through the control plane
// (comm/control/transport.h), runs asks with deadlines, and implements supervision
// (monitor/link, Down messages).
//
// Threads (ExecutionMode::kThreaded). A small scheduler: `threads` pool threads run
// actors; an actor with messages is queued once, and one thread processes up to a batch
// of its messages, so each actor handles one message at a time while different actors
// run in parallel. A handler that blocks holds a pool thread: spawn such actors with
// SpawnOptions::dedicated_thread (their own thread). One timer thread fires ask
// deadlines and run_after callbacks by the injected Clock. The transport has its own
// loop thread.
//
// Deterministic mode (ExecutionMode::kManual). No threads for actors and timers:
// run_until_idle() processes every queued message and every timer due at clock.now()
// on the calling thread, in FIFO order. With a ManualClock, a test advances time and
// calls run_until_idle() to see deadlines fire exactly. (Networking still uses the
// transport's thread; messages it receives wait for the next run_until_idle.)
//
// Supervision. When an actor stops, every monitor and linked actor gets a Down with the
// reason: kExit (stop() or normal end), kCrash (a handler threw, on_start failed),
// kKilled (ActorSystem::stop, shutdown, a linked actor failed). When the node of a
// remote actor stops answering heartbeats or its connection closes, the local watchers
// get a Down with kHeartbeatTimeout or kConnectionLost, and pending asks to that node
// fail with Unavailable.
//
// Lifetime: create() -> connect()/spawn()/tell()/ask() -> shutdown() (or destruction).
// All public methods are thread-safe. The clock must outlive the system.
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>

#include "actors/actor.h"
#include "actors/actor_ref.h"
#include "actors/message.h"
#include "comm/control/clock.h"
#include "comm/control/transport.h"
#include "core/status.h"

namespace troupe::actors {

enum class ExecutionMode { kThreaded, kManual };

struct ActorSystemOptions {
  // This process's node id: the `node` in its actors' refs. No '/'.
  std::string node_id = "local";
  ExecutionMode mode = ExecutionMode::kThreaded;
  size_t threads = 2;            // pool threads (kThreaded)
  const Clock* clock = nullptr;  // null: a SystemClock owned by the system
  RandomSource random;           // null: os_random(); seeds correlation ids
  // Present: start a Transport (its node_id and clock are taken from this struct).
  // Absent: a process-local system without sockets.
  std::optional<control::TransportOptions> network;
  // Optional node-level events (e.g. the scheduler's health view), called on the
  // transport's thread after the system has handled them (Downs sent, asks failed); they
  // must not block.
  std::function<void(const std::string& node)> on_node_up;
  std::function<void(const std::string& node, DownReason reason, const std::string& text)> on_node_down;
};

struct SpawnOptions {
  bool dedicated_thread = false;  // run this actor on its own thread (kThreaded only)
};

class ActorSystem {
 public:
  static Result<std::unique_ptr<ActorSystem>> create(ActorSystemOptions opts);
  ~ActorSystem();  // shutdown()
  ActorSystem(const ActorSystem&) = delete;
  ActorSystem& operator=(const ActorSystem&) = delete;

  const std::string& node_id() const;
  const Clock& clock() const;
  // The bound control-plane endpoint ("tcp://127.0.0.1:40123"), empty without network.
  std::string endpoint() const;
  // Opens the route to node `node` at `endpoint` (see Transport::connect). Nodes that
  // connect to us are reachable without this.
  Status connect(const std::string& node, const std::string& endpoint,
                 const std::string& server_public_key = "");
  // True when `node` is this node or a peer currently answering heartbeats.
  bool is_node_up(const std::string& node) const;

  // Constructs A(args...) and starts it under `name` (unique in this node; no '/').
  template <class A, class... Args>
  requires std::derived_from<A, Actor> Result<ActorRef> spawn(std::string name, Args&&... args) {
    return spawn_actor(std::move(name), std::make_unique<A>(std::forward<Args>(args)...));
  }
  Result<ActorRef> spawn_actor(std::string name, std::unique_ptr<Actor> actor, SpawnOptions opts = {});

  // Fire and forget from outside any actor. Errors: encoding failures, no route to the
  // node. A missing local actor is logged (as for remote ones), not returned.
  template <Message M>
  Status tell(const ActorRef& to, const M& msg) {
    return send_user({}, to, MessageTraits<M>::kTypeId, MessageTraits<M>::encode(msg));
  }
  template <Message M, class... Ms>
  Status tell(const TypedActorRef<Ms...>& to, const M& msg) {
    static_assert(TypedActorRef<Ms...>::template accepts<M>, "the actor does not accept M");
    return tell(to.ref(), msg);
  }

  // Request/reply from outside any actor. The future is always fulfilled: with the
  // reply, an ErrorReply's status, DeadlineExceeded after `timeout`, Unavailable when the
  // target's node goes down, NotFound when the actor does not exist.
  template <Reply R, Message M>
  std::future<Result<R>> ask(const ActorRef& to, const M& msg, Duration timeout) {
    auto promise = std::make_shared<std::promise<Result<R>>>();
    auto fut = promise->get_future();
    ask(to, msg, timeout,
        std::function<void(Result<R>)>([promise](Result<R> r) { promise->set_value(std::move(r)); }));
    return fut;
  }
  // Callback form: `then` runs once on a system thread (or in run_until_idle) and must
  // not block.
  template <Reply R, Message M>
  void ask(const ActorRef& to, const M& msg, Duration timeout, std::function<void(Result<R>)> then) {
    ask_raw({}, to, MessageTraits<M>::kTypeId, MessageTraits<M>::encode(msg), timeout,
            [then = std::move(then)](Result<control::Payload> p) {
              if (!p.ok()) return then(p.status());
              then(from_payload<R>(*p));
            });
  }
  template <Reply R, Message M, class... Ms>
  std::future<Result<R>> ask(const TypedActorRef<Ms...>& to, const M& msg, Duration timeout) {
    static_assert(TypedActorRef<Ms...>::template accepts<M>, "the actor does not accept M");
    return ask<R>(to.ref(), msg, timeout);
  }

  // Watches `target` from outside any actor: `on_down` runs once on a system thread
  // when it stops (or its node is lost). A missing target gives an immediate Down.
  Status monitor(const ActorRef& target, std::function<void(const Down&)> on_down);

  // Asks a local actor to stop after its current message.
  Status stop(const ActorRef& local_actor, DownReason reason = DownReason::kKilled,
              std::string text = "stopped by the actor system");
  bool has_actor(const std::string& name) const;
  size_t actor_count() const;

  // kManual: runs queued messages and due timers until none is left; returns how many
  // items ran. kThreaded: waits (up to 5 s) until every mailbox is empty; returns 0.
  size_t run_until_idle();

  // Stops every actor (kKilled), then the timer, the pool and the transport. Idempotent.
  void shutdown();

  class Impl;

 private:
  friend class Actor;
  friend class ResponsePromise;
  explicit ActorSystem(std::unique_ptr<Impl> impl);

  Status send_user(const control::ActorAddress& from, const ActorRef& to, uint64_t type_id,
                   std::string bytes);
  void ask_raw(const control::ActorAddress& from, const ActorRef& to, uint64_t type_id, std::string bytes,
               Duration timeout, std::function<void(Result<control::Payload>)> then);
  void send_reply(const control::ActorAddress& from, const control::ActorAddress& to, uint64_t correlation_id,
                  control::Payload p);
  void supervise(const control::ActorAddress& from, const ActorRef& target, control::Payload request);
  void request_stop(const control::ActorAddress& self, DownReason reason, std::string text);
  void run_after(const control::ActorAddress& self, Duration delay, std::function<void()> fn);

  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::actors
