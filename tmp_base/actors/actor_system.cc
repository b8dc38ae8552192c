// actors/actor_system.cc — ActorSystem: actor cells and mailboxes, the executor (pool,
// dedicated threads, or manual), timers, routing, pending asks and supervision.
#include "actors/actor_system.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/logging.h"

namespace troupe::actors {
namespace {

using control::ActorAddress;
using control::Envelope;
using control::Payload;

constexpr size_t kBatch = 32;  // messages one actor may process before yielding its thread

// One queued unit of work for an actor: a message, or a closure (ask callback, timer).
struct MailItem {
  std::optional<Envelope> env;
  std::function<void()> fn;
};

class Executor;

struct Cell {
  std::unique_ptr<Actor> actor;
  ActorAddress addr;
  Executor* executor = nullptr;

  std::mutex mu;  // guards everything below
  std::deque<MailItem> mailbox;
  bool queued = false;  // in an executor queue or being run
  bool started = false;
  bool finished = false;
  std::optional<control::Down> stop_request;
  std::set<ActorAddress> monitors;  // to notify when this actor stops
  std::set<ActorAddress> links;     // linked actors (notified, and their failure stops us)
};

bool is_external_watcher(const std::string& name) {
  return name.rfind("$watch-", 0) == 0;
}

// Runs cells: `threads` > 0 starts that many threads; 0 is manual (run_one()).
class Executor {
 public:
  Executor(std::function<void(const std::shared_ptr<Cell>&)> run, size_t threads) : run_(std::move(run)) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Executor() { stop(); }

  void schedule(std::shared_ptr<Cell> c) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(c));
    }
    cv_.notify_one();
  }
  // Manual mode: runs one queued cell; false when none.
  bool run_one() {
    std::shared_ptr<Cell> c;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (queue_.empty()) return false;
      c = std::move(queue_.front());
      queue_.pop_front();
    }
    run_(c);
    return true;
  }
  bool idle() {
    std::lock_guard<std::mutex> lk(mu_);
    return queue_.empty() && busy_ == 0;
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
      if (t.joinable()) t.detach();  // only when stop() runs on this executor's own thread
    }
    threads_.clear();
  }

 private:
  void loop() {
    while (true) {
      std::shared_ptr<Cell> c;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        c = std::move(queue_.front());
        queue_.pop_front();
        ++busy_;
      }
      run_(c);
      std::lock_guard<std::mutex> lk(mu_);
      --busy_;
    }
  }

  std::function<void(const std::shared_ptr<Cell>&)> run_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Cell>> queue_;
  std::vector<std::thread> threads_;
  size_t busy_ = 0;
  bool stopping_ = false;
};

}  // namespace

class ActorSystem::Impl {
 public:
  explicit Impl(ActorSystemOptions opts) : opts_(std::move(opts)) {
    clock_ = opts_.clock != nullptr ? opts_.clock : &own_clock_;
    if (!opts_.random) opts_.random = os_random();
    next_correlation_ = opts_.random() >> 1;  // random start: ids differ across restarts
    log_ = make_logger("actors");
  }

  Status start(ActorSystem* owner) {
    owner_ = owner;
    if (opts_.node_id.empty() || opts_.node_id.find('/') != std::string::npos ||
        opts_.node_id.size() > control::kMaxNameBytes) {
      return invalid_argument("node id '{}' must be non-empty, without '/', at most {} bytes", opts_.node_id,
                              control::kMaxNameBytes);
    }
    const bool manual = opts_.mode == ExecutionMode::kManual;
    if (!manual && opts_.threads == 0) return invalid_argument("kThreaded needs at least one thread");
    pool_ = std::make_unique<Executor>([this](const std::shared_ptr<Cell>& c) { run_cell(c); },
                                       manual ? 0 : opts_.threads);
    if (!manual) timer_thread_ = std::thread([this] { timer_loop(); });
    if (opts_.network) {
      control::TransportOptions t = *opts_.network;
      t.node_id = opts_.node_id;
      t.clock = clock_;
      control::TransportCallbacks cb;
      cb.on_envelope = [this](Envelope&& e, const std::string&) { deliver_local(std::move(e)); };
      cb.on_peer_down = [this](const std::string& node, DownReason r, const std::string& text) {
        peer_down(node, r, text);
        if (opts_.on_node_down) opts_.on_node_down(node, r, text);
      };
      cb.on_peer_up = [this](const std::string& node) {
        if (opts_.on_node_up) opts_.on_node_up(node);
      };
      cb.on_undeliverable = [this](Envelope&& e, const Status& why) { undeliverable(std::move(e), why); };
      auto tr = control::Transport::start(std::move(t), std::move(cb));
      if (!tr.ok()) {
        stop_threads();
        return tr.status();
      }
      transport_ = std::move(tr).value();
    }
    return ok_status();
  }

