// scheduler/daemons/rendezvous.h — defines RendezvousTable, the scheduler side of the rendezvous
// store: keys namespaced by (job, epoch), set/get/wait/contains where get and wait park
// until the keys exist or their deadline passes. Values are written through to the
// StateStore (when given) so a restarted scheduler still serves them.
//
// Cost: a set, get or contains is O(log n) in the keys held, whatever the number of parked
// requests; a set wakes only the requests that wait for its key (an index from each missing
// key to its waiters); deadlines are kept in time order. A (job, epoch) is read from
// SQLite once (a restarted scheduler), after which the memory copy is authoritative, so
// a miss never touches the database.
//
// Single-threaded (the scheduler loop). Time comes in as arguments, so tests control it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "scheduler/client/protocol.h"
#include "scheduler/daemons/state_store.h"

namespace troupe::sched {

class RendezvousTable {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxKeyBytes = 1024;
  static constexpr size_t kMaxValueBytes = size_t{4} << 20;

  explicit RendezvousTable(StateStore* durable) : durable_(durable) {}

  // Answers at once (set, contains, or get/wait whose keys exist, or a bad request), or
  // parks the request under `token` and returns nullopt.
  std::optional<Reply> handle(const StoreRequest& req, uint64_t token, Clock::time_point now);
  // Requests answered since the last call (keys arrived, or deadline passed), by token.
  std::vector<std::pair<uint64_t, Reply>> take_ready(Clock::time_point now);
  // Forgets every key and waiter of the job (waiters get kCancelled).
  void drop_job(const std::string& job_id);
  size_t parked() const { return waiters_.size(); }

 private:
  using Key = std::tuple<std::string, uint64_t, std::string>;
  struct Waiter {
    StoreRequest req;
    Clock::time_point deadline;
    size_t missing = 0;  // keys of req not set yet
  };
  std::optional<std::string> lookup(const std::string& job, uint64_t epoch, const std::string& key);
  void load(const std::string& job, uint64_t epoch);  // from SQLite, once per (job, epoch)
  Reply complete(const StoreRequest& req);            // every key is present
  void forget(uint64_t token, const Waiter& w);       // out of the key and deadline indexes

  StateStore* durable_;
  std::map<Key, std::string> values_;
  std::set<std::pair<std::string, uint64_t>> loaded_;
  std::map<uint64_t, Waiter> waiters_;                          // by token
  std::map<Key, std::vector<uint64_t>> waiting_for_;            // missing key -> tokens
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;  // (deadline, token)
  std::vector<std::pair<uint64_t, Reply>> ready_;
};

}  // namespace troupe::sched
