// scheduler/client/transport.cc — the scheduler's endpoints over the actor runtime, key files,
// and the bare-ZeroMQ connection probe used to explain a failed request.
#include "scheduler/client/transport.h"

#include <sodium.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "actors/actor.h"
#include "actors/actor_system.h"
#include "comm/control/host_addr.h"
#include "core/env.h"
#include "core/job_env.h"
#include "core/logging.h"

namespace troupe::sched {

// One scheduler Message as an actor message (the bytes are scheduler/client/protocol.capnp).
struct SchedWire {
  std::string bytes;
};
// Local only: "send these bytes to the scheduler as this node's inbox actor".
struct SchedOutgoing {
  std::string bytes;
};

}  // namespace troupe::sched

namespace troupe::actors {
template <>
struct MessageTraits<sched::SchedWire> {
  static constexpr uint64_t kTypeId = sched::kSchedWireTypeId;
  static std::string encode(const sched::SchedWire& m) { return m.bytes; }
  static Result<sched::SchedWire> decode(std::string_view b) { return sched::SchedWire{std::string(b)}; }
};
template <>
struct MessageTraits<sched::SchedOutgoing> {
  static constexpr uint64_t kTypeId = sched::kSchedOutgoingTypeId;
  static std::string encode(const sched::SchedOutgoing& m) { return m.bytes; }
  static Result<sched::SchedOutgoing> decode(std::string_view b) { return sched::SchedOutgoing{std::string(b)}; }
};
}  // namespace troupe::actors

namespace troupe::sched {
namespace {

std::shared_ptr<spdlog::logger> log() {
  static auto l = make_logger("sched-net");
  return l;
}

control::TransportOptions transport_options(const std::string& node, const std::string& bind) {
  control::TransportOptions t;
  t.node_id = node;
  t.bind_endpoint = bind;
  // 1 Hz: a scheduler has one session per agent and per job process (10,000s); the
  // timeout leaves a loaded host room (bench/scale).
  t.heartbeat_interval = std::chrono::milliseconds(1000);
  t.heartbeat_timeout = std::chrono::milliseconds(5000);
  t.max_message_bytes = kMaxMessageBytes;
  return t;
}

std::string sanitize_node(const std::string& id) {
  std::string out = id.substr(0, control::kMaxNameBytes);
  for (char& c : out) {
    if (c == '/' || c < 32 || c > 126) c = '_';
  }
  return out;
}

}  // namespace

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ------------------------------------------------------------------ keys and addresses

Result<CurveKeyPair> generate_curve_keypair() { return control::generate_curve_keypair(); }

Status write_key_files(const std::string& prefix, const CurveKeyPair& keys) {
  return control::write_curve_key_files(prefix, keys);
}

Result<CurveKeyPair> read_key_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found("CURVE key file {} does not exist", path);
  return control::read_curve_key_file(path);
}

Result<std::vector<std::string>> read_public_keys(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec)) {
      for (const auto& e : std::filesystem::directory_iterator(p)) {
        auto ext = e.path().extension();
        if (ext != ".pub" && ext != ".key") continue;
        TROUPE_ASSIGN_OR_RETURN(auto k, read_key_file(e.path().string()));
        out.push_back(k.public_key);
      }
    } else {
      TROUPE_ASSIGN_OR_RETURN(auto k, read_key_file(p));
      out.push_back(k.public_key);
    }
  }
  return out;
}

Result<std::string> normalize_endpoint(const std::string& addr) {
  if (addr.empty()) return invalid_argument("empty scheduler address");
  if (addr.find("://") != std::string::npos) {
    if (addr.rfind("tcp://", 0) != 0 && addr.rfind("ipc://", 0) != 0 && addr.rfind("inproc://", 0) != 0) {
      return invalid_argument("address '{}': transport must be tcp://, ipc:// or inproc://", addr);
    }
    return addr;
  }
  auto colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == addr.size()) {
    return invalid_argument("address '{}': expected HOST:PORT or tcp://HOST:PORT", addr);
  }
  std::string port = addr.substr(colon + 1);
  if (port != "*" && port.find_first_not_of("0123456789") != std::string::npos) {
    return invalid_argument("address '{}': port '{}' is not a number", addr, port);
  }
  return "tcp://" + addr;
}