  // ---- public API ----

  const std::string& node_id() const { return opts_.node_id; }
  const Clock& clock() const { return *clock_; }
  std::string endpoint() const { return transport_ ? transport_->endpoint() : std::string(); }

  Status connect(const std::string& node, const std::string& endpoint, const std::string& key) {
    if (!transport_) return failed_precondition("actor system {} has no network", opts_.node_id);
    return transport_->connect(node, endpoint, key);
  }

  bool is_node_up(const std::string& node) const {
    return node == opts_.node_id || (transport_ && transport_->is_peer_up(node));
  }

  Result<ActorRef> spawn(std::string name, std::unique_ptr<Actor> actor, SpawnOptions so) {
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '$' ||
        name.size() > control::kMaxNameBytes) {
      return invalid_argument("actor name '{}' must be non-empty, without '/', not start with '$'", name);
    }
    if (!actor) return invalid_argument("spawn of '{}' with a null actor", name);
    auto cell = std::make_shared<Cell>();
    cell->addr = ActorAddress{opts_.node_id, name};
    actor->system_ = owner_;
    actor->self_ = ActorRef(cell->addr);
    cell->actor = std::move(actor);
    cell->executor = pool_.get();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (shut_down_) return failed_precondition("actor system {} is shut down", opts_.node_id);
      if (actors_.count(name) != 0)
        return already_exists("actor '{}' already exists on {}", name, opts_.node_id);
      if (so.dedicated_thread && opts_.mode == ExecutionMode::kThreaded) {
        dedicated_.push_back(
            std::make_unique<Executor>([this](const std::shared_ptr<Cell>& c) { run_cell(c); }, 1));
        cell->executor = dedicated_.back().get();
      }
      actors_[name] = cell;
      cell->queued = true;  // runs on_start first
    }
    cell->executor->schedule(cell);
    return ActorRef(cell->addr);
  }

  Status send_user(const ActorAddress& from, const ActorRef& to, uint64_t type_id, std::string bytes) {
    if (!to.valid()) return invalid_argument("tell to an invalid actor ref '{}'", to.to_string());
    if (control::is_reserved_type_id(type_id)) {
      return invalid_argument("message type id {:#x} is reserved", type_id);
    }
    Envelope e;
    e.sender = from.node.empty() ? ActorAddress{opts_.node_id, ""} : from;
    e.receiver = to.address();
    e.payload = control::UserPayload{type_id, std::move(bytes)};
    return route(std::move(e));
  }

  void ask_raw(const ActorAddress& from, const ActorRef& to, uint64_t type_id, std::string bytes,
               Duration timeout, std::function<void(Result<Payload>)> then) {
    if (!to.valid()) return then(invalid_argument("ask to an invalid actor ref '{}'", to.to_string()));
    if (control::is_reserved_type_id(type_id)) {
      return then(invalid_argument("message type id {:#x} is reserved", type_id));
    }
    uint64_t corr = next_correlation_.fetch_add(1);
    if (corr == 0) corr = next_correlation_.fetch_add(1);
    const ActorAddress asker = from.node.empty() ? ActorAddress{opts_.node_id, ""} : from;
    const auto timeout_ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (shut_down_) return then(cancelled("actor system {} is shut down", opts_.node_id));
      Pending p;
      p.then = std::move(then);
      p.target_node = to.node();
      p.asker = asker;
      p.timer = add_timer_locked(timeout, [this, corr, timeout_ms, to] {
        complete(corr, deadline_exceeded("ask to {} got no reply within {} ms", to.to_string(), timeout_ms));
      });
      pending_.emplace(corr, std::move(p));
    }
    wake_timer_thread();
    Envelope e;
    e.sender = asker;
    e.receiver = to.address();
    e.correlation_id = corr;
    e.deadline_unix_nanos = clock_->unix_nanos() + timeout.count();
    e.payload = control::UserPayload{type_id, std::move(bytes)};
    Status st = route(std::move(e));
    if (!st.ok()) complete(corr, st);
  }

  void send_reply(const ActorAddress& from, const ActorAddress& to, uint64_t corr, Payload p) {
    Envelope e;
    e.sender = from;
    e.receiver = to;
    e.correlation_id = corr;
    e.is_reply = true;
    e.payload = std::move(p);
    Status st = route(std::move(e));
    if (!st.ok()) log_->warn("reply from {} to {} failed: {}", from.to_string(), to.to_string(), st);
  }

  void supervise(const ActorAddress& from, const ActorRef& target, Payload request) {
    if (!target.valid()) return;
    if (std::holds_alternative<control::LinkRequest>(request) ||
        std::holds_alternative<control::UnlinkRequest>(request)) {
      // Our side of the link: the other actor's failure reaches us, ours reaches it.
      if (auto cell = find(from.name)) {
        std::lock_guard<std::mutex> lk(cell->mu);
        if (std::holds_alternative<control::LinkRequest>(request)) {
          cell->links.insert(target.address());
        } else {
          cell->links.erase(target.address());
        }
      }
    } else if (target.node() != opts_.node_id) {
      std::lock_guard<std::mutex> lk(mu_);
      if (std::holds_alternative<control::MonitorRequest>(request)) {
        remote_monitors_.insert({from, target.address()});
      } else {
        remote_monitors_.erase({from, target.address()});
      }
    }
    Envelope e;
    e.sender = from;
    e.receiver = ActorAddress{target.node(), ""};  // supervision requests go to the node
    e.payload = std::move(request);
    Status st = route(std::move(e));
    if (!st.ok()) log_->warn("supervision request from {} failed: {}", from.to_string(), st);
  }

  Status monitor_external(const ActorRef& target, std::function<void(const control::Down&)> cb) {
    if (!target.valid()) return invalid_argument("monitor of an invalid actor ref '{}'", target.to_string());
    ActorAddress watcher;
    {
      std::lock_guard<std::mutex> lk(mu_);
      watcher = ActorAddress{opts_.node_id, fmt::format("$watch-{}", ++watcher_seq_)};
      external_watchers_[watcher.name] = std::move(cb);
    }
    supervise(watcher, target, control::MonitorRequest{watcher, target.address()});
    return ok_status();
  }

  void request_stop(const ActorAddress& self, DownReason reason, std::string text) {
    auto cell = find(self.name);
    if (!cell) return;
    bool schedule = false;
    {
      std::lock_guard<std::mutex> lk(cell->mu);
      if (cell->finished || cell->stop_request) return;
      cell->stop_request = control::Down{self, reason, std::move(text)};
      if (!cell->queued) {
        cell->queued = true;
        schedule = true;
      }
    }
    if (schedule) cell->executor->schedule(cell);
  }

  Status stop_actor(const ActorRef& ref, DownReason reason, std::string text) {
    if (ref.node() != opts_.node_id) {
      return invalid_argument("stop: {} is not an actor of this node ({})", ref.to_string(), opts_.node_id);
    }
    if (!find(ref.name())) return not_found("stop: no actor '{}' on {}", ref.name(), opts_.node_id);
    request_stop(ref.address(), reason, std::move(text));
    return ok_status();
  }

  void run_after(const ActorAddress& self, Duration delay, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      add_timer_locked(delay, [this, self, fn = std::move(fn)]() mutable {
        if (auto cell = find(self.name)) enqueue(cell, MailItem{std::nullopt, std::move(fn)});
      });
    }
    wake_timer_thread();
  }

  bool has_actor(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    return actors_.count(name) != 0;
  }
  size_t actor_count() const {
    std::lock_guard<std::mutex> lk(mu_);
    return actors_.size();
  }

  size_t run_until_idle() {
    if (opts_.mode == ExecutionMode::kThreaded) {
      const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (std::chrono::steady_clock::now() < limit && !all_idle()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return 0;
    }
    size_t n = 0;
    while (true) {
      size_t round = fire_due_timers();
      while (pool_->run_one()) ++round;
      n += round;
      if (round == 0) return n;
    }
  }

  void shutdown() {
    std::vector<std::shared_ptr<Cell>> cells;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (shut_down_) return;
      shut_down_ = true;
      for (auto& [name, c] : actors_) cells.push_back(c);
    }
    if (!pool_) return;  // start() failed before anything ran
    for (auto& c : cells) request_stop(c->addr, DownReason::kKilled, "actor system shutting down");
    if (opts_.mode == ExecutionMode::kManual) {
      run_until_idle();
    } else {
      const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (actor_count() != 0 && std::chrono::steady_clock::now() < limit) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (actor_count() != 0) log_->error("shutdown: {} actors did not stop within 5 s", actor_count());
    }
    if (transport_) transport_->stop();
    stop_threads();
    std::map<uint64_t, Pending> left;
    {
      std::lock_guard<std::mutex> lk(mu_);
      left.swap(pending_);
    }
    for (auto& [corr, p] : left) p.then(cancelled("actor system {} shut down", opts_.node_id));
  }

 private:
  struct Pending {
    std::function<void(Result<Payload>)> then;
    std::string target_node;
    ActorAddress asker;
    uint64_t timer = 0;
  };

  bool all_idle() {
    if (!pool_->idle()) return false;
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [name, c] : actors_) {
      std::lock_guard<std::mutex> ck(c->mu);
      if (c->queued) return false;
    }
    return true;
  }

  void stop_threads() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      timer_stop_ = true;
    }
    timer_cv_.notify_all();
    if (timer_thread_.joinable()) timer_thread_.join();
    if (pool_) pool_->stop();
    std::vector<std::unique_ptr<Executor>> dedicated;
    {
      std::lock_guard<std::mutex> lk(mu_);
      dedicated.swap(dedicated_);
    }
    for (auto& d : dedicated) d->stop();
  }

  std::shared_ptr<Cell> find(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = actors_.find(name);
    return it == actors_.end() ? nullptr : it->second;
  }

  // ---- timers (mu_ held for the _locked ones) ----

  // Adds a timer; sets timer_wake_ when it became the earliest (the timer thread must
  // re-arm), so the common case (a long ask deadline) does not wake the timer thread.
  uint64_t add_timer_locked(Duration delay, std::function<void()> fn) {
    const uint64_t id = ++timer_seq_;
    const auto due = clock_->now() + delay;
    auto it = timers_.emplace(std::make_pair(due.count(), id), std::move(fn)).first;
    timer_due_[id] = due.count();
    if (it == timers_.begin()) timer_wake_ = true;
    return id;
  }
  void wake_timer_thread() {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      wake = std::exchange(timer_wake_, false);
    }
    if (wake) timer_cv_.notify_all();
  }
  void cancel_timer_locked(uint64_t id) {
    auto it = timer_due_.find(id);
    if (it == timer_due_.end()) return;
    timers_.erase({it->second, id});
    timer_due_.erase(it);
  }
  size_t fire_due_timers() {
    std::vector<std::function<void()>> due;
    {
      std::lock_guard<std::mutex> lk(mu_);
      const int64_t now = clock_->now().count();
      while (!timers_.empty() && timers_.begin()->first.first <= now) {
        timer_due_.erase(timers_.begin()->first.second);
        due.push_back(std::move(timers_.begin()->second));
        timers_.erase(timers_.begin());
      }
    }
    for (auto& fn : due) fn();
    return due.size();
  }
  void timer_loop() {
    while (true) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (timer_stop_) return;
        // Waits for the earliest deadline by the injected clock; the 50 ms cap keeps a
        // non-real clock (ManualClock in threaded mode) responsive.
        auto wait = std::chrono::nanoseconds(std::chrono::milliseconds(50));
        if (!timers_.empty()) {
          wait = std::min(wait, std::chrono::nanoseconds(timers_.begin()->first.first) - clock_->now());
        }
        if (wait > std::chrono::nanoseconds(0)) timer_cv_.wait_for(lk, wait);
        if (timer_stop_) return;
      }
      fire_due_timers();
    }
  }

  // ---- delivery ----

  Status route(Envelope e) {
    if (e.receiver.node == opts_.node_id) {
      deliver_local(std::move(e));
      return ok_status();
    }
    if (!transport_) {
      return unavailable("node {} is unreachable: actor system {} has no network", e.receiver.node,
                         opts_.node_id);
    }
    const std::string node = e.receiver.node;
    return transport_->send(node, std::move(e));
  }

  void deliver_local(Envelope e) {
    if (e.is_reply) {
      if (e.correlation_id != 0) complete(e.correlation_id, std::move(e.payload));
      return;
    }
    if (auto* m = std::get_if<control::MonitorRequest>(&e.payload)) {
      if (!add_watcher(m->target.name, m->watcher, /*link=*/false)) {
        send_down(m->target, m->watcher, DownReason::kExit, "no such actor");
      }
    } else if (auto* d = std::get_if<control::DemonitorRequest>(&e.payload)) {
      if (auto cell = find(d->target.name)) {
        std::lock_guard<std::mutex> lk(cell->mu);
        cell->monitors.erase(d->watcher);
      }
    } else if (auto* l = std::get_if<control::LinkRequest>(&e.payload)) {
      if (!add_watcher(l->to.name, l->from, /*link=*/true)) {
        send_down(l->to, l->from, DownReason::kExit, "no such actor");
      }
    } else if (auto* u = std::get_if<control::UnlinkRequest>(&e.payload)) {
      if (auto cell = find(u->to.name)) {
        std::lock_guard<std::mutex> lk(cell->mu);
        cell->links.erase(u->from);
      }
    } else if (auto* down = std::get_if<control::Down>(&e.payload)) {
      deliver_down(e.receiver, *down);
    } else if (std::holds_alternative<control::UserPayload>(e.payload)) {
      auto cell = find(e.receiver.name);
      if (!cell) {
        no_such_actor(e);
        return;
      }
      enqueue(cell, MailItem{std::move(e), nullptr});
    } else {
      log_->warn("dropped {}: not valid as a request", control::describe(e));
    }
  }

  void no_such_actor(const Envelope& e) {
    const std::string what = fmt::format("no actor '{}' on node {}", e.receiver.name, opts_.node_id);
    if (e.correlation_id != 0) {
      send_reply(ActorAddress{opts_.node_id, ""}, e.sender, e.correlation_id,
                 control::ErrorReply{static_cast<uint16_t>(StatusCode::kNotFound), what});
    } else {
      log_->warn("dropped {}: {}", control::describe(e), what);
    }
  }

  bool add_watcher(const std::string& target, const ActorAddress& watcher, bool link) {
    auto cell = find(target);
    if (!cell) return false;
    std::lock_guard<std::mutex> lk(cell->mu);
    if (cell->finished) return false;
    (link ? cell->links : cell->monitors).insert(watcher);
    return true;
  }

  void send_down(const ActorAddress& actor, const ActorAddress& to, DownReason reason, std::string text) {
    Envelope e;
    e.sender = actor.node == opts_.node_id || actor.node.empty() ? actor : ActorAddress{opts_.node_id, ""};
    e.receiver = to;
    e.payload = control::Down{actor, reason, std::move(text)};
    if (to.node == opts_.node_id) {
      deliver_local(std::move(e));
      return;
    }
    Status st = route(std::move(e));
    if (!st.ok()) log_->debug("Down for {} to {} not sent: {}", actor.to_string(), to.to_string(), st);
  }

  void deliver_down(const ActorAddress& receiver, const control::Down& down) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      remote_monitors_.erase({receiver, down.actor});
      if (is_external_watcher(receiver.name)) {
        auto it = external_watchers_.find(receiver.name);
        if (it == external_watchers_.end()) return;
        auto cb = std::move(it->second);
        external_watchers_.erase(it);
        lk.unlock();
        cb(down);
        return;
      }
    }
    auto cell = find(receiver.name);
    if (!cell) return;
    Envelope e;
    e.sender = down.actor;
    e.receiver = receiver;
    e.payload = down;
    enqueue(cell, MailItem{std::move(e), nullptr});
  }

  void enqueue(const std::shared_ptr<Cell>& cell, MailItem item) {
    bool schedule = false;
    bool rejected = false;
    {
      std::lock_guard<std::mutex> lk(cell->mu);
      if (cell->finished) {
        rejected = true;
      } else {
        cell->mailbox.push_back(std::move(item));
        if (!cell->queued) {
          cell->queued = true;
          schedule = true;
        }
      }
    }
    if (rejected) {
      if (item.env && item.env->correlation_id != 0 && !item.env->is_reply) no_such_actor(*item.env);
      return;
    }
    if (schedule) cell->executor->schedule(cell);
  }

  // Completes a pending ask exactly once (reply, timeout, failure), in the asking actor
  // when there is one.
  void complete(uint64_t corr, Result<Payload> r) {
    Pending p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = pending_.find(corr);
      if (it == pending_.end()) return;  // already completed (late reply, or timed out)
      p = std::move(it->second);
      pending_.erase(it);
      cancel_timer_locked(p.timer);
    }
    if (p.asker.name.empty()) {
      p.then(std::move(r));
      return;
    }
    if (auto cell = find(p.asker.name)) {
      enqueue(cell, MailItem{std::nullopt,
                             [then = std::move(p.then), r = std::move(r)]() mutable { then(std::move(r)); }});
    }
  }

  void undeliverable(Envelope e, const Status& why) {
    if (e.correlation_id != 0 && !e.is_reply) {
      complete(e.correlation_id, why);
    } else if (auto* m = std::get_if<control::MonitorRequest>(&e.payload)) {
      send_down(m->target, m->watcher, DownReason::kConnectionLost, why.message());
    } else if (auto* l = std::get_if<control::LinkRequest>(&e.payload)) {
      send_down(l->to, l->from, DownReason::kConnectionLost, why.message());
    } else if (std::holds_alternative<control::Down>(e.payload)) {
      log_->debug("undeliverable {}: {}", control::describe(e), why);  // its watcher's node is gone
    } else {
      log_->warn("undeliverable {}: {}", control::describe(e), why);
    }
  }

  void peer_down(const std::string& node, DownReason reason, const std::string& text) {
    std::vector<uint64_t> failed_asks;
    std::vector<std::pair<ActorAddress, ActorAddress>> monitors;  // (watcher, target)
    std::vector<std::shared_ptr<Cell>> cells;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [corr, p] : pending_) {
        if (p.target_node == node) failed_asks.push_back(corr);
      }
      for (auto it = remote_monitors_.begin(); it != remote_monitors_.end();) {
        if (it->second.node == node) {
          monitors.push_back(*it);
          it = remote_monitors_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& [name, c] : actors_) cells.push_back(c);
    }
    for (uint64_t corr : failed_asks)
      complete(corr, unavailable("node {} is down ({}): {}", node, control::down_reason_name(reason), text));
    for (auto& [watcher, target] : monitors) deliver_down(watcher, control::Down{target, reason, text});
    for (auto& cell : cells) {
      std::vector<ActorAddress> lost_links;
      {
        std::lock_guard<std::mutex> lk(cell->mu);
        for (auto it = cell->links.begin(); it != cell->links.end();) {
          if (it->node == node) {
            lost_links.push_back(*it);
            it = cell->links.erase(it);
          } else {
            ++it;
          }
        }
        for (auto it = cell->monitors.begin(); it != cell->monitors.end();) {
          it = it->node == node ? cell->monitors.erase(it) : std::next(it);
        }
      }
      for (auto& l : lost_links) {
        // The link is already removed from the cell, so the link rule is applied here.
        enqueue(cell,
                MailItem{std::nullopt, [this, cell, down = control::Down{l, reason, text}] {
                           cell->actor->on_down(down);
                           if (down.reason != DownReason::kExit) {
                             request_stop(
                                 cell->addr, DownReason::kKilled,
                                 fmt::format("linked actor {} went down ({}): {}", down.actor.to_string(),
                                             control::down_reason_name(down.reason), down.text));
                           }
                         }});
      }
    }
  }

  // ---- running actors ----

  void run_cell(const std::shared_ptr<Cell>& cell) {
    bool first = false;
    {
      std::lock_guard<std::mutex> lk(cell->mu);
      if (cell->finished) return;
      first = !cell->started;
      cell->started = true;
    }
    if (first) {
      Status st;
      try {
        st = cell->actor->on_start();
      } catch (const std::exception& ex) {
        st = internal_error("on_start threw: {}", ex.what());
      }
      if (!st.ok()) {
        finish(cell, control::Down{cell->addr, DownReason::kCrash, st.to_string()});
        return;
      }
    }
    for (size_t i = 0; i < kBatch; ++i) {
      MailItem item;
      {
        std::lock_guard<std::mutex> lk(cell->mu);
        if (cell->stop_request || cell->mailbox.empty()) break;
        item = std::move(cell->mailbox.front());
        cell->mailbox.pop_front();
      }
      process(cell, std::move(item));
    }
    std::optional<control::Down> stop;
    bool again = false;
    {
      std::lock_guard<std::mutex> lk(cell->mu);
      if (cell->stop_request) {
        stop = cell->stop_request;
      } else if (!cell->mailbox.empty()) {
        again = true;  // stays queued: let other actors run first
      } else {
        cell->queued = false;
      }
    }
    if (stop) {
      finish(cell, *stop);
    } else if (again) {
      cell->executor->schedule(cell);
    }
  }

  void process(const std::shared_ptr<Cell>& cell, MailItem item) {
    Actor& actor = *cell->actor;
    std::optional<MessageContext> ctx;
    try {
      if (item.fn) {
        item.fn();
        return;
      }
      Envelope& e = *item.env;
      if (auto* down = std::get_if<control::Down>(&e.payload)) {
        bool linked = false;
        {
          std::lock_guard<std::mutex> lk(cell->mu);
          linked = cell->links.erase(down->actor) != 0;
        }
        actor.on_down(*down);
        if (linked && down->reason != DownReason::kExit) {
          request_stop(cell->addr, DownReason::kKilled,
                       fmt::format("linked actor {} went down ({}): {}", down->actor.to_string(),
                                   control::down_reason_name(down->reason), down->text));
        }
        return;
      }
      auto& user = std::get<control::UserPayload>(e.payload);
      ctx.emplace();
      ctx->sender_ = ActorRef(e.sender);
      ctx->correlation_id_ = e.correlation_id;
      ctx->deadline_unix_nanos_ = e.deadline_unix_nanos;
      if (e.deadline_unix_nanos != 0 && clock_->unix_nanos() > e.deadline_unix_nanos) {
        log_->debug("actor {}: dropped {} past its deadline", cell->addr.to_string(), control::describe(e));
        return;
      }
      auto h = actor.handlers_.find(user.type_id);
      if (h == actor.handlers_.end()) {
        actor.promise_taken_ = false;
        actor.reply_error(*ctx, unimplemented("actor {} does not handle message type {:#x}",
                                              cell->addr.to_string(), user.type_id));
        return;
      }
      actor.current_ = &*ctx;
      actor.promise_taken_ = false;
      h->second(user.data, *ctx);
      actor.current_ = nullptr;
    } catch (const std::exception& ex) {
      crashed(cell, ctx, ex.what());
    } catch (...) {
      crashed(cell, ctx, "a non-standard exception");
    }
  }

  void crashed(const std::shared_ptr<Cell>& cell, const std::optional<MessageContext>& ctx,
               const std::string& what) {
    Actor& actor = *cell->actor;
    actor.current_ = nullptr;
    const std::string text = fmt::format("handler threw: {}", what);
    log_->error("actor {} crashed: {}", cell->addr.to_string(), text);
    if (ctx && ctx->is_ask() && !actor.promise_taken_) {
      send_reply(cell->addr, ctx->sender().address(), ctx->correlation_id(),
                 control::ErrorReply{static_cast<uint16_t>(StatusCode::kInternal), text});
    }
    std::lock_guard<std::mutex> lk(cell->mu);
    if (!cell->stop_request) cell->stop_request = control::Down{cell->addr, DownReason::kCrash, text};
  }

  void finish(const std::shared_ptr<Cell>& cell, const control::Down& down) {
    std::set<ActorAddress> notify;
    std::deque<MailItem> left;
    {
      std::lock_guard<std::mutex> lk(cell->mu);
      if (cell->finished) return;
      cell->finished = true;
      notify = std::move(cell->monitors);
      notify.insert(cell->links.begin(), cell->links.end());
      left.swap(cell->mailbox);
    }
    try {
      cell->actor->on_stop(down);
    } catch (const std::exception& ex) {
      log_->error("actor {}: on_stop threw: {}", cell->addr.to_string(), ex.what());
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      actors_.erase(cell->addr.name);
      for (auto it = remote_monitors_.begin(); it != remote_monitors_.end();) {
        it = it->first == cell->addr ? remote_monitors_.erase(it) : std::next(it);
      }
    }
    if (down.reason == DownReason::kCrash) {
      log_->warn("actor {} stopped ({}): {}", cell->addr.to_string(), control::down_reason_name(down.reason),
                 down.text);
    } else {
      log_->debug("actor {} stopped ({}): {}", cell->addr.to_string(), control::down_reason_name(down.reason),
                  down.text);
    }
    for (const ActorAddress& w : notify) send_down(cell->addr, w, down.reason, down.text);
    for (MailItem& item : left) {
      if (item.env && item.env->correlation_id != 0 && !item.env->is_reply &&
          std::holds_alternative<control::UserPayload>(item.env->payload)) {
        send_reply(cell->addr, item.env->sender, item.env->correlation_id,
                   control::ErrorReply{
                       static_cast<uint16_t>(StatusCode::kNotFound),
                       fmt::format("actor {} stopped before handling the ask", cell->addr.to_string())});
      }
    }
  }

  ActorSystemOptions opts_;
  SystemClock own_clock_;
  const Clock* clock_ = nullptr;
  ActorSystem* owner_ = nullptr;
  std::shared_ptr<spdlog::logger> log_;
  std::atomic<uint64_t> next_correlation_{1};

  std::unique_ptr<Executor> pool_;
  std::unique_ptr<control::Transport> transport_;
  std::thread timer_thread_;
  std::condition_variable timer_cv_;

  mutable std::mutex mu_;  // guards everything below
  bool shut_down_ = false;
  bool timer_stop_ = false;
  bool timer_wake_ = false;
  std::unordered_map<std::string, std::shared_ptr<Cell>> actors_;
  std::vector<std::unique_ptr<Executor>> dedicated_;
  std::map<uint64_t, Pending> pending_;
  std::set<std::pair<ActorAddress, ActorAddress>> remote_monitors_;  // (local watcher, remote target)
  std::unordered_map<std::string, std::function<void(const control::Down&)>> external_watchers_;
  uint64_t watcher_seq_ = 0;
  std::map<std::pair<int64_t, uint64_t>, std::function<void()>> timers_;  // (due, id) -> fn
  std::unordered_map<uint64_t, int64_t> timer_due_;
  uint64_t timer_seq_ = 0;
};

