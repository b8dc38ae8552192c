// scheduler/client/transport.h — defines the scheduler's control-plane endpoints on top of the
// actor runtime (actors/actor_system.h over comm/control): ServerEndpoint (the
// scheduler's node "scheduler" with its inbox actor "scheduler") and ClientEndpoint (a
// node per agent, job process or CLI, with an inbox actor), CURVE key files (the
// comm/control format that `troupe keygen` writes), and
// normalize_endpoint ("host:port" -> "tcp://host:port").
//
// Every scheduler message (scheduler/client/protocol.h, Cap'n Proto encoded) travels as one
// actor message of type kSchedWireTypeId. Client requests are actor asks with deadlines
// (the scheduler may answer later, e.g. a rendezvous wait); agent traffic is tells
// between the two inbox actors. The transport gives loopback-by-default, CURVE with a
// ZAP allow-list, size limits and reconnection; the scheduler keeps its own per-process
// heartbeats on top (ProcBeat, AgentHeartbeat) because their timeouts are per job.
//
// Threads: messages arrive on actor threads and are queued; poll()/receive() hand them to
// the owner's thread. send() may be called from the owner's thread; request() from any
// thread (each is its own ask, answered on its own).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/control/curve.h"
#include "core/status.h"
#include "scheduler/client/protocol.h"

namespace troupe::actors {
class ActorSystem;
class ResponsePromise;
class ActorRef;
}  // namespace troupe::actors

namespace troupe::sched {

inline constexpr uint64_t kSchedWireTypeId = 0x5C4E'0000'0000'0001ULL;      // a Message
inline constexpr uint64_t kSchedOutgoingTypeId = 0x5C4E'0000'0000'0002ULL;  // local: send it as me
inline constexpr const char* kSchedulerNode = "scheduler";
inline constexpr const char* kSchedulerActor = "scheduler";
// Where troupe-scheduler listens and the CLI connects when neither is told otherwise.
inline constexpr const char* kDefaultSchedulerAddress = "tcp://127.0.0.1:7460";

using CurveKeyPair = control::CurveKeyPair;

Result<CurveKeyPair> generate_curve_keypair();
// Writes <prefix>.key (both halves, mode 0600) and <prefix>.pub (comm/control format).
Status write_key_files(const std::string& prefix, const CurveKeyPair& keys);
Result<CurveKeyPair> read_key_file(const std::string& path);
// Reads public keys from each path: a key file or a directory of *.pub / *.key files.
Result<std::vector<std::string>> read_public_keys(const std::vector<std::string>& paths);

// The CURVE key pair of one job, derived from the scheduler's secret key and the job id
// (keyed BLAKE2b): the same after a scheduler restart, unknowable without the scheduler's
// secret. Handed to the job's processes (TROUPE_JOB_PUBLIC_KEY / TROUPE_JOB_SECRET_KEY_FILE)
// for their own control planes (comm/control/host_addr.h).
Result<CurveKeyPair> derive_job_keypair(const CurveKeyPair& scheduler_keys, const std::string& job_id);

// "host:port" -> "tcp://host:port"; "tcp://..", "ipc://..", "inproc://.." pass through.
Result<std::string> normalize_endpoint(const std::string& addr);

struct ServerSecurity {
  std::optional<CurveKeyPair> server_keys;        // unset: plain TCP, loopback only
  std::vector<std::string> allowed_client_keys;   // public keys; required when server_keys set
  bool allow_insecure_non_loopback = false;       // bind a non-loopback address without CURVE
};

struct ClientSecurity {
  std::string server_public_key;                  // empty: plain TCP
  std::optional<CurveKeyPair> client_keys;
};

struct Incoming {
  std::string peer;   // where a reply goes: an actor ref "node/inbox", or a pending ask
  Message msg;
  std::chrono::steady_clock::time_point received{};  // when the inbox actor took it
};

// A thread-safe queue of messages with an eventfd that is readable while it is non-empty
// (for poll() loops that also watch other fds).
class MessageQueue {
 public:
  MessageQueue();
  ~MessageQueue();
  void push(Incoming in);
  // Waits up to `timeout` for the first message, then takes everything queued.
  std::vector<Incoming> take(std::chrono::milliseconds timeout);
  // Waits up to `timeout` for the first message and takes only it (order kept: what
  // arrives meanwhile queues behind what was there).
  std::optional<Incoming> take_one(std::chrono::milliseconds timeout);
  int fd() const { return fd_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Incoming> q_;
  int fd_ = -1;
};

class ServerEndpoint {
 public:
  // Binds `endpoint` ("tcp://127.0.0.1:0" picks a free port: see bound_endpoint()).
  // `io_threads`: ZeroMQ I/O threads (control::TransportOptions::io_threads); with CURVE
  // they run every client's handshake, about 0.3 ms of CPU each (bench/scale).
  // `ipc_same_user`: an ipc:// endpoint without CURVE that admits only this process's uid
  // (control::TransportOptions::ipc_same_user; an agent's relay).
  static Result<std::unique_ptr<ServerEndpoint>> bind(const std::string& endpoint, const ServerSecurity& sec,
                                                      int io_threads = 1, bool ipc_same_user = false);
  ~ServerEndpoint();

