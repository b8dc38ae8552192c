// comm/nccl_communicator.cc — NcclCommunicator: Communicator over NCCL with a watchdog.
#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/prctl.h>

#include <cstring>
#include <deque>
#include <thread>

namespace troupe::comm {
namespace {

using Millis = std::chrono::milliseconds;

std::optional<ncclDataType_t> nccl_dtype(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF8E4M3: return ncclFloat8e4m3;
    case DType::kF8E5M2: return ncclFloat8e5m2;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8: return ncclUint8;
    // NCCL has no 16-bit integer type: copies (gather, send, broadcast) move the bits as f16,
    // and check_reduce_dtype refuses to reduce i16.
    case DType::kI16:
      return ncclFloat16;
  }
  return std::nullopt;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

Status nccl_status(ncclResult_t r, std::string_view what) {
  return unavailable("{}: NCCL error {} ({})", what, ncclGetErrorString(r), static_cast<int>(r));
}

struct Pending {
  WorkPtr work;
  cudaEvent_t event = nullptr;
  Deadline deadline;
  std::vector<Tensor> keep;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(CommSpec spec, int device, ncclComm_t comm, cudaStream_t stream, void* scratch)
      : spec_(std::move(spec)), device_(device), comm_(comm), stream_(stream), scratch_(scratch) {
    spec_.store = nullptr;
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~NcclCommunicator() override {
    // Healthy: let pending work finish (the watchdog enforces the deadlines).
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return pending_.empty() || comm_ == nullptr; });
      stop_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      // Clean teardown: finalize (polled, bounded), then destroy; abort if it stalls.
      ncclResult_t r = ncclCommFinalize(comm_);
      if (r == ncclInProgress) r = settle(deadline_in(spec_.options.op_timeout));
      if (r == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    // After an abort the stream may still hold cancelled work; release without waiting.
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
    for (auto ev : free_events_) cudaEventDestroy(ev);
  }

  int rank() const override { return spec_.rank; }
  int size() const override { return spec_.size; }
  std::string_view backend() const override { return "nccl"; }
  Device device() const override { return Device::cuda(device_); }
  const CommSpec& spec() const override { return spec_; }

