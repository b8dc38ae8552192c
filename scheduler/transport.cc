// scheduler/transport.cc — ZeroMQ ROUTER/DEALER endpoints, CURVE keys and the ZAP handler.
#include "scheduler/transport.h"

#include <zmq_addon.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/logging.h"

namespace troupe::sched {
namespace {

constexpr int kHeartbeatIvlMs = 500;
constexpr int kHeartbeatTimeoutMs = 3000;

std::shared_ptr<spdlog::logger> log() {
  static auto l = make_logger("transport");
  return l;
}

void common_options(zmq::socket_t& s) {
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
  s.set(zmq::sockopt::heartbeat_ivl, kHeartbeatIvlMs);
  s.set(zmq::sockopt::heartbeat_timeout, kHeartbeatTimeoutMs);
  s.set(zmq::sockopt::heartbeat_ttl, kHeartbeatTimeoutMs);
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n\"");
  size_t e = s.find_last_not_of(" \t\r\n\"");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

bool valid_z85_key(const std::string& k) {
  uint8_t raw[32];
  return k.size() == 40 && zmq_z85_decode(raw, k.c_str()) != nullptr;
}

}  // namespace

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<CurveKeyPair> generate_curve_keypair() {
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) return internal_error("zmq_curve_keypair: {}", zmq_strerror(zmq_errno()));
  return CurveKeyPair{pub, sec};
}

Status write_key_file(const std::string& path, const CurveKeyPair& keys, bool include_secret) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return io_error("cannot write key file {}", tmp);
    f << "# Troupe CURVE key " << (include_secret ? "pair: keep this file private" : "(public part)") << "\n";
    f << "public-key = \"" << keys.public_key << "\"\n";
    if (include_secret) f << "secret-key = \"" << keys.secret_key << "\"\n";
    if (!f.flush()) return io_error("cannot write key file {}", tmp);
  }
  std::error_code ec;
  std::filesystem::permissions(tmp,
                               include_secret ? std::filesystem::perms::owner_read | std::filesystem::perms::owner_write
                                              : std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                                                    std::filesystem::perms::group_read |
                                                    std::filesystem::perms::others_read,
                               ec);
  std::filesystem::rename(tmp, path, ec);
  if (ec) return io_error("cannot rename {} to {}: {}", tmp, path, ec.message());
  return ok_status();
}

Result<CurveKeyPair> read_key_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return not_found("cannot read CURVE key file {}", path);
  CurveKeyPair k;
  std::string line;
  while (std::getline(f, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    auto eq = line.find('=');
    if (eq == std::string::npos) return invalid_argument("key file {}: bad line '{}'", path, line);
    std::string key = trim(line.substr(0, eq)), val = trim(line.substr(eq + 1));
    if (key == "public-key") k.public_key = val;
    else if (key == "secret-key") k.secret_key = val;
    else return invalid_argument("key file {}: unknown entry '{}'", path, key);
  }
  if (!valid_z85_key(k.public_key)) return invalid_argument("key file {}: no valid public-key (40 Z85 chars)", path);
  if (!k.secret_key.empty() && !valid_z85_key(k.secret_key)) {
    return invalid_argument("key file {}: secret-key is not 40 Z85 chars", path);
  }
  return k;
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
  for (size_t i = colon + 1; i < addr.size(); ++i) {
    if (addr[i] < '0' || addr[i] > '9') {
      if (addr.substr(colon + 1) == "*") break;
      return invalid_argument("address '{}': port '{}' is not a number", addr, addr.substr(colon + 1));
    }
  }
  return "tcp://" + addr;
}

// ---------------------------------------------------------------- ServerEndpoint

Result<std::unique_ptr<ServerEndpoint>> ServerEndpoint::bind(const std::string& endpoint, const ServerSecurity& sec) {
  std::unique_ptr<ServerEndpoint> s(new ServerEndpoint());
  try {
    if (sec.server_keys) {
      if (sec.allowed_client_keys.empty()) {
        return invalid_argument("CURVE is configured but no client key is allowed (--allow-keys)");
      }
      // The ZAP handler must be bound before any peer connects.
      s->zap_.emplace(s->ctx_, zmq::socket_type::rep);
      s->zap_->set(zmq::sockopt::linger, 0);
      s->zap_->bind("inproc://zeromq.zap.01");
      s->allowed_.insert(sec.allowed_client_keys.begin(), sec.allowed_client_keys.end());
    }
    s->router_.emplace(s->ctx_, zmq::socket_type::router);
    auto& r = *s->router_;
    common_options(r);
    r.set(zmq::sockopt::router_mandatory, true);
    r.set(zmq::sockopt::router_handover, true);
    r.set(zmq::sockopt::sndhwm, 10000);
    r.set(zmq::sockopt::rcvhwm, 10000);
    if (sec.server_keys) {
      r.set(zmq::sockopt::curve_server, true);
      r.set(zmq::sockopt::curve_secretkey, sec.server_keys->secret_key);
      r.set(zmq::sockopt::zap_domain, std::string("troupe"));
    }
    std::string ep = endpoint;
    // "tcp://host:0" means "any free port" (zmq spells it '*').
    if (ep.size() > 2 && ep.compare(ep.size() - 2, 2, ":0") == 0 && ep.rfind("tcp://", 0) == 0) {
      ep = ep.substr(0, ep.size() - 1) + "*";
    }
    r.bind(ep);
    s->bound_ = r.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return unavailable("cannot bind {}: {}", endpoint, e.what());
  }
  return s;
}

