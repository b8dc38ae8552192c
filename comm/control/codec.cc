// comm/control/codec.cc — implements encode_envelope / decode_envelope over the
// generated Cap'n Proto classes (schema/envelope.capnp): one field table per payload
// (core/capnp_fields.h copies both ways by it; core/capnp_io.h frames and bounds it), and
// the checks a decoded envelope must pass beyond its wire types. Compiled as C++17.
#include "comm/control/codec.h"

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <string_view>

#include "comm/control/schema/envelope.capnp.h"
#include "core/capnp_fields.h"

namespace troupe::control {
namespace {

namespace cc = capnp_codec;

// Field order is the order the encoder fills the message in: keep it, and the bytes stay
// those of earlier builds.
constexpr auto kAddress = cc::fields(TROUPE_CAPNP_FIELD(node, Node), TROUPE_CAPNP_FIELD(name, Name));
constexpr auto kWatch = cc::fields(TROUPE_CAPNP_STRUCT(watcher, Watcher, kAddress),
                                   TROUPE_CAPNP_STRUCT(target, Target, kAddress));
constexpr auto kLink =
    cc::fields(TROUPE_CAPNP_STRUCT(from, From, kAddress), TROUPE_CAPNP_STRUCT(to, To, kAddress));
// envelope.capnp's DownReason numbers its enumerants as DownReason does.
constexpr auto kPayload = cc::one_of(
    cc::alt<Heartbeat>(TROUPE_CAPNP_WHOLE(
        Heartbeat,
        cc::fields(TROUPE_CAPNP_FIELD(sequence, Sequence), TROUPE_CAPNP_FIELD(sent_at_nanos, SentAtNanos)))),
    cc::alt<MonitorRequest>(TROUPE_CAPNP_WHOLE(Monitor, kWatch)),
    cc::alt<DemonitorRequest>(TROUPE_CAPNP_WHOLE(Demonitor, kWatch)),
    cc::alt<LinkRequest>(TROUPE_CAPNP_WHOLE(Link, kLink)),
    cc::alt<UnlinkRequest>(TROUPE_CAPNP_WHOLE(Unlink, kLink)),
    cc::alt<Down>(TROUPE_CAPNP_WHOLE(Down, cc::fields(TROUPE_CAPNP_STRUCT(actor, Actor, kAddress),
                                                      TROUPE_CAPNP_ENUM(reason, Reason, DownReason::kKilled),
                                                      TROUPE_CAPNP_FIELD(text, Text)))),
    cc::alt<ErrorReply>(TROUPE_CAPNP_WHOLE(
        Error, cc::fields(TROUPE_CAPNP_FIELD(code, Code), TROUPE_CAPNP_FIELD(message, Message)))),
    cc::alt<Ack>(TROUPE_CAPNP_WHOLE(Ack, cc::kPlain)),
    cc::alt<UserPayload>(TROUPE_CAPNP_WHOLE(
        User, cc::fields(TROUPE_CAPNP_FIELD(type_id, TypeId), TROUPE_CAPNP_FIELD(data, Data)))));
constexpr auto kEnvelope = cc::fields(
    TROUPE_CAPNP_FIELD(protocol_version, ProtocolVersion), TROUPE_CAPNP_STRUCT(sender, Sender, kAddress),
    TROUPE_CAPNP_STRUCT(receiver, Receiver, kAddress), TROUPE_CAPNP_FIELD(correlation_id, CorrelationId),
    TROUPE_CAPNP_FIELD(is_reply, IsReply), TROUPE_CAPNP_FIELD(deadline_unix_nanos, DeadlineUnixNanos),
    TROUPE_CAPNP_FIELD(message_type_id, MessageTypeId), TROUPE_CAPNP_STRUCT(payload, Payload, kPayload));

template <class... Fs>
struct Overload : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overload(Fs...) -> Overload<Fs...>;

Status check_address(const ActorAddress& a, const char* what) {
  for (const std::string* s : {&a.node, &a.name}) {
    if (s->size() > kMaxNameBytes) {
      return invalid_argument("{} {} is {} bytes, longer than the limit of {}", what,
                              s == &a.node ? "node" : "name", s->size(), kMaxNameBytes);
    }
  }
  return ok_status();
}

// What both directions refuse beyond the wire types: over-long names, reserved user ids.
Status check_payload(const Payload& payload) {
  auto pair = [](const ActorAddress& a, const char* what_a, const ActorAddress& b, const char* what_b) {
    TROUPE_RETURN_IF_ERROR(check_address(a, what_a));
    return check_address(b, what_b);
  };
  return std::visit(
      Overload{
          [&](const MonitorRequest& m) {
            return pair(m.watcher, "monitor.watcher", m.target, "monitor.target");
          },
          [&](const DemonitorRequest& m) {
            return pair(m.watcher, "demonitor.watcher", m.target, "demonitor.target");
          },
          [&](const LinkRequest& l) { return pair(l.from, "link.from", l.to, "link.to"); },
          [&](const UnlinkRequest& l) { return pair(l.from, "unlink.from", l.to, "unlink.to"); },
          [&](const Down& d) { return check_address(d.actor, "down.actor"); },
          [&](const UserPayload& u) {
            return is_reserved_type_id(u.type_id)
                       ? invalid_argument("user payload with reserved type id {:#x}", u.type_id)
                       : ok_status();
          },
          [&](const auto&) { return ok_status(); },
      },
      payload);
}

Status check_envelope(const Envelope& e) {
  TROUPE_RETURN_IF_ERROR(check_address(e.sender, "sender"));
  TROUPE_RETURN_IF_ERROR(check_address(e.receiver, "receiver"));
  return check_payload(e.payload);
}

}  // namespace

Result<std::string> encode_envelope(const Envelope& e, size_t max_message_bytes) {
  TROUPE_RETURN_IF_ERROR(check_envelope(e));
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<wire::Envelope>();
  cc::write(b, kEnvelope, e);
  b.setMessageTypeId(system_type_id(e.payload));  // derived, whatever e says
  size_t words = capnp::computeSerializedSizeInWords(mb);
  if (words * sizeof(capnp::word) > max_message_bytes) {
    return resource_exhausted("encoded envelope is {} bytes, over the limit of {}",
                              words * sizeof(capnp::word), max_message_bytes);
  }
  return to_flat_bytes(mb);
}

Result<Envelope> decode_envelope(const void* data, size_t size, const DecodeLimits& limits) {
  if (size > limits.max_message_bytes) {
    return resource_exhausted("frame of {} bytes is over the limit of {}", size, limits.max_message_bytes);
  }
  const size_t n_words = size / sizeof(capnp::word);
  const CapnpLimits bounds{limits.max_message_bytes,
                           limits.traversal_limit_words != 0 ? limits.traversal_limit_words : n_words + 64,
                           static_cast<int>(limits.nesting_limit)};
  return read_flat_message(std::string_view(static_cast<const char*>(data), size), "envelope", bounds,
                           [](capnp::MessageReader& reader) -> Result<Envelope> {
                             auto root = reader.getRoot<wire::Envelope>();
                             if (root.getProtocolVersion() != kProtocolVersion) {
                               return invalid_argument("protocol version {} (this build speaks {})",
                                                       root.getProtocolVersion(), kProtocolVersion);
                             }
                             Envelope e;
                             TROUPE_RETURN_IF_ERROR(cc::read_into(root, kEnvelope, e, "envelope"));
                             TROUPE_RETURN_IF_ERROR(check_envelope(e));
                             if (e.message_type_id != system_type_id(e.payload)) {
                               return invalid_argument(
                                   "message type id {:#x} does not match its payload ({:#x})",
                                   e.message_type_id, system_type_id(e.payload));
                             }
                             return e;
                           });
}

}  // namespace troupe::control
