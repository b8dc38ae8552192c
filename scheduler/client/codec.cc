// scheduler/client/codec.cc — encode_message / decode_message over scheduler/client/protocol.capnp.
// Compiled as C++17: Cap'n Proto 0.9.2 headers fail under GCC 13 in C++20 mode.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>
#include <memory>

#include "scheduler/client/protocol.capnp.h"
#include "scheduler/client/protocol.h"

namespace troupe::sched {
namespace {

namespace wire = ::capnp;  // short alias for capnp helpers

void put_proc(::ProcStatus::Builder b, const ProcStatus& p) {
  b.setJobId(p.job_id);
  b.setName(p.name);
  b.setEpoch(p.epoch);
  b.setPid(p.pid);
  b.setRunning(p.running);
  b.setExitCode(p.exit_code);
  b.setTermSignal(p.term_signal);
  b.setError(p.error);
  b.setTimeMs(p.time_ms);
}

ProcStatus get_proc(::ProcStatus::Reader r) {
  ProcStatus p;
  p.job_id = r.getJobId();
  p.name = r.getName();
  p.epoch = r.getEpoch();
  p.pid = r.getPid();
  p.running = r.getRunning();
  p.exit_code = r.getExitCode();
  p.term_signal = r.getTermSignal();
  p.error = r.getError();
  p.time_ms = r.getTimeMs();
  return p;
}

void put_logs(::LogsRequest::Builder b, const LogsRequest& l) {
  b.setJobId(l.job_id);
  b.setName(l.name);
  b.setOffset(l.offset);
  b.setMaxBytes(l.max_bytes);
}

LogsRequest get_logs(::LogsRequest::Reader r) {
  return LogsRequest{r.getJobId(), r.getName(), r.getOffset(), r.getMaxBytes()};
}

kj::ArrayPtr<const kj::byte> bytes_of(const std::string& s) {
  return kj::ArrayPtr<const kj::byte>(reinterpret_cast<const kj::byte*>(s.data()), s.size());
}

std::string string_of(wire::Data::Reader d) {
  return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
}

struct Encoder {
  ::Msg::Builder m;

