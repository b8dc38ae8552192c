// kernels/cpu/loss.cc — CPU reference of cross-entropy from logits, forward and backward.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {

void cross_entropy_forward(const Exec&, const Tensor& logits, const Tensor& targets, Tensor& losses,
                           Tensor& lse) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int32_t* pt = targets.data<int32_t>();
  F32In pl(logits);
  F32Out ploss(losses), plse(lse);
  for (int64_t t = 0; t < rows; ++t) {
    const float* lr = pl.get() + t * vocab;
    const int64_t target = pt[t];
    TROUPE_CHECK(target >= -1 && target < vocab, "cross_entropy_forward: targets[{}] = {} outside [-1, {})",
                 t, target, vocab);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, lr[v]);
    double z = 0.0;
    for (int64_t v = 0; v < vocab; ++v) z += std::exp(lr[v] - mx);  // f32 exp, f64 sum
    const double l = static_cast<double>(mx) + std::log(z);
    plse[t] = static_cast<float>(l);
    ploss[t] = target < 0 ? 0.0f : static_cast<float>(l - lr[target]);
  }
}

// Elementwise per row, so dlogits may alias logits: each element is read before it is
// written and nothing else reads it afterwards.
void cross_entropy_backward(const Exec&, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float grad_scale, Tensor& dlogits) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int32_t* pt = targets.data<int32_t>();
  F32In pl(logits), plse(lse);
  F32Out pd(dlogits);
  for (int64_t t = 0; t < rows; ++t) {
    const float* lr = pl.get() + t * vocab;
    float* dr = pd.get() + t * vocab;
    const int64_t target = pt[t];
    TROUPE_CHECK(target >= -1 && target < vocab, "cross_entropy_backward: targets[{}] = {} outside [-1, {})",
                 t, target, vocab);
    if (target < 0) {
      for (int64_t v = 0; v < vocab; ++v) dr[v] = 0.0f;
      continue;
    }
    const float l = plse[t];
    for (int64_t v = 0; v < vocab; ++v) dr[v] = std::exp(lr[v] - l) * grad_scale;
    dr[target] -= grad_scale;
  }
}

// The forward then the backward (per row each reads its logits before the backward
// writes them, so dlogits may alias logits here too).
void cross_entropy_forward_backward(const Exec& ex, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& losses, Tensor& lse, Tensor& dlogits) {
  cpu::cross_entropy_forward(ex, logits, targets, losses, lse);
  cpu::cross_entropy_backward(ex, logits, targets, lse, grad_scale, dlogits);
}

}  // namespace troupe::kernels::cpu
