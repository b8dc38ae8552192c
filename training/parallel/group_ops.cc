// training/parallel/group_ops.cc — CommTime and the blocking group helpers.
#include "training/parallel/group_ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "training/parallel/elastic_comm.h"

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::training {

using Clock = std::chrono::steady_clock;

namespace {
std::string kind_of(std::string_view what) {
  const std::string first(what.substr(0, what.find(' ')));
  for (const char* s : {"replicated", "tied", "grads", "params", "bf16"}) {
    if (first == s) return "sync";
  }
  return first;
}

// The communication lane of a kind (the group its operations run on).
std::string lane_of(std::string_view what) {
  const std::string k = kind_of(what);
  if (k == "ulysses" || k == "expert" || k == "router") return "comm n";
  if (k == "sync") return "comm dp";
  if (k == "pipeline") return "comm pp";
  return "comm world";
}
}  // namespace

#if TROUPE_HAVE_CUDA
class DeviceTimeline {
 public:
  struct Span {
    int64_t step;
    std::string lane, what;
    cudaEvent_t ev0, ev1;
  };
  ~DeviceTimeline() {
    for (const Span& s : spans_) {
      cudaEventDestroy(s.ev0);
      cudaEventDestroy(s.ev1);
    }
    for (const auto& [step, ev] : origin_) cudaEventDestroy(ev);
  }
  cudaEvent_t mark(int64_t step, cudaStream_t stream) {
    cudaEvent_t ev = nullptr;
    CUDA_CHECK(cudaEventCreate(&ev));
    CUDA_CHECK(cudaEventRecord(ev, stream));
    if (!origin_.contains(step)) {  // the step's origin: a second event at the same point
      cudaEvent_t o = nullptr;
      CUDA_CHECK(cudaEventCreate(&o));
      CUDA_CHECK(cudaEventRecord(o, stream));
      origin_[step] = o;
    }
    return ev;
  }
  void add(int64_t step, std::string_view lane, std::string_view what, cudaEvent_t ev0, cudaEvent_t ev1) {
    spans_.push_back({step, std::string(lane), std::string(what), ev0, ev1});
  }
  std::vector<std::pair<int64_t, TraceEvent>> take() {
    std::vector<std::pair<int64_t, TraceEvent>> out;
    std::vector<Span> left;
    const auto ns = [](cudaEvent_t from, cudaEvent_t to) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, from, to));
      return static_cast<int64_t>(static_cast<double>(ms) * 1e6);
    };
    for (Span& s : spans_) {
      const cudaEvent_t origin = origin_.at(s.step);
      if (cudaEventQuery(s.ev1) != cudaSuccess || cudaEventQuery(origin) != cudaSuccess) {
        (void)cudaGetLastError();  // cudaErrorNotReady is not an error
        left.push_back(std::move(s));
        continue;
      }
      out.push_back({s.step, TraceEvent{s.lane, s.what, ns(origin, s.ev0), ns(origin, s.ev1)}});
      CUDA_CHECK(cudaEventDestroy(s.ev0));
      CUDA_CHECK(cudaEventDestroy(s.ev1));
    }
    spans_ = std::move(left);
    for (auto it = origin_.begin(); it != origin_.end();) {
      const bool used =
          std::any_of(spans_.begin(), spans_.end(), [&](const Span& s) { return s.step == it->first; });
      if (!used && cudaEventQuery(it->second) == cudaSuccess) {
        CUDA_CHECK(cudaEventDestroy(it->second));
        it = origin_.erase(it);
      } else {
        (void)cudaGetLastError();
        ++it;
      }
    }
    return out;
  }

 private:
  std::vector<Span> spans_;
  std::map<int64_t, cudaEvent_t> origin_;
};
#else
class DeviceTimeline {};
#endif

CommTime::CommTime() = default;
CommTime::~CommTime() = default;

void* CommTime::device_mark(void* stream) {
#if TROUPE_HAVE_CUDA
  if (!tracing_ || ctx_ == nullptr || ctx_->ex.cuda == nullptr) return nullptr;
  auto s = static_cast<cudaStream_t>(stream != nullptr ? stream : ctx_->ex.cuda->stream);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return nullptr;
  if (device_trace_ == nullptr) device_trace_ = std::make_unique<DeviceTimeline>();
  return device_trace_->mark(trace_step_, s);
#else
  (void)stream;
  return nullptr;
#endif
}

