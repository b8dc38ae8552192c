// comm/control/liveness.h — defines PeerLiveness: the application-heartbeat bookkeeping of
// a Transport, kept apart from sockets so its timing is tested with a ManualClock.
//
// A peer is tracked from the moment we connect to it or first hear from it. Anything
// received from it counts as a heartbeat. A peer silent for longer than the timeout is
// reported down once; hearing from it again reports it up again (a restarted process).
// Not thread-safe: owned by the transport's I/O thread.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace troupe::control {

class PeerLiveness {
 public:
  explicit PeerLiveness(std::chrono::nanoseconds timeout) : timeout_(timeout) {}

  // Starts tracking `peer` (e.g. on connect) as if heard at `now`, unless already tracked.
  void watch(const std::string& peer, std::chrono::nanoseconds now);
  // Records traffic from `peer`. Returns true when it was untracked or down: it is (back) up.
  bool heard(const std::string& peer, std::chrono::nanoseconds now);
  // Marks `peer` down now (connection lost). Returns true when it was up.
  bool mark_down(const std::string& peer);
  // Peers up but silent for more than the timeout at `now`; each is marked down and
  // returned once.
  std::vector<std::string> expire(std::chrono::nanoseconds now);

  bool is_up(const std::string& peer) const;
  std::vector<std::string> up_peers() const;
  std::chrono::nanoseconds timeout() const { return timeout_; }

 private:
  struct State {
    std::chrono::nanoseconds last_heard{0};
    bool up = true;
  };
  std::chrono::nanoseconds timeout_;
  std::map<std::string, State> peers_;
};

}  // namespace troupe::control