// ------------------------------------------------------------------ MessageQueue

MessageQueue::MessageQueue() { fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); }
MessageQueue::~MessageQueue() {
  if (fd_ >= 0) close(fd_);
}

void MessageQueue::push(Incoming in) {
  bool was_empty;
  {
    std::lock_guard<std::mutex> lk(mu_);
    was_empty = q_.empty();
    q_.push_back(std::move(in));
  }
  if (!was_empty) return;  // the fd is readable already (one syscall per burst, not per message)
  cv_.notify_one();
  uint64_t one = 1;
  ssize_t n = write(fd_, &one, sizeof(one));
  (void)n;
}

std::vector<Incoming> MessageQueue::take(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout.count() > 0) cv_.wait_for(lk, timeout, [&] { return !q_.empty(); });
  std::vector<Incoming> out(std::make_move_iterator(q_.begin()), std::make_move_iterator(q_.end()));
  q_.clear();
  uint64_t drain;
  ssize_t n = read(fd_, &drain, sizeof(drain));  // empty now: clear readability
  (void)n;
  return out;
}

std::optional<Incoming> MessageQueue::take_one(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout.count() > 0) cv_.wait_for(lk, timeout, [&] { return !q_.empty(); });
  if (q_.empty()) return std::nullopt;
  Incoming in = std::move(q_.front());
  q_.pop_front();
  if (q_.empty()) {
    uint64_t drain;
    ssize_t n = read(fd_, &drain, sizeof(drain));  // empty now: clear readability
    (void)n;
  }
  return in;
}

// ------------------------------------------------------------------ ServerEndpoint

struct ServerEndpoint::Shared {
  MessageQueue queue;
  std::mutex mu;
  struct PendingAsk {
    actors::ResponsePromise promise;
    int64_t deadline_unix_nanos = 0;  // the asker's; 0: none
  };
  std::map<std::string, PendingAsk> asks;  // "ask:<n>" -> the asker's promise
  uint64_t next_ask = 0;
};

namespace {

// The scheduler's inbox: every message becomes an Incoming for the scheduler's loop;
// an ask leaves its promise behind, to be fulfilled by ServerEndpoint::send.
class ServerInbox final : public actors::Actor {
 public:
  explicit ServerInbox(std::shared_ptr<ServerEndpoint::Shared> s) : s_(std::move(s)) {
    handle<SchedWire>([this](const SchedWire& w, const actors::MessageContext& ctx) -> Status {
      auto m = decode_message(w.bytes.data(), w.bytes.size());
      if (!m.ok()) {
        log()->warn("dropped a message from {}: {}", ctx.sender().to_string(), m.status().to_string());
        return m.status();
      }
      std::string peer;
      if (ctx.is_ask()) {
        std::lock_guard<std::mutex> lk(s_->mu);
        peer = fmt::format("ask:{}", ++s_->next_ask);
        s_->asks.emplace(
            peer, ServerEndpoint::Shared::PendingAsk{make_response_promise(), ctx.deadline_unix_nanos()});
      } else if (ctx.sender().valid()) {
        peer = ctx.sender().to_string();
      }
      s_->queue.push(Incoming{std::move(peer), std::move(m).value(), std::chrono::steady_clock::now()});
      return ok_status();
    });
  }

 private:
  std::shared_ptr<ServerEndpoint::Shared> s_;
};

class ClientInbox final : public actors::Actor {
 public:
  ClientInbox(std::shared_ptr<MessageQueue> q, actors::ActorRef scheduler) : q_(std::move(q)), scheduler_(std::move(scheduler)) {
    handle<SchedWire>([this](const SchedWire& w) {
      auto m = decode_message(w.bytes.data(), w.bytes.size());
      if (!m.ok()) {
        log()->warn("dropped a message from the scheduler: {}", m.status().to_string());
        return;
      }
      q_->push(Incoming{"", std::move(m).value()});
    });
    handle<SchedOutgoing>([this](const SchedOutgoing& o) { tell(scheduler_, SchedWire{o.bytes}); });
  }

