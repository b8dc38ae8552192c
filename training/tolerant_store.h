// training/tolerant_store.h — defines TolerantStore, the job's rendezvous store as
// the driver and the workers of a training job use it: it rides out an outage of the store
// (troupe-scheduler restarting, or unreachable), keeps the outage visible and bounds it.
//
// - set and contains retry a transient failure (kUnavailable, kDeadlineExceeded) for as long
//   as the outage lasts; get and wait retry kUnavailable until their own deadline. Past
//   Options::outage_limit (counted from the first failure after the last answer) every call
//   fails at once with limit_status().
// - in_outage() says, without asking the store, that it is out; try_set / try_contains /
//   try_get make one attempt and never retry: callers that merely poll (heartbeat keys,
//   exit reports, requests, status) use them and skip the store while it is out, so
//   training, which never needs the store between membership changes, goes on during an
//   outage (the one attempt under way when it begins waits for its own timeout, ~14 s).
// - While it is out a watchman thread asks the store every second (a short get) and logs
//   "<who>: waiting for the scheduler at <where> for N s (limit L s)" every
//   Options::log_every; it logs the return ("answers again after N s") and counts it in
//   outages_ended(), which tells a supervisor that liveness evidence older than that is void.
//
// Thread-safe: any thread may call anything; calls run concurrently on the base store
// (which must allow that, as SchedulerStore and FileStore do).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/rendezvous_store.h"
#include "core/status.h"

namespace troupe::training {

class TolerantStore final : public comm::RendezvousStore {
 public:
  struct Options {
    std::chrono::milliseconds outage_limit{300000};  // elastic.scheduler_outage_limit_ms
    std::chrono::milliseconds log_every{5000};
    std::string who = "trainer";  // the prefix of its log lines ("driver", "worker slot 3")
    std::string where;            // the store's address, for the log lines and errors
  };
  TolerantStore(comm::RendezvousStore& base, Options o);
  TolerantStore(std::unique_ptr<comm::RendezvousStore> base, Options o);
  ~TolerantStore() override;  // stops and joins the watchman

  Status set(std::string_view key, std::string_view value) override;
  Result<std::string> get(std::string_view key, comm::Deadline deadline) override;
  Status wait(const std::vector<std::string>& keys, comm::Deadline deadline) override;
  Result<bool> contains(std::string_view key) override;
  // One attempt each, no retry (the outage is noted all the same).
  Status try_set(std::string_view key, std::string_view value);
  Result<bool> try_contains(std::string_view key);
  Result<std::string> try_get(std::string_view key, comm::Deadline deadline);

  // The store failed (transiently) and has not answered since.
  bool in_outage() const { return outage_since_ns_.load() != 0; }
  // How long the current outage has lasted (0 when none).
  std::chrono::milliseconds outage_for() const;
  // The current outage lasted past the limit: the process should end (limit_status()).
  bool past_limit() const { return outage_for() > o_.outage_limit; }
  // FailedPrecondition naming the store, how long it has been out and the limit.
  Status limit_status() const;
  // Outages that ended so far (the store answered again after failing).
  uint64_t outages_ended() const { return outages_ended_.load(); }

 private:
  // Notes the outcome of one call on the base store, made at `started_ns` (steady clock):
  // an outage begins when the first call that failed was made, not when it gave up.
  void note(const Status& st, int64_t started_ns);
  void watch();  // the watchman (runs while an outage lasts)

  std::unique_ptr<comm::RendezvousStore> owned_;
  comm::RendezvousStore& base_;
  Options o_;
  std::atomic<int64_t> outage_since_ns_{0};  // steady clock; 0: no outage
  std::atomic<uint64_t> outages_ended_{0};
  std::mutex mu_;  // guards the watchman's start and stop
  std::condition_variable cv_;
  std::thread watchman_;
  bool stopping_ = false;
  bool watchman_running_ = false;  // from its start until it returns (under mu_)
};

}  // namespace troupe::training
