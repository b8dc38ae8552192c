// scheduler/client/protocol.h — defines the plain C++ messages exchanged by troupe-scheduler,
// troupe-agent, job processes and the troupe CLI (Message and its payloads), and
// encode_message / decode_message, the codec over scheduler/client/protocol.capnp.
//
// Cap'n Proto stays inside codec.cc (compiled as C++17, see dependencies.md §7); callers
// see only these structs. decode_message never throws: malformed, truncated, oversized or
// unknown-union input comes back as a DataLoss/InvalidArgument status with the reason.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "core/status.h"

namespace troupe::sched {

inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kMaxMessageBytes = size_t{16} << 20;  // also the socket limit

struct ProcStatus {
  std::string job_id;
  std::string name;
  uint64_t epoch = 0;
  int32_t pid = 0;
  bool running = false;
  int32_t exit_code = 0;
  int32_t term_signal = 0;
  std::string error;
  int64_t time_ms = 0;
};

struct SpawnRequest {
  std::string job_id;
  std::string name;
  uint64_t epoch = 0;
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
  std::string work_dir;
  // With CURVE: the job's secret key (Z85). Never an environment entry: the agent writes
  // it to a 0600 file and hands the process that file's path (job_env::kJobSecretKeyFile).
  std::string job_secret_key;
};

struct KillRequest {
  std::string job_id;
  std::string name;  // empty: every process of the job
  int32_t signal = 15;
  int32_t grace_ms = 2000;
};

struct RegisterAgent {
  std::string agent_id;
  std::string host;
  int32_t slots = 0;
  int32_t gpus = 0;
  std::vector<ProcStatus> procs;
};

struct RegisterAck {
  uint64_t incarnation = 0;
  int32_t heartbeat_ms = 0;
};

// Beats carry the sender's wall clock (sent_at_ms, 0: unknown): the scheduler measures how
// far behind its own receive path is from them (scheduler/daemons/receive_lag.h).
struct AgentHeartbeat {
  std::string agent_id;
  uint64_t incarnation = 0;
  int64_t sent_at_ms = 0;
  // Its snapshot keeper (checkpoint/snapshot_keeper.h): bytes held, parts, copies.
  uint64_t snapshot_bytes = 0;
  int32_t snapshot_parts = 0;
  int32_t snapshot_copies = 0;
};

struct Reregister {};

struct ProcBeat {
  std::string job_id;
  std::string name;
  uint64_t epoch = 0;
  int32_t pid = 0;
  bool hello = false;
  std::string actor_node;  // the process's actor system (node id, endpoint), if any
  std::string endpoint;
  int64_t sent_at_ms = 0;
};

enum class StoreOp : uint8_t { kSet, kGet, kWait, kContains };

struct StoreRequest {
  StoreOp op = StoreOp::kGet;
  std::string job_id;
  uint64_t epoch = 0;
  std::vector<std::string> keys;
  std::string value;
  int32_t timeout_ms = 0;
};

struct ExitAck {
  std::string job_id;
  std::string name;
  uint64_t epoch = 0;
  int32_t pid = 0;
};

struct LogsRequest {
  std::string job_id;
  std::string name;
  int64_t offset = 0;
  int32_t max_bytes = 0;
};

struct Reply {
  StatusCode code = StatusCode::kOk;
  std::string message;
  std::string body;
  std::string data;
  int64_t offset = 0;

  Status status() const { return code == StatusCode::kOk ? Status() : Status(code, message); }
  static Reply of(const Status& s) { return Reply{s.code(), s.message(), {}, {}, 0}; }
};

struct PlaceActors {
  std::string job_id;
  uint64_t epoch = 0;
  std::vector<std::pair<std::string, std::string>> placements;  // actor -> process name
  // The parallel layout the driver runs the job's workers as (ParallelLayout::to_string();
  // at most kMaxLayoutBytes), which only the app knows when the job was submitted without
  // --layout; empty: not said.
  std::string layout;
};
inline constexpr size_t kMaxLayoutBytes = 64;

// A local session's message relayed by its node's agent (protocol.capnp, Relay). `msg` is
// the encoded inner Message; decode_message checks that `session` is 1..kMaxRelaySessionBytes
// of printable ASCII without spaces. Receivers decode `msg` themselves and drop an inner
// relay (nesting is not allowed).
inline constexpr size_t kMaxRelaySessionBytes = 256;
struct RelayedMessage {
  std::string session;
  std::string msg;
};

// A job process's health report (protocol.capnp, HealthReport); metric names are
// observe/metric.h's. decode_message refuses more than kMaxHealthMetrics of them.
inline constexpr size_t kMaxHealthMetrics = 256;
struct HealthReport {
  std::string job_id;
  std::string name;
  uint64_t epoch = 0;
  int32_t pid = 0;
  int64_t sent_at_ms = 0;
  std::vector<std::pair<std::string, double>> metrics;
};

// Typed wrappers so the variant can tell apart payloads of the same C++ type.
struct ProcStarted { ProcStatus proc; };
struct ProcExited { ProcStatus proc; };
struct SubmitJob { std::string spec_json; };
struct StatusQuery { std::string job_id; };
struct CancelJob { std::string job_id; };
struct LogsQuery { LogsRequest req; };
struct AgentLogsQuery { LogsRequest req; };

using Payload =
    std::variant<RegisterAgent, RegisterAck, AgentHeartbeat, Reregister, SpawnRequest, KillRequest,
                 ProcStarted, ProcExited, ExitAck, ProcBeat, StoreRequest, SubmitJob, StatusQuery, CancelJob,
                 LogsQuery, Reply, AgentLogsQuery, PlaceActors, RelayedMessage, HealthReport>;

struct Message {
  uint64_t request_id = 0;
  Payload payload;
};

// A name for logs: "spawn", "procExited", ...
const char* payload_name(const Payload& p);

std::string encode_message(const Message& m);
Result<Message> decode_message(const void* data, size_t size);

}  // namespace troupe::sched
