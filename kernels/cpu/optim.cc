// kernels/cpu/optim.cc — CPU reference of the AdamW step (decoupled weight decay, bias
// correction, gradient multiplier), its multi-tensor form, and the multi-tensor sum of
// squares (global gradient norm), to the host or into a device scalar; the split master's
// halves (master_split / master_join).
#include <array>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/master_bits.h"

namespace troupe::kernels::cpu {

// g = grad * grad_scale; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// param -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps) + lr * wd * param,
// the decay using the parameter before this step (as torch.optim.AdamW).
namespace {
// adamw_step with lr and the bias corrections given (schedule = adamw_schedule's values).
void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWConfig& cfg,
                  const std::array<float, 3>& schedule) {
  const int64_t n = param.numel();
  F32In pg(grad);
  float* pp = param.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  const float lr = schedule[0], bc1 = schedule[1], bc2 = schedule[2];
  for (int64_t i = 0; i < n; ++i) {
    const float g = pg[i] * cfg.grad_scale;
    pm[i] = cfg.beta1 * pm[i] + (1.0f - cfg.beta1) * g;
    pv[i] = cfg.beta2 * pv[i] + (1.0f - cfg.beta2) * g * g;
    const float mhat = pm[i] / bc1;
    const float vhat = pv[i] / bc2;
    pp[i] -= lr * (mhat / (std::sqrt(vhat) + cfg.eps) + cfg.weight_decay * pp[i]);
  }
}
}  // namespace

void adamw_step(const Exec&, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const AdamWConfig& cfg) {
  adamw_update(param, grad, m, v, cfg, adamw_schedule(cfg));
}

// Each tensor with its own weight decay; the same arithmetic as adamw_step. With a clip
// tensor, grad_scale takes the clip factor max / n of the norm n it holds (n > max > 0).
void adamw_step_multi(const Exec& ex, std::span<const AdamWTensor> tensors, const AdamWConfig& cfg) {
  AdamWConfig c = cfg;
  if (cfg.clip_sum_squares != nullptr) {
    const double n = std::sqrt(static_cast<double>(cfg.clip_sum_squares->data<float>()[0]));
    if (cfg.clip_max_norm > 0 && n > cfg.clip_max_norm)
      c.grad_scale *= static_cast<float>(cfg.clip_max_norm / n);
    c.clip_sum_squares = nullptr;
  }
  std::array<float, 3> schedule{};
  if (cfg.device_schedule != nullptr) {
    const float* s = cfg.device_schedule->data<float>();
    schedule = {s[0], s[1], s[2]};
  } else {
    schedule = adamw_schedule(cfg);
  }
  for (const AdamWTensor& t : tensors) {
    c.weight_decay = t.weight_decay;
    if (t.work_lo != nullptr) {  // the split master: joined, updated, split again
      Tensor master = Tensor::empty(t.work->shape(), DType::kF32);
      cpu::master_join(ex, *t.work, *t.work_lo, master);
      adamw_update(master, *t.grad, *t.m, *t.v, c, schedule);
      cpu::master_split(ex, master, *t.work, *t.work_lo);
      continue;
    }
    adamw_update(*t.param, *t.grad, *t.m, *t.v, c, schedule);
    if (t.work != nullptr) cpu::cast(ex, *t.param, *t.work);
  }
}

void master_split(const Exec&, const Tensor& value, Tensor& hi, Tensor& lo) {
  const uint32_t* b = reinterpret_cast<const uint32_t*>(value.data<float>());
  uint16_t* h = reinterpret_cast<uint16_t*>(hi.data_ptr());
  uint16_t* l = reinterpret_cast<uint16_t*>(lo.data_ptr());
  for (int64_t i = 0, n = value.numel(); i < n; ++i) master_split_bits(b[i], h[i], l[i]);
}

void master_join(const Exec&, const Tensor& hi, const Tensor& lo, Tensor& value) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(hi.data_ptr());
  const uint16_t* l = reinterpret_cast<const uint16_t*>(lo.data_ptr());
  uint32_t* b = reinterpret_cast<uint32_t*>(value.data<float>());
  for (int64_t i = 0, n = value.numel(); i < n; ++i) b[i] = master_join_bits(h[i], l[i]);
}

double sum_squares_multi(const Exec& ex, std::span<const Tensor* const> tensors) {
  double s = 0.0;
  for (const Tensor* t : tensors) s += cpu::sum_squares(ex, *t);
  return s;
}

void sum_squares_into(const Exec& ex, std::span<const Tensor* const> tensors,
                      std::span<const Tensor* const> sums, Tensor& out, bool accumulate) {
  double s = cpu::sum_squares_multi(ex, tensors);
  for (const Tensor* t : sums) s += cpu::sum(ex, *t);
  float* o = out.data<float>();
  o[0] = static_cast<float>(s + (accumulate ? static_cast<double>(o[0]) : 0.0));
}

}  // namespace troupe::kernels::cpu
