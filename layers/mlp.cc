// layers/mlp.cc — SwiGLUMLP and Experts forward/backward.
#include "layers/mlp.h"

namespace troupe::layers {

SwiGLUMLP::SwiGLUMLP(int64_t d, int64_t f, bool rc) : recompute(rc) {
  w1.allocate({d, 2 * f});
  w2.allocate({f, d});
  w1.overwrites_grad = w2.overwrites_grad = true;  // backward: accumulate_grad()
}

void SwiGLUMLP::init(uint64_t seed, const std::string& prefix, float std, float out_std) {
  init_normal(w1.value, seed, prefix + ".w1", std);
  init_normal(w2.value, seed, prefix + ".w2", out_std);
}

void SwiGLUMLP::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  out.push_back({prefix + ".w1", &w1});
  out.push_back({prefix + ".w2", &w2});
}

Tensor SwiGLUMLP::forward(const Ctx& c, const Tensor& x, Saved& s) const {
  const int64_t t = x.size(0), f = w2.value.size(0);
  s.x = x;
  s.h = c.empty({t, 2 * f});
  kernels::matmul(c.ex, x, w1.w(), s.h);
  Tensor a = c.empty({t, f});
  kernels::swiglu_forward(c.ex, s.h, a);
  Tensor y = c.empty({t, w2.value.size(1)});
  kernels::matmul(c.ex, a, w2.w(), y);
  s.a = recompute ? Tensor() : a;
  return y;
}

Tensor SwiGLUMLP::backward(const Ctx& c, const Tensor& dy, const Saved& s) {
  const int64_t t = s.x.size(0), f = w2.value.size(0);
  Tensor a = s.a;
  if (!a.defined()) {
    a = c.empty({t, f});
    kernels::swiglu_forward(c.ex, s.h, a);
  }
  Tensor da = c.empty({t, f});
  kernels::matmul_backward(c.ex, a, w2.w(), dy, &da, nullptr);
  kernels::matmul_backward(c.ex, a, w2.w(), dy, nullptr, &w2.grad, false, false, w2.accumulate_grad());
  Tensor dh = c.empty(s.h.shape());
  kernels::swiglu_backward(c.ex, s.h, da, dh);
  Tensor dx = c.empty(s.x.shape());
  kernels::matmul_backward(c.ex, s.x, w1.w(), dh, &dx, nullptr);
  kernels::matmul_backward(c.ex, s.x, w1.w(), dh, nullptr, &w1.grad, false, false, w1.accumulate_grad());
  return dx;
}

Experts::Experts(int64_t e, int64_t d, int64_t f, bool rc) : recompute(rc) {
  w1.allocate({e, d, 2 * f});
  w2.allocate({e, f, d});
  // The dW products write every expert's gradient (zeros where an expert got no rows)
  // when not accumulating: backward takes the flag from accumulate_grad().
  w1.overwrites_grad = w2.overwrites_grad = true;
  // The grouped dW writes (or adds to) a bf16 gradient as well (train.expert_grads).
  w1.bf16_grad_ok = w2.bf16_grad_ok = true;
  // A written dW can leave its sum of squares for the gradient norm (Model::enable_grad_norm_fold).
  w1.grad_sum_squares_slots = kernels::grouped_matmul_dw_sum_squares_slots(e, d, 2 * f);
  w2.grad_sum_squares_slots = kernels::grouped_matmul_dw_sum_squares_slots(e, f, d);
}

void Experts::init(uint64_t seed, const std::string& prefix, float std, float out_std, int64_t first_expert) {
  init_normal_rows(w1.value, seed, prefix + ".w1", std, first_expert);
  init_normal_rows(w2.value, seed, prefix + ".w2", out_std, first_expert);
}

void Experts::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  out.push_back({prefix + ".w1", &w1});
  out.push_back({prefix + ".w2", &w2});
}

Tensor Experts::forward(const Ctx& c, const Tensor& xp, const Tensor& offsets, Saved& s) const {
  const int64_t r = xp.size(0), f = w2.value.size(1);
  s.xp = xp;
  s.offsets = offsets;
  s.h = c.empty({r, 2 * f});
  kernels::grouped_matmul(c.ex, xp, w1.w(), offsets, s.h);
  Tensor a = c.empty({r, f});
  kernels::swiglu_forward(c.ex, s.h, a);
  Tensor yp = c.empty({r, w2.value.size(2)});
  kernels::grouped_matmul(c.ex, a, w2.w(), offsets, yp);
  s.a = recompute ? Tensor() : a;
  return yp;
}

Tensor Experts::backward(const Ctx& c, const Tensor& dyp, const Saved& s) {
  const int64_t r = s.xp.size(0), f = w2.value.size(1);
  Tensor a = s.a;
  if (!a.defined()) {
    a = c.empty({r, f});
    kernels::swiglu_forward(c.ex, s.h, a);
  }
  Tensor da = c.empty({r, f});
  const bool add2 = w2.accumulate_grad();
  kernels::grouped_matmul_backward(c.ex, a, w2.w(), s.offsets, dyp, &da, &w2.grad, false, add2,
                                   w2.grad_sum_squares_out(add2));
  Tensor dh = c.empty(s.h.shape());
  kernels::swiglu_backward(c.ex, s.h, da, dh);
  Tensor dxp = c.empty(s.xp.shape());
  const bool add1 = w1.accumulate_grad();
  kernels::grouped_matmul_backward(c.ex, s.xp, w1.w(), s.offsets, dh, &dxp, &w1.grad, false, add1,
                                   w1.grad_sum_squares_out(add1));
  return dxp;
}

}  // namespace troupe::layers