void CommTime::device_span(std::string_view lane, std::string_view what, void* ev0, void* ev1) {
#if TROUPE_HAVE_CUDA
  if (ev0 == nullptr || ev1 == nullptr) {
    if (ev0 != nullptr) CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(ev0)));
    if (ev1 != nullptr) CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(ev1)));
    return;
  }
  device_trace_->add(trace_step_, lane, what, static_cast<cudaEvent_t>(ev0), static_cast<cudaEvent_t>(ev1));
#else
  (void)lane, (void)what, (void)ev0, (void)ev1;
#endif
}

std::vector<std::pair<int64_t, TraceEvent>> CommTime::take_device_trace() {
#if TROUPE_HAVE_CUDA
  if (device_trace_ != nullptr) return device_trace_->take();
#endif
  return {};
}

void CommTime::span(std::string_view lane, std::string_view what, int64_t t0, int64_t t1) {
  if (tracing_) trace_.push_back({std::string(lane), std::string(what), t0, t1});
}

void CommTime::trace_work(const comm::Work& w, std::string_view what) {
  if (tracing_ && w.test()) span(lane_of(what), what, w.started_ns(), w.completed_ns());
}

void CommTime::fail(const comm::Work& w, const Status& st, std::string_view what) {
  // Elastic workers unwind the step instead (elastic_comm.h).
  if (throw_on_comm_error()) {
    throw CommFailure(fmt::format("data plane: {} ({}) failed: {}", what, w.what(), st.to_string()));
  }
  TROUPE_CHECK(false, "data plane: {} ({}) failed: {}", what, w.what(), st.to_string());
  std::abort();
}

CommOp CommTime::launch(const std::function<comm::WorkPtr(const comm::OpOptions&)>& fn, std::string_view what,
                        void* stream) {
  (void)stream;  // device builds only
  CommOp op;
  op.what = std::string(what);
  comm::OpOptions o = op_options();
#if TROUPE_HAVE_CUDA
  void* target = stream != nullptr ? stream : comm_stream_;
  if (ctx_ != nullptr && target != nullptr && ctx_->ex.cuda != nullptr) {
    auto comm = static_cast<cudaStream_t>(target);
    cudaEvent_t before = nullptr, after = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(before, ctx_->ex.cuda->stream));
    CUDA_CHECK(cudaStreamWaitEvent(comm, before, 0));
    CUDA_CHECK(cudaEventDestroy(before));  // released once recorded and waited on
    o.stream = target;
    void* mark0 = device_mark(comm);
    op.work = fn(o);
    if (mark0 != nullptr) device_span("gpu " + lane_of(what), what, mark0, device_mark(comm));
    CUDA_CHECK(cudaEventCreateWithFlags(&after, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(after, comm));
    op.event = after;
    return op;
  }
#endif
  op.work = fn(o);
  return op;
}

void CommTime::await(CommOp& op) {
  if (!op.pending()) return;
#if TROUPE_HAVE_CUDA
  if (op.event != nullptr) {
    auto ev = static_cast<cudaEvent_t>(op.event);
    CUDA_CHECK(cudaStreamWaitEvent(ctx_->ex.cuda->stream, ev, 0));
    CUDA_CHECK(cudaEventDestroy(ev));
    op.event = nullptr;
  }
#endif
  if (ctx_ != nullptr) {
    issue(op.work, op.what);
  } else {
    wait(op.work, op.what);
  }
  op.work.reset();
}

void CommTime::add(double seconds, std::string_view what) {
  seconds_ += seconds;
  by_kind_[kind_of(what)] += seconds;
}

void CommTime::wait(const comm::WorkPtr& w, std::string_view what) {
  fault_point(what);
  const auto t0 = Clock::now();
  const Status st = w->wait();
  const auto t1 = Clock::now();
  add(std::chrono::duration<double>(t1 - t0).count(), what);
  if (tracing_) {
    span("main", fmt::format("wait: {}", what),
         std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count(),
         std::chrono::duration_cast<std::chrono::nanoseconds>(t1.time_since_epoch()).count());
    trace_work(*w, what);
  }
  if (!st.ok()) fail(*w, st, what);
}

void CommTime::wait_all(const std::vector<comm::WorkPtr>& ws, std::string_view what) {
  for (const auto& w : ws) wait(w, what);
}

