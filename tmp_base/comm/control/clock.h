// comm/control/clock.h — defines Clock (injectable time), SystemClock (the real one),
// ManualClock (tests move time by hand), and RandomSource (injectable randomness).
//
// No globals: main() (or a test) creates the clock and passes it to the transport and
// the actor system, which keep a non-owning pointer (the clock must outlive them).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace troupe {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic time from an arbitrary origin; drives timers, timeouts and heartbeats.
  virtual std::chrono::nanoseconds now() const = 0;
  // Wall-clock time since the Unix epoch; only for deadlines carried across processes
  // (envelope deadlineUnixNanos) and for logs.
  virtual int64_t unix_nanos() const = 0;
};

// steady_clock and system_clock. Stateless, thread-safe.
class SystemClock final : public Clock {
 public:
  std::chrono::nanoseconds now() const override {
    return std::chrono::steady_clock::now().time_since_epoch();
  }
  int64_t unix_nanos() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

// Time moves only when advance() is called; both readings move together. Thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(std::chrono::nanoseconds start = std::chrono::seconds(1000),
                       int64_t unix_start = int64_t{1'700'000'000} * 1'000'000'000)
      : now_(start.count()), unix_offset_(unix_start - start.count()) {}
  std::chrono::nanoseconds now() const override {
    return std::chrono::nanoseconds(now_.load(std::memory_order_acquire));
  }
  int64_t unix_nanos() const override { return now_.load(std::memory_order_acquire) + unix_offset_; }
  void advance(std::chrono::nanoseconds d) { now_.fetch_add(d.count(), std::memory_order_acq_rel); }

 private:
  std::atomic<int64_t> now_;
  int64_t unix_offset_;
};

// Injectable randomness: returns 64 uniformly random bits per call. Must be callable from
// the thread that owns the component it was given to.
using RandomSource = std::function<uint64_t()>;

// A deterministic source (splitmix64) for tests and reproducible runs.
inline RandomSource seeded_random(uint64_t seed) {
  return [state = seed]() mutable {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
}

// Seeded from the OS (std::random_device) once.
RandomSource os_random();

}  // namespace troupe
