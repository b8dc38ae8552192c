// scheduler/transport.h — defines the scheduler's control-plane endpoints over ZeroMQ:
// ServerEndpoint (ROUTER, bound by troupe-scheduler; CURVE with an allow-list of client
// keys checked by a ZAP handler when keys are configured), ClientEndpoint (DEALER used by
// agents, job processes and the CLI, with request/reply under a deadline and a clear
// error for an unreachable or refusing scheduler), CURVE key pairs and their files, and
// normalize_endpoint ("host:port" -> "tcp://host:port").
//
// Framing: a DEALER sends one frame (an encoded Message); the ROUTER sees [peer id, frame].
// Every socket has linger=0, a message size limit and ZMTP heartbeats. Sockets are not
// thread-safe: each endpoint belongs to the thread that created it.
#pragma once

#include <zmq.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "scheduler/protocol.h"

namespace troupe::sched {

struct CurveKeyPair {
  std::string public_key;  // 40-char Z85
  std::string secret_key;
};

Result<CurveKeyPair> generate_curve_keypair();
// Key files: "public-key = <z85>" and "secret-key = <z85>" lines; '#' starts a comment.
// A public-only file (no secret line) is what a peer's allow-list or server key needs.
Status write_key_file(const std::string& path, const CurveKeyPair& keys, bool include_secret);
Result<CurveKeyPair> read_key_file(const std::string& path);
// Reads public keys from each path: a key file or a directory of *.pub / *.key files.
Result<std::vector<std::string>> read_public_keys(const std::vector<std::string>& paths);

// "host:port" -> "tcp://host:port"; "tcp://..", "ipc://..", "inproc://.." pass through.
Result<std::string> normalize_endpoint(const std::string& addr);

struct ServerSecurity {
  std::optional<CurveKeyPair> server_keys;        // unset: plain TCP (loopback only by default)
  std::vector<std::string> allowed_client_keys;   // public keys; required when server_keys set
};

struct ClientSecurity {
  std::string server_public_key;                  // empty: plain TCP
  std::optional<CurveKeyPair> client_keys;
};

struct Incoming {
  std::string peer;   // ROUTER routing id of the sender
  Message msg;
};

class ServerEndpoint {
 public:
  // Binds `endpoint` ("tcp://127.0.0.1:0" picks a free port: see bound_endpoint()).
  static Result<std::unique_ptr<ServerEndpoint>> bind(const std::string& endpoint, const ServerSecurity& sec);
  ~ServerEndpoint();

  // Waits up to `timeout` for traffic, serves ZAP requests, and returns the decoded
  // messages that arrived. Malformed messages are logged and dropped.
  std::vector<Incoming> poll(std::chrono::milliseconds timeout);
  // False when the peer is gone (EHOSTUNREACH) or its queue is full.
  bool send(const std::string& peer, const Message& msg);

  const std::string& bound_endpoint() const { return bound_; }
  uint64_t dropped_messages() const { return dropped_; }
  uint64_t refused_clients() const { return refused_; }

 private:
  ServerEndpoint() = default;
  void serve_zap();

  zmq::context_t ctx_{1};
  std::optional<zmq::socket_t> router_;
  std::optional<zmq::socket_t> zap_;
  std::set<std::string> allowed_;
  std::string bound_;
  uint64_t dropped_ = 0;
  uint64_t refused_ = 0;
};

class ClientEndpoint {
 public:
  // Connects (asynchronously) to `endpoint`; `identity` becomes the routing id (a stable
  // one lets a restarted peer take over its old connection).
  static Result<std::unique_ptr<ClientEndpoint>> connect(const std::string& endpoint, const ClientSecurity& sec,
                                                         const std::string& identity);
  ~ClientEndpoint();

  bool send(const Message& msg);
  // Receives one message within `timeout` (nullopt on timeout; bad frames are dropped).
  std::optional<Message> receive(std::chrono::milliseconds timeout);
  // Sends `payload` with a fresh request id and waits for the Reply carrying that id;
  // other messages arriving meanwhile are dropped. Errors: kPermissionDenied when the
  // scheduler refuses our key, kUnavailable when nothing answered before the deadline.
  Result<Reply> request(Payload payload, std::chrono::milliseconds timeout);

  // Polls the socket monitor: true once a CURVE handshake was refused.
  bool auth_refused();
  bool ever_connected();
  const std::string& endpoint() const { return endpoint_; }
  zmq::socket_t& socket() { return *sock_; }

 private:
  ClientEndpoint() = default;
  void drain_monitor();

  zmq::context_t ctx_{1};
  std::optional<zmq::socket_t> sock_;
  std::optional<zmq::socket_t> monitor_;
  std::string endpoint_;
  uint64_t next_request_ = 1;
  bool auth_refused_ = false;
  bool connected_ = false;
};

int64_t wall_ms();  // milliseconds since the Unix epoch

}  // namespace troupe::sched
