// comm/control/codec.h — defines encode_envelope / decode_envelope: the only door between
// the plain C++ Envelope (comm/control/envelope.h) and its Cap'n Proto bytes.
//
// C++17 on purpose (dependencies.md §7): this header and codec.cc form the small
// troupe_control_codec target; the rest of the code never includes Cap'n Proto.
//
// decode_envelope treats its input as hostile: it checks the size limit and the word
// alignment of the length, copies misaligned input to an aligned buffer, applies reader
// limits (traversal, nesting), rejects unknown union members, unknown enumerants, wrong
// protocol versions, over-long names and zero user type ids, and turns every Cap'n Proto
// exception into a Status naming the problem. It never throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "comm/control/envelope.h"
#include "core/status.h"

namespace troupe::control {

struct DecodeLimits {
  size_t max_message_bytes = size_t{16} << 20;  // larger frames are rejected unread
  uint32_t nesting_limit = 16;                 // the schema nests 4 deep at most
  // Words the reader may traverse; 0 means max_message_bytes / 8 (each word read once).
  uint64_t traversal_limit_words = 0;
};

// Serializes `e` (message_type_id is derived from the payload; the field is ignored).
// Fails with InvalidArgument when a name exceeds kMaxNameBytes or a user payload has
// type id 0, and with ResourceExhausted when the result exceeds `max_message_bytes`.
Result<std::string> encode_envelope(const Envelope& e,
                                    size_t max_message_bytes = size_t{16} << 20);

// Parses bytes produced by encode_envelope (by any peer with the same protocol major).
// Errors: ResourceExhausted (too large), DataLoss (truncated, misframed, malformed,
// traversal or nesting limit hit, unknown union member or enumerant), InvalidArgument
// (bad version, name too long, reserved user type id, type id mismatch).
Result<Envelope> decode_envelope(const void* data, size_t size, const DecodeLimits& limits = {});

}  // namespace troupe::control
