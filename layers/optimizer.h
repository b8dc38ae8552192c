// layers/optimizer.h — defines AdamW (fp32 master weights, fp32 moments, decoupled weight
// decay, global-norm gradient clipping) over kernels::adamw_step, and LrSchedule (linear
// warmup then cosine decay to a floor).
//
// Distributed use: grad_norm_squared() is the local sum of squares; a data/expert-parallel
// caller all-reduces it before calling step() with the global norm, and may construct
// AdamW over its shard of the parameters only (ZeRO-1).
#pragma once

#include <string>
#include <vector>

#include "layers/context.h"
#include "layers/parameter.h"

namespace troupe::layers {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // max global gradient norm; <= 0 disables clipping
};

class AdamW {
 public:
  // Moments are allocated (zeroed) on c's device, which must be the parameters' device.
  AdamW(std::vector<NamedParameter> params, const AdamWOptions& opts, const Ctx& c = Ctx::cpu());

  double grad_norm_squared(const Ctx& c) const;
  // Clips by `grad_norm` (the global norm) and updates every parameter; advances step().
  void step(const Ctx& c, double lr, double grad_norm);
  // The same with the global norm left on the device: grad_norm_squared f32 [1] (e.g.
  // Model::grad_norm_squared_on_device); the clip factor is taken there (no host wait).
  void step(const Ctx& c, double lr, const Tensor& grad_norm_squared);
  // When on, each step also writes every parameter's working copy (Parameter::work, where
  // defined) from its updated value in the same pass over memory, so the caller need not
  // refresh them (Model::refresh_working_copies) after the step. Required for split masters
  // (Parameter::work_lo), which the step reads from and writes to (work, work_lo) instead
  // of value, marking value stale (Model::sync_master_values).
  void write_working_copies(bool on) { write_work_ = on; }
  // CUDA graphs of the step (train_moe): the learning rate and bias corrections come from
  // a device tensor (f32 [3], allocated here) instead of the launch's arguments, so the
  // launch enqueued by enqueue_update is the same every step. Then each step is
  // prepare_step (advances step(), uploads its schedule: outside the graph) followed by
  // enqueue_update (the update itself: inside); step(c, lr, norm) does both.
  void use_device_schedule(const Ctx& c);
  bool device_schedule() const { return schedule_.defined(); }
  void prepare_step(const Ctx& c, double lr);
  void enqueue_update(const Ctx& c, const Tensor& grad_norm_squared);
  int64_t steps_done() const { return step_; }
  void set_steps_done(int64_t s) { step_ = s; }
  // Moments as named tensors ("<param>.adam_m", "<param>.adam_v") for checkpoints.
  std::vector<NamedBuffer> state();
  const AdamWOptions& options() const { return opts_; }

 private:
  void step_impl(const Ctx& c, double lr, double grad_scale, const Tensor* norm_sq);
  kernels::AdamWConfig config(double lr) const;  // lr, betas, eps and step()
  void launch(const Ctx& c, kernels::AdamWConfig cfg, double grad_scale, const Tensor* norm_sq);
  // Split masters (Model::split_masters) are updated in their halves: values fall behind.
  void mark_split_values_stale();
  std::vector<NamedParameter> params_;
  std::vector<Tensor> m_, v_;
  AdamWOptions opts_;
  int64_t step_ = 0;
  bool write_work_ = false;
  Tensor schedule_;  // device schedule (use_device_schedule), else undefined
};

// Clip multiplier for a gradient of global norm `norm`: min(1, max_norm / norm).
double clip_factor(double norm, double max_norm);

struct LrSchedule {
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  // step is 1-based: warmup rises linearly to lr at warmup_steps, then cosine to min_lr
  // at total_steps (and stays there).
  double at(int64_t step) const;
};

}  // namespace troupe::layers
