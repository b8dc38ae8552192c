// core/capnp_io.h — defines the framing Troupe's message codecs share around Cap'n Proto:
// to_flat_bytes (a built message as one flat byte string) and read_flat_message (such a
// string read back under bounds: its size, the traversal and nesting limits; an aligned
// copy first, since frames carry no alignment guarantee; any exception — malformed,
// truncated, too deep — becomes DataLoss naming `what`). Header-only: for the codecs that
// link CapnProto (core/capnp_fields.h frames its messages with it).
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "core/status.h"

namespace troupe {

struct CapnpLimits {
  size_t max_bytes;          // a longer string is refused before it is read
  uint64_t traversal_words;  // capnp::ReaderOptions::traversalLimitInWords
  int nesting = 8;           // capnp::ReaderOptions::nestingLimit
};

inline std::string to_flat_bytes(capnp::MessageBuilder& mb) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(mb);
  auto b = words.asBytes();
  return std::string(reinterpret_cast<const char*>(b.begin()), b.size());
}

// Runs `read` over `bytes` as one flat message; returns what `read` returns (a Result).
template <class Fn>
auto read_flat_message(std::string_view bytes, const char* what, const CapnpLimits& limits, Fn read)
    -> decltype(read(std::declval<capnp::MessageReader&>())) {
  if (bytes.size() > limits.max_bytes)
    return data_loss("{}: {} bytes is over the {} byte limit", what, bytes.size(), limits.max_bytes);
  if (bytes.empty() || bytes.size() % sizeof(capnp::word) != 0) {
    return data_loss("{}: {} bytes is not a whole number of 8-byte words", what, bytes.size());
  }
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  capnp::ReaderOptions opt;
  opt.traversalLimitInWords = limits.traversal_words;
  opt.nestingLimit = limits.nesting;
  try {
    capnp::FlatArrayMessageReader reader(words.asPtr(), opt);
    return read(reader);
  } catch (const kj::Exception& e) {
    return data_loss("{}: malformed message: {}", what, std::string(e.getDescription().cStr()));
  }
}

}  // namespace troupe
