// actors/training/group_ops.cc — CommTime and the blocking group helpers.
#include "actors/training/group_ops.h"

#include <cstring>

#include <fmt/format.h>

#include "actors/training/elastic_comm.h"
#include "core/check.h"

#if TROUPE_HAVE_CUDA
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
}  // namespace

void CommTime::add(double seconds, std::string_view what) {
  seconds_ += seconds;
  by_kind_[kind_of(what)] += seconds;
}

void CommTime::wait(const comm::WorkPtr& w, std::string_view what) {
  fault_point(what);
  const auto t0 = Clock::now();
  const Status st = w->wait();
  add(std::chrono::duration<double>(Clock::now() - t0).count(), what);
  // Elastic workers unwind the step instead (elastic_comm.h).
  if (!st.ok() && throw_on_comm_error()) {
    throw CommFailure(fmt::format("data plane: {} ({}) failed: {}", what, w->what(), st.to_string()));
  }
  TROUPE_CHECK(st.ok(), "data plane: {} ({}) failed: {}", what, w->what(), st.to_string());
}

void CommTime::wait_all(const std::vector<comm::WorkPtr>& ws, std::string_view what) {
  for (const auto& w : ws) wait(w, what);
}

void CommTime::issue(const comm::WorkPtr& w, std::string_view what) {
  if (ctx_ == nullptr) {
    wait(w, what);
    return;
  }
  // Drop the completed ones (checking them) so the list stays short within a step.
  size_t k = 0;
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    const comm::WorkPtr& pw = in_flight_[i].first;
    if (pw->test()) {
      const Status st = pw->status();
      TROUPE_CHECK(st.ok(), "data plane: {} ({}) failed: {}", in_flight_[i].second, pw->what(),
                   st.to_string());
    } else {
      if (k != i) in_flight_[k] = std::move(in_flight_[i]);
      ++k;
    }
  }
  in_flight_.resize(k);
  if (w->test()) {
    const Status st = w->status();
    TROUPE_CHECK(st.ok(), "data plane: {} ({}) failed: {}", what, w->what(), st.to_string());
    return;
  }
  in_flight_.emplace_back(w, std::string(what));
}

void CommTime::drain(std::string_view what) {
  for (auto& [work, name] : in_flight_) wait(work, fmt::format("{} ({})", what, name));
  in_flight_.clear();
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

void all_gather(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t, std::string_view what) {
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
                       const Tensor& out, const std::vector<int64_t>& recv_rows, CommTime& t, std::string_view what) {
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
