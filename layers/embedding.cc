// layers/embedding.cc — Embedding and RMSNorm over the kernels of kernels/ops.h.
#include "layers/embedding.h"

namespace troupe::layers {

Embedding::Embedding(int64_t vocab, int64_t dim) {
  weight.allocate({vocab, dim});
  weight.reads_value = true;  // the gather reads the f32 master, never a split one
}

void Embedding::init(uint64_t seed, const std::string& prefix, float std) {
  init_normal(weight.value, seed, prefix + ".weight", std);
}

void Embedding::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  out.push_back({prefix + ".weight", &weight});
}

Tensor Embedding::forward(const Ctx& c, const Tensor& ids) const {
  Tensor out = c.empty({ids.numel(), weight.value.size(1)});
  kernels::embedding_forward(c.ex, ids, weight.value, out);
  return out;
}

void Embedding::backward(const Ctx& c, const Tensor& ids, const Tensor& dout) {
  kernels::embedding_backward(c.ex, ids, dout, weight.grad);
}

RMSNorm::RMSNorm(int64_t dim, float eps_) : eps(eps_) {
  weight.allocate({dim}, /*with_decay=*/false);
  weight.overwrites_grad = true;  // backward: accumulate_grad()
}

void RMSNorm::init() {
  init_constant(weight.value, 1.0f);
}

void RMSNorm::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  out.push_back({prefix + ".weight", &weight});
}

Tensor RMSNorm::forward(const Ctx& c, const Tensor& x, Saved& s) const {
  Tensor y = c.empty(x.shape());
  s.x = x;
  s.rstd = c.empty({x.size(0)}, DType::kF32);
  kernels::rmsnorm_forward(c.ex, x, weight.value, eps, y, s.rstd);
  return y;
}

Tensor RMSNorm::forward_add(const Ctx& c, const Tensor& x, const Tensor& r, Tensor& h, Saved& s) const {
  h = c.empty(x.shape());
  Tensor y = c.empty(x.shape());
  s.x = h;
  s.rstd = c.empty({x.size(0)}, DType::kF32);
  kernels::rmsnorm_add_forward(c.ex, x, r, weight.value, eps, h, y, s.rstd);
  return y;
}

Tensor RMSNorm::backward(const Ctx& c, const Tensor& dy, const Saved& s, const Tensor* dres) {
  Tensor dx = c.empty(s.x.shape());
  kernels::rmsnorm_backward(c.ex, dy, s.x, weight.value, s.rstd, dx, weight.grad, weight.accumulate_grad(),
                            dres);
  return dx;
}

}  // namespace troupe::layers
