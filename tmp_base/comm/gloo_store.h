// comm/gloo_store.h — defines GlooStore, a gloo::rendezvous::Store over any
// RendezvousStore, so Gloo contexts meet through the scheduler's store (or a FileStore).
//
// Gloo's Store reports failure by throwing; this adapter throws gloo::IoException with the
// RendezvousStore's status message, and bounds every get/wait by `timeout` (or the
// timeout Gloo passes), so a missing peer makes the Gloo rendezvous fail, never hang.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/rendezvous_store.h"

namespace troupe::comm {

class GlooStore final : public gloo::rendezvous::Store {
 public:
  // Does not own `store`; it must outlive this adapter.
  GlooStore(RendezvousStore& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  RendezvousStore& store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace troupe::comm
