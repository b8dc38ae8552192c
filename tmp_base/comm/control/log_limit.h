// comm/control/log_limit.h — defines escape_for_log (bytes from the network made safe to
// print: non-printable bytes become \xNN, a backslash \\, long strings are cut with
// "...") and LogRateLimiter (at most `burst` lines per key per window, plus a global
// bound, so a peer flooding bad frames cannot flood the log; suppressed lines are
// counted and reported with the next line that is let through).
//
// Threads: LogRateLimiter is not thread-safe; the transport uses it from its loop thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace troupe::control {

std::string escape_for_log(std::string_view bytes, size_t max_bytes = 80);

class LogRateLimiter {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Decision {
    bool log = false;         // print this line
    uint64_t suppressed = 0;  // lines of this key dropped since its last printed one
  };

  // Per key: `burst` lines per `window`; all keys together: `global_burst` per window.
  // At most `max_keys` keys are remembered (the oldest window is forgotten first).
  LogRateLimiter(size_t burst = 3, size_t global_burst = 20,
                 std::chrono::milliseconds window = std::chrono::seconds(10), size_t max_keys = 1024)
      : burst_(burst), global_burst_(global_burst), window_(window), max_keys_(max_keys) {}

  Decision admit(const std::string& key, TimePoint now);
  uint64_t total_suppressed() const { return total_suppressed_; }

 private:
  struct Bucket {
    TimePoint start{};
    size_t count = 0;
    uint64_t suppressed = 0;
  };
  size_t burst_, global_burst_;
  std::chrono::milliseconds window_;
  size_t max_keys_;
  std::map<std::string, Bucket> keys_;
  Bucket global_;
  uint64_t total_suppressed_ = 0;
};

}  // namespace troupe::control
