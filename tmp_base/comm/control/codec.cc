// comm/control/codec.cc — implements encode_envelope / decode_envelope over the
// generated Cap'n Proto classes (schema/envelope.capnp). Compiled as C++17.
#include "comm/control/codec.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>
#include <exception>
#include <memory>
#include <type_traits>

#include "comm/control/schema/envelope.capnp.h"

namespace troupe::control {
namespace {

using wire::DownReason;

template <class... Fs>
struct Overload : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overload(Fs...) -> Overload<Fs...>;

Status check_name(const std::string& s, const char* what) {
  if (s.size() > kMaxNameBytes) {
    return invalid_argument("{} is {} bytes, longer than the limit of {}", what, s.size(), kMaxNameBytes);
  }
  return ok_status();
}

Status check_address(const ActorAddress& a, const char* what) {
  TROUPE_RETURN_IF_ERROR(check_name(a.node, what));
  return check_name(a.name, what);
}

void set_address(wire::ActorAddress::Builder b, const ActorAddress& a) {
  b.setNode(capnp::Text::Reader(a.node.data(), a.node.size()));
  b.setName(capnp::Text::Reader(a.name.data(), a.name.size()));
}

wire::DownReason to_wire(control::DownReason r) {
  switch (r) {
    case control::DownReason::kExit:
      return wire::DownReason::EXIT;
    case control::DownReason::kCrash:
      return wire::DownReason::CRASH;
    case control::DownReason::kHeartbeatTimeout:
      return wire::DownReason::HEARTBEAT_TIMEOUT;
    case control::DownReason::kConnectionLost:
      return wire::DownReason::CONNECTION_LOST;
    case control::DownReason::kKilled:
      return wire::DownReason::KILLED;
  }
  return wire::DownReason::CRASH;  // unreachable for valid enum values
}

std::string text_of(capnp::Text::Reader t) {
  return std::string(t.cStr(), t.size());
}

Result<ActorAddress> read_address(wire::ActorAddress::Reader r, const char* what) {
  ActorAddress a;
  capnp::Text::Reader node = r.getNode();
  capnp::Text::Reader name = r.getName();
  if (node.size() > kMaxNameBytes || name.size() > kMaxNameBytes) {
    return invalid_argument("{}: node or name longer than {} bytes", what, kMaxNameBytes);
  }
  a.node = text_of(node);
  a.name = text_of(name);
  return a;
}

Result<control::DownReason> read_reason(wire::DownReason r) {
  switch (r) {
    case wire::DownReason::EXIT:
      return control::DownReason::kExit;
    case wire::DownReason::CRASH:
      return control::DownReason::kCrash;
    case wire::DownReason::HEARTBEAT_TIMEOUT:
      return control::DownReason::kHeartbeatTimeout;
    case wire::DownReason::CONNECTION_LOST:
      return control::DownReason::kConnectionLost;
    case wire::DownReason::KILLED:
      return control::DownReason::kKilled;
    default:
      break;
  }
  return invalid_argument("unknown Down reason enumerant {}", static_cast<unsigned>(r));
}

// Reads the payload union; every sub-reader is fetched once (traversal limit accounting).
Result<Payload> read_payload(wire::Envelope::Payload::Reader p) {
  switch (p.which()) {
    case wire::Envelope::Payload::HEARTBEAT: {
      auto h = p.getHeartbeat();
      return Payload(Heartbeat{h.getSequence(), h.getSentAtNanos()});
    }
    case wire::Envelope::Payload::MONITOR: {
      auto m = p.getMonitor();
      TROUPE_ASSIGN_OR_RETURN(ActorAddress w, read_address(m.getWatcher(), "monitor.watcher"));
      TROUPE_ASSIGN_OR_RETURN(ActorAddress t, read_address(m.getTarget(), "monitor.target"));
      return Payload(MonitorRequest{std::move(w), std::move(t)});
    }
    case wire::Envelope::Payload::DEMONITOR: {
      auto m = p.getDemonitor();
      TROUPE_ASSIGN_OR_RETURN(ActorAddress w, read_address(m.getWatcher(), "demonitor.watcher"));
      TROUPE_ASSIGN_OR_RETURN(ActorAddress t, read_address(m.getTarget(), "demonitor.target"));
      return Payload(DemonitorRequest{std::move(w), std::move(t)});
    }
    case wire::Envelope::Payload::LINK: {
      auto l = p.getLink();
      TROUPE_ASSIGN_OR_RETURN(ActorAddress f, read_address(l.getFrom(), "link.from"));
      TROUPE_ASSIGN_OR_RETURN(ActorAddress t, read_address(l.getTo(), "link.to"));
      return Payload(LinkRequest{std::move(f), std::move(t)});
    }
    case wire::Envelope::Payload::UNLINK: {
      auto l = p.getUnlink();
      TROUPE_ASSIGN_OR_RETURN(ActorAddress f, read_address(l.getFrom(), "unlink.from"));
      TROUPE_ASSIGN_OR_RETURN(ActorAddress t, read_address(l.getTo(), "unlink.to"));
      return Payload(UnlinkRequest{std::move(f), std::move(t)});
    }
    case wire::Envelope::Payload::DOWN: {
      auto d = p.getDown();
      TROUPE_ASSIGN_OR_RETURN(ActorAddress a, read_address(d.getActor(), "down.actor"));
      TROUPE_ASSIGN_OR_RETURN(control::DownReason r, read_reason(d.getReason()));
      return Payload(Down{std::move(a), r, text_of(d.getText())});
    }
    case wire::Envelope::Payload::ERROR: {
      auto e = p.getError();
      return Payload(ErrorReply{e.getCode(), text_of(e.getMessage())});
    }
    case wire::Envelope::Payload::ACK:
      return Payload(Ack{});
    case wire::Envelope::Payload::USER: {
      auto u = p.getUser();
      uint64_t type_id = u.getTypeId();
      if (is_reserved_type_id(type_id)) {
        return invalid_argument("user payload with reserved type id {:#x}", type_id);
      }
      capnp::Data::Reader d = u.getData();
      return Payload(UserPayload{type_id, std::string(reinterpret_cast<const char*>(d.begin()), d.size())});
    }
    default:
      break;
  }
  return invalid_argument("unknown payload union member {}", static_cast<unsigned>(p.which()));
}

Result<Envelope> read_envelope(wire::Envelope::Reader r) {
  Envelope e;
  e.protocol_version = r.getProtocolVersion();
  if (e.protocol_version != kProtocolVersion) {
    return invalid_argument("protocol version {} (this build speaks {})", e.protocol_version,
                            kProtocolVersion);
  }
  TROUPE_ASSIGN_OR_RETURN(e.sender, read_address(r.getSender(), "sender"));
  TROUPE_ASSIGN_OR_RETURN(e.receiver, read_address(r.getReceiver(), "receiver"));
  e.correlation_id = r.getCorrelationId();
  e.is_reply = r.getIsReply();
  e.deadline_unix_nanos = r.getDeadlineUnixNanos();
  e.message_type_id = r.getMessageTypeId();
  TROUPE_ASSIGN_OR_RETURN(e.payload, read_payload(r.getPayload()));
  if (e.message_type_id != system_type_id(e.payload)) {
    return invalid_argument("message type id {:#x} does not match its payload ({:#x})", e.message_type_id,
                            system_type_id(e.payload));
  }
  return e;
}

}  // namespace

Result<std::string> encode_envelope(const Envelope& e, size_t max_message_bytes) {
  TROUPE_RETURN_IF_ERROR(check_address(e.sender, "sender"));
  TROUPE_RETURN_IF_ERROR(check_address(e.receiver, "receiver"));
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<wire::Envelope>();
  b.setProtocolVersion(e.protocol_version);
  set_address(b.initSender(), e.sender);
  set_address(b.initReceiver(), e.receiver);
  b.setCorrelationId(e.correlation_id);
  b.setIsReply(e.is_reply);
  b.setDeadlineUnixNanos(e.deadline_unix_nanos);
  b.setMessageTypeId(system_type_id(e.payload));
  auto p = b.initPayload();
  Status st = std::visit(
      Overload{
          [&](const Heartbeat& h) {
            auto x = p.initHeartbeat();
            x.setSequence(h.sequence);
            x.setSentAtNanos(h.sent_at_nanos);
            return ok_status();
          },
          [&](const MonitorRequest& m) {
            TROUPE_RETURN_IF_ERROR(check_address(m.watcher, "monitor.watcher"));
            TROUPE_RETURN_IF_ERROR(check_address(m.target, "monitor.target"));
            auto x = p.initMonitor();
            set_address(x.initWatcher(), m.watcher);
            set_address(x.initTarget(), m.target);
            return ok_status();
          },
          [&](const DemonitorRequest& m) {
            TROUPE_RETURN_IF_ERROR(check_address(m.watcher, "demonitor.watcher"));
            TROUPE_RETURN_IF_ERROR(check_address(m.target, "demonitor.target"));
            auto x = p.initDemonitor();
            set_address(x.initWatcher(), m.watcher);
            set_address(x.initTarget(), m.target);
            return ok_status();
          },
          [&](const LinkRequest& l) {
            TROUPE_RETURN_IF_ERROR(check_address(l.from, "link.from"));
            TROUPE_RETURN_IF_ERROR(check_address(l.to, "link.to"));
            auto x = p.initLink();
            set_address(x.initFrom(), l.from);
            set_address(x.initTo(), l.to);
            return ok_status();
          },
          [&](const UnlinkRequest& l) {
            TROUPE_RETURN_IF_ERROR(check_address(l.from, "unlink.from"));
            TROUPE_RETURN_IF_ERROR(check_address(l.to, "unlink.to"));
            auto x = p.initUnlink();
            set_address(x.initFrom(), l.from);
            set_address(x.initTo(), l.to);
            return ok_status();
          },
          [&](const Down& d) {
            TROUPE_RETURN_IF_ERROR(check_address(d.actor, "down.actor"));
            auto x = p.initDown();
            set_address(x.initActor(), d.actor);
            x.setReason(to_wire(d.reason));
            x.setText(capnp::Text::Reader(d.text.data(), d.text.size()));
            return ok_status();
          },
          [&](const ErrorReply& r) {
            auto x = p.initError();
            x.setCode(r.code);
            x.setMessage(capnp::Text::Reader(r.message.data(), r.message.size()));
            return ok_status();
          },
          [&](const Ack&) {
            p.setAck();
            return ok_status();
          },
          [&](const UserPayload& u) {
            if (is_reserved_type_id(u.type_id)) {
              return invalid_argument("user payload with reserved type id {:#x}", u.type_id);
            }
            auto x = p.initUser();
            x.setTypeId(u.type_id);
            x.setData(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(u.data.data()), u.data.size()));
            return ok_status();
          },
      },
      e.payload);
  TROUPE_RETURN_IF_ERROR(st);
  size_t words = capnp::computeSerializedSizeInWords(mb);
  if (words * sizeof(capnp::word) > max_message_bytes) {
    return resource_exhausted("encoded envelope is {} bytes, over the limit of {}",
                              words * sizeof(capnp::word), max_message_bytes);
  }
  kj::Array<capnp::word> flat = capnp::messageToFlatArray(mb);
  auto bytes = flat.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

Result<Envelope> decode_envelope(const void* data, size_t size, const DecodeLimits& limits) {
  if (size > limits.max_message_bytes) {
    return resource_exhausted("frame of {} bytes is over the limit of {}", size, limits.max_message_bytes);
  }
  if (size == 0 || size % sizeof(capnp::word) != 0) {
    return data_loss("frame of {} bytes is not a whole number of 8-byte words", size);
  }
  const size_t n_words = size / sizeof(capnp::word);
  // zmq frames carry no alignment guarantee; FlatArrayMessageReader requires 8 bytes.
  kj::Array<capnp::word> aligned_copy;
  const capnp::word* words = static_cast<const capnp::word*>(data);
  if (reinterpret_cast<uintptr_t>(data) % alignof(capnp::word) != 0) {
    aligned_copy = kj::heapArray<capnp::word>(n_words);
    std::memcpy(aligned_copy.begin(), data, size);
    words = aligned_copy.begin();
  }
  capnp::ReaderOptions opts;
  opts.traversalLimitInWords =
      limits.traversal_limit_words != 0 ? limits.traversal_limit_words : n_words + 64;
  opts.nestingLimit = static_cast<int>(limits.nesting_limit);
  try {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words, n_words), opts);
    if (reader.getEnd() != words + n_words) {
      return data_loss("{} trailing bytes after the message",
                       (words + n_words - reader.getEnd()) * sizeof(capnp::word));
    }
    return read_envelope(reader.getRoot<wire::Envelope>());
  } catch (const kj::Exception& ex) {
    return data_loss("malformed envelope: {}", ex.getDescription().cStr());
  } catch (const std::exception& ex) {
    return data_loss("malformed envelope: {}", ex.what());
  }
}

}  // namespace troupe::control
