// layers/param_buffer.cc — ParamBuffer: layout, written gradients, the folded norm,
// working copies and split masters.
#include "layers/param_buffer.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

namespace troupe::layers {

namespace {
bool has_work(const Ctx& c, const Parameter& p) {
  return p.value.dim() >= 2 && c.act != DType::kF32;
}
}  // namespace

void ParamBuffer::build(const Ctx& c, const std::vector<NamedParameter>& params, const Options& o) {
  TROUPE_CHECK(o.shards >= 1, "ParamBuffer: {} shards", o.shards);
  TROUPE_CHECK(o.expert_grads == DType::kF32 || o.expert_grads == DType::kBF16,
               "ParamBuffer: expert gradients must be f32 or bf16, not {}", dtype_name(o.expert_grads));
  on_device_ = c.on_device();
  // Unique parameters, those with an f32 gradient first, each group in the given order.
  std::unordered_set<const Parameter*> seen;
  std::vector<Slot> f32s, lows;
  for (const auto& np : params) {
    TROUPE_CHECK(np.param != nullptr, "ParamBuffer: parameter '{}' is null", np.name);
    if (!seen.insert(np.param).second) continue;
    const bool low = o.expert_grads == DType::kBF16 && np.param->bf16_grad_ok;
    (low ? lows : f32s).push_back(Slot{np.name, np.param, 0, low});
  }
  slots_ = std::move(f32s);
  int64_t at = 0;
  for (Slot& s : slots_) {
    s.offset = at;
    at += padded(s.numel());
  }
  low_begin_ = at;
  for (Slot& s : lows) {
    s.offset = at;
    at += padded(s.numel());
    slots_.push_back(std::move(s));
  }
  used_ = at;
  size_ = (std::max<int64_t>(used_, 1) + o.shards - 1) / o.shards * o.shards;
  if (lows.empty()) low_begin_ = size_;  // the tail padding belongs to grads()

  values_ = c.zeros({size_}, DType::kF32);
  grads_ = low_begin_ > 0 ? c.zeros({low_begin_}, DType::kF32) : Tensor();
  low_grads_ = size_ > low_begin_ ? c.zeros({size_ - low_begin_}, DType::kBF16) : Tensor();
  int64_t work_total = 0;
  work_offsets_.assign(slots_.size(), -1);
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!has_work(c, *slots_[i].param)) continue;
    work_offsets_[i] = work_total;
    work_total += padded(slots_[i].numel());
  }
  works_ = work_total > 0 ? c.empty({work_total}, c.act) : Tensor();
  master_lo_ = Tensor();
  fold_slots_ = Tensor();
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    Parameter& p = *s.param;
    const Shape shape = p.value.shape();
    Tensor v = values_.narrow(0, s.offset, s.numel()).view(shape);
    if (p.value.defined()) {
      if (!on_device_) {
        v.copy_from(p.value);
      } else if (p.value.device().is_cpu()) {
        c.copy_to_device(p.value.contiguous(), v);
      } else {
        kernels::cast(c.ex, p.value, v);  // already on the device (a rebuild): a copy
      }
    }
    p.value = v;
    p.grad = grad_range(s.offset, s.offset + s.numel()).view(shape);
    p.work = work_offsets_[i] >= 0 ? works_.narrow(0, work_offsets_[i], s.numel()).view(shape) : Tensor();
    p.work_lo = Tensor();
    p.value_stale = false;
    p.grad_stale = false;
    p.grad_sum_squares = Tensor();
    p.reset_grad_products();
  }
  refresh_working_copies(c);
}

int64_t ParamBuffer::slot_of(const Parameter* p) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].param == p) return static_cast<int64_t>(i);
  return -1;
}

Tensor ParamBuffer::grad_range(int64_t lo, int64_t hi) const {
  TROUPE_CHECK(0 <= lo && lo <= hi && hi <= size_, "ParamBuffer: gradient range [{}, {}) outside [0, {})", lo,
               hi, size_);
  if (hi <= low_begin_) return grads_.narrow(0, lo, hi - lo);
  TROUPE_CHECK(lo >= low_begin_, "ParamBuffer: gradient range [{}, {}) straddles the bf16 part at {}", lo, hi,
               low_begin_);
  return low_grads_.narrow(0, lo - low_begin_, hi - lo);
}