  WorkPtr all_reduce(Tensor t, ReduceOp op, const OpOptions& opts) override {
    std::string what = fmt::format("all_reduce({}, {})", reduce_op_name(op), t.defined() ? t.describe() : "?");
    Status st = detail::check_tensor(t, device(), what);
    if (st.ok()) st = detail::check_reduce_dtype(t.dtype(), what);
    if (!st.ok()) return Work::completed(what, st);
    return enqueue(std::move(what), opts, {t}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), *nccl_dtype(t.dtype()), nccl_op(op), c, s);
    });
  }

  WorkPtr reduce_scatter(Tensor in, Tensor out, ReduceOp op, const OpOptions& opts) override {
    std::string what = fmt::format("reduce_scatter({}, {} -> {})", reduce_op_name(op), in.defined() ? in.describe() : "?",
                                   out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok()) st = detail::check_reduce_dtype(in.dtype(), what);
    if (st.ok() && in.numel() != out.numel() * size()) {
      st = invalid_argument("{}: input has {} elements, expected size {} x output {}", what, in.numel(), size(), out.numel());
    }
    if (!st.ok()) return Work::completed(what, st);
    return enqueue(std::move(what), opts, {in, out}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), *nccl_dtype(in.dtype()), nccl_op(op), c, s);
    });
  }

  WorkPtr all_gather(Tensor in, Tensor out, const OpOptions& opts) override {
    std::string what = fmt::format("all_gather({} -> {})", in.defined() ? in.describe() : "?", out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok() && out.numel() != in.numel() * size()) {
      st = invalid_argument("{}: output has {} elements, expected size {} x input {}", what, out.numel(), size(), in.numel());
    }
    if (!st.ok()) return Work::completed(what, st);
    return enqueue(std::move(what), opts, {in, out}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), *nccl_dtype(in.dtype()), c, s);
    });
  }

  WorkPtr all_to_all(Tensor in, Tensor out, const OpOptions& opts) override {
    std::string what = fmt::format("all_to_all({} -> {})", in.defined() ? in.describe() : "?", out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok() && (in.numel() != out.numel() || in.numel() % size() != 0)) {
      st = invalid_argument("{}: input and output need the same element count, divisible by {}", what, size());
    }
    if (!st.ok()) return Work::completed(what, st);
    std::vector<int64_t> counts(size(), in.numel() / size());
    return grouped_exchange(std::move(what), in, counts, out, counts, opts);
  }

  WorkPtr all_to_all_v(Tensor in, std::vector<int64_t> send_counts, Tensor out, std::vector<int64_t> recv_counts,
                       const OpOptions& opts) override {
    std::string what = fmt::format("all_to_all_v({} -> {})", in.defined() ? in.describe() : "?", out.defined() ? out.describe() : "?");
    Status st = check_pair(in, out, what);
    if (st.ok()) st = detail::check_counts(send_counts, size(), in.numel(), what + " send_counts");
    if (st.ok()) st = detail::check_counts(recv_counts, size(), out.numel(), what + " recv_counts");
    if (st.ok() && send_counts[rank()] != recv_counts[rank()]) {
      st = invalid_argument("{}: send_counts[self] != recv_counts[self]", what);
    }
    if (!st.ok()) return Work::completed(what, st);
    return grouped_exchange(std::move(what), in, send_counts, out, recv_counts, opts);
  }

  WorkPtr send(Tensor t, int peer, const OpOptions& opts) override {
    std::string what = fmt::format("send({}, peer {})", t.defined() ? t.describe() : "?", peer);
    Status st = detail::check_tensor(t, device(), what);
    if (st.ok()) st = detail::check_peer(peer, size(), rank(), what);
    if (!st.ok()) return Work::completed(what, st);
    return enqueue(std::move(what), opts, {t}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclSend(t.data_ptr(), t.numel(), *nccl_dtype(t.dtype()), peer, c, s);
    });
  }

  WorkPtr recv(Tensor t, int peer, const OpOptions& opts) override {
    std::string what = fmt::format("recv({}, peer {})", t.defined() ? t.describe() : "?", peer);
    Status st = detail::check_tensor(t, device(), what);
    if (st.ok()) st = detail::check_peer(peer, size(), rank(), what);
    if (!st.ok()) return Work::completed(what, st);
    return enqueue(std::move(what), opts, {t}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclRecv(t.data_ptr(), t.numel(), *nccl_dtype(t.dtype()), peer, c, s);
    });
  }

  WorkPtr broadcast(Tensor t, int root, const OpOptions& opts) override {
    std::string what = fmt::format("broadcast({}, root {})", t.defined() ? t.describe() : "?", root);
    Status st = detail::check_tensor(t, device(), what);
    if (st.ok() && (root < 0 || root >= size())) st = invalid_argument("{}: root not in [0, {})", what, size());
    if (!st.ok()) return Work::completed(what, st);
    return enqueue(std::move(what), opts, {t}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), *nccl_dtype(t.dtype()), root, c, s);
    });
  }

  WorkPtr barrier(const OpOptions& opts) override {
    return enqueue("barrier", opts, {}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, c, s);
    });
  }

  // An event after the stream's work so far, tracked as an operation (deadline, async
  // errors): the check of a replayed CUDA graph's captured collectives.
  WorkPtr fence(const OpOptions& opts) override {
    return enqueue("fence", opts, {}, [](ncclComm_t, cudaStream_t) { return ncclSuccess; });
  }

  void abort(std::string_view reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    fail_locked(aborted("communicator '{}' aborted: {}", spec_.name, reason));
  }

  Status health() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return health_;
  }

 private:
  Status check_pair(const Tensor& in, const Tensor& out, const std::string& what) const {
    Status st = detail::check_tensor(in, device(), what);
    if (st.ok()) st = detail::check_tensor(out, device(), what);
    if (st.ok() && in.dtype() != out.dtype()) st = invalid_argument("{}: dtypes differ", what);
    return st;
  }

  // Polls the communicator's state until it leaves ncclInProgress or `deadline` passes.
  // A non-blocking enqueue normally settles within microseconds, so the first 2 ms spin
  // (yielding): sleeping at once cost ~140 us per operation (a sleep_for(50 us) lasts
  // 50 us plus the timer slack), which capped small collectives at ~7k ops/s.
  ncclResult_t settle(Deadline deadline) {
    ncclResult_t state = ncclInProgress;
    const auto spin_until = Clock::now() + std::chrono::milliseconds(2);
    for (;;) {
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return ncclSystemError;
      if (state != ncclInProgress) return state;
      const auto now = Clock::now();
      if (now >= deadline) return ncclInProgress;
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  // Records the first error, aborts the NCCL communicator (once; never destroyed after)
  // and completes every pending Work. Call with mu_ held.
  void fail_locked(const Status& st) {
    if (health_.ok()) health_ = st;
    if (comm_ != nullptr) {
      cudaSetDevice(device_);
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    Status reason = st.code() == StatusCode::kAborted || st.code() == StatusCode::kDeadlineExceeded
                        ? st
                        : failed_precondition("communicator '{}' failed: {}", spec_.name, st.to_string());
    for (auto& p : pending_) {
      p.work->complete(reason);
      cudaEventDestroy(p.event);  // released once the (aborted) stream passes it
    }
    pending_.clear();
    cv_.notify_all();
  }

  Status unusable_locked(const std::string& what) const {
    if (health_.code() == StatusCode::kAborted) return aborted("{}: {}", what, health_.message());
    return failed_precondition("{}: communicator '{}' is unusable: {}", what, spec_.name, health_.to_string());
  }

  template <typename Issue>
  WorkPtr enqueue(std::string what, const OpOptions& opts, std::vector<Tensor> keep, Issue&& issue) {
    auto work = std::make_shared<Work>(std::move(what));
    const Millis timeout = detail::op_timeout(opts, spec_.options);
    std::lock_guard<std::mutex> lock(mu_);
    if (!health_.ok() || comm_ == nullptr) {
      work->complete(unusable_locked(work->what()));
      return work;
    }
    cudaSetDevice(device_);
    cudaStream_t stream = opts.stream ? static_cast<cudaStream_t>(opts.stream) : stream_;
    ncclResult_t r = issue(comm_, stream);
    if (r == ncclInProgress) r = settle(deadline_in(timeout));
    if (r != ncclSuccess) {
      Status st = r == ncclInProgress ? deadline_exceeded("{}: NCCL still enqueuing after {} ms", work->what(), timeout.count())
                                      : nccl_status(r, work->what());
      fail_locked(st);
      work->complete(st);
      return work;
    }
    // Enqueued into a CUDA graph being captured: it runs at each replay, tracked by the
    // fence the replaying code enqueues after the graph (an event recorded now would
    // belong to the capture, and querying it fails). Its tensors stay with the Work
    // (Work::hold): the caller keeps it until its stream has waited for the operation, so
    // the capture's allocator cannot give a buffer still being sent or received on
    // another stream to a later node (a pipeline's send of activations its stage has
    // dropped, as captured on two GPUs: the peer received what overwrote them).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusActive) {
      work->hold(std::move(keep));
      work->complete(ok_status());
      return work;
    }
    cudaEvent_t ev = nullptr;
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    } else if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess) {
      Status st = internal_error("{}: cudaEventCreate: {}", work->what(), cudaGetErrorString(e));
      fail_locked(st);
      work->complete(st);
      return work;
    }
    if (cudaError_t e = cudaEventRecord(ev, stream); e != cudaSuccess) {
      Status st = internal_error("{}: cudaEventRecord: {}", work->what(), cudaGetErrorString(e));
      cudaEventDestroy(ev);
      fail_locked(st);
      work->complete(st);
      return work;
    }
    pending_.push_back(Pending{work, ev, Clock::now() + timeout, std::move(keep)});
    cv_.notify_all();
    return work;
  }

  WorkPtr grouped_exchange(std::string what, const Tensor& in, const std::vector<int64_t>& sc, const Tensor& out,
                           const std::vector<int64_t>& rc, const OpOptions& opts) {
    const ncclDataType_t dt = *nccl_dtype(in.dtype());
    const size_t esize = in.element_size();
    return enqueue(std::move(what), opts, {in, out}, [&](ncclComm_t c, cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      size_t soff = 0, roff = 0;
      for (int p = 0; p < size(); ++p) {
        if (sc[p] > 0) {
          r = ncclSend(static_cast<const char*>(in.data_ptr()) + soff * esize, sc[p], dt, p, c, s);
          if (r != ncclSuccess && r != ncclInProgress) break;
        }
        if (rc[p] > 0) {
          r = ncclRecv(static_cast<char*>(out.data_ptr()) + roff * esize, rc[p], dt, p, c, s);
          if (r != ncclSuccess && r != ncclInProgress) break;
        }
        soff += sc[p];
        roff += rc[p];
      }
      ncclResult_t end = ncclGroupEnd();
      return (r != ncclSuccess && r != ncclInProgress) ? r : end;
    });
  }

  void watchdog_loop() {
    // 1 us timer slack: the 50 us polls below would otherwise last ~100 us, adding that
    // much latency to every completion a host thread waits for.
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      // Poll fast while work is pending (a completion is seen within ~50 us), slowly when idle.
      cv_.wait_for(lock, pending_.empty() ? std::chrono::microseconds(1000) : std::chrono::microseconds(50),
                   [&] { return stop_; });
      if (stop_) break;
      if (comm_ == nullptr || pending_.empty()) continue;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess ||
          (async != ncclSuccess && async != ncclInProgress)) {
        fail_locked(nccl_status(async, fmt::format("communicator '{}' (watchdog)", spec_.name)));
        continue;
      }
      const auto now = Clock::now();
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t q = cudaEventQuery(it->event);
        if (q == cudaSuccess) {
          it->work->complete(ok_status());
          free_events_.push_back(it->event);
          it = pending_.erase(it);
          continue;
        }
        if (q != cudaErrorNotReady) {
          fail_locked(internal_error("{}: CUDA error {}", it->work->what(), cudaGetErrorString(q)));
          break;
        }
        if (now >= it->deadline) {
          fail_locked(deadline_exceeded("{}: not complete within its deadline; communicator '{}' aborted",
                                        it->work->what(), spec_.name));
          break;
        }
        ++it;
      }
      if (pending_.empty()) cv_.notify_all();
    }
  }

  CommSpec spec_;
  const int device_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  ncclComm_t comm_;           // null once aborted or destroyed
  cudaStream_t stream_;
  void* scratch_;             // one float for barrier()
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  Status health_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommSpec& spec, const NcclOptions& options) {
  TROUPE_RETURN_IF_ERROR(spec.validate());
  const std::string what = fmt::format("nccl communicator '{}' (rank {} of {}, {})", spec.name, spec.rank, spec.size,
                                       spec.key_prefix());
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    return unavailable("{}: no usable GPU ({})", what, e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
  }
  if (options.device < 0 || options.device >= count) {
    return invalid_argument("{}: device {} not in [0, {})", what, options.device, count);
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return unavailable("{}: cudaSetDevice({}): {}", what, options.device, cudaGetErrorString(e));
  }
  // Unique id through the store: one per communicator, made by rank 0.
  const Deadline deadline = deadline_in(spec.options.init_timeout);
  PrefixStore store(*spec.store, spec.key_prefix());
  ncclUniqueId id;
  if (spec.rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return nccl_status(r, what + ": ncclGetUniqueId");
    TROUPE_RETURN_IF_ERROR(store.set("nccl_id", std::string_view(id.internal, sizeof(id.internal))));
  } else {
    TROUPE_ASSIGN_OR_RETURN(std::string raw, store.get("nccl_id", deadline));
    if (raw.size() != sizeof(id.internal)) return data_loss("{}: unique id has {} bytes", what, raw.size());
    std::memcpy(id.internal, raw.data(), raw.size());
  }
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  cfg.commName = spec.name.c_str();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, spec.size, id, spec.rank, &cfg);
  if (r == ncclInProgress || r == ncclSuccess) {
    ncclResult_t state = ncclInProgress;
    while (comm != nullptr) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) {
        state = ncclSystemError;
        break;
      }
      if (state != ncclInProgress || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    r = comm == nullptr ? ncclInternalError : state;
  }
  if (r != ncclSuccess) {
    if (comm != nullptr) ncclCommAbort(comm);
    if (r == ncclInProgress) {
      return deadline_exceeded("{}: ncclCommInitRankConfig not done within {} ms", what, spec.options.init_timeout.count());
    }
    return nccl_status(r, what + ": ncclCommInitRankConfig");
  }
  cudaStream_t stream = nullptr;
  void* scratch = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    ncclCommAbort(comm);
    return internal_error("{}: cudaStreamCreate: {}", what, cudaGetErrorString(e));
  }
  if (cudaError_t e = cudaMalloc(&scratch, sizeof(float)); e != cudaSuccess) {
    ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    return resource_exhausted("{}: cudaMalloc: {}", what, cudaGetErrorString(e));
  }
  cudaMemset(scratch, 0, sizeof(float));
  return std::unique_ptr<Communicator>(new NcclCommunicator(spec, options.device, comm, stream, scratch));
}

}  // namespace troupe::comm