 private:
  std::shared_ptr<MessageQueue> q_;
  actors::ActorRef scheduler_;
};

}  // namespace

Result<CurveKeyPair> derive_job_keypair(const CurveKeyPair& scheduler_keys, const std::string& job_id) {
  if (scheduler_keys.secret_key.size() != control::kZ85KeyChars) {
    return invalid_argument("deriving job {}'s key: the scheduler's secret key is not a 40-character Z85 key",
                            job_id);
  }
  uint8_t secret[32];
  if (!zmq_z85_decode(secret, scheduler_keys.secret_key.c_str())) {
    return invalid_argument("deriving job {}'s key: the scheduler's secret key is not valid Z85", job_id);
  }
  const std::string msg = "troupe job key v1\n" + job_id;
  uint8_t derived[32];
  crypto_generichash(derived, sizeof derived, reinterpret_cast<const uint8_t*>(msg.data()), msg.size(),
                     secret, sizeof secret);
  sodium_memzero(secret, sizeof secret);
  char z85[41] = {0};
  zmq_z85_encode(z85, derived, sizeof derived);
  sodium_memzero(derived, sizeof derived);
  CurveKeyPair kp;
  kp.secret_key = z85;
  TROUPE_ASSIGN_OR_RETURN(kp.public_key, control::curve_public_key_of(kp.secret_key));
  return kp;
}

Result<std::unique_ptr<ServerEndpoint>> ServerEndpoint::bind(const std::string& endpoint,
                                                             const ServerSecurity& sec, int io_threads,
                                                             bool ipc_same_user) {
  std::unique_ptr<ServerEndpoint> s(new ServerEndpoint());
  s->shared_ = std::make_shared<Shared>();
  std::string ep = endpoint;
  if (ep.size() > 2 && ep.compare(ep.size() - 2, 2, ":0") == 0 && ep.rfind("tcp://", 0) == 0) {
    ep = ep.substr(0, ep.size() - 1) + "*";  // "any free port"
  }
  actors::ActorSystemOptions o;
  o.node_id = kSchedulerNode;
  o.threads = 1;
  o.network = transport_options(kSchedulerNode, ep);
  o.network->io_threads = io_threads;
  o.network->ipc_same_user = ipc_same_user;
  if (sec.server_keys) {
    if (sec.allowed_client_keys.empty()) {
      return invalid_argument("CURVE is configured but no client key is allowed (--allow-keys)");
    }
    o.network->curve.own = *sec.server_keys;
    o.network->curve.allowed_client_keys.insert(sec.allowed_client_keys.begin(), sec.allowed_client_keys.end());
    o.network->allow_non_loopback = true;
  } else {
    o.network->allow_non_loopback = sec.allow_insecure_non_loopback;
  }
  auto sys = actors::ActorSystem::create(std::move(o));
  if (!sys.ok()) return sys.status().with_context(fmt::format("cannot listen on {}", endpoint));
  s->system_ = std::move(sys).value();
  auto inbox = s->system_->spawn<ServerInbox>(kSchedulerActor, s->shared_);
  if (!inbox.ok()) return inbox.status();
  s->bound_ = s->system_->endpoint();
  return s;
}

ServerEndpoint::~ServerEndpoint() {
  if (system_) system_->shutdown();
  std::lock_guard<std::mutex> lk(shared_->mu);
  for (auto& [peer, p] : shared_->asks) p.promise.fail(cancelled("the scheduler is shutting down"));
  shared_->asks.clear();
}

std::vector<Incoming> ServerEndpoint::poll(std::chrono::milliseconds timeout) { return shared_->queue.take(timeout); }

