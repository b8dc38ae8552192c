// layers/optimizer.cc — AdamW and the LR schedule.
#include "layers/optimizer.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace troupe::layers {

AdamW::AdamW(std::vector<NamedParameter> params, const AdamWOptions& opts, const Ctx& c)
    : params_(std::move(params)), opts_(opts) {
  for (auto& p : params_) {
    TROUPE_CHECK(p.param->value.device() == c.ex.device, "AdamW: {} is on {} but the Ctx runs on {}", p.name,
                 p.param->value.device(), c.ex.device);
    if (c.on_device()) {
      m_.push_back(c.zeros(p.param->value.shape(), DType::kF32));
      v_.push_back(c.zeros(p.param->value.shape(), DType::kF32));
    } else {
      m_.push_back(Tensor::zeros(p.param->value.shape(), DType::kF32));
      v_.push_back(Tensor::zeros(p.param->value.shape(), DType::kF32));
    }
  }
}

double AdamW::grad_norm_squared(const Ctx& c) const {
  std::vector<const Tensor*> grads;
  grads.reserve(params_.size());
  for (const auto& p : params_) grads.push_back(&p.param->grad);
  return kernels::sum_squares_multi(c.ex, grads);
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / norm;
}

void AdamW::step(const Ctx& c, double lr, double grad_norm) {
  step_impl(c, lr, clip_factor(grad_norm, opts_.grad_clip), nullptr);
}

void AdamW::step(const Ctx& c, double lr, const Tensor& grad_norm_squared) {
  step_impl(c, lr, 1.0, &grad_norm_squared);
}

kernels::AdamWConfig AdamW::config(double lr) const {
  kernels::AdamWConfig cfg;
  cfg.lr = static_cast<float>(lr);
  cfg.beta1 = static_cast<float>(opts_.beta1);
  cfg.beta2 = static_cast<float>(opts_.beta2);
  cfg.eps = static_cast<float>(opts_.eps);
  cfg.step = step_;
  return cfg;
}

void AdamW::use_device_schedule(const Ctx& c) {
  schedule_ = c.on_device() ? c.zeros({3}, DType::kF32) : Tensor::zeros({3}, DType::kF32);
}

void AdamW::mark_split_values_stale() {
  for (auto& p : params_)
    if (p.param->work_lo.defined()) p.param->value_stale = true;
}

void AdamW::prepare_step(const Ctx& c, double lr) {
  TROUPE_CHECK(schedule_.defined(), "AdamW::prepare_step needs use_device_schedule");
  ++step_;
  mark_split_values_stale();  // a replayed graph's update runs none of launch()'s host code
  const std::array<float, 3> v = kernels::adamw_schedule(config(lr));
  Tensor host = Tensor::zeros({3}, DType::kF32);
  std::copy(v.begin(), v.end(), host.data<float>());
  c.copy_to_device(host, schedule_);
}

void AdamW::enqueue_update(const Ctx& c, const Tensor& grad_norm_squared) {
  TROUPE_CHECK(schedule_.defined() && step_ >= 1, "AdamW::enqueue_update needs prepare_step first");
  // lr is a placeholder here: the kernel reads the schedule prepare_step uploaded.
  launch(c, config(0.0), 1.0, &grad_norm_squared);
}

void AdamW::step_impl(const Ctx& c, double lr, double grad_scale, const Tensor* norm_sq) {
  if (schedule_.defined()) {
    prepare_step(c, lr);
  } else {
    ++step_;
  }
  launch(c, config(lr), grad_scale, norm_sq);
}

void AdamW::launch(const Ctx& c, kernels::AdamWConfig cfg, double grad_scale, const Tensor* norm_sq) {
  cfg.grad_scale = static_cast<float>(grad_scale);
  if (norm_sq != nullptr && opts_.grad_clip > 0) {
    cfg.clip_sum_squares = norm_sq;
    cfg.clip_max_norm = static_cast<float>(opts_.grad_clip);
  }
  if (schedule_.defined()) cfg.device_schedule = &schedule_;
  // One multi-tensor step (one launch per 256 tensors on CUDA instead of one per tensor).
  std::vector<kernels::AdamWTensor> list;
  list.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i].param;
    // A split master lives in the working copy and its low half: the step writes both.
    TROUPE_CHECK(!p.work_lo.defined() || write_work_,
                 "AdamW: {} has a split master, which needs write_working_copies(true)", params_[i].name);
    list.push_back(
        {&p.value, &p.grad, &m_[i], &v_[i], p.decay ? static_cast<float>(opts_.weight_decay) : 0.0f,
         write_work_ && p.work.defined() ? &p.work : nullptr, p.work_lo.defined() ? &p.work_lo : nullptr});
  }
  kernels::adamw_step_multi(c.ex, list, cfg);
  mark_split_values_stale();
}

std::vector<NamedBuffer> AdamW::state() {
  std::vector<NamedBuffer> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.push_back({params_[i].name + ".adam_m", &m_[i]});
    out.push_back({params_[i].name + ".adam_v", &v_[i]});
  }
  return out;
}

double LrSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps) {
    return lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  }
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace troupe::layers