void CommTime::issue(const comm::WorkPtr& w, std::string_view what) {
  if (ctx_ == nullptr) {
    wait(w, what);
    return;
  }
  fault_point(what);  // device mode: where the step meets this operation (fault injection)
  // Drop the completed ones (checking them) so the list stays short within a step.
  size_t k = 0;
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    const comm::WorkPtr& pw = in_flight_[i].first;
    if (pw->test()) {
      const Status st = pw->status();
      if (!st.ok()) {
        // An aborted communicator (a new membership epoch) or a failed peer: the step
        // unwinds (elastic workers) with nothing left in flight.
        const comm::WorkPtr failed = pw;
        const std::string name = in_flight_[i].second;
        in_flight_.clear();
        fail(*failed, st, name);
      }
    } else {
      if (k != i) in_flight_[k] = std::move(in_flight_[i]);
      ++k;
    }
  }
  in_flight_.resize(k);
  if (w->test()) {
    const Status st = w->status();
    if (!st.ok()) {
      in_flight_.clear();
      fail(*w, st, what);
    }
    return;
  }
  in_flight_.emplace_back(w, std::string(what));
}

void CommTime::drain(std::string_view what) {
  // Taken out first: a failed wait throws (elastic workers) with nothing left in flight.
  std::vector<std::pair<comm::WorkPtr, std::string>> works;
  works.swap(in_flight_);
  for (auto& [work, name] : works) wait(work, fmt::format("{} ({})", what, name));
}

comm::OpOptions CommTime::op_options() const {
  comm::OpOptions o;
#if TROUPE_HAVE_CUDA
  if (ctx_ != nullptr && ctx_->ex.cuda != nullptr) o.stream = ctx_->ex.cuda->stream;
#endif
  return o;
}

void all_reduce_sum(comm::Communicator& c, const Tensor& x, CommTime& t, std::string_view what) {
  if (c.size() == 1) return;
  t.issue(c.all_reduce(x, comm::ReduceOp::kSum, t.op_options()), what);
}

void all_gather(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t,
                std::string_view what) {
  if (c.size() == 1) {
    Tensor o = out;
    if (t.device_mode()) {
      kernels::cast(t.device_ctx()->ex, in.view(out.shape()), o);
    } else {
      o.copy_from(in.view(out.shape()));
    }
    return;
  }
  t.issue(c.all_gather(in, out, t.op_options()), what);
}

void reduce_scatter_sum(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t,
                        std::string_view what) {
  if (c.size() == 1) {
    Tensor o = out;
    if (t.device_mode()) {
      kernels::cast(t.device_ctx()->ex, in.view(out.shape()), o);
    } else {
      o.copy_from(in.view(out.shape()));
    }
    return;
  }
  t.issue(c.reduce_scatter(in, out, comm::ReduceOp::kSum, t.op_options()), what);
}

void all_to_all_v_rows(comm::Communicator& c, const Tensor& in, const std::vector<int64_t>& send_rows,
                       const Tensor& out, const std::vector<int64_t>& recv_rows, CommTime& t,
                       std::string_view what) {
  int64_t cols = 1;  // elements per row (rows may be 0)
  for (int64_t d = 1; d < in.dim(); ++d) cols *= in.size(d);
  std::vector<int64_t> sc(send_rows.size()), rc(recv_rows.size());
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = send_rows[i] * cols;
  for (size_t i = 0; i < rc.size(); ++i) rc[i] = recv_rows[i] * cols;
  t.issue(c.all_to_all_v(in.view({in.numel()}), sc, out.view({out.numel()}), rc, t.op_options()), what);
}

void sum_doubles(comm::Communicator& c, std::vector<double>& values, CommTime& t, std::string_view what) {
  if (c.size() == 1) return;
  const int64_t bytes = static_cast<int64_t>(values.size() * sizeof(double));
  Tensor in = Tensor::empty({bytes}, DType::kU8);
  std::memcpy(in.data_ptr(), values.data(), static_cast<size_t>(bytes));
  Tensor out;
  if (t.device_mode()) {
    // NCCL moves device memory only: a small copy each way (the host sync is the point:
    // the values are needed on the host).
    const layers::Ctx& dc = *t.device_ctx();
    Tensor dout = dc.empty({bytes * c.size()}, DType::kU8);
    t.issue(c.all_gather(dc.to_device(in), dout, t.op_options()), what);
    const auto t0 = Clock::now();
    out = dc.to_host(dout);
    t.add(std::chrono::duration<double>(Clock::now() - t0).count(), what);
  } else {
    out = Tensor::empty({bytes * c.size()}, DType::kU8);
    t.wait(c.all_gather(in, out), what);
  }
  const auto* all = static_cast<const double*>(out.data_ptr());
  for (size_t i = 0; i < values.size(); ++i) {
    double s = 0;
    for (int r = 0; r < c.size(); ++r) s += all[static_cast<size_t>(r) * values.size() + i];
    values[i] = s;
  }
}

