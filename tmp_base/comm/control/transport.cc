// comm/control/transport.cc — Transport: the loop thread, its sockets, routing,
// application heartbeats and the ZAP handler.
#include "comm/control/transport.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "comm/control/liveness.h"
#include "comm/control/log_limit.h"
#include "core/logging.h"

namespace troupe::control {
namespace {

constexpr size_t kMaxReceivesPerWake = 256;  // bounds the time spent on one socket
// ZAP requests answered per wake: each is a set lookup, and each connecting CURVE peer's
// handshake waits for its answer (10,000 workers connect within a second or two).
constexpr size_t kMaxZapPerWake = 4096;

Status validate_node_id(const std::string& id) {
  if (id.empty()) return invalid_argument("node id is empty");
  if (id.size() > kMaxNameBytes) {
    return invalid_argument("node id '{}' is longer than {} bytes", id, kMaxNameBytes);
  }
  if (id.find('/') != std::string::npos) {
    return invalid_argument("node id '{}' contains '/'", id);
  }
  return ok_status();
}

// Every socket: no linger (context termination never waits for a dead peer) and a size
// limit enforced by libzmq before we see the frame. ZMTP heartbeats run from the DEALER
// (client) side only: its timeout is longer than the application one, so a
// stuck-but-connected process is reported as a heartbeat timeout by our own logic. The
// ROUTER neither pings nor asks for a TTL: libzmq keeps its heartbeat timers in one list
// per I/O thread and cancels them by linear search on every message that follows a
// ping, which at thousands of connections made the server's I/O thread quadratic
// (bench/scale). Dead client connections are closed by TCP keepalive on the ROUTER and by
// the application heartbeat, which declares the peer down.
void set_common_options(zmq::socket_t& s, const TransportOptions& o, bool server) {
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(o.max_message_bytes));
  const int zmtp_timeout = static_cast<int>(2 * o.heartbeat_timeout.count());
  if (server) {
    s.set(zmq::sockopt::backlog, 4096);  // thousands of clients may connect at once
    s.set(zmq::sockopt::tcp_keepalive, 1);
    s.set(zmq::sockopt::tcp_keepalive_idle, std::max(1, zmtp_timeout / 1000));
    s.set(zmq::sockopt::tcp_keepalive_intvl, std::max(1, zmtp_timeout / 3000));
    s.set(zmq::sockopt::tcp_keepalive_cnt, 3);
    return;
  }
  s.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(o.heartbeat_interval.count()));
  s.set(zmq::sockopt::heartbeat_timeout, zmtp_timeout);
}

}  // namespace

