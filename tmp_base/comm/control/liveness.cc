// comm/control/liveness.cc — PeerLiveness.
#include "comm/control/liveness.h"

namespace troupe::control {

void PeerLiveness::watch(const std::string& peer, std::chrono::nanoseconds now) {
  peers_.try_emplace(peer, State{now, true});
}

bool PeerLiveness::heard(const std::string& peer, std::chrono::nanoseconds now) {
  auto [it, inserted] = peers_.try_emplace(peer, State{now, true});
  const bool came_up = inserted || !it->second.up;
  it->second.last_heard = now;
  it->second.up = true;
  return came_up;
}

bool PeerLiveness::mark_down(const std::string& peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.up) return false;
  it->second.up = false;
  return true;
}

std::vector<std::string> PeerLiveness::expire(std::chrono::nanoseconds now) {
  std::vector<std::string> down;
  for (auto& [peer, s] : peers_) {
    if (s.up && now - s.last_heard > timeout_) {
      s.up = false;
      down.push_back(peer);
    }
  }
  return down;
}

bool PeerLiveness::is_up(const std::string& peer) const {
  auto it = peers_.find(peer);
  return it != peers_.end() && it->second.up;
}

std::vector<std::string> PeerLiveness::up_peers() const {
  std::vector<std::string> out;
  for (const auto& [peer, s] : peers_) {
    if (s.up) out.push_back(peer);
  }
  return out;
}

}  // namespace troupe::control
