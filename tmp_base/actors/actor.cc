// actors/actor.cc — Actor's non-template members and ResponsePromise: thin bridges to
// the ActorSystem.
#include "actors/actor.h"

#include "actors/actor_system.h"
#include "core/logging.h"

namespace troupe::actors {

ResponsePromise& ResponsePromise::operator=(ResponsePromise&& o) noexcept {
  if (this != &o) {
    if (pending()) fail(aborted("response promise replaced before it was fulfilled"));
    system_ = std::exchange(o.system_, nullptr);
    self_ = std::move(o.self_);
    to_ = std::move(o.to_);
    correlation_id_ = o.correlation_id_;
  }
  return *this;
}

ResponsePromise::~ResponsePromise() {
  if (pending()) fail(aborted("actor {} dropped the reply to this ask", self_.to_string()));
}

void ResponsePromise::fail(const Status& st) {
  send(control::ErrorReply{static_cast<uint16_t>(st.code()), st.message()});
}

void ResponsePromise::send(control::Payload p) {
  if (system_ == nullptr) return;
  ActorSystem* sys = std::exchange(system_, nullptr);
  sys->send_reply(self_, to_, correlation_id_, std::move(p));
}

const Clock& Actor::clock() const {
  return system_->clock();
}

void Actor::monitor(const ActorRef& target) {
  system_->supervise(self_.address(), target, control::MonitorRequest{self_.address(), target.address()});
}
void Actor::demonitor(const ActorRef& target) {
  system_->supervise(self_.address(), target, control::DemonitorRequest{self_.address(), target.address()});
}
void Actor::link(const ActorRef& other) {
  system_->supervise(self_.address(), other, control::LinkRequest{self_.address(), other.address()});
}
void Actor::unlink(const ActorRef& other) {
  system_->supervise(self_.address(), other, control::UnlinkRequest{self_.address(), other.address()});
}

void Actor::stop(DownReason reason, std::string text) {
  system_->request_stop(self_.address(), reason, std::move(text));
}

ResponsePromise Actor::make_response_promise() {
  ResponsePromise p;
  if (current_ == nullptr || !current_->is_ask() || promise_taken_) return p;
  promise_taken_ = true;
  p.system_ = system_;
  p.self_ = self_.address();
  p.to_ = current_->sender().address();
  p.correlation_id_ = current_->correlation_id();
  return p;
}

void Actor::run_after(Duration delay, std::function<void()> fn) {
  system_->run_after(self_.address(), delay, std::move(fn));
}

void Actor::send_user(const ActorRef& to, uint64_t type_id, std::string bytes) {
  Status st = system_->send_user(self_.address(), to, type_id, std::move(bytes));
  if (!st.ok()) {
    make_logger("actors")->warn("actor {}: tell to {} failed: {}", self_.to_string(), to.to_string(), st);
  }
}

void Actor::ask_raw(const ActorRef& to, uint64_t type_id, std::string bytes, Duration timeout,
                    std::function<void(Result<control::Payload>)> then) {
  system_->ask_raw(self_.address(), to, type_id, std::move(bytes), timeout, std::move(then));
}

void Actor::reply_current(const MessageContext& ctx, control::Payload p) {
  if (!ctx.is_ask() || promise_taken_) return;
  system_->send_reply(self_.address(), ctx.sender().address(), ctx.correlation_id(), std::move(p));
}

void Actor::reply_error(const MessageContext& ctx, const Status& st) {
  if (ctx.is_ask() && !promise_taken_) {
    system_->send_reply(self_.address(), ctx.sender().address(), ctx.correlation_id(),
                        control::ErrorReply{static_cast<uint16_t>(st.code()), st.message()});
    return;
  }
  make_logger("actors")->warn("actor {}: message from {} failed: {}", self_.to_string(),
                              ctx.sender().to_string(), st);
}

}  // namespace troupe::actors
