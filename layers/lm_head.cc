// layers/lm_head.cc — LMHead over matmul and the cross-entropy kernels, chunked by rows.
#include "layers/lm_head.h"

#include <algorithm>

namespace troupe::layers {

LMHead::LMHead(int64_t vocab, int64_t d_model, float eps, Parameter* tied_to, int64_t chunk_rows)
    : norm(d_model, eps), weight(tied_to), tied(tied_to != nullptr), chunk_rows_(chunk_rows) {
  if (!tied) {
    own_.allocate({vocab, d_model});
    own_.overwrites_grad = true;  // the first chunk of a step's first micro-batch writes it
    weight = &own_;
  }
}

void LMHead::init(uint64_t seed, float std) {
  norm.init();
  if (!tied) init_normal(own_.value, seed, "lm_head.weight", std);
}

void LMHead::collect(std::vector<NamedParameter>& out) {
  norm.collect("final_norm", out);
  if (!tied) out.push_back({"lm_head.weight", &own_});
}

double LMHead::forward_backward(const Ctx& c, const Tensor& x, const Tensor& targets, float grad_scale,
                                Tensor& dx) {
  return kernels::sum(c.ex, forward_backward_losses(c, x, targets, grad_scale, dx));
}

Tensor LMHead::forward_backward_losses(const Ctx& c, const Tensor& x, const Tensor& targets, float grad_scale,
                                       Tensor& dx) {
  RMSNorm::Saved ns;
  Tensor xn = norm.forward(c, x, ns);
  const int64_t t = x.size(0), v = weight->value.size(0);
  Tensor dxn = c.empty(x.shape());
  Tensor losses = c.empty({t}, DType::kF32);
  // The weight gradient is written by the first chunk where accumulate_grad says so (a
  // step's first micro-batch, untied), then added to; each chunk writes its rows of dxn.
  bool add_w = weight->accumulate_grad();
  for (int64_t r0 = 0; r0 < t; r0 += chunk_rows_) {
    const int64_t n = std::min(chunk_rows_, t - r0);
    Tensor xc = xn.narrow(0, r0, n);
    Tensor tc = targets.narrow(0, r0, n);
    Tensor logits = c.empty({n, v});
    kernels::matmul(c.ex, xc, weight->w(), logits, false, /*trans_b=*/true);
    Tensor lc = losses.narrow(0, r0, n), lse = c.empty({n}, DType::kF32);
    kernels::cross_entropy_forward_backward(c.ex, logits, tc, grad_scale, lc, lse, logits);  // in place
    Tensor dxc = dxn.narrow(0, r0, n);
    kernels::matmul_backward(c.ex, xc, weight->w(), logits, &dxc, nullptr, false, true);
    kernels::matmul_backward(c.ex, xc, weight->w(), logits, nullptr, &weight->grad, false, true, add_w);
    add_w = true;
  }
  dx = norm.backward(c, dxn, ns);
  return losses;
}

double LMHead::loss_sum(const Ctx& c, const Tensor& x, const Tensor& targets) const {
  RMSNorm::Saved ns;
  Tensor xn = norm.forward(c, x, ns);
  const int64_t t = x.size(0), v = weight->value.size(0);
  Tensor losses = c.empty({t}, DType::kF32);
  for (int64_t r0 = 0; r0 < t; r0 += chunk_rows_) {
    const int64_t n = std::min(chunk_rows_, t - r0);
    Tensor logits = c.empty({n, v});
    kernels::matmul(c.ex, xn.narrow(0, r0, n), weight->w(), logits, false, true);
    Tensor lc = losses.narrow(0, r0, n), lse = c.empty({n}, DType::kF32);
    kernels::cross_entropy_forward(c.ex, logits, targets.narrow(0, r0, n), lc, lse);
  }
  return kernels::sum(c.ex, losses);  // one read-back for the whole batch
}

Tensor LMHead::logits(const Ctx& c, const Tensor& x) const {
  RMSNorm::Saved ns;
  Tensor xn = norm.forward(c, x, ns);
  Tensor out = c.empty({x.size(0), weight->value.size(0)});
  kernels::matmul(c.ex, xn, weight->w(), out, false, true);
  return out;
}

}  // namespace troupe::layers