bool is_loopback_endpoint(const std::string& endpoint) {
  if (endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0) return true;
  if (endpoint.rfind("tcp://", 0) != 0) return false;
  std::string host = endpoint.substr(6);
  const size_t colon = host.rfind(':');
  if (colon == std::string::npos) return false;
  host = host.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

class Transport::Impl {
 public:
  Impl(TransportOptions opts, TransportCallbacks cb)
      : opts_(std::move(opts)), cb_(std::move(cb)), liveness_(opts_.heartbeat_timeout) {
    clock_ = opts_.clock != nullptr ? opts_.clock : &own_clock_;
    log_ = make_logger("control");
  }

  ~Impl() { stop(); }

  Status start() {
    TROUPE_RETURN_IF_ERROR(validate_node_id(opts_.node_id));
    TROUPE_RETURN_IF_ERROR(opts_.curve.validate());
    if (opts_.io_threads < 1 || opts_.io_threads > 64) {
      return invalid_argument("io_threads must be in 1..64, got {}", opts_.io_threads);
    }
    if (opts_.heartbeat_interval.count() <= 0 || opts_.heartbeat_timeout <= opts_.heartbeat_interval) {
      return invalid_argument("heartbeat interval ({} ms) must be positive and below the timeout ({} ms)",
                              opts_.heartbeat_interval.count(), opts_.heartbeat_timeout.count());
    }
    if (opts_.ipc_same_user && (opts_.curve.enabled() || opts_.bind_endpoint.rfind("ipc://", 0) != 0)) {
      return invalid_argument("ipc_same_user needs an ipc:// bind endpoint and no CURVE (got {})",
                              opts_.bind_endpoint);
    }
    if (!opts_.bind_endpoint.empty() && !opts_.allow_non_loopback &&
        !is_loopback_endpoint(opts_.bind_endpoint)) {
      return invalid_argument(
          "refusing to bind {}: not a loopback address (set allow_non_loopback, with CURVE)",
          opts_.bind_endpoint);
    }
    if (opts_.context == nullptr) {
      own_context_ = std::make_unique<zmq::context_t>(opts_.io_threads);
      ctx_ = own_context_.get();
    } else {
      ctx_ = opts_.context;
    }
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return io_error("eventfd failed: errno {}", errno);
    std::promise<Status> ready;
    auto ready_future = ready.get_future();
    thread_ = std::thread([this, &ready] { run(ready); });
    Status st = ready_future.get();
    if (!st.ok()) {
      thread_.join();
      return st;
    }
    return ok_status();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    wake();
    if (thread_.joinable()) thread_.join();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    wake_fd_ = -1;
    own_context_.reset();
  }

  Status connect(const std::string& node, const std::string& endpoint, const std::string& key) {
    TROUPE_RETURN_IF_ERROR(validate_node_id(node));
    if (node == opts_.node_id) return invalid_argument("node '{}' cannot connect to itself", node);
    if (opts_.curve.enabled()) {
      TROUPE_RETURN_IF_ERROR(validate_z85_key(key, "server public key of " + node));
    }
    auto done = std::make_shared<std::promise<Status>>();
    auto fut = done->get_future();
    TROUPE_RETURN_IF_ERROR(
        post([this, node, endpoint, key, done] { done->set_value(open_dealer(node, endpoint, key)); }));
    if (fut.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      return deadline_exceeded("connect to {} at {} did not complete in 10 s", node, endpoint);
    }
    return fut.get();
  }

  Status send(const std::string& node, Envelope e) {
    TROUPE_ASSIGN_OR_RETURN(std::string bytes, encode_envelope(e, opts_.max_message_bytes));
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return failed_precondition("transport {} is stopped", opts_.node_id);
    outbox_.push_back(Outgoing{node, std::move(bytes), std::move(e)});
    if (outbox_.size() == 1) wake_locked();
    return ok_status();
  }

  bool is_peer_up(const std::string& node) const {
    std::lock_guard<std::mutex> lk(mu_);
    return up_mirror_.count(node) != 0;
  }

  TransportStats stats() const {
    return TransportStats{sent_.load(), received_.load(), dropped_.load(), send_failures_.load(),
                          drops_not_logged_.load()};
  }

  const std::string& node_id() const { return opts_.node_id; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Outgoing {
    std::string node;
    std::string bytes;
    Envelope envelope;  // kept for on_undeliverable
  };
  struct Dealer {
    std::unique_ptr<zmq::socket_t> socket;
    std::unique_ptr<zmq::socket_t> monitor;  // PAIR receiving DISCONNECTED events
    std::string endpoint;
  };

  Status post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return failed_precondition("transport {} is stopped", opts_.node_id);
    commands_.push_back(std::move(fn));
    wake_locked();
    return ok_status();
  }
  void wake_locked() { wake(); }
  void wake() {
    if (wake_fd_ < 0) return;
    uint64_t one = 1;
    ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    (void)n;  // EAGAIN means the counter is already non-zero: the loop will wake anyway
  }

  // ---- loop thread ----

  void run(std::promise<Status>& ready) {
    Status st = open_sockets();
    ready.set_value(st);
    if (!st.ok()) {
      close_sockets();
      return;
    }
    next_heartbeat_ = clock_->now();
    while (true) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (stopped_) break;
      }
      poll_once();
    }
    say_goodbye();
    close_sockets();
  }

  // A stopping transport tells every peer it is leaving (a node-level Down, reason exit),
  // so they report its disconnect as an exit, not a lost connection. The sockets linger
  // up to kGoodbyeLinger for those frames; a peer that is already gone costs that much.
  static constexpr int kGoodbyeLingerMs = 200;
  void say_goodbye() {
    std::set<std::string> peers(inbound_.begin(), inbound_.end());
    for (auto& [node, d] : dealers_) peers.insert(node);
    bool sent = false;
    for (const std::string& node : peers) {
      if (!liveness_.is_up(node)) continue;
      Envelope bye;
      bye.sender = ActorAddress{opts_.node_id, ""};
      bye.receiver = ActorAddress{node, ""};
      bye.payload = Down{ActorAddress{opts_.node_id, ""}, DownReason::kExit, "node stopping"};
      Result<std::string> bytes = encode_envelope(bye, opts_.max_message_bytes);
      if (bytes.ok() && send_bytes(node, *bytes).ok()) sent = true;
    }
    if (!sent) return;
    try {
      for (auto& [node, d] : dealers_) {
        if (d.socket) d.socket->set(zmq::sockopt::linger, kGoodbyeLingerMs);
      }
      if (router_) router_->set(zmq::sockopt::linger, kGoodbyeLingerMs);
    } catch (const zmq::error_t&) {
      // The frames are dropped: peers see a lost connection, as before.
    }
  }

  Status open_sockets() {
    try {
      if (opts_.curve.enabled() || opts_.ipc_same_user) {
        // The ZAP handler must be bound before the ROUTER accepts a connection.
        zap_ = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::rep);
        zap_->set(zmq::sockopt::linger, 0);
        try {
          zap_->bind("inproc://zeromq.zap.01");
        } catch (const zmq::error_t& e) {
          return failed_precondition(
              "cannot bind the ZAP handler ({}): one CURVE transport per ZeroMQ context", e.what());
        }
      }
      if (!opts_.bind_endpoint.empty()) {
        router_ = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::router);
        set_common_options(*router_, opts_, /*server=*/true);
        router_->set(zmq::sockopt::router_mandatory, true);
        router_->set(zmq::sockopt::router_handover, true);
        router_->set(zmq::sockopt::routing_id, opts_.node_id);
        if (opts_.curve.enabled()) {
          router_->set(zmq::sockopt::curve_server, true);
          router_->set(zmq::sockopt::curve_secretkey, opts_.curve.own.secret_key);
          router_->set(zmq::sockopt::zap_domain, "troupe");
        } else if (opts_.ipc_same_user) {
          router_->set(zmq::sockopt::zap_domain, "troupe");  // NULL mechanism: ZAP sees SO_PEERCRED
        }
        try {
          router_->bind(opts_.bind_endpoint);
        } catch (const zmq::error_t& e) {
          return unavailable("cannot bind {}: {}", opts_.bind_endpoint, e.what());
        }
        endpoint_ = router_->get(zmq::sockopt::last_endpoint);
      }
    } catch (const zmq::error_t& e) {
      return io_error("creating control sockets failed: {}", e.what());
    }
    return ok_status();
  }

  void close_sockets() {
    for (auto& [node, d] : dealers_) close_dealer(d);
    dealers_.clear();
    router_.reset();
    zap_.reset();
  }

  void close_dealer(Dealer& d) {
    if (d.socket) zmq_socket_monitor(d.socket->handle(), nullptr, 0);
    d.monitor.reset();
    d.socket.reset();
  }

  Status open_dealer(const std::string& node, const std::string& endpoint, const std::string& key) {
    auto it = dealers_.find(node);
    if (it != dealers_.end()) {
      close_dealer(it->second);
      dealers_.erase(it);
    }
    Dealer d;
    d.endpoint = endpoint;
    try {
      d.socket = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::dealer);
      set_common_options(*d.socket, opts_, /*server=*/false);
      d.socket->set(zmq::sockopt::routing_id, opts_.node_id);
      d.socket->set(zmq::sockopt::reconnect_ivl, 100);
      d.socket->set(zmq::sockopt::reconnect_ivl_max, 1000);
      if (opts_.curve.enabled()) {
        d.socket->set(zmq::sockopt::curve_serverkey, key);
        d.socket->set(zmq::sockopt::curve_publickey, opts_.curve.own.public_key);
        d.socket->set(zmq::sockopt::curve_secretkey, opts_.curve.own.secret_key);
      }
      const std::string monitor_addr =
          fmt::format("inproc://troupe-monitor-{}-{}", static_cast<void*>(this), ++monitor_seq_);
      if (zmq_socket_monitor(d.socket->handle(), monitor_addr.c_str(), ZMQ_EVENT_DISCONNECTED) != 0) {
        return io_error("zmq_socket_monitor failed: {}", zmq_strerror(zmq_errno()));
      }
      d.monitor = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::pair);
      d.monitor->set(zmq::sockopt::linger, 0);
      d.monitor->connect(monitor_addr);
      d.socket->connect(endpoint);
    } catch (const zmq::error_t& e) {
      return invalid_argument("cannot connect to {} at {}: {}", node, endpoint, e.what());
    }
    dealers_.emplace(node, std::move(d));
    liveness_.watch(node, clock_->now());
    mirror_up(node, liveness_.is_up(node));
    return ok_status();
  }

  void poll_once() {
    std::vector<zmq_pollitem_t> items;
    items.push_back({nullptr, wake_fd_, ZMQ_POLLIN, 0});
    const size_t router_idx = items.size();
    if (router_) items.push_back({router_->handle(), 0, ZMQ_POLLIN, 0});
    const size_t zap_idx = items.size();
    if (zap_) items.push_back({zap_->handle(), 0, ZMQ_POLLIN, 0});
    const size_t dealers_idx = items.size();
    std::vector<std::string> dealer_nodes;
    for (auto& [node, d] : dealers_) {
      dealer_nodes.push_back(node);
      items.push_back({d.socket->handle(), 0, ZMQ_POLLIN, 0});
      items.push_back({d.monitor->handle(), 0, ZMQ_POLLIN, 0});
    }
    const auto now = clock_->now();
    auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_heartbeat_ - now);
    const auto cap = std::max(std::chrono::milliseconds(5), opts_.heartbeat_interval / 4);
    wait = std::clamp(wait, std::chrono::milliseconds(0), cap);
    try {
      zmq::poll(items.data(), items.size(), wait);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) log_->warn("control {}: poll failed: {}", opts_.node_id, e.what());
      return;
    }
    if (items[0].revents & ZMQ_POLLIN) {
      uint64_t v;
      ssize_t n = ::read(wake_fd_, &v, sizeof(v));
      (void)n;
    }
    run_commands();
    if (router_ && (items[router_idx].revents & ZMQ_POLLIN)) receive_router();
    if (zap_ && (items[zap_idx].revents & ZMQ_POLLIN)) {
      for (size_t i = 0; i < kMaxZapPerWake; ++i) {
        const bool served = opts_.ipc_same_user
                                ? serve_zap_request_same_uid(*zap_, ::getuid(), *log_)
                                : serve_zap_request(*zap_, opts_.curve.allowed_client_keys, *log_);
        if (!served) break;
      }
    }
    for (size_t i = 0; i < dealer_nodes.size(); ++i) {
      auto it = dealers_.find(dealer_nodes[i]);
      if (it == dealers_.end()) continue;  // replaced by a command above
      if (items[dealers_idx + 2 * i].revents & ZMQ_POLLIN) receive_dealer(it->first, it->second);
      if (items[dealers_idx + 2 * i + 1].revents & ZMQ_POLLIN) receive_monitor(it->first, it->second);
    }
    flush_outbox();
    tick();
  }

  void run_commands() {
    std::deque<std::function<void()>> cmds;
    {
      std::lock_guard<std::mutex> lk(mu_);
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();
  }

  void flush_outbox() {
    std::deque<Outgoing> out;
    {
      std::lock_guard<std::mutex> lk(mu_);
      out.swap(outbox_);
    }
    const auto now = out.empty() ? std::chrono::nanoseconds(0) : clock_->now();
    for (Outgoing& o : out) {
      Status st = send_bytes(o.node, o.bytes);
      if (st.ok()) {
        ++sent_;
        last_sent_[o.node] = now;
      } else {
        ++send_failures_;
        log_->debug("control {}: cannot deliver {}: {}", opts_.node_id, describe(o.envelope), st);
        if (cb_.on_undeliverable) cb_.on_undeliverable(std::move(o.envelope), st);
      }
    }
  }

  Status send_bytes(const std::string& node, const std::string& bytes) {
    try {
      if (auto it = dealers_.find(node); it != dealers_.end()) {
        if (!it->second.socket->send(zmq::buffer(bytes), zmq::send_flags::dontwait)) {
          return unavailable("queue to node {} is full (peer not reading or not connected)", node);
        }
        return ok_status();
      }
      if (router_ && inbound_.count(node) != 0) {
        if (!router_->send(zmq::buffer(node), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
          return unavailable("queue to node {} is full", node);
        }
        router_->send(zmq::buffer(bytes), zmq::send_flags::dontwait);
        return ok_status();
      }
    } catch (const zmq::error_t& e) {
      if (e.num() == EHOSTUNREACH) return unavailable("node {} is not connected", node);
      return unavailable("sending to node {} failed: {}", node, e.what());
    }
    return not_found("no route to node {} (neither connected to it nor connected from it)", node);
  }

  void receive_router() {
    for (size_t i = 0; i < kMaxReceivesPerWake; ++i) {
      std::vector<zmq::message_t> frames;
      try {
        if (!zmq::recv_multipart(*router_, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) log_->warn("control {}: router receive failed: {}", opts_.node_id, e.what());
        return;
      }
      std::string from = frames.empty() ? std::string() : frames[0].to_string();
      if (frames.size() != 2) {
        drop(from, fmt::format("expected 2 frames [id][envelope], got {}", frames.size()));
        continue;
      }
      if (accept(frames[1], from)) inbound_.insert(from);
    }
  }

  void receive_dealer(const std::string& node, Dealer& d) {
    for (size_t i = 0; i < kMaxReceivesPerWake; ++i) {
      std::vector<zmq::message_t> frames;
      try {
        if (!zmq::recv_multipart(*d.socket, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR)
          log_->warn("control {}: receive from {} failed: {}", opts_.node_id, node, e.what());
        return;
      }
      if (frames.size() != 1) {
        drop(node, fmt::format("expected 1 frame, got {}", frames.size()));
        continue;
      }
      accept(frames[0], node);
    }
  }

  void receive_monitor(const std::string& node, Dealer& d) {
    std::vector<zmq::message_t> frames;
    try {
      if (!zmq::recv_multipart(*d.monitor, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
    } catch (const zmq::error_t&) {
      return;
    }
    if (frames.empty() || frames[0].size() < 2) return;
    uint16_t event = 0;
    std::memcpy(&event, frames[0].data(), sizeof(event));
    if (event == ZMQ_EVENT_DISCONNECTED && liveness_.mark_down(node)) {
      mirror_up(node, false);
      peer_down(node, DownReason::kConnectionLost,
                fmt::format("connection to {} at {} closed", node, d.endpoint));
    }
  }

  // Decodes and checks one envelope frame from `from`; returns true when it was accepted.
  bool accept(const zmq::message_t& frame, const std::string& from) {
    DecodeLimits limits;
    limits.max_message_bytes = opts_.max_message_bytes;
    Result<Envelope> env = decode_envelope(frame.data(), frame.size(), limits);
    if (!env.ok()) {
      drop(from, env.status().to_string());
      return false;
    }
    if (env->sender.node != from) {
      drop(from, fmt::format("sender node '{}' does not match the connection's node id", env->sender.node));
      return false;
    }
    if (!env->receiver.node.empty() && env->receiver.node != opts_.node_id) {
      drop(from, fmt::format("addressed to node '{}', this is '{}'", env->receiver.node, opts_.node_id));
      return false;
    }
    ++received_;
    if (liveness_.heard(from, clock_->now())) {
      leaving_.erase(from);  // back (a new process with the same node id)
      mirror_up(from, true);
      log_->info("control {}: peer {} is up", opts_.node_id, from);
      if (cb_.on_peer_up) cb_.on_peer_up(from);
    }
    if (std::holds_alternative<Heartbeat>(env->payload)) return true;
    if (const Down* d = std::get_if<Down>(&env->payload);
        d != nullptr && env->receiver.name.empty() && d->actor.name.empty() && d->actor.node == from) {
      leaving_.insert(from);  // its goodbye: its disconnect is an exit (peer_down)
      return true;
    }
    if (cb_.on_envelope) cb_.on_envelope(std::move(env).value(), from);
    return true;
  }

  // Bad frames are counted; the log gets at most a few lines per peer and window (the
  // peer's id and the reason escaped: both may hold any bytes the peer chose).
  void drop(const std::string& from, const std::string& why) {
    ++dropped_;
    const LogRateLimiter::Decision d = drop_limiter_.admit(from, std::chrono::steady_clock::now());
    if (!d.log) {
      ++drops_not_logged_;
      return;
    }
    log_->warn(
        "control {}: dropped a frame from '{}': {}{}", opts_.node_id, escape_for_log(from),
        escape_for_log(why, 200),
        d.suppressed ? fmt::format(" ({} more from this peer not logged)", d.suppressed) : std::string());
  }

  // Runs after every wake. The silence scan is O(peers), so it runs every quarter
  // interval, not per wake (thousands a second at a scheduler with 10,000 peers). A peer
  // that got any envelope from us within the last interval gets no heartbeat: any
  // envelope is proof of life, so the receiver still hears from us at least every two
  // intervals, and a scheduler answering 10,000 workers does not double its traffic.
  void tick() {
    const auto now = clock_->now();
    if (now >= next_expire_) {
      next_expire_ = now + std::max<std::chrono::nanoseconds>(std::chrono::milliseconds(5),
                                                              opts_.heartbeat_interval / 4);
      for (const std::string& node : liveness_.expire(now)) {
        mirror_up(node, false);
        peer_down(
            node, DownReason::kHeartbeatTimeout,
            fmt::format("no message from node {} for over {} ms", node, opts_.heartbeat_timeout.count()));
      }
    }
    if (now < next_heartbeat_) return;
    next_heartbeat_ = now + opts_.heartbeat_interval;
    std::set<std::string> peers(inbound_.begin(), inbound_.end());
    for (auto& [node, d] : dealers_) peers.insert(node);
    for (auto it = last_sent_.begin(); it != last_sent_.end();) {
      it = now - it->second > 4 * opts_.heartbeat_interval ? last_sent_.erase(it) : std::next(it);
    }
    for (const std::string& node : peers) {
      if (auto it = last_sent_.find(node);
          it != last_sent_.end() && now - it->second < opts_.heartbeat_interval) {
        continue;
      }
      Envelope hb;
      hb.sender = ActorAddress{opts_.node_id, ""};
      hb.receiver = ActorAddress{node, ""};
      hb.payload = Heartbeat{++heartbeat_seq_, clock_->unix_nanos()};
      Result<std::string> bytes = encode_envelope(hb, opts_.max_message_bytes);
      if (bytes.ok() && send_bytes(node, *bytes).ok()) ++sent_;
    }
  }

  void peer_down(const std::string& node, DownReason reason, const std::string& text) {
    if (leaving_.erase(node) != 0) {
      // It said goodbye first: an orderly exit, whatever closed the connection.
      log_->info("control {}: peer {} left ({})", opts_.node_id, node, text);
      if (cb_.on_peer_down) cb_.on_peer_down(node, DownReason::kExit, fmt::format("{} left: {}", node, text));
      return;
    }
    log_->warn("control {}: peer {} is down ({}): {}", opts_.node_id, node, down_reason_name(reason), text);
    if (cb_.on_peer_down) cb_.on_peer_down(node, reason, text);
  }

  void mirror_up(const std::string& node, bool up) {
    std::lock_guard<std::mutex> lk(mu_);
    if (up) {
      up_mirror_.insert(node);
    } else {
      up_mirror_.erase(node);
    }
  }

  TransportOptions opts_;
  TransportCallbacks cb_;
  SystemClock own_clock_;
  const Clock* clock_ = nullptr;
  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<zmq::context_t> own_context_;
  zmq::context_t* ctx_ = nullptr;
  int wake_fd_ = -1;
  std::thread thread_;
  std::string endpoint_;  // written before start() returns, then read-only

  mutable std::mutex mu_;  // guards stopped_, commands_, outbox_, up_mirror_
  bool stopped_ = false;
  std::deque<std::function<void()>> commands_;
  std::deque<Outgoing> outbox_;
  std::set<std::string> up_mirror_;

  std::atomic<uint64_t> sent_{0}, received_{0}, dropped_{0}, send_failures_{0};
  std::atomic<uint64_t> drops_not_logged_{0};
  LogRateLimiter drop_limiter_;  // loop thread only

  // Loop thread only.
  std::unique_ptr<zmq::socket_t> router_, zap_;
  std::map<std::string, Dealer> dealers_;
  std::set<std::string> inbound_;
  std::set<std::string> leaving_;  // peers that said goodbye (loop thread)
  PeerLiveness liveness_;
  std::chrono::nanoseconds next_heartbeat_{0};
  std::chrono::nanoseconds next_expire_{0};
  std::unordered_map<std::string, std::chrono::nanoseconds> last_sent_;  // node -> last envelope we sent it
  uint64_t heartbeat_seq_ = 0;
  uint64_t monitor_seq_ = 0;
};

Result<std::unique_ptr<Transport>> Transport::start(TransportOptions opts, TransportCallbacks cb) {
  auto impl = std::make_unique<Impl>(std::move(opts), std::move(cb));
  TROUPE_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<Transport>(new Transport(std::move(impl)));
}

Transport::Transport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Transport::~Transport() {
  stop();
}
const std::string& Transport::node_id() const {
  return impl_->node_id();
}
const std::string& Transport::endpoint() const {
  return impl_->endpoint();
}
Status Transport::connect(const std::string& node, const std::string& endpoint,
                          const std::string& server_public_key) {
  return impl_->connect(node, endpoint, server_public_key);
}
Status Transport::send(const std::string& node, const Envelope& e) {
  return impl_->send(node, e);
}
bool Transport::is_peer_up(const std::string& node) const {
  return impl_->is_peer_up(node);
}
TransportStats Transport::stats() const {
  return impl_->stats();
}
void Transport::stop() {
  if (impl_) impl_->stop();
}

}  // namespace troupe::control
