// comm/control/log_limit.cc — escape_for_log and LogRateLimiter.
#include "comm/control/log_limit.h"

#include <algorithm>

namespace troupe::control {

std::string escape_for_log(std::string_view bytes, size_t max_bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const size_t n = std::min(bytes.size(), max_bytes);
  out.reserve(n + 8);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 32 && c < 127) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (bytes.size() > max_bytes) out += "...";
  return out;
}

LogRateLimiter::Decision LogRateLimiter::admit(const std::string& key, TimePoint now) {
  if (now - global_.start >= window_) global_ = Bucket{now, 0, global_.suppressed};
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    if (keys_.size() >= max_keys_) {
      auto oldest = std::min_element(keys_.begin(), keys_.end(), [](const auto& a, const auto& b) {
        return a.second.start < b.second.start;
      });
      keys_.erase(oldest);
    }
    it = keys_.emplace(key, Bucket{now, 0, 0}).first;
  }
  Bucket& b = it->second;
  if (now - b.start >= window_) {
    b.start = now;
    b.count = 0;
  }
  if (b.count >= burst_ || global_.count >= global_burst_) {
    ++b.suppressed;
    ++total_suppressed_;
    return {};
  }
  ++b.count;
  ++global_.count;
  Decision d{true, b.suppressed};
  b.suppressed = 0;
  return d;
}

}  // namespace troupe::control