size_t ServerEndpoint::expire_asks(std::chrono::milliseconds grace) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  const int64_t limit = now - std::chrono::duration_cast<std::chrono::nanoseconds>(grace).count();
  std::vector<actors::ResponsePromise> expired;  // failed (to nobody) outside the lock
  {
    std::lock_guard<std::mutex> lk(shared_->mu);
    for (auto it = shared_->asks.begin(); it != shared_->asks.end();) {
      if (it->second.deadline_unix_nanos != 0 && it->second.deadline_unix_nanos < limit) {
        expired.push_back(std::move(it->second.promise));
        it = shared_->asks.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& p : expired) p.fail(deadline_exceeded("no answer before the asker's deadline"));
  return expired.size();
}

size_t ServerEndpoint::pending_asks() const {
  std::lock_guard<std::mutex> lk(shared_->mu);
  return shared_->asks.size();
}

int ServerEndpoint::wake_fd() const {
  return shared_->queue.fd();
}

bool ServerEndpoint::send(const std::string& peer, const Message& msg) {
  SchedWire w{encode_message(msg)};
  if (peer.rfind("ask:", 0) == 0) {
    actors::ResponsePromise p;
    {
      std::lock_guard<std::mutex> lk(shared_->mu);
      auto it = shared_->asks.find(peer);
      if (it == shared_->asks.end()) return false;  // answered already
      p = std::move(it->second.promise);
      shared_->asks.erase(it);
    }
    p.deliver(w);
    return true;
  }
  auto ref = actors::ActorRef::parse(peer);
  if (!ref.ok()) return false;
  Status s = system_->tell(*ref, w);
  if (!s.ok()) log()->debug("send to {}: {}", peer, s.to_string());
  return s.ok();
}

// ------------------------------------------------------------------ ClientEndpoint

Result<std::unique_ptr<ClientEndpoint>> ClientEndpoint::connect(const std::string& endpoint, const ClientSecurity& sec,
                                                                const std::string& identity) {
  std::unique_ptr<ClientEndpoint> c(new ClientEndpoint());
  c->endpoint_ = endpoint;
  c->sec_ = sec;
  c->node_ = sanitize_node(identity);
  c->inbox_ = std::make_shared<MessageQueue>();
  actors::ActorSystemOptions o;
  o.node_id = c->node_;
  o.threads = 1;
  o.network = transport_options(c->node_, "");  // connect-only
  if (!sec.server_public_key.empty()) {
    if (!sec.client_keys || sec.client_keys->secret_key.empty()) {
      return invalid_argument("the scheduler uses CURVE: a client key pair (--curve-key) is needed");
    }
    o.network->curve.own = *sec.client_keys;
  }
  auto sys = actors::ActorSystem::create(std::move(o));
  if (!sys.ok()) return sys.status();
  c->system_ = std::move(sys).value();
  // With TROUPE_HOST_ADDR set (an agent's --host-addr, and its job processes) the
  // connection leaves from that address (ZeroMQ's "tcp://source:0;dest:port").
  std::string via = endpoint;
  if (std::optional<std::string> src = env::get(job_env::kHostAddr);
      src && via.rfind("tcp://", 0) == 0 && via.find(';') == std::string::npos) {
    via = fmt::format("tcp://{}:0;{}", *src, via.substr(6));
  }
  Status st = c->system_->connect(kSchedulerNode, via, sec.server_public_key);
  if (!st.ok()) return invalid_argument("cannot connect to '{}': {}", endpoint, st.message());
  auto inbox = c->system_->spawn<ClientInbox>("inbox", c->inbox_, actors::ActorRef(kSchedulerNode, kSchedulerActor));
  if (!inbox.ok()) return inbox.status();
  return c;
}

ClientEndpoint::~ClientEndpoint() {
  if (system_) system_->shutdown();
}

int ClientEndpoint::wake_fd() const { return inbox_->fd(); }

bool ClientEndpoint::send(const Message& msg) {
  return system_->tell(actors::ActorRef(node_, "inbox"), SchedOutgoing{encode_message(msg)}).ok();
}

std::optional<Message> ClientEndpoint::receive(std::chrono::milliseconds timeout) {
  // One at a time, in arrival order (taking all and queueing the rest again would put
  // them behind what arrived meanwhile: an agent saw a spawn before the kill sent ahead
  // of it).
  auto got = inbox_->take_one(timeout);
  if (!got) return std::nullopt;
  return std::move(got->msg);
}

Result<Reply> ClientEndpoint::request(Payload payload, std::chrono::milliseconds timeout) {
  Message m{next_request_++, std::move(payload)};
  auto fut = system_->ask<SchedWire>(actors::ActorRef(kSchedulerNode, kSchedulerActor), SchedWire{encode_message(m)},
                                     std::chrono::duration_cast<actors::Duration>(timeout));
  if (fut.wait_for(timeout + std::chrono::seconds(2)) != std::future_status::ready) {
    return diagnose(timeout, deadline_exceeded("no answer"));
  }
  auto r = fut.get();
  if (!r.ok()) {
    if (r.status().code() == StatusCode::kDeadlineExceeded || r.status().code() == StatusCode::kUnavailable) {
      return diagnose(timeout, r.status());
    }
    return r.status();
  }
  auto msg = decode_message(r->bytes.data(), r->bytes.size());
  if (!msg.ok()) return msg.status();
  auto* rep = std::get_if<Reply>(&msg->payload);
  if (!rep) return internal_error("the scheduler answered with a {} message", payload_name(msg->payload));
  return *rep;
}

Status ClientEndpoint::diagnose(std::chrono::milliseconds timeout, const Status& original) {
  Status probe = probe_connection(endpoint_, sec_, std::min(timeout, std::chrono::milliseconds(2000)));
  if (probe.code() == StatusCode::kPermissionDenied) return probe;
  if (probe.code() == StatusCode::kUnavailable) {
    return unavailable("cannot reach a scheduler at {} (nothing accepted the connection within {} ms)", endpoint_,
                       timeout.count());
  }
  return unavailable("the scheduler at {} did not answer within {} ms ({})", endpoint_, timeout.count(),
                     original.message());
}

Status probe_connection(const std::string& endpoint, const ClientSecurity& sec, std::chrono::milliseconds timeout) {
  try {
    zmq::context_t ctx(1);
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    if (!sec.server_public_key.empty() && sec.client_keys) {
      s.set(zmq::sockopt::curve_serverkey, sec.server_public_key);
      s.set(zmq::sockopt::curve_publickey, sec.client_keys->public_key);
      s.set(zmq::sockopt::curve_secretkey, sec.client_keys->secret_key);
    }
    std::string mon = fmt::format("inproc://troupe-probe-{}", static_cast<const void*>(&s));
    zmq_socket_monitor(s.handle(), mon.c_str(),
                       ZMQ_EVENT_CONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                           ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL);
    zmq::socket_t m(ctx, zmq::socket_type::pair);
    m.set(zmq::sockopt::linger, 0);
    m.connect(mon);
    s.connect(endpoint);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    bool connected = false;
    constexpr int kHandshakeFailuresToRefuse = 3;
    int handshake_failures = 0;
    Status result = unavailable("no connection to {}", endpoint);
    while (std::chrono::steady_clock::now() < deadline) {
      zmq::pollitem_t item{m.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(20));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(m, std::back_inserter(frames))) continue;
      if (frames.empty() || frames[0].size() < 2) continue;
      uint16_t ev;
      std::memcpy(&ev, frames[0].data(), 2);
      if (ev == ZMQ_EVENT_CONNECTED) connected = true;
      if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        result = ok_status();
        break;
      }
      // A ZAP refusal (FAILED_AUTH) is final. A protocol / no-detail failure is also what a
      // scheduler that is stopping or starting produces (the connection closes in the
      // middle of the greeting), so only a repeated one (ZeroMQ reconnects every ~100 ms)
      // means the credentials are wrong: a restart must not read as a refusal.
      const bool refused = ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ||
                           ((ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) &&
                            ++handshake_failures >= kHandshakeFailuresToRefuse);
      if (refused) {
        result = permission_denied(
            "the scheduler at {} refused this client's credentials ({}: wrong --curve-key / --scheduler-key, "
            "or the key is not in its allow-list)",
            endpoint, sec.server_public_key.empty() ? "it requires CURVE" : "CURVE handshake failed");
        break;
      }
    }
    if (connected && result.code() == StatusCode::kUnavailable) result = deadline_exceeded("connected, no handshake");
    zmq_socket_monitor(s.handle(), nullptr, 0);
    return result;
  } catch (const zmq::error_t& e) {
    return invalid_argument("cannot connect to '{}': {}", endpoint, e.what());
  }
}

}  // namespace troupe::sched
