// layers/context.h — defines Ctx, what every layer call needs: where ops run
// (kernels::Exec), where new activations are allocated, and their dtype. Built by main()
// (or a test) and passed down; layers never look at the device themselves except through
// the explicit host<->device copies below, which are for scalars, small routing tensors
// and inputs/metrics only.
#pragma once

#include "core/allocator.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace troupe::layers {

struct Ctx {
  kernels::Exec ex = kernels::Exec::cpu();
  Allocator* alloc = &cpu_allocator();
  // Dtype of activations and activation gradients (f32 on the CPU reference, bf16 on
  // CUDA). Statistics that need range (RMSNorm rstd, log-sum-exps, router logits, scores
  // and gates, token losses) are always f32.
  DType act = DType::kF32;

  static Ctx cpu() { return Ctx{}; }
  bool on_device() const { return !ex.device.is_cpu(); }

  // Uninitialised buffer on the Exec's device (activation dtype unless given).
  Tensor empty(const Shape& shape) const { return empty(shape, act); }
  Tensor empty(const Shape& shape, DType dtype) const { return Tensor::empty(shape, dtype, *alloc); }
  Tensor zeros(const Shape& shape) const { return zeros(shape, act); }
  Tensor zeros(const Shape& shape, DType dtype) const {
    Tensor t = empty(shape, dtype);
    kernels::fill(ex, t, 0.0f);
    return t;
  }

  // A copy of a host tensor on the Exec's device (the tensor itself when the Exec is the
  // CPU). Enqueued on the Exec's stream.
  Tensor to_device(const Tensor& host) const;
  // A host copy of `t` (t itself, made contiguous, when it is already on the host).
  // Synchronises the Exec's stream: use it for metrics and small routing tensors only.
  Tensor to_host(const Tensor& t) const;
  // Copies host tensor `src` into `dst` on the Exec's device (same shape and dtype); a
  // no-op when dst shares src's storage on the CPU.
  void copy_to_device(const Tensor& src, Tensor& dst) const;
};

}  // namespace troupe::layers
