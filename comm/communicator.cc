// comm/communicator.cc — Work, CommSpec validation and the shared argument checks.
#include "comm/communicator.h"

namespace troupe::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

std::shared_ptr<Work> Work::completed(std::string what, Status status) {
  auto w = std::make_shared<Work>(std::move(what));
  w->complete(std::move(status));
  return w;
}

bool Work::complete(Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.load(std::memory_order_relaxed)) return false;
    status_ = std::move(status);
    completed_ns_.store(now_ns(), std::memory_order_release);
    if (started_ns_.load(std::memory_order_relaxed) == 0)
      started_ns_.store(created_ns_, std::memory_order_release);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  return true;
}

void Work::mark_started() {
  started_ns_.store(now_ns(), std::memory_order_release);
}

Status Work::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_.load(std::memory_order_relaxed); });
  return status_;
}

Status Work::wait(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return done_.load(std::memory_order_relaxed); })) {
    return deadline_exceeded("{}: not complete before the caller's deadline", what_);
  }
  return status_;
}

Status Work::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_.load(std::memory_order_relaxed)) return failed_precondition("{}: still running", what_);
  return status_;
}

WorkPtr Communicator::fence(const OpOptions& opts) {
  (void)opts;
  return Work::completed("fence", ok_status());
}

Status wait_all(const std::vector<WorkPtr>& works) {
  Status first;
  for (const auto& w : works) {
    Status st = w->wait();
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

Status CommSpec::validate() const {
  if (store == nullptr) return invalid_argument("communicator '{}': no rendezvous store", name);
  if (name.empty()) return invalid_argument("communicator name is empty");
  if (ns.job.empty()) return invalid_argument("communicator '{}': job name is empty", name);
  if (size < 1) return invalid_argument("communicator '{}': size {} < 1", name, size);
  if (rank < 0 || rank >= size) return invalid_argument("communicator '{}': rank {} not in [0, {})", name, rank, size);
  if (options.op_timeout.count() <= 0 || options.init_timeout.count() <= 0) {
    return invalid_argument("communicator '{}': timeouts must be positive", name);
  }
  return ok_status();
}

namespace detail {

Status check_tensor(const Tensor& t, Device device, std::string_view what) {
  if (!t.defined()) return invalid_argument("{}: tensor is undefined", what);
  if (!t.is_contiguous()) return invalid_argument("{}: tensor {} is not contiguous", what, t.describe());
  if (t.device() != device) {
    return invalid_argument("{}: tensor {} is not on the communicator's device {}", what, t.describe(), device);
  }
  return ok_status();
}

Status check_reduce_dtype(DType t, std::string_view what) {
  switch (t) {
    case DType::kF32: case DType::kBF16: case DType::kF16: case DType::kI32: case DType::kI64:
      return ok_status();
    default:
      return invalid_argument("{}: cannot reduce {} (reductions take f32, bf16, f16, i32, i64)", what,
                              dtype_name(t));
  }
}

Status check_peer(int peer, int size, int self, std::string_view what) {
  if (peer < 0 || peer >= size) return invalid_argument("{}: peer {} not in [0, {})", what, peer, size);
  if (peer == self) return invalid_argument("{}: peer {} is this rank", what, peer);
  return ok_status();
}

Status check_counts(const std::vector<int64_t>& counts, int size, int64_t numel, std::string_view what) {
  if (static_cast<int>(counts.size()) != size) {
    return invalid_argument("{}: {} counts for {} ranks", what, counts.size(), size);
  }
  int64_t sum = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) return invalid_argument("{}: count {} for rank {} is negative", what, counts[i], i);
    sum += counts[i];
  }
  if (sum != numel) return invalid_argument("{}: counts sum to {} but the tensor has {} elements", what, sum, numel);
  return ok_status();
}

std::chrono::milliseconds op_timeout(const OpOptions& opts, const CommOptions& comm) {
  return opts.timeout.count() > 0 ? opts.timeout : comm.op_timeout;
}

}  // namespace detail
}  // namespace troupe::comm