// ---- ActorSystem: forwarding ----

Result<std::unique_ptr<ActorSystem>> ActorSystem::create(ActorSystemOptions opts) {
  auto impl = std::make_unique<Impl>(std::move(opts));
  std::unique_ptr<ActorSystem> sys(new ActorSystem(std::move(impl)));
  TROUPE_RETURN_IF_ERROR(sys->impl_->start(sys.get()));
  return sys;
}

ActorSystem::ActorSystem(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ActorSystem::~ActorSystem() {
  shutdown();
}
const std::string& ActorSystem::node_id() const {
  return impl_->node_id();
}
const Clock& ActorSystem::clock() const {
  return impl_->clock();
}
std::string ActorSystem::endpoint() const {
  return impl_->endpoint();
}
Status ActorSystem::connect(const std::string& node, const std::string& endpoint,
                            const std::string& server_public_key) {
  return impl_->connect(node, endpoint, server_public_key);
}
bool ActorSystem::is_node_up(const std::string& node) const {
  return impl_->is_node_up(node);
}
Result<ActorRef> ActorSystem::spawn_actor(std::string name, std::unique_ptr<Actor> actor, SpawnOptions opts) {
  return impl_->spawn(std::move(name), std::move(actor), opts);
}
Status ActorSystem::monitor(const ActorRef& target, std::function<void(const Down&)> on_down) {
  return impl_->monitor_external(target, std::move(on_down));
}
Status ActorSystem::stop(const ActorRef& local_actor, DownReason reason, std::string text) {
  return impl_->stop_actor(local_actor, reason, std::move(text));
}
bool ActorSystem::has_actor(const std::string& name) const {
  return impl_->has_actor(name);
}
size_t ActorSystem::actor_count() const {
  return impl_->actor_count();
}
size_t ActorSystem::run_until_idle() {
  return impl_->run_until_idle();
}
void ActorSystem::shutdown() {
  if (impl_) impl_->shutdown();
}
Status ActorSystem::send_user(const control::ActorAddress& from, const ActorRef& to, uint64_t type_id,
                              std::string bytes) {
  return impl_->send_user(from, to, type_id, std::move(bytes));
}
void ActorSystem::ask_raw(const control::ActorAddress& from, const ActorRef& to, uint64_t type_id,
                          std::string bytes, Duration timeout,
                          std::function<void(Result<control::Payload>)> then) {
  impl_->ask_raw(from, to, type_id, std::move(bytes), timeout, std::move(then));
}
void ActorSystem::send_reply(const control::ActorAddress& from, const control::ActorAddress& to,
                             uint64_t correlation_id, control::Payload p) {
  impl_->send_reply(from, to, correlation_id, std::move(p));
}
void ActorSystem::supervise(const control::ActorAddress& from, const ActorRef& target,
                            control::Payload request) {
  impl_->supervise(from, target, std::move(request));
}
void ActorSystem::request_stop(const control::ActorAddress& self, DownReason reason, std::string text) {
  impl_->request_stop(self, reason, std::move(text));
}
void ActorSystem::run_after(const control::ActorAddress& self, Duration delay, std::function<void()> fn) {
  impl_->run_after(self, delay, std::move(fn));
}

}  // namespace troupe::actors
