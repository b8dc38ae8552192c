// core/capnp_io.h — defines the framing Troupe's message codecs share around Cap'n Proto:
// to_flat_bytes (a built message as one flat byte string) and read_flat_message (such a
// string read back under bounds: its size, the traversal and nesting limits, no bytes after
// the message; an aligned copy first where the bytes are not 8-byte aligned, since frames
// carry no alignment guarantee; any exception — malformed, truncated, too deep — becomes
// DataLoss naming `what`). Header-only: for the codecs that
// link CapnProto (core/capnp_fields.h frames its messages with it).
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstdint>
#include <cstring>
#include <exception>
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
  const size_t n_words = bytes.size() / sizeof(capnp::word);
  kj::Array<capnp::word> aligned;
  const auto* words = reinterpret_cast<const capnp::word*>(bytes.data());
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(capnp::word) != 0) {
    aligned = kj::heapArray<capnp::word>(n_words);
    std::memcpy(aligned.begin(), bytes.data(), bytes.size());
    words = aligned.begin();
  }
  capnp::ReaderOptions opt;
  opt.traversalLimitInWords = limits.traversal_words;
  opt.nestingLimit = limits.nesting;
  try {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words, n_words), opt);
    if (reader.getEnd() != words + n_words) {
      return data_loss("{}: {} trailing bytes after the message", what,
                       (words + n_words - reader.getEnd()) * sizeof(capnp::word));
    }
    return read(reader);
  } catch (const kj::Exception& e) {
    return data_loss("{}: malformed message: {}", what, std::string(e.getDescription().cStr()));
  } catch (const std::exception& e) {
    return data_loss("{}: malformed message: {}", what, e.what());
  }
}

}  // namespace troupe
