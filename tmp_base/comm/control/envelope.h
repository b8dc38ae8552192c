// comm/control/envelope.h — defines the plain C++ view of the control-plane wire format
// (comm/control/schema/envelope.capnp): ActorAddress, DownReason, the system payloads
// (Heartbeat, MonitorRequest, LinkRequest, UnlinkRequest, Down, ErrorReply, Ack), the
// UserPayload that other layers fill with their own messages, and Envelope.
//
// C++17 on purpose: the codec's translation units (C++17, see dependencies.md §7)
// include it. Nothing here includes Cap'n Proto: comm/control/codec.h turns an Envelope into bytes
// and back. Field meanings are documented in the schema and docs/control-plane.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <variant>

namespace troupe::control {

// Bumped only by an incompatible change to the schema (docs/control-plane.md).
inline constexpr uint16_t kProtocolVersion = 1;

// Longest node id or actor name accepted by the decoder (bytes).
inline constexpr size_t kMaxNameBytes = 256;

// An actor's address: the process ("node") it lives in and its name in that process.
// Text form "node/name" (see actors/actor_ref.h). An empty name addresses the node.
struct ActorAddress {
  std::string node;
  std::string name;

  bool empty() const { return node.empty() && name.empty(); }
  std::string to_string() const { return node + "/" + name; }
  friend bool operator==(const ActorAddress& a, const ActorAddress& b) {
    return a.node == b.node && a.name == b.name;
  }
  friend bool operator!=(const ActorAddress& a, const ActorAddress& b) { return !(a == b); }
  friend bool operator<(const ActorAddress& a, const ActorAddress& b) {
    return a.node != b.node ? a.node < b.node : a.name < b.name;
  }
};

// Why an actor stopped (or is presumed stopped). Values match the schema's enumerants.
enum class DownReason : uint8_t {
  kExit = 0,              // stopped normally
  kCrash = 1,             // a handler threw, or on_start failed
  kHeartbeatTimeout = 2,  // its process stopped answering application heartbeats
  kConnectionLost = 3,    // the connection to its process closed
  kKilled = 4,            // stopped by the system (shutdown, a linked actor failed)
};
std::string_view down_reason_name(DownReason r);

struct Heartbeat {
  uint64_t sequence = 0;
  int64_t sent_at_nanos = 0;
  auto fields() const { return std::tie(sequence, sent_at_nanos); }
  friend bool operator==(const Heartbeat& a, const Heartbeat& b) { return a.fields() == b.fields(); }
};

struct MonitorRequest {
  ActorAddress watcher;
  ActorAddress target;
  auto fields() const { return std::tie(watcher, target); }
  friend bool operator==(const MonitorRequest& a, const MonitorRequest& b) {
    return a.fields() == b.fields();
  }
};
// Same fields as MonitorRequest; a distinct type so the variant can tell them apart.
struct DemonitorRequest {
  ActorAddress watcher;
  ActorAddress target;
  auto fields() const { return std::tie(watcher, target); }
  friend bool operator==(const DemonitorRequest& a, const DemonitorRequest& b) {
    return a.fields() == b.fields();
  }
};

struct LinkRequest {
  ActorAddress from;
  ActorAddress to;
  auto fields() const { return std::tie(from, to); }
  friend bool operator==(const LinkRequest& a, const LinkRequest& b) { return a.fields() == b.fields(); }
};

struct UnlinkRequest {
  ActorAddress from;
  ActorAddress to;
  auto fields() const { return std::tie(from, to); }
  friend bool operator==(const UnlinkRequest& a, const UnlinkRequest& b) { return a.fields() == b.fields(); }
};

struct Down {
  ActorAddress actor;
  DownReason reason = DownReason::kExit;
  std::string text;
  auto fields() const { return std::tie(actor, reason, text); }
  friend bool operator==(const Down& a, const Down& b) { return a.fields() == b.fields(); }
};

// The reply to a failed ask: a troupe::StatusCode value and its message.
struct ErrorReply {
  uint16_t code = 0;
  std::string message;
  auto fields() const { return std::tie(code, message); }
  friend bool operator==(const ErrorReply& a, const ErrorReply& b) { return a.fields() == b.fields(); }
};

// The reply to an ask whose handler returns no value.
struct Ack {
  friend bool operator==(const Ack&, const Ack&) { return true; }
};

// A message owned by another layer: its type id (non-zero) and its encoded bytes.
struct UserPayload {
  uint64_t type_id = 0;
  std::string data;
  auto fields() const { return std::tie(type_id, data); }
  friend bool operator==(const UserPayload& a, const UserPayload& b) { return a.fields() == b.fields(); }
};

using Payload = std::variant<Heartbeat, MonitorRequest, DemonitorRequest, LinkRequest, UnlinkRequest, Down,
                             ErrorReply, Ack, UserPayload>;

// Ids that messageTypeId carries for the system payloads. User type ids must avoid the
// range [kSystemTypeIdBase, kSystemTypeIdBase + 255].
inline constexpr uint64_t kSystemTypeIdBase = 0xffffffffffffff00ull;
uint64_t system_type_id(const Payload& p);  // the user type id for a UserPayload
// True for 0 and the system range: such ids are rejected on user payloads.
bool is_reserved_type_id(uint64_t type_id);

struct Envelope {
  uint16_t protocol_version = kProtocolVersion;
  ActorAddress sender;          // empty name: sent from outside any actor
  ActorAddress receiver;        // empty name: addressed to the node itself
  uint64_t correlation_id = 0;  // non-zero for an ask and for its reply
  bool is_reply = false;
  int64_t deadline_unix_nanos = 0;  // 0: none
  uint64_t message_type_id = 0;     // filled by encode from the payload
  Payload payload = Ack{};

  auto fields() const {
    return std::tie(protocol_version, sender, receiver, correlation_id, is_reply, deadline_unix_nanos,
                    message_type_id, payload);
  }
  friend bool operator==(const Envelope& a, const Envelope& b) { return a.fields() == b.fields(); }
};

// "user 0x1234 a/b -> c/d corr=7" — for logs.
std::string describe(const Envelope& e);

}  // namespace troupe::control
