// actors/actor.h — defines Actor, the base class of every actor; MessageContext (who
// sent the message being handled, and whether it is an ask); ResponsePromise (a reply
// to an ask given later than the handler's return).
//
// An actor declares the messages it handles with handle<M>(fn), usually in its
// constructor. The system runs an actor's handlers one message at a time, never
// concurrently, so an actor's members need no locks. A handler may return:
//   void             -> an ask gets Ack
//   Status           -> an ask gets Ack, or the error
//   R (a Reply)      -> an ask gets R
//   Result<R>        -> an ask gets R, or the error
// (for a tell the value is dropped; an error is logged). A handler that throws crashes
// the actor: it stops with DownReason::kCrash and every monitor gets a Down.
//
// Errors travel as values (ErrorReply -> Status) and never as exceptions across actors.
// Handlers must not block for long: they share the system's threads (see
// actors/actor_system.h, "Threads"); use the callback form of ask inside actors.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "actors/actor_ref.h"
#include "actors/message.h"
#include "comm/control/clock.h"
#include "core/status.h"

namespace troupe::actors {

class ActorSystem;
using Duration = std::chrono::nanoseconds;

class MessageContext {
 public:
  // The sending actor; its name is empty when the message came from outside any actor.
  const ActorRef& sender() const { return sender_; }
  // Non-zero when the message is an ask awaiting a reply.
  uint64_t correlation_id() const { return correlation_id_; }
  bool is_ask() const { return correlation_id_ != 0; }
  // 0, or the Unix-epoch nanoseconds after which the asker no longer waits.
  int64_t deadline_unix_nanos() const { return deadline_unix_nanos_; }

 private:
  friend class ActorSystem;
  ActorRef sender_;
  uint64_t correlation_id_ = 0;
  int64_t deadline_unix_nanos_ = 0;
};

// A deferred reply to one ask. Move-only; deliver() or fail() at most once, from the
// owning actor's handlers (or any thread: sending is thread-safe). Dropping an
// unfulfilled promise replies with an Aborted error so the asker is not left waiting.
class ResponsePromise {
 public:
  ResponsePromise() = default;
  ResponsePromise(ResponsePromise&& o) noexcept { *this = std::move(o); }
  ResponsePromise& operator=(ResponsePromise&& o) noexcept;
  ~ResponsePromise();

  template <Reply R>
  void deliver(const R& r) {
    send(to_payload(r));
  }
  void fail(const Status& st);
  bool pending() const { return system_ != nullptr; }

 private:
  friend class Actor;
  void send(control::Payload p);
  ActorSystem* system_ = nullptr;
  control::ActorAddress self_, to_;
  uint64_t correlation_id_ = 0;
};

class Actor {
 public:
  Actor() = default;
  virtual ~Actor() = default;
  Actor(const Actor&) = delete;
  Actor& operator=(const Actor&) = delete;

  // Valid once spawned (from on_start on).
  const ActorRef& self() const { return self_; }
  ActorSystem& system() const { return *system_; }
  const Clock& clock() const;

 protected:
  // Lifecycle. on_start runs on the actor's thread before its first message; an error
  // stops the actor with kCrash. on_stop runs once, last, with the reason it stops.
  virtual Status on_start() { return ok_status(); }
  virtual void on_stop(const Down& why) { (void)why; }
  // Every Down this actor receives (from monitor() or link()).
  virtual void on_down(const Down& down) { (void)down; }

  // Declares that this actor handles M with `fn`; see the banner for the signatures.
  template <Message M, class F>
  void handle(F fn);

  // Fire and forget, sent as this actor. Delivery failures are logged, not returned.
  template <Message M>
  void tell(const ActorRef& to, const M& msg) {
    send_user(to, MessageTraits<M>::kTypeId, MessageTraits<M>::encode(msg));
  }
  template <Message M, class... Ms>
  void tell(const TypedActorRef<Ms...>& to, const M& msg) {
    static_assert(TypedActorRef<Ms...>::template accepts<M>, "the actor does not accept M");
    tell(to.ref(), msg);
  }