ServerEndpoint::~ServerEndpoint() {
  router_.reset();
  zap_.reset();
  ctx_.close();
}

void ServerEndpoint::serve_zap() {
  std::vector<zmq::message_t> frames;
  if (!zmq::recv_multipart(*zap_, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
  // [version, request id, domain, address, routing id, mechanism, client key...]
  std::string status = "400", text = "key not allowed";
  std::string user;
  if (frames.size() >= 7 && frames[5].to_string() == "CURVE" && frames[6].size() == 32) {
    char z85[41];
    zmq_z85_encode(z85, static_cast<const uint8_t*>(frames[6].data()), 32);
    if (allowed_.count(z85)) {
      status = "200";
      text = "OK";
      user = z85;
    } else {
      ++refused_;
      log()->warn("refused a client with CURVE key {} from {}", z85, frames[3].to_string());
    }
  } else {
    ++refused_;
    log()->warn("refused a client without a CURVE key");
  }
  std::string version = frames.size() > 0 ? frames[0].to_string() : std::string("1.0");
  std::string req = frames.size() > 1 ? frames[1].to_string() : std::string();
  std::string empty;
  std::vector<zmq::const_buffer> out = {zmq::buffer(version), zmq::buffer(req), zmq::buffer(status),
                                        zmq::buffer(text), zmq::buffer(user), zmq::buffer(empty)};
  zmq::send_multipart(*zap_, out);
}

std::vector<Incoming> ServerEndpoint::poll(std::chrono::milliseconds timeout) {
  std::vector<Incoming> out;
  zmq::pollitem_t items[2] = {{router_->handle(), 0, ZMQ_POLLIN, 0},
                              {zap_ ? zap_->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
  int n = zap_ ? 2 : 1;
  try {
    zmq::poll(items, n, timeout);
    if (n == 2 && (items[1].revents & ZMQ_POLLIN)) serve_zap();
    // Drain what is queued, bounded so timers still run under a flood.
    for (int i = 0; i < 1000; ++i) {
      std::vector<zmq::message_t> frames;
      auto got = zmq::recv_multipart(*router_, std::back_inserter(frames), zmq::recv_flags::dontwait);
      if (!got) break;
      if (frames.size() != 2) {
        ++dropped_;
        log()->warn("dropped a message of {} frames (expected 2)", frames.size());
        continue;
      }
      auto msg = decode_message(frames[1].data(), frames[1].size());
      if (!msg.ok()) {
        ++dropped_;
        log()->warn("dropped a message from peer {}: {}", frames[0].size(), msg.status().to_string());
        continue;
      }
      out.push_back(Incoming{frames[0].to_string(), std::move(msg).value()});
    }
  } catch (const zmq::error_t& e) {
    log()->error("server poll: {}", e.what());
  }
  return out;
}

bool ServerEndpoint::send(const std::string& peer, const Message& msg) {
  std::string body = encode_message(msg);
  try {
    if (!router_->send(zmq::buffer(peer), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) return false;
    return router_->send(zmq::buffer(body), zmq::send_flags::dontwait).has_value();
  } catch (const zmq::error_t& e) {
    // EHOSTUNREACH: the peer disconnected; the caller decides what that means.
    return false;
  }
}

// ---------------------------------------------------------------- ClientEndpoint

Result<std::unique_ptr<ClientEndpoint>> ClientEndpoint::connect(const std::string& endpoint,
                                                                const ClientSecurity& sec,
                                                                const std::string& identity) {
  std::unique_ptr<ClientEndpoint> c(new ClientEndpoint());
  c->endpoint_ = endpoint;
  try {
    c->sock_.emplace(c->ctx_, zmq::socket_type::dealer);
    auto& s = *c->sock_;
    common_options(s);
    s.set(zmq::sockopt::routing_id, identity);
    s.set(zmq::sockopt::reconnect_ivl, 100);
    s.set(zmq::sockopt::reconnect_ivl_max, 1000);
    s.set(zmq::sockopt::sndhwm, 10000);
    if (!sec.server_public_key.empty()) {
      if (!sec.client_keys || sec.client_keys->secret_key.empty()) {
        return invalid_argument("the scheduler uses CURVE: a client key pair (--curve-key) is needed");
      }
      s.set(zmq::sockopt::curve_serverkey, sec.server_public_key);
      s.set(zmq::sockopt::curve_publickey, sec.client_keys->public_key);
      s.set(zmq::sockopt::curve_secretkey, sec.client_keys->secret_key);
    }
    std::string mon = fmt::format("inproc://troupe-monitor-{}", static_cast<const void*>(c.get()));
    if (zmq_socket_monitor(s.handle(), mon.c_str(),
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                               ZMQ_EVENT_HANDSHAKE_SUCCEEDED) == 0) {
      c->monitor_.emplace(c->ctx_, zmq::socket_type::pair);
      c->monitor_->set(zmq::sockopt::linger, 0);
      c->monitor_->connect(mon);
    }
    s.connect(endpoint);
  } catch (const zmq::error_t& e) {
    return invalid_argument("cannot connect to '{}': {}", endpoint, e.what());
  }
  return c;
}

ClientEndpoint::~ClientEndpoint() {
  if (sock_) zmq_socket_monitor(sock_->handle(), nullptr, 0);
  monitor_.reset();
  sock_.reset();
  ctx_.close();
}

void ClientEndpoint::drain_monitor() {
  if (!monitor_) return;
  for (;;) {
    std::vector<zmq::message_t> frames;
    try {
      if (!zmq::recv_multipart(*monitor_, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
    } catch (const zmq::error_t&) {
      return;
    }
    if (frames.empty() || frames[0].size() < 2) continue;
    uint16_t event;
    std::memcpy(&event, frames[0].data(), 2);
    if (event == ZMQ_EVENT_CONNECTED) connected_ = true;
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) auth_refused_ = false;
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH || event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
        event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
      auth_refused_ = true;
    }
  }
}

bool ClientEndpoint::auth_refused() {
  drain_monitor();
  return auth_refused_;
}

bool ClientEndpoint::ever_connected() {
  drain_monitor();
  return connected_;
}

bool ClientEndpoint::send(const Message& msg) {
  std::string body = encode_message(msg);
  try {
    return sock_->send(zmq::buffer(body), zmq::send_flags::dontwait).has_value();
  } catch (const zmq::error_t&) {
    return false;
  }
}

std::optional<Message> ClientEndpoint::receive(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() < 0) left = std::chrono::milliseconds(0);
    zmq::pollitem_t item{sock_->handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, left);
      if (item.revents & ZMQ_POLLIN) {
        zmq::message_t m;
        if (sock_->recv(m, zmq::recv_flags::dontwait)) {
          auto msg = decode_message(m.data(), m.size());
          if (msg.ok()) return std::move(msg).value();
          log()->warn("dropped a message from the scheduler: {}", msg.status().to_string());
          continue;
        }
      }
    } catch (const zmq::error_t& e) {
      log()->error("client receive: {}", e.what());
      return std::nullopt;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
  }
}

Result<Reply> ClientEndpoint::request(Payload payload, std::chrono::milliseconds timeout) {
  Message m{next_request_++, std::move(payload)};
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool sent = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auth_refused()) {
      return permission_denied("the scheduler at {} refused this client's CURVE key (wrong --curve-key, or "
                               "the key is not in its allow-list)", endpoint_);
    }
    // A DEALER queues a message before the connection exists, so one send is enough.
    if (!sent) sent = send(m);
    auto got = receive(std::chrono::milliseconds(50));
    if (!got) continue;
    if (auto* r = std::get_if<Reply>(&got->payload); r && got->request_id == m.request_id) return *r;
  }
  if (auth_refused()) {
    return permission_denied("the scheduler at {} refused this client's CURVE key", endpoint_);
  }
  if (!ever_connected()) {
    return unavailable("cannot reach a scheduler at {} (nothing accepted the connection within {} ms)", endpoint_,
                       timeout.count());
  }
  return unavailable("the scheduler at {} did not answer within {} ms (is it a Troupe scheduler? does it use "
                     "CURVE while this client does not?)",
                     endpoint_, timeout.count());
}

}  // namespace troupe::sched
