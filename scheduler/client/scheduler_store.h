// scheduler/client/scheduler_store.h — defines SchedulerStore, the client side of the
// scheduler's rendezvous store for one job and epoch (what NCCL unique ids and Gloo
// rendezvous go through).
//
// It implements comm::RendezvousStore (comm/rendezvous_store.h): set / get(key, deadline)
// / wait(keys, deadline) / contains, blocking calls that never outlive their deadline, so
// Gloo and NCCL set-up meet their peers through the scheduler (the app wires it in; comm
// never includes scheduler code). Keys live in the scheduler's SQLite state, namespaced
// by (job, epoch): a new epoch after a restart never sees the failed epoch's keys.
// Thread-safe, and calls from several threads run concurrently over the one connection
// (each is its own ask): a blocking get or wait on one thread (a rendezvous waiting for a
// late peer) never holds up another thread's set (the elastic worker's heartbeat).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "comm/rendezvous_store.h"
#include "core/status.h"
#include "scheduler/client/job_context.h"
#include "scheduler/client/transport.h"

namespace troupe::sched {

class SchedulerStore final : public comm::RendezvousStore {
 public:
  using Clock = comm::Clock;
  using Deadline = comm::Deadline;

  static Result<std::unique_ptr<SchedulerStore>> connect(const std::string& endpoint, const ClientSecurity& sec,
                                                         const std::string& job_id, uint64_t epoch);
  static Result<std::unique_ptr<SchedulerStore>> connect(const JobContext& ctx) {
    return connect(ctx.session_endpoint(), ctx.session_security(), ctx.job_id, ctx.epoch);
  }

  Status set(std::string_view key, std::string_view value) override;
  Result<std::string> get(std::string_view key, Deadline deadline) override;
  Status wait(const std::vector<std::string>& keys, Deadline deadline) override;
  Result<bool> contains(std::string_view key) override;

  // Closes the connection to the scheduler (fault injection: a cut control connection);
  // every later call fails with kUnavailable.
  void disconnect();

  const std::string& job_id() const { return job_id_; }
  uint64_t epoch() const { return epoch_; }

 private:
  SchedulerStore(std::unique_ptr<ClientEndpoint> c, std::string job, uint64_t epoch)
      : conn_(std::move(c)), job_id_(std::move(job)), epoch_(epoch) {}
  std::shared_ptr<ClientEndpoint> connection();
  Result<std::string> call(StoreOp op, std::vector<std::string> keys, std::string value, Deadline deadline);

  std::mutex mu_;                         // guards conn_ only, never held across a request
  std::shared_ptr<ClientEndpoint> conn_;  // a call in flight keeps it alive past disconnect()
  std::string job_id_;
  uint64_t epoch_;
};

}  // namespace troupe::sched
