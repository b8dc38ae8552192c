// scheduler/scheduler_store.h — defines SchedulerStore, the client side of the
// scheduler's rendezvous store for one job and epoch (what NCCL unique ids and Gloo
// rendezvous go through).
//
// Its methods match comm::RendezvousStore (comm/rendezvous_store.h on the comm branch):
// set / get(key, deadline) / wait(keys, deadline) / contains, blocking calls that never
// outlive their deadline. Until that header is on this branch the class stands alone;
// deriving from the interface is then a one-line change (see the report).
// Thread-safe: one connection guarded by a mutex.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "scheduler/job_context.h"
#include "scheduler/transport.h"

namespace troupe::sched {

class SchedulerStore {
 public:
  using Clock = std::chrono::steady_clock;
  using Deadline = Clock::time_point;

  static Result<std::unique_ptr<SchedulerStore>> connect(const std::string& endpoint, const ClientSecurity& sec,
                                                         const std::string& job_id, uint64_t epoch);
  static Result<std::unique_ptr<SchedulerStore>> connect(const JobContext& ctx) {
    return connect(ctx.scheduler, ctx.security, ctx.job_id, ctx.epoch);
  }

  Status set(std::string_view key, std::string_view value);
  Result<std::string> get(std::string_view key, Deadline deadline);
  Status wait(const std::vector<std::string>& keys, Deadline deadline);
  Result<bool> contains(std::string_view key);

  const std::string& job_id() const { return job_id_; }
  uint64_t epoch() const { return epoch_; }

 private:
  SchedulerStore(std::unique_ptr<ClientEndpoint> c, std::string job, uint64_t epoch)
      : conn_(std::move(c)), job_id_(std::move(job)), epoch_(epoch) {}
  Result<std::string> call(StoreOp op, std::vector<std::string> keys, std::string value, Deadline deadline);

  std::mutex mu_;
  std::unique_ptr<ClientEndpoint> conn_;
  std::string job_id_;
  uint64_t epoch_;
};

}  // namespace troupe::sched