namespace {
// Merges [begin, end) ranges of the flat index space into maximal runs that do not cross
// `split` (the bf16 part's start).
std::vector<std::pair<int64_t, int64_t>> merge_runs(std::vector<std::pair<int64_t, int64_t>> r,
                                                    int64_t split) {
  std::sort(r.begin(), r.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& [b, e] : r) {
    if (!out.empty() && b <= out.back().second && (b < split) == (out.back().first < split)) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(b, e);
    }
  }
  return out;
}
}  // namespace

void ParamBuffer::zero_grad(const Ctx& c) {
  // Gradients that their backward overwrites are only marked stale: clearing them would
  // cost a pass over memory and make the first micro-batch's products read zeros back.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Slot& s : slots_) {
    Parameter& p = *s.param;
    p.grad_stale = p.overwrites_grad;
    p.reset_grad_products();
    if (!p.grad_stale) ranges.emplace_back(s.offset, std::min(s.offset + padded(s.numel()), size_));
  }
  for (const auto& [b, e] : merge_runs(std::move(ranges), low_begin_)) {
    Tensor run = grad_range(b, e);
    kernels::fill(c.ex, run, 0.0f);
  }
}

void ParamBuffer::settle_grads(const Ctx& c) {
  for (Slot& s : slots_) {
    if (!s.param->grad_stale) continue;
    kernels::fill(c.ex, s.param->grad, 0.0f);  // no backward wrote it: its gradient is zero
    s.param->grad_stale = false;
  }
}

void ParamBuffer::settle_grads(const Ctx& c, std::span<const size_t> which) {
  for (size_t i : which) {
    Parameter& p = *slots_.at(i).param;
    if (!p.grad_stale) continue;
    kernels::fill(c.ex, p.grad, 0.0f);
    p.grad_stale = false;
  }
}

int64_t ParamBuffer::enable_grad_norm_fold(const Ctx& c, const std::vector<bool>& eligible) {
  TROUPE_CHECK(eligible.empty() || eligible.size() == slots_.size(), "ParamBuffer: {} flags for {} slots",
               eligible.size(), slots_.size());
  const auto folds = [&](size_t i) {
    return (eligible.empty() || eligible[i]) && slots_[i].param->grad_sum_squares_slots > 0;
  };
  int64_t total = 0, count = 0;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (folds(i)) total += slots_[i].param->grad_sum_squares_slots;
  fold_slots_ = total > 0 ? c.zeros({total}, DType::kF32) : Tensor();
  int64_t at = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Parameter& p = *slots_[i].param;
    p.grad_sum_squares = Tensor();
    p.reset_grad_products();  // not valid before the next zero_grad
    if (!folds(i)) continue;
    p.grad_sum_squares = fold_slots_.narrow(0, at, p.grad_sum_squares_slots);
    at += p.grad_sum_squares_slots;
    ++count;
  }
  return count;
}

int64_t ParamBuffer::grad_norm_squared_into(const Ctx& c, Tensor& out,
                                            const std::vector<bool>& counted) const {
  TROUPE_CHECK(counted.empty() || counted.size() == slots_.size(), "ParamBuffer: {} flags for {} slots",
               counted.size(), slots_.size());
  std::vector<std::pair<int64_t, int64_t>> read;
  std::vector<const Tensor*> sums;  // folded: their slots, summed (already squares)
  int64_t folded = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!counted.empty() && !counted[i]) continue;
    const Slot& s = slots_[i];
    if (s.param->grad_sum_squares_valid()) {
      sums.push_back(&s.param->grad_sum_squares);
      folded += s.numel();
    } else {
      // The padding after a gradient is zero: reading it lets neighbours merge into one run.
      read.emplace_back(s.offset, std::min(s.offset + padded(s.numel()), size_));
    }
  }
  std::vector<Tensor> runs;
  for (const auto& [b, e] : merge_runs(std::move(read), low_begin_)) runs.push_back(grad_range(b, e));
  std::vector<const Tensor*> squares;
  for (const Tensor& t : runs) squares.push_back(&t);
  kernels::sum_squares_into(c.ex, squares, out, /*accumulate=*/false, sums);
  return folded;
}