  // Waits up to `timeout` for messages and returns those that arrived.
  std::vector<Incoming> poll(std::chrono::milliseconds timeout);
  // Readable while poll() has something: for poll() loops (an agent's relay).
  int wake_fd() const;
  // Forgets asks whose asker's deadline passed more than `grace` ago (nobody waits for
  // their answer any more); returns how many. Call it now and then: an ask that is never
  // answered (a relayed request lost with a scheduler restart) would otherwise be kept.
  size_t expire_asks(std::chrono::milliseconds grace = std::chrono::milliseconds(1000));
  size_t pending_asks() const;  // asks not yet answered
  // Sends to an Incoming's peer. A reply to an ask is delivered once; later sends to the
  // same peer are dropped. False when the message could not be handed to the transport.
  bool send(const std::string& peer, const Message& msg);

  const std::string& bound_endpoint() const { return bound_; }

  struct Shared;  // state shared with the inbox actor

 private:
  ServerEndpoint() = default;
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<actors::ActorSystem> system_;
  std::string bound_;
};

class ClientEndpoint {
 public:
  // Connects (asynchronously) to the scheduler at `endpoint`; `identity` becomes this
  // node's id (unique per process and role; '/' is replaced).
  static Result<std::unique_ptr<ClientEndpoint>> connect(const std::string& endpoint, const ClientSecurity& sec,
                                                         const std::string& identity);
  ~ClientEndpoint();

  // Tells the scheduler `msg` (from this node's inbox, so it can answer with a tell).
  bool send(const Message& msg);
  // Receives one message within `timeout` (nullopt on timeout).
  std::optional<Message> receive(std::chrono::milliseconds timeout);
  // Readable while receive() has something: for poll() loops.
  int wake_fd() const;
  // Asks the scheduler and waits for its Reply (thread-safe: concurrent requests each wait
  // for their own answer). Errors: kPermissionDenied when the scheduler refuses our CURVE
  // key, kUnavailable when nothing answered in time.
  Result<Reply> request(Payload payload, std::chrono::milliseconds timeout);

  const std::string& endpoint() const { return endpoint_; }

 private:
  ClientEndpoint() = default;
  Status diagnose(std::chrono::milliseconds timeout, const Status& original);

  std::shared_ptr<MessageQueue> inbox_;
  std::unique_ptr<actors::ActorSystem> system_;
  std::string endpoint_;
  std::string node_;
  ClientSecurity sec_;
  std::atomic<uint64_t> next_request_{1};
};

// Opens a bare ZeroMQ connection with `sec` and watches the handshake: Ok when it
// succeeds, kPermissionDenied when the server refuses the key or mechanism, kUnavailable
// when no connection could be made within `timeout`.
Status probe_connection(const std::string& endpoint, const ClientSecurity& sec, std::chrono::milliseconds timeout);

int64_t wall_ms();  // milliseconds since the Unix epoch

}  // namespace troupe::sched
