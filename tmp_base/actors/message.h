// actors/message.h — defines what a message type is for the actor API: MessageTraits<M>
// (its type id and its encoding) and the Message concept that tell/ask/handle require.
//
// A message is a plain C++ struct. Give it, in the struct itself:
//
//   struct Ping {
//     static constexpr uint64_t kTypeId = 0x5d1c'0001;   // unique across the program
//     int64_t seq = 0;
//     void encode(troupe::control::ByteWriter& w) const { w.put(seq); }
//     static troupe::Result<Ping> decode(troupe::control::ByteReader& r) {
//       Ping p; r.get(&p.seq); TROUPE_RETURN_IF_ERROR(r.finish("Ping")); return p;
//     }
//   };
//
// or specialise MessageTraits<M> (e.g. to encode with a Cap'n Proto schema of your own
// layer, in a C++17 translation unit). Type ids are chosen by each layer; 0 and the top
// 256 values are reserved (control::is_reserved_type_id). A convention that avoids
// clashes: the top 16 bits name the layer (0x5C4E scheduler, 0x7A1E training, 0x0E5A
// examples/tests).
//
// Messages are encoded even between actors of one process, so a message behaves the
// same locally and remotely (no shared mutable state crosses actors).
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>

#include "comm/control/bytes.h"
#include "comm/control/envelope.h"
#include "core/status.h"

namespace troupe::actors {

using control::ByteReader;
using control::ByteWriter;
using control::DownReason;

// A Down message: `actor` stopped (or its process is presumed dead) for `reason`.
using Down = control::Down;

// The reply to an ask whose handler returns void: ask<Ack>(...) waits for it.
using Ack = control::Ack;

// Empty for types that are not messages; specialise it for your own encodings.
template <class M>
struct MessageTraits {};

// The default: the members of M (kTypeId, encode(ByteWriter&), decode(ByteReader&)).
template <class M>
requires requires {
  M::kTypeId;
}
struct MessageTraits<M> {
  static constexpr uint64_t kTypeId = M::kTypeId;
  static std::string encode(const M& m) {
    ByteWriter w;
    m.encode(w);
    return std::move(w).bytes();
  }
  static Result<M> decode(std::string_view bytes) {
    ByteReader r(bytes);
    return M::decode(r);
  }
};

template <class M>
concept Message = requires(const M& m, std::string_view bytes) {
  { MessageTraits<M>::kTypeId } -> std::convertible_to<uint64_t>;
  { MessageTraits<M>::encode(m) } -> std::convertible_to<std::string>;
  { MessageTraits<M>::decode(bytes) } -> std::same_as<Result<M>>;
};

// A reply type for ask: any Message, or Ack.
template <class R>
concept Reply = Message<R> || std::same_as<R, Ack>;

}  // namespace troupe::actors

namespace troupe::actors {

// The envelope payload carrying `r` (Ack travels as the system ack).
template <Reply R>
control::Payload to_payload(const R& r) {
  if constexpr (std::same_as<R, Ack>) {
    return Ack{};
  } else {
    return control::UserPayload{MessageTraits<R>::kTypeId, MessageTraits<R>::encode(r)};
  }
}

// The reply `R` carried by `p`: an ErrorReply becomes its Status; a payload of another
// type is an error naming both types.
template <Reply R>
Result<R> from_payload(const control::Payload& p) {
  if (const auto* err = std::get_if<control::ErrorReply>(&p)) {
    const bool known = err->code != 0 && err->code <= static_cast<uint16_t>(StatusCode::kIoError);
    return Status(known ? static_cast<StatusCode>(err->code) : StatusCode::kInternal, err->message);
  }
  if constexpr (std::same_as<R, Ack>) {
    if (std::holds_alternative<Ack>(p)) return Ack{};
  } else {
    if (const auto* u = std::get_if<control::UserPayload>(&p)) {
      if (u->type_id == MessageTraits<R>::kTypeId) return MessageTraits<R>::decode(u->data);
      return invalid_argument("reply has type {:#x}, expected {:#x}", u->type_id, MessageTraits<R>::kTypeId);
    }
  }
  return invalid_argument("reply payload kind {} is not the expected reply type", p.index());
}

}  // namespace troupe::actors