  // Request/reply: `then` runs in this actor (like a message) with the reply, or with
  // DeadlineExceeded after `timeout`, or Unavailable/NotFound when it cannot be
  // delivered or the target's node goes down.
  template <Reply R, Message M>
  void ask(const ActorRef& to, const M& msg, Duration timeout, std::function<void(Result<R>)> then) {
    ask_raw(to, MessageTraits<M>::kTypeId, MessageTraits<M>::encode(msg), timeout,
            [then = std::move(then)](Result<control::Payload> p) {
              if (!p.ok()) return then(p.status());
              then(from_payload<R>(*p));
            });
  }

  // Supervision. monitor: a Down reaches on_down when `target` stops. link: both
  // directions, and an abnormal Down (anything but kExit) also stops this actor.
  void monitor(const ActorRef& target);
  void demonitor(const ActorRef& target);
  void link(const ActorRef& other);
  void unlink(const ActorRef& other);

  // Stops this actor after the current message (on_stop, then Downs to its monitors).
  void stop(DownReason reason = DownReason::kExit, std::string text = "");

  // Takes over the reply to the ask being handled; the handler's return value is then
  // not sent. Only valid inside a handler of an ask (otherwise the promise is empty).
  ResponsePromise make_response_promise();

  // Runs `fn` in this actor after `delay` (by the system's clock) unless it stopped.
  void run_after(Duration delay, std::function<void()> fn);

 private:
  friend class ActorSystem;
  using RawHandler = std::function<void(const std::string& bytes, const MessageContext& ctx)>;

  template <class F, class M>
  static decltype(auto) call(F& fn, const M& m, const MessageContext& ctx) {
    if constexpr (std::is_invocable_v<F&, const M&, const MessageContext&>) {
      return fn(m, ctx);
    } else {
      return fn(m);
    }
  }
  template <class T>
  struct IsResult : std::false_type {};
  template <class T>
  struct IsResult<Result<T>> : std::true_type {};

  void send_user(const ActorRef& to, uint64_t type_id, std::string bytes);
  void ask_raw(const ActorRef& to, uint64_t type_id, std::string bytes, Duration timeout,
               std::function<void(Result<control::Payload>)> then);
  // Replies to the current ask (if it is one and no promise was taken); for a tell an
  // error is logged instead.
  void reply_current(const MessageContext& ctx, control::Payload p);
  void reply_error(const MessageContext& ctx, const Status& st);

  std::unordered_map<uint64_t, RawHandler> handlers_;
  ActorSystem* system_ = nullptr;
  ActorRef self_;
  const MessageContext* current_ = nullptr;  // the message being handled
  bool promise_taken_ = false;
};

template <Message M, class F>
void Actor::handle(F fn) {
  handlers_[MessageTraits<M>::kTypeId] = [this, fn = std::move(fn)](const std::string& bytes,
                                                                    const MessageContext& ctx) mutable {
    Result<M> m = MessageTraits<M>::decode(bytes);
    if (!m.ok()) {
      reply_error(ctx, m.status().with_context("decoding message"));
      return;
    }
    using Ret = decltype(call(fn, *m, ctx));
    if constexpr (std::is_void_v<Ret>) {
      call(fn, *m, ctx);
      reply_current(ctx, Ack{});
    } else if constexpr (std::is_same_v<std::decay_t<Ret>, Status>) {
      Status st = call(fn, *m, ctx);
      if (st.ok()) {
        reply_current(ctx, Ack{});
      } else {
        reply_error(ctx, st);
      }
    } else if constexpr (IsResult<std::decay_t<Ret>>::value) {
      auto r = call(fn, *m, ctx);
      if (r.ok()) {
        reply_current(ctx, to_payload(*r));
      } else {
        reply_error(ctx, r.status());
      }
    } else {
      static_assert(Reply<std::decay_t<Ret>>, "a handler returns void, Status, a Reply or Result<Reply>");
      reply_current(ctx, to_payload(call(fn, *m, ctx)));
    }
  };
}

}  // namespace troupe::actors