  void operator()(const RegisterAgent& v) {
    auto b = m.initRegisterAgent();
    b.setAgentId(v.agent_id);
    b.setHost(v.host);
    b.setSlots(v.slots);
    b.setGpus(v.gpus);
    auto procs = b.initProcs(static_cast<unsigned>(v.procs.size()));
    for (size_t i = 0; i < v.procs.size(); ++i) put_proc(procs[static_cast<unsigned>(i)], v.procs[i]);
  }
  void operator()(const RegisterAck& v) {
    auto b = m.initRegisterAck();
    b.setIncarnation(v.incarnation);
    b.setHeartbeatMs(v.heartbeat_ms);
  }
  void operator()(const AgentHeartbeat& v) {
    auto b = m.initAgentHeartbeat();
    b.setAgentId(v.agent_id);
    b.setIncarnation(v.incarnation);
    b.setSentAtMs(v.sent_at_ms);
    b.setSnapshotBytes(v.snapshot_bytes);
    b.setSnapshotParts(v.snapshot_parts);
    b.setSnapshotCopies(v.snapshot_copies);
  }
  void operator()(const Reregister&) { m.setReregister(); }
  void operator()(const SpawnRequest& v) {
    auto b = m.initSpawn();
    b.setJobId(v.job_id);
    b.setName(v.name);
    b.setJobSecretKey(v.job_secret_key);
    b.setEpoch(v.epoch);
    auto argv = b.initArgv(static_cast<unsigned>(v.argv.size()));
    for (size_t i = 0; i < v.argv.size(); ++i) argv.set(static_cast<unsigned>(i), v.argv[i]);
    auto env = b.initEnv(static_cast<unsigned>(v.env.size()));
    for (size_t i = 0; i < v.env.size(); ++i) {
      env[static_cast<unsigned>(i)].setKey(v.env[i].first);
      env[static_cast<unsigned>(i)].setValue(v.env[i].second);
    }
    b.setWorkDir(v.work_dir);
  }
  void operator()(const KillRequest& v) {
    auto b = m.initKill();
    b.setJobId(v.job_id);
    b.setName(v.name);
    b.setSignal(v.signal);
    b.setGraceMs(v.grace_ms);
  }
  void operator()(const ProcStarted& v) { put_proc(m.initProcStarted(), v.proc); }
  void operator()(const ProcExited& v) { put_proc(m.initProcExited(), v.proc); }
  void operator()(const ExitAck& v) {
    auto b = m.initExitAck();
    b.setJobId(v.job_id);
    b.setName(v.name);
    b.setEpoch(v.epoch);
    b.setPid(v.pid);
  }
  void operator()(const ProcBeat& v) {
    auto b = m.initProcBeat();
    b.setJobId(v.job_id);
    b.setName(v.name);
    b.setEpoch(v.epoch);
    b.setPid(v.pid);
    b.setHello(v.hello);
    b.setActorNode(v.actor_node);
    b.setEndpoint(v.endpoint);
    b.setSentAtMs(v.sent_at_ms);
  }
  void operator()(const HealthReport& v) {
    auto b = m.initHealth();
    b.setJobId(v.job_id);
    b.setName(v.name);
    b.setEpoch(v.epoch);
    b.setPid(v.pid);
    b.setSentAtMs(v.sent_at_ms);
    auto list = b.initMetrics(static_cast<unsigned>(v.metrics.size()));
    for (size_t i = 0; i < v.metrics.size(); ++i) {
      list[static_cast<unsigned>(i)].setName(v.metrics[i].first);
      list[static_cast<unsigned>(i)].setValue(v.metrics[i].second);
    }
  }
  void operator()(const PlaceActors& v) {
    auto b = m.initPlaceActors();
    b.setJobId(v.job_id);
    b.setEpoch(v.epoch);
    auto list = b.initPlacements(static_cast<unsigned>(v.placements.size()));
    for (size_t i = 0; i < v.placements.size(); ++i) {
      list[static_cast<unsigned>(i)].setActor(v.placements[i].first);
      list[static_cast<unsigned>(i)].setProc(v.placements[i].second);
    }
    b.setLayout(v.layout);
  }
  void operator()(const StoreRequest& v) {
    auto b = m.initStore();
    switch (v.op) {
      case StoreOp::kSet: b.setOp(::StoreOp::SET); break;
      case StoreOp::kGet: b.setOp(::StoreOp::GET); break;
      case StoreOp::kWait: b.setOp(::StoreOp::WAIT); break;
      case StoreOp::kContains: b.setOp(::StoreOp::CONTAINS); break;
    }
    b.setJobId(v.job_id);
    b.setEpoch(v.epoch);
    auto keys = b.initKeys(static_cast<unsigned>(v.keys.size()));
    for (size_t i = 0; i < v.keys.size(); ++i) keys.set(static_cast<unsigned>(i), v.keys[i]);
    b.setValue(bytes_of(v.value));
    b.setTimeoutMs(v.timeout_ms);
  }
  void operator()(const RelayedMessage& v) {
    auto b = m.initRelay();
    b.setSession(v.session);
    b.setMsg(bytes_of(v.msg));
  }
  void operator()(const SubmitJob& v) { m.setSubmit(v.spec_json); }
  void operator()(const StatusQuery& v) { m.setStatus(v.job_id); }
  void operator()(const CancelJob& v) { m.setCancel(v.job_id); }
  void operator()(const LogsQuery& v) { put_logs(m.initLogs(), v.req); }
  void operator()(const AgentLogsQuery& v) { put_logs(m.initLogsForAgent(), v.req); }
  void operator()(const Reply& v) {
    auto b = m.initReply();
    b.setCode(static_cast<uint8_t>(v.code));
    b.setMessage(v.message);
    b.setBody(v.body);
    b.setData(bytes_of(v.data));
    b.setOffset(v.offset);
  }
};

Result<Payload> decode_payload(::Msg::Reader m) {
  switch (m.which()) {
    case ::Msg::REGISTER_AGENT: {
      auto r = m.getRegisterAgent();
      RegisterAgent v;
      v.agent_id = r.getAgentId();
      v.host = r.getHost();
      v.slots = r.getSlots();
      v.gpus = r.getGpus();
      for (auto p : r.getProcs()) v.procs.push_back(get_proc(p));
      return Payload(std::move(v));
    }
    case ::Msg::REGISTER_ACK: {
      auto r = m.getRegisterAck();
      return Payload(RegisterAck{r.getIncarnation(), r.getHeartbeatMs()});
    }
    case ::Msg::AGENT_HEARTBEAT: {
      auto r = m.getAgentHeartbeat();
      return Payload(AgentHeartbeat{r.getAgentId(), r.getIncarnation(), r.getSentAtMs(), r.getSnapshotBytes(),
                                    r.getSnapshotParts(), r.getSnapshotCopies()});
    }
    case ::Msg::REREGISTER: return Payload(Reregister{});
    case ::Msg::SPAWN: {
      auto r = m.getSpawn();
      SpawnRequest v;
      v.job_id = r.getJobId();
      v.name = r.getName();
      v.epoch = r.getEpoch();
      for (auto a : r.getArgv()) v.argv.emplace_back(a);
      for (auto kv : r.getEnv()) v.env.emplace_back(kv.getKey(), kv.getValue());
      v.work_dir = r.getWorkDir();
      v.job_secret_key = r.getJobSecretKey();
      return Payload(std::move(v));
    }
    case ::Msg::KILL: {
      auto r = m.getKill();
      return Payload(KillRequest{r.getJobId(), r.getName(), r.getSignal(), r.getGraceMs()});
    }
    case ::Msg::PROC_STARTED: return Payload(ProcStarted{get_proc(m.getProcStarted())});
    case ::Msg::PROC_EXITED: return Payload(ProcExited{get_proc(m.getProcExited())});
    case ::Msg::EXIT_ACK: {
      auto r = m.getExitAck();
      return Payload(ExitAck{r.getJobId(), r.getName(), r.getEpoch(), r.getPid()});
    }
    case ::Msg::PROC_BEAT: {
      auto r = m.getProcBeat();
      return Payload(ProcBeat{r.getJobId(), r.getName(), r.getEpoch(), r.getPid(), r.getHello(),
                              r.getActorNode(), r.getEndpoint(), r.getSentAtMs()});
    }
    case ::Msg::STORE: {
      auto r = m.getStore();
      StoreRequest v;
      switch (r.getOp()) {
        case ::StoreOp::SET: v.op = StoreOp::kSet; break;
        case ::StoreOp::GET: v.op = StoreOp::kGet; break;
        case ::StoreOp::WAIT: v.op = StoreOp::kWait; break;
        case ::StoreOp::CONTAINS: v.op = StoreOp::kContains; break;
        default: return invalid_argument("store request with an unknown op {}", static_cast<int>(r.getOp()));
      }
      v.job_id = r.getJobId();
      v.epoch = r.getEpoch();
      for (auto k : r.getKeys()) v.keys.emplace_back(k);
      v.value = string_of(r.getValue());
      v.timeout_ms = r.getTimeoutMs();
      return Payload(std::move(v));
    }
    case ::Msg::SUBMIT: return Payload(SubmitJob{m.getSubmit()});
    case ::Msg::STATUS: return Payload(StatusQuery{m.getStatus()});
    case ::Msg::CANCEL: return Payload(CancelJob{m.getCancel()});
    case ::Msg::LOGS: return Payload(LogsQuery{get_logs(m.getLogs())});
    case ::Msg::LOGS_FOR_AGENT: return Payload(AgentLogsQuery{get_logs(m.getLogsForAgent())});
    case ::Msg::PLACE_ACTORS: {
      auto r = m.getPlaceActors();
      PlaceActors v;
      v.job_id = r.getJobId();
      v.epoch = r.getEpoch();
      for (auto p : r.getPlacements()) v.placements.emplace_back(p.getActor(), p.getProc());
      v.layout = r.getLayout();
      if (v.layout.size() > kMaxLayoutBytes) {
        return invalid_argument("actor placement with a layout of {} bytes (at most {})", v.layout.size(),
                                kMaxLayoutBytes);
      }
      return Payload(std::move(v));
    }
    case ::Msg::HEALTH: {
      auto r = m.getHealth();
      HealthReport v;
      v.job_id = r.getJobId();
      v.name = r.getName();
      v.epoch = r.getEpoch();
      v.pid = r.getPid();
      v.sent_at_ms = r.getSentAtMs();
      if (r.getMetrics().size() > kMaxHealthMetrics) {
        return invalid_argument("health report with {} metrics (at most {})", r.getMetrics().size(),
                                kMaxHealthMetrics);
      }
      for (auto x : r.getMetrics()) v.metrics.emplace_back(x.getName(), x.getValue());
      return Payload(std::move(v));
    }
    case ::Msg::RELAY: {
      auto r = m.getRelay();
      RelayedMessage v;
      v.session = r.getSession();
      if (v.session.empty() || v.session.size() > kMaxRelaySessionBytes) {
        return invalid_argument("relay with a session name of {} bytes (1..{})", v.session.size(),
                                kMaxRelaySessionBytes);
      }
      for (char c : v.session) {
        if (c < 33 || c > 126)
          return invalid_argument("relay with a session name that is not printable ASCII");
      }
      v.msg = string_of(r.getMsg());
      if (v.msg.size() < 2 * sizeof(wire::word)) return data_loss("relay of a {}-byte message", v.msg.size());
      return Payload(std::move(v));
    }
    case ::Msg::REPLY: {
      auto r = m.getReply();
      Reply v;
      if (r.getCode() > static_cast<uint8_t>(StatusCode::kIoError)) {
        return invalid_argument("reply with an unknown status code {}", r.getCode());
      }
      v.code = static_cast<StatusCode>(r.getCode());
      v.message = r.getMessage();
      v.body = r.getBody();
      v.data = string_of(r.getData());
      v.offset = r.getOffset();
      return Payload(std::move(v));
    }
    default:
      return invalid_argument("message with an unknown payload type {}", static_cast<int>(m.which()));
  }
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
  std::visit(Encoder{m}, msg.payload);
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
    TROUPE_ASSIGN_OR_RETURN(out.payload, decode_payload(m));
  } catch (const kj::Exception& e) {
    return data_loss("undecodable message: {}", e.getDescription().cStr());
  } catch (const std::exception& e) {
    return data_loss("undecodable message: {}", e.what());
  }
  return out;
}

}  // namespace troupe::sched
