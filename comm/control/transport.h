// comm/control/transport.h — defines Transport: one process's ("node's") control-plane
// endpoint over ZeroMQ, carrying Envelopes between nodes.
//
// Sockets. The node binds one ROUTER (unless bind_endpoint is empty) and, for each peer
// it connect()s to, owns one DEALER whose routing id is this node's id. A message to
// node X leaves through our DEALER to X when we connected to X, else through our ROUTER
// to X's DEALER when X connected to us (router_mandatory: an unknown id fails instead of
// vanishing). Every frame is one encoded Envelope; the ROUTER sees [node id][envelope].
// The sender's node in each envelope must match the connection it arrived on, so a peer
// cannot speak for another node. Every socket has linger=0 and maxmsgsize; DEALERs have
// ZMTP heartbeats and automatic reconnection, the ROUTER TCP keepalive (docs/control-plane.md,
// "Liveness"); router_handover lets a restarted peer reclaim its id.
//
// Liveness. Besides ZMTP heartbeats (which libzmq's I/O thread answers even when the
// application is stuck), the transport sends an application Heartbeat envelope to every
// peer each heartbeat_interval from its own loop thread, and declares a peer down after
// heartbeat_timeout without traffic (DownReason::kHeartbeatTimeout), or at once when a
// DEALER's connection closes (kConnectionLost). A stopped process (SIGSTOP) or a stuck
// loop therefore looks dead. A peer heard again later is reported up again.
//
// Security. bind_endpoint defaults to loopback. With curve.enabled(), the ROUTER is a
// CURVE server whose ZAP handler accepts only curve.allowed_client_keys, and each DEALER
// is a CURVE client that must be given the peer's public key.
//
// Threads. One loop thread owns every socket; callbacks run on it and must not block
// (hand work to another thread). All public methods are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/control/clock.h"
#include "comm/control/codec.h"
#include "comm/control/curve.h"
#include "comm/control/envelope.h"
#include "core/status.h"

namespace zmq {
class context_t;
}

namespace troupe::control {

struct TransportOptions {
  // This node's id: the routing id of its DEALERs and the `node` of its actor addresses.
  // Non-empty, at most kMaxNameBytes, no '/'.
  std::string node_id;
  // Where the ROUTER binds: "tcp://127.0.0.1:*" (OS-assigned port), "ipc:///path",
  // "inproc://name" (needs a shared context). Empty: do not bind (connect-only client).
  std::string bind_endpoint = "tcp://127.0.0.1:*";
  // Binding to a non-loopback tcp address is refused unless this is set (docs/cluster.md,
  // "Security"); set it only with CURVE enabled or on a trusted network.
  bool allow_non_loopback = false;
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{3000};
  size_t max_message_bytes = size_t{16} << 20;
  CurveConfig curve;  // disabled by default
  // For an ipc:// bind without CURVE: admit only peers running as this process's uid
  // (ZAP over the connection's SO_PEERCRED, serve_zap_request_same_uid). Refused with CURVE
  // or another transport.
  bool ipc_same_user = false;
  // Share one context between transports of one process to use inproc endpoints; null:
  // the transport owns a context. Not owned; must outlive the transport.
  zmq::context_t* context = nullptr;
  // ZeroMQ I/O threads of the transport's own context (ignored with `context`): they read,
  // write and (with CURVE) encrypt, decrypt and run every handshake. One carries a node
  // with a few peers; a server with thousands of CURVE peers needs more (scheduler).
  int io_threads = 1;
  const Clock* clock = nullptr;  // null: a SystemClock owned by the transport
};

struct TransportCallbacks {
  // A decoded envelope from `from_node` (heartbeats are consumed by the transport).
  std::function<void(Envelope&& e, const std::string& from_node)> on_envelope;
  // A peer was heard for the first time, or again after being down.
  std::function<void(const std::string& node)> on_peer_up;
  // A peer was declared down (heartbeat timeout or connection lost).
  std::function<void(const std::string& node, DownReason reason, const std::string& text)>
      on_peer_down;
  // An envelope accepted by send() could not be handed to ZeroMQ (no route, queue full).
  std::function<void(Envelope&& e, const Status& why)> on_undeliverable;
};

struct TransportStats {
  uint64_t envelopes_sent = 0;
  uint64_t envelopes_received = 0;  // including heartbeats
  uint64_t frames_dropped = 0;      // malformed, unauthenticated-sender or misrouted frames
  uint64_t send_failures = 0;
  uint64_t drops_not_logged = 0;  // dropped frames whose warning the per-peer rate limit held back
};

class Transport {
 public:
  // Creates the sockets, binds, and starts the loop thread. Fails on bad options or when
  // the bind fails (address in use, bad endpoint).
  static Result<std::unique_ptr<Transport>> start(TransportOptions opts, TransportCallbacks cb);
  ~Transport();  // stop()s
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  const std::string& node_id() const;
  // The bound endpoint with the OS-assigned port filled in ("tcp://127.0.0.1:40123");
  // empty when not bound.
  const std::string& endpoint() const;

  // Opens (or replaces) the DEALER to `node` at `endpoint`. `server_public_key` (Z85) is
  // required when CURVE is enabled. Returns once the socket is connecting; delivery
  // starts when the connection is up (messages sent before that are queued).
  Status connect(const std::string& node, const std::string& endpoint,
                 const std::string& server_public_key = "");

  // Encodes `e` on the calling thread and queues it for `node`. Errors: encoding
  // failures, FailedPrecondition after stop(). Failures after queuing go to
  // on_undeliverable.
  Status send(const std::string& node, const Envelope& e);

  // True when `node` is currently considered alive.
  bool is_peer_up(const std::string& node) const;

  TransportStats stats() const;

  // Stops the loop thread and closes every socket, after telling every live peer it is
  // leaving (a node-level Down with reason exit, given up to 200 ms to go out; other queued
  // frames are dropped). A peer that said goodbye is reported to on_peer_down as kExit
  // ("<node> left: ...") when its connection closes or its heartbeats stop.
  // Idempotent. Callbacks are not called after stop() returns.
  void stop();

  class Impl;

 private:
  explicit Transport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True for tcp endpoints whose host is 127.0.0.0/8, ::1 or localhost, and for ipc/inproc.
bool is_loopback_endpoint(const std::string& endpoint);

}  // namespace troupe::control
