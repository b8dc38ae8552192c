// scheduler/daemons/receive_lag.h — defines ReceiveLag: how far behind the scheduler's receive path
// is (kernel socket buffers, ZeroMQ's I/O threads with their CURVE handshakes, the
// transport and actor threads, the loop's own backlog), estimated from the send times peers
// stamp on their beats (AgentHeartbeat / ProcBeat sent_at_ms).
//
// Hosts' clocks differ, so a peer's (received - sent) means nothing by itself; what counts
// is its excess over the least that peer has shown within the last 30-60 s (its clock
// offset plus the path's base latency). The path's lag is the median excess over the beats
// of the last window: a delay most peers share is on our side (or the network's), not
// theirs, and silence must not be held against them while it lasts (Scheduler::timers).
// One slow peer moves the median by nothing. Because the baseline is at most a minute old,
// a lasting shift (a clock stepped back on every host, a path slow for good) is absorbed
// within a minute: failure detection is never held back longer than that.
//
// Not thread-safe: the scheduler's loop thread owns it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe::sched {

class ReceiveLag {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMinSamples = 8;  // fewer beats in the window: no estimate (zero)

  explicit ReceiveLag(std::chrono::milliseconds window = std::chrono::milliseconds(2000)) : window_(window) {}

  // A beat from `peer` stamped `sent_ms` by its sender arrived (by our wall clock) at
  // `received_ms`; `now` is our steady clock. A zero stamp (an older sender) is ignored.
  void add(const std::string& peer, int64_t sent_ms, int64_t received_ms, Clock::time_point now) {
    if (sent_ms <= 0) return;
    const int64_t offset = received_ms - sent_ms;
    auto [it, fresh] = base_.try_emplace(peer, Base{offset, offset, received_ms, received_ms});
    Base& b = it->second;
    if (received_ms - b.bucket_start_ms >= kBucketMs) {  // a new bucket: the oldest is dropped
      b.min_prev = received_ms - b.bucket_start_ms >= 2 * kBucketMs ? offset : b.min_cur;
      b.min_cur = offset;
      b.bucket_start_ms = received_ms;
    }
    b.min_cur = std::min(b.min_cur, offset);
    b.at_ms = received_ms;
    samples_.emplace_back(now, offset - std::min(b.min_cur, b.min_prev));
    if (samples_.size() > kMaxSamples) samples_.pop_front();
  }

  // The median excess of the beats that arrived within the window before `now`.
  std::chrono::milliseconds lag(Clock::time_point now) {
    while (!samples_.empty() && now - samples_.front().first > window_) samples_.pop_front();
    if (samples_.size() < kMinSamples) return std::chrono::milliseconds(0);
    scratch_.clear();
    for (const auto& s : samples_) scratch_.push_back(s.second);
    auto mid = scratch_.begin() + static_cast<std::ptrdiff_t>(scratch_.size() / 2);
    std::nth_element(scratch_.begin(), mid, scratch_.end());
    return std::chrono::milliseconds(*mid);
  }

  // Drops baselines of peers not heard from for `idle_ms` (of our wall clock).
  void prune(int64_t now_ms, int64_t idle_ms) {
    std::erase_if(base_, [&](const auto& kv) { return now_ms - kv.second.at_ms > idle_ms; });
  }

  size_t peers() const { return base_.size(); }

 private:
  static constexpr size_t kMaxSamples = 1 << 16;  // bounds memory at any beat rate
  static constexpr int64_t kBucketMs = 30'000;
  struct Base {  // least (received - sent) in this bucket and the one before
    int64_t min_cur, min_prev;
    int64_t bucket_start_ms;  // our wall clock
    int64_t at_ms;            // last beat (our wall clock)
  };
  std::chrono::milliseconds window_;
  std::unordered_map<std::string, Base> base_;
  std::deque<std::pair<Clock::time_point, int64_t>> samples_;  // (arrival, excess ms)
  std::vector<int64_t> scratch_;
};

}  // namespace troupe::sched