namespace {
// The part of [lo, hi) in shard p ([p*len, (p+1)*len)), as a length (0 if none).
int64_t part_len(int64_t lo, int64_t hi, int64_t p, int64_t len) {
  return std::max<int64_t>(0, std::min(hi, (p + 1) * len) - std::max(lo, p * len));
}
}  // namespace

void grad_bucket_launch(comm::Communicator& dp, const layers::Ctx& c, const Tensor& grads, int64_t shard_len,
                        DType wire, Bucket& b, CommTime& t, std::string_view what) {
  const int n = dp.size(), me = dp.rank();
  std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) sc[static_cast<size_t>(p)] = part_len(b.lo, b.hi, p, shard_len);
  const int64_t mine = part_len(b.lo, b.hi, me, shard_len);
  b.mine_lo = std::max(b.lo, me * shard_len);
  b.mine_hi = b.mine_lo + mine;
  for (int q = 0; q < n; ++q) rc[static_cast<size_t>(q)] = mine;
  TROUPE_CHECK(grads.numel() == b.hi - b.lo, "grad_bucket_launch: {} gradients for the range [{}, {})",
               grads.numel(), b.lo, b.hi);
  const Tensor in = grads.view({grads.numel()});
  if (in.dtype() == wire) {
    b.send = in;  // already the wire's dtype (f32, or bf16 gradients)
  } else {
    b.send = c.empty({b.hi - b.lo}, wire);
    kernels::cast(c.ex, in, b.send);
  }
  b.recv = c.empty({n * mine}, wire);
  b.op = t.launch([&](const comm::OpOptions& o) { return dp.all_to_all_v(b.send, sc, b.recv, rc, o); }, what);
}

void grad_bucket_finish(const layers::Ctx& c, Bucket& b, const Tensor& shard, int64_t shard_len,
                        CommTime& t) {
  t.await(b.op);
  const int64_t mine = b.mine_hi - b.mine_lo;
  if (mine > 0) {
    const int64_t n = b.recv.numel() / mine;
    const int64_t base = b.mine_lo - (b.mine_lo / shard_len) * shard_len;
    Tensor out = shard.narrow(0, base, mine);
    // fp32, in rank order: ((r0 + r1) + r2) + ... (as Gloo's reduce_scatter sums).
    kernels::sum_chunks(c.ex, b.recv.view({n, mine}), out);
  }
  b.send = Tensor();
  b.recv = Tensor();
}

void param_bucket_launch(comm::Communicator& dp, const layers::Ctx& c, const Tensor& flat, int64_t shard_len,
                         Bucket& b, CommTime& t, std::string_view what) {
  const int n = dp.size(), me = dp.rank();
  const int64_t mine = part_len(b.lo, b.hi, me, shard_len);
  b.mine_lo = std::max(b.lo, me * shard_len);
  b.mine_hi = b.mine_lo + mine;
  std::vector<int64_t> sc(static_cast<size_t>(n), mine), rc(static_cast<size_t>(n));
  for (int q = 0; q < n; ++q) rc[static_cast<size_t>(q)] = part_len(b.lo, b.hi, q, shard_len);
  b.send = c.empty({n * mine}, flat.dtype());
  if (mine > 0) {
    const Tensor src = flat.narrow(0, b.mine_lo, mine);
    for (int p = 0; p < n; ++p) {
      Tensor dst = b.send.narrow(0, p * mine, mine);
      kernels::cast(c.ex, src, dst);
    }
  }
  b.recv = flat.narrow(0, b.lo, b.hi - b.lo);
  b.op = t.launch([&](const comm::OpOptions& o) { return dp.all_to_all_v(b.send, sc, b.recv, rc, o); }, what);
}

void gather_rows(const Tensor& src, const std::vector<int64_t>& idx, Tensor& dst) {
  const int64_t d = src.size(1);
  const float* s = src.data<float>();
  float* o = dst.data<float>();
  for (size_t i = 0; i < idx.size(); ++i) {
    std::memcpy(o + static_cast<int64_t>(i) * d, s + idx[i] * d, static_cast<size_t>(d) * sizeof(float));
  }
}

void scatter_rows(const Tensor& src, const std::vector<int64_t>& idx, Tensor& dst) {
  const int64_t d = src.size(1);
  const float* s = src.data<float>();
  float* o = dst.data<float>();
  for (size_t i = 0; i < idx.size(); ++i) {
    std::memcpy(o + idx[i] * d, s + static_cast<int64_t>(i) * d, static_cast<size_t>(d) * sizeof(float));
  }
}

}  // namespace troupe::training
