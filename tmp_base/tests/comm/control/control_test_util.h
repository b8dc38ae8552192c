// tests/comm/control/control_test_util.h — defines Inbox, a thread-safe record of what a
// Transport's callbacks saw, with bounded waits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "comm/control/transport.h"

namespace troupe {
// Lets gtest print a Status after `<<`.
inline std::ostream& operator<<(std::ostream& os, const Status& s) {
  return os << s.to_string();
}
}  // namespace troupe

namespace troupe::control::testing {

struct PeerEvent {
  std::string node;
  bool up = false;
  DownReason reason = DownReason::kExit;
  std::string text;
  std::chrono::steady_clock::time_point at;
};

class Inbox {
 public:
  TransportCallbacks callbacks() {
    TransportCallbacks cb;
    cb.on_envelope = [this](Envelope&& e, const std::string& from) {
      std::lock_guard<std::mutex> lk(mu_);
      envelopes_.push_back({std::move(e), from});
      cv_.notify_all();
    };
    cb.on_peer_up = [this](const std::string& node) {
      std::lock_guard<std::mutex> lk(mu_);
      events_.push_back({node, true, DownReason::kExit, "", std::chrono::steady_clock::now()});
      cv_.notify_all();
    };
    cb.on_peer_down = [this](const std::string& node, DownReason r, const std::string& text) {
      std::lock_guard<std::mutex> lk(mu_);
      events_.push_back({node, false, r, text, std::chrono::steady_clock::now()});
      cv_.notify_all();
    };
    return cb;
  }
  // Waits up to `timeout` for an envelope; false on timeout.
  bool pop(Envelope* e, std::string* from, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, timeout, [&] { return !envelopes_.empty(); })) return false;
    *e = std::move(envelopes_.front().first);
    if (from) *from = envelopes_.front().second;
    envelopes_.pop_front();
    return true;
  }
  bool wait_event(const std::function<bool(const PeerEvent&)>& pred, PeerEvent* out,
                  std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, timeout, [&] {
      for (const auto& ev : events_) {
        if (pred(ev)) {
          if (out) *out = ev;
          return true;
        }
      }
      return false;
    });
  }
  size_t envelope_count() {
    std::lock_guard<std::mutex> lk(mu_);
    return envelopes_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Envelope, std::string>> envelopes_;
  std::vector<PeerEvent> events_;
};

inline Envelope user_envelope(const std::string& from, const std::string& to, std::string data,
                              uint64_t type_id = 0x0E5A0001) {
  Envelope e;
  e.sender = {from, "a"};
  e.receiver = {to, "b"};
  e.payload = UserPayload{type_id, std::move(data)};
  return e;
}

}  // namespace troupe::control::testing
