// comm/control/bytes.h — defines ByteWriter and ByteReader: a small bounds-checked
// little-endian binary encoding for simple user payloads (numbers, strings, byte
// blobs, vectors of those), for layers that do not need a Cap'n Proto schema of their own.
//
// ByteReader never reads past its input: every getter returns false (and the reader
// stays failed) on truncated input, so decoding code checks once at the end with ok()
// and finish() (which also rejects trailing bytes).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/status.h"

namespace troupe::control {

class ByteWriter {
 public:
  template <class T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>, int> = 0>
  ByteWriter& put(T v) {
    char buf[sizeof(T)];
    std::memcpy(buf, &v, sizeof(T));  // x86-64 and aarch64 Linux are little-endian
    out_.append(buf, sizeof(T));
    return *this;
  }
  // Length-prefixed (u32) bytes.
  ByteWriter& put_bytes(std::string_view s) {
    put(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
    return *this;
  }
  template <class T>
  ByteWriter& put_vector(const std::vector<T>& v) {
    put(static_cast<uint32_t>(v.size()));
    for (const T& x : v) put(x);
    return *this;
  }
  const std::string& bytes() const& { return out_; }
  std::string bytes() && { return std::move(out_); }

 private:
  std::string out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}

  template <class T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>, int> = 0>
  bool get(T* v) {
    if (!ok_ || in_.size() - pos_ < sizeof(T)) return fail();
    std::memcpy(v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool get_bytes(std::string* s, uint32_t max_len = 1u << 24) {
    uint32_t n = 0;
    if (!get(&n) || n > max_len || in_.size() - pos_ < n) return fail();
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <class T>
  bool get_vector(std::vector<T>* v, uint32_t max_len = 1u << 24) {
    uint32_t n = 0;
    if (!get(&n) || n > max_len || (in_.size() - pos_) / sizeof(T) < n) return fail();
    v->resize(n);
    for (uint32_t i = 0; i < n; ++i) get(&(*v)[i]);
    return ok_;
  }
  bool ok() const { return ok_; }
  // Ok when every read succeeded and the input was consumed exactly.
  Status finish(std::string_view what) const {
    if (!ok_) return data_loss("{}: truncated or malformed payload", what);
    if (pos_ != in_.size()) return data_loss("{}: {} trailing bytes", what, in_.size() - pos_);
    return ok_status();
  }

 private:
  bool fail() {
    ok_ = false;
    return false;
  }
  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace troupe::control
