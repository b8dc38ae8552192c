// scheduler/client/scheduler_store.cc — SchedulerStore.
#include "scheduler/client/scheduler_store.h"

#include <unistd.h>

#include <algorithm>
#include <random>

namespace troupe::sched {

Result<std::unique_ptr<SchedulerStore>> SchedulerStore::connect(const std::string& endpoint, const ClientSecurity& sec,
                                                                const std::string& job_id, uint64_t epoch) {
  TROUPE_ASSIGN_OR_RETURN(std::string ep, normalize_endpoint(endpoint));
  std::string id = fmt::format("store:{}:{}:{}:{:x}", job_id, epoch, getpid(), std::random_device{}());
  TROUPE_ASSIGN_OR_RETURN(auto conn, ClientEndpoint::connect(ep, sec, id));
  return std::unique_ptr<SchedulerStore>(new SchedulerStore(std::move(conn), job_id, epoch));
}

void SchedulerStore::disconnect() {
  std::shared_ptr<ClientEndpoint> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gone = std::move(conn_);
  }
}

std::shared_ptr<ClientEndpoint> SchedulerStore::connection() {
  std::lock_guard<std::mutex> lock(mu_);
  return conn_;
}

Result<std::string> SchedulerStore::call(StoreOp op, std::vector<std::string> keys, std::string value, Deadline deadline) {
  const std::shared_ptr<ClientEndpoint> conn = connection();
  if (!conn) return unavailable("store of job {}: disconnected", job_id_);
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  StoreRequest req{op, job_id_, epoch_, std::move(keys), std::move(value),
                   static_cast<int32_t>(std::clamp<int64_t>(left.count(), 0, INT32_MAX))};
  // The scheduler answers at its deadline; allow the round trip on top of it.
  TROUPE_ASSIGN_OR_RETURN(
      Reply r, conn->request(std::move(req),
                             std::max(left, std::chrono::milliseconds(0)) + std::chrono::milliseconds(2000)));
  TROUPE_RETURN_IF_ERROR(r.status());
  return std::string(r.data);
}

Status SchedulerStore::set(std::string_view key, std::string_view value) {
  auto r = call(StoreOp::kSet, {std::string(key)}, std::string(value), Clock::now() + std::chrono::seconds(10));
  return r.ok() ? ok_status() : r.status();
}

Result<std::string> SchedulerStore::get(std::string_view key, Deadline deadline) {
  return call(StoreOp::kGet, {std::string(key)}, {}, deadline);
}

Status SchedulerStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  auto r = call(StoreOp::kWait, keys, {}, deadline);
  return r.ok() ? ok_status() : r.status();
}

Result<bool> SchedulerStore::contains(std::string_view key) {
  auto r = call(StoreOp::kContains, {std::string(key)}, {}, Clock::now() + std::chrono::seconds(10));
  if (!r.ok()) return r.status();
  const std::string& v = r.value();
  return !v.empty() && v[0] == '1';
}

}  // namespace troupe::sched
