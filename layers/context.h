// layers/context.h — defines Ctx, what every layer call needs: where ops run
// (kernels::Exec) and where new activations are allocated. Built by main() or a test.
#pragma once

#include "core/allocator.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace troupe::layers {

struct Ctx {
  kernels::Exec ex = kernels::Exec::cpu();
  Allocator* alloc = &cpu_allocator();

  static Ctx cpu() { return Ctx{}; }
  // Uninitialised activation buffer on the Exec's device.
  Tensor empty(const Shape& shape, DType dtype = DType::kF32) const { return Tensor::empty(shape, dtype, *alloc); }
  Tensor zeros(const Shape& shape, DType dtype = DType::kF32) const {
    Tensor t = empty(shape, dtype);
    kernels::fill(ex, t, 0.0f);
    return t;
  }
};

}  // namespace troupe::layers
