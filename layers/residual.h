// layers/residual.h — the pre-norm residual step of a transformer block as two calls:
//   forward   y  = x + f(norm(x))
//   backward  dx = dy + norm'(f'(dy))   (norm' accumulates the norm's weight gradient)
// A block is two of them (attention, then the MLP or MoE layer); stage programs
// (training/stage/stage_program.h) build theirs from it with their own f.
#pragma once

#include <utility>

#include "kernels/ops.h"
#include "layers/embedding.h"

namespace troupe::layers {

// `f` maps the normalised input [T, D] to the sublayer's output [T, D].
template <class F>
Tensor residual_forward(const Ctx& c, const Tensor& x, const RMSNorm& norm, RMSNorm::Saved& s, F&& f) {
  const Tensor y = std::forward<F>(f)(norm.forward(c, x, s));
  Tensor out = c.empty(x.shape());
  kernels::add(c.ex, x, y, out);
  return out;
}

// `df` maps the gradient of the sublayer's output to that of its (normalised) input.
template <class F>
Tensor residual_backward(const Ctx& c, const Tensor& dy, RMSNorm& norm, const RMSNorm::Saved& s, F&& df) {
  return norm.backward(c, std::forward<F>(df)(dy), s, &dy);  // + dy in the norm's pass
}

}  // namespace troupe::layers
