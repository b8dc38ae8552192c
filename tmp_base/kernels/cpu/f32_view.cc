// kernels/cpu/f32_view.cc — F32In and F32Out, the f32 views of f32 or bf16 tensors.
#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {

F32In::F32In(const Tensor& t) {
  if (t.dtype() == DType::kF32) {
    p_ = t.data<float>();
    return;
  }
  buf_.resize(static_cast<size_t>(t.numel()));
  if (!buf_.empty()) convert_dtype(t.data_ptr(), t.dtype(), buf_.data(), DType::kF32, buf_.size());
  p_ = buf_.data();
}

F32Out::F32Out(Tensor& t, bool load) : t_(t) {
  if (t.dtype() == DType::kF32) {
    p_ = t.data<float>();
    return;
  }
  buf_.resize(static_cast<size_t>(t.numel()));
  if (load && !buf_.empty()) convert_dtype(t.data_ptr(), t.dtype(), buf_.data(), DType::kF32, buf_.size());
  p_ = buf_.data();
}

F32Out::~F32Out() {
  if (t_.dtype() != DType::kF32 && !buf_.empty()) {
    convert_dtype(buf_.data(), DType::kF32, t_.data_ptr(), t_.dtype(), buf_.size());
  }
}

}  // namespace troupe::kernels::cpu