double ParamBuffer::grad_norm_squared(const Ctx& c, const std::vector<bool>& counted) const {
  Tensor out = c.zeros({1}, DType::kF32);
  grad_norm_squared_into(c, out, counted);
  return static_cast<double>(c.to_host(out).data<float>()[0]);
}

void ParamBuffer::refresh_working_copies(const Ctx& c) {
  for (Slot& s : slots_) {
    Parameter& p = *s.param;
    if (p.work_lo.defined()) {
      // Splitting a value that is behind would undo the optimizer's steps since.
      TROUPE_CHECK(!p.value_stale,
                   "ParamBuffer: {} is behind its split master (the optimizer wrote the working copy "
                   "itself); call sync_master_values before reading or rewriting values",
                   s.name);
      kernels::master_split(c.ex, p.value, p.work, p.work_lo);
    } else if (p.work.defined()) {
      kernels::cast(c.ex, p.value, p.work);
    }
  }
}

void ParamBuffer::refresh_working_copies(const Ctx& c, std::span<const size_t> which) {
  for (size_t i : which) {
    Parameter& p = *slots_.at(i).param;
    if (p.work_lo.defined()) {
      TROUPE_CHECK(!p.value_stale, "ParamBuffer: {} is behind its split master", slots_[i].name);
      kernels::master_split(c.ex, p.value, p.work, p.work_lo);
    } else if (p.work.defined()) {
      kernels::cast(c.ex, p.value, p.work);
    }
  }
}

int64_t ParamBuffer::split_masters(const Ctx& c) {
  TROUPE_CHECK(built(), "ParamBuffer::split_masters before build");
  const auto splits = [](const Parameter& p) {
    return p.work.defined() && p.work.dtype() == DType::kBF16 && !p.reads_value && !p.work_lo.defined();
  };
  int64_t total = 0;
  for (const Slot& s : slots_)
    if (splits(*s.param)) total += padded(s.numel());
  if (total == 0) return 0;
  master_lo_ = c.empty({total}, DType::kI16);
  int64_t at = 0, n = 0;
  for (Slot& s : slots_) {
    Parameter& p = *s.param;
    if (!splits(p)) continue;
    p.work_lo = master_lo_.narrow(0, at, s.numel()).view(p.value.shape());
    kernels::master_split(c.ex, p.value, p.work, p.work_lo);
    p.value_stale = false;
    at += padded(s.numel());
    ++n;
  }
  return n;
}

void ParamBuffer::sync_master_values(const Ctx& c) {
  for (Slot& s : slots_) {
    Parameter& p = *s.param;
    if (!p.value_stale) continue;
    kernels::master_join(c.ex, p.work, p.work_lo, p.value);
    p.value_stale = false;
  }
}

void ParamBuffer::values_written() {
  for (Slot& s : slots_) s.param->value_stale = false;
}

void ParamBuffer::to_host(const Ctx& c) {
  sync_master_values(c);
  for (Slot& s : slots_) {
    Parameter& p = *s.param;
    // On the CPU to_host gives a view of the buffer itself: a copy of its own instead.
    const auto own = [&](const Tensor& t) {
      for (const Tensor* b : {&values_, &grads_, &low_grads_})
        if (b->defined() && t.storage() == b->storage()) return t.clone();
      return t;
    };
    p.value = own(c.to_host(p.value));
    Tensor g = c.to_host(p.grad);
    if (g.dtype() != DType::kF32) {  // a bf16 gradient: f32 on the host, as ever
      Tensor f = Tensor::empty(g.shape(), DType::kF32);
      kernels::cast(kernels::Exec::cpu(), g, f);
      g = f;
    }
    p.grad = own(g);
    p.work = Tensor();
    p.work_lo = Tensor();
    p.value_stale = false;
    p.grad_sum_squares = Tensor();
  }
  slots_.clear();
  work_offsets_.clear();
  values_ = grads_ = low_grads_ = works_ = master_lo_ = fold_slots_ = Tensor();
  used_ = size_ = low_begin_ = 0;
}

}  // namespace troupe::layers
