// scheduler/client/codec.cc — encode_message / decode_message over scheduler/client/protocol.capnp:
// one field table per payload (core/capnp_fields.h copies both ways by it), plus the checks
// a decoded payload must pass.
// Compiled as C++17: Cap'n Proto 0.9.2 headers fail under GCC 13 in C++20 mode.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>
#include <memory>

#include "core/capnp_fields.h"
#include "scheduler/client/protocol.capnp.h"
#include "scheduler/client/protocol.h"

namespace troupe::sched {
namespace {

namespace wire = ::capnp;  // short alias for capnp helpers
namespace cc = capnp_codec;

// Field order is the order the encoder fills the message in: keep it, and the bytes stay
// those of earlier builds.

// A job's process as every process message names it.
constexpr auto kProcess = cc::fields(TROUPE_CAPNP_FIELD(job_id, JobId), TROUPE_CAPNP_FIELD(name, Name),
                                     TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(pid, Pid));
constexpr auto kProcStatus = cc::join(
    kProcess, cc::fields(TROUPE_CAPNP_FIELD(running, Running), TROUPE_CAPNP_FIELD(exit_code, ExitCode),
                         TROUPE_CAPNP_FIELD(term_signal, TermSignal), TROUPE_CAPNP_FIELD(error, Error),
                         TROUPE_CAPNP_FIELD(time_ms, TimeMs)));
constexpr auto kLogsRequest =
    cc::fields(TROUPE_CAPNP_FIELD(job_id, JobId), TROUPE_CAPNP_FIELD(name, Name),
               TROUPE_CAPNP_FIELD(offset, Offset), TROUPE_CAPNP_FIELD(max_bytes, MaxBytes));

constexpr auto kRegisterAgent = cc::fields(
    TROUPE_CAPNP_FIELD(agent_id, AgentId), TROUPE_CAPNP_FIELD(host, Host), TROUPE_CAPNP_FIELD(slots, Slots),
    TROUPE_CAPNP_FIELD(gpus, Gpus), TROUPE_CAPNP_LIST(procs, Procs, kProcStatus));
constexpr auto kRegisterAck =
    cc::fields(TROUPE_CAPNP_FIELD(incarnation, Incarnation), TROUPE_CAPNP_FIELD(heartbeat_ms, HeartbeatMs));
constexpr auto kAgentHeartbeat = cc::fields(
    TROUPE_CAPNP_FIELD(agent_id, AgentId), TROUPE_CAPNP_FIELD(incarnation, Incarnation),
    TROUPE_CAPNP_FIELD(sent_at_ms, SentAtMs), TROUPE_CAPNP_FIELD(snapshot_bytes, SnapshotBytes),
    TROUPE_CAPNP_FIELD(snapshot_parts, SnapshotParts), TROUPE_CAPNP_FIELD(snapshot_copies, SnapshotCopies));
constexpr auto kSpawn =
    cc::fields(TROUPE_CAPNP_FIELD(job_id, JobId), TROUPE_CAPNP_FIELD(name, Name),
               TROUPE_CAPNP_FIELD(job_secret_key, JobSecretKey), TROUPE_CAPNP_FIELD(epoch, Epoch),
               TROUPE_CAPNP_FIELD(argv, Argv),
               TROUPE_CAPNP_LIST(
                   env, Env, cc::fields(TROUPE_CAPNP_FIELD(first, Key), TROUPE_CAPNP_FIELD(second, Value))),
               TROUPE_CAPNP_FIELD(work_dir, WorkDir));
constexpr auto kKill = cc::fields(TROUPE_CAPNP_FIELD(job_id, JobId), TROUPE_CAPNP_FIELD(name, Name),
                                  TROUPE_CAPNP_FIELD(signal, Signal), TROUPE_CAPNP_FIELD(grace_ms, GraceMs));
constexpr auto kProcBeat = cc::join(
    kProcess, cc::fields(TROUPE_CAPNP_FIELD(hello, Hello), TROUPE_CAPNP_FIELD(actor_node, ActorNode),
                         TROUPE_CAPNP_FIELD(endpoint, Endpoint), TROUPE_CAPNP_FIELD(sent_at_ms, SentAtMs)));
constexpr auto kHealth =
    cc::join(kProcess, cc::fields(TROUPE_CAPNP_FIELD(sent_at_ms, SentAtMs),
                                  TROUPE_CAPNP_LIST(metrics, Metrics,
                                                    cc::fields(TROUPE_CAPNP_FIELD(first, Name),
                                                               TROUPE_CAPNP_FIELD(second, Value)))));
constexpr auto kPlaceActors = cc::fields(
    TROUPE_CAPNP_FIELD(job_id, JobId), TROUPE_CAPNP_FIELD(epoch, Epoch),
    TROUPE_CAPNP_LIST(placements, Placements,
                      cc::fields(TROUPE_CAPNP_FIELD(first, Actor), TROUPE_CAPNP_FIELD(second, Proc))),
    TROUPE_CAPNP_FIELD(layout, Layout));
// protocol.capnp's StoreOp numbers its ops as StoreOp does.
constexpr auto kStore =
    cc::fields(TROUPE_CAPNP_ENUM(op, Op, StoreOp::kContains), TROUPE_CAPNP_FIELD(job_id, JobId),
               TROUPE_CAPNP_FIELD(epoch, Epoch), TROUPE_CAPNP_FIELD(keys, Keys),
               TROUPE_CAPNP_FIELD(value, Value), TROUPE_CAPNP_FIELD(timeout_ms, TimeoutMs));
constexpr auto kRelay = cc::fields(TROUPE_CAPNP_FIELD(session, Session), TROUPE_CAPNP_FIELD(msg, Msg));
constexpr auto kReply = cc::fields(TROUPE_CAPNP_ENUM(code, Code, StatusCode::kIoError),
                                   TROUPE_CAPNP_FIELD(message, Message), TROUPE_CAPNP_FIELD(body, Body),
                                   TROUPE_CAPNP_FIELD(data, Data), TROUPE_CAPNP_FIELD(offset, Offset));

// The payload union of Msg: a group, a struct or a single value per payload type.
constexpr auto kPayload =
    cc::one_of(cc::alt<RegisterAgent>(TROUPE_CAPNP_WHOLE(RegisterAgent, kRegisterAgent)),
               cc::alt<RegisterAck>(TROUPE_CAPNP_WHOLE(RegisterAck, kRegisterAck)),
               cc::alt<AgentHeartbeat>(TROUPE_CAPNP_WHOLE(AgentHeartbeat, kAgentHeartbeat)),
               cc::alt<Reregister>(TROUPE_CAPNP_WHOLE(Reregister, cc::kPlain)),
               cc::alt<SpawnRequest>(TROUPE_CAPNP_WHOLE(Spawn, kSpawn)),
               cc::alt<KillRequest>(TROUPE_CAPNP_WHOLE(Kill, kKill)),
               cc::alt<ProcStarted>(TROUPE_CAPNP_STRUCT(proc, ProcStarted, kProcStatus)),
               cc::alt<ProcExited>(TROUPE_CAPNP_STRUCT(proc, ProcExited, kProcStatus)),
               cc::alt<ExitAck>(TROUPE_CAPNP_WHOLE(ExitAck, kProcess)),
               cc::alt<ProcBeat>(TROUPE_CAPNP_WHOLE(ProcBeat, kProcBeat)),
               cc::alt<StoreRequest>(TROUPE_CAPNP_WHOLE(Store, kStore)),
               cc::alt<SubmitJob>(TROUPE_CAPNP_FIELD(spec_json, Submit)),
               cc::alt<StatusQuery>(TROUPE_CAPNP_FIELD(job_id, Status)),
               cc::alt<CancelJob>(TROUPE_CAPNP_FIELD(job_id, Cancel)),
               cc::alt<LogsQuery>(TROUPE_CAPNP_STRUCT(req, Logs, kLogsRequest)),
               cc::alt<Reply>(TROUPE_CAPNP_WHOLE(Reply, kReply)),
               cc::alt<AgentLogsQuery>(TROUPE_CAPNP_STRUCT(req, LogsForAgent, kLogsRequest)),
               cc::alt<PlaceActors>(TROUPE_CAPNP_WHOLE(PlaceActors, kPlaceActors)),
               cc::alt<RelayedMessage>(TROUPE_CAPNP_WHOLE(Relay, kRelay)),
               cc::alt<HealthReport>(TROUPE_CAPNP_WHOLE(Health, kHealth)));

// The checks a decoded payload must pass beyond its wire types; most have none.
template <class T>
Status check(const T&) {
  return Status();
}

Status check(const PlaceActors& v) {
  if (v.layout.size() > kMaxLayoutBytes) {
    return invalid_argument("actor placement with a layout of {} bytes (at most {})", v.layout.size(),
                            kMaxLayoutBytes);
  }
  return Status();
}

Status check(const HealthReport& v) {
  if (v.metrics.size() > kMaxHealthMetrics) {
    return invalid_argument("health report with {} metrics (at most {})", v.metrics.size(),
                            kMaxHealthMetrics);
  }
  return Status();
}

Status check(const RelayedMessage& v) {
  if (v.session.empty() || v.session.size() > kMaxRelaySessionBytes) {
    return invalid_argument("relay with a session name of {} bytes (1..{})", v.session.size(),
                            kMaxRelaySessionBytes);
  }
  for (char c : v.session) {
    if (c < 33 || c > 126) return invalid_argument("relay with a session name that is not printable ASCII");
  }
  if (v.msg.size() < 2 * sizeof(wire::word)) return data_loss("relay of a {}-byte message", v.msg.size());
  return Status();
}

}  // namespace

const char* payload_name(const Payload& p) {
  static const char* const kNames[] = {
      "registerAgent", "registerAck", "agentHeartbeat", "reregister",  "spawn",  "kill",   "procStarted",
      "procExited",    "exitAck",     "procBeat",       "store",       "submit", "status", "cancel",
      "logs",          "reply",       "logsForAgent",   "placeActors", "relay",  "health"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == std::variant_size_v<Payload>);
  return kNames[p.index()];
}

std::string encode_message(const Message& msg) {
  wire::MallocMessageBuilder builder;
  auto m = builder.initRoot<::Msg>();
  m.setVersion(kProtocolVersion);
  m.setRequestId(msg.request_id);
  cc::write(m, kPayload, msg.payload);
  auto words = wire::messageToFlatArray(builder);
  auto bytes = words.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

Result<Message> decode_message(const void* data, size_t size) {
  if (size == 0) return data_loss("empty message");
  if (size > kMaxMessageBytes) return resource_exhausted("message of {} bytes exceeds the limit of {}", size, kMaxMessageBytes);
  if (size % sizeof(wire::word) != 0) return data_loss("message of {} bytes is not a whole number of words", size);
  // FlatArrayMessageReader needs 8-byte alignment; zmq frames carry no such guarantee.
  auto words = kj::heapArray<wire::word>(size / sizeof(wire::word));
  std::memcpy(words.begin(), data, size);
  wire::ReaderOptions opts;
  opts.traversalLimitInWords = size / sizeof(wire::word) * 4 + 1024;
  opts.nestingLimit = 16;
  Message out;
  try {
    wire::FlatArrayMessageReader reader(words.asPtr(), opts);
    auto m = reader.getRoot<::Msg>();
    if (m.getVersion() != kProtocolVersion) {
      return invalid_argument("protocol version {} (this build speaks {})", m.getVersion(), kProtocolVersion);
    }
    out.request_id = m.getRequestId();
    TROUPE_RETURN_IF_ERROR(cc::read_into(m, kPayload, out.payload, "message"));
    TROUPE_RETURN_IF_ERROR(std::visit([](const auto& v) { return check(v); }, out.payload));
  } catch (const kj::Exception& e) {
    return data_loss("undecodable message: {}", e.getDescription().cStr());
  } catch (const std::exception& e) {
    return data_loss("undecodable message: {}", e.what());
  }
  return out;
}

}  // namespace troupe::sched
