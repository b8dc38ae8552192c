// layers/attention.cc — Attention forward/backward over kernels::matmul, rope and attention.
#include "layers/attention.h"

#include <cmath>

namespace troupe::layers {

Attention::Attention(int64_t d_model, int64_t nh, int64_t nkv, int64_t dh, float theta, bool qk_norm,
                     float norm_eps)
    : n_heads(nh), n_kv_heads(nkv), head_dim(dh), rope_theta(theta) {
  if (qk_norm) {
    q_norm = std::make_unique<RMSNorm>(dh, norm_eps);
    k_norm = std::make_unique<RMSNorm>(dh, norm_eps);
  }
  wq.allocate({d_model, nh * dh});
  wk.allocate({d_model, nkv * dh});
  wv.allocate({d_model, nkv * dh});
  wo.allocate({nh * dh, d_model});
  // The backward writes each weight gradient on a step's first micro-batch (accumulate_grad).
  wq.overwrites_grad = wk.overwrites_grad = wv.overwrites_grad = wo.overwrites_grad = true;
}

void Attention::init(uint64_t seed, const std::string& prefix, float std, float out_std) {
  init_normal(wq.value, seed, prefix + ".wq", std);
  init_normal(wk.value, seed, prefix + ".wk", std);
  init_normal(wv.value, seed, prefix + ".wv", std);
  init_normal(wo.value, seed, prefix + ".wo", out_std);
  if (q_norm) q_norm->init();
  if (k_norm) k_norm->init();
}

void Attention::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  out.push_back({prefix + ".wq", &wq});
  out.push_back({prefix + ".wk", &wk});
  out.push_back({prefix + ".wv", &wv});
  out.push_back({prefix + ".wo", &wo});
  if (q_norm) q_norm->collect(prefix + ".q_norm", out);
  if (k_norm) k_norm->collect(prefix + ".k_norm", out);
}

namespace {
// a, b and c as one [3, ...] tensor when they have one shape and dtype and lie side by side
// in memory (Model::to_device allocates a layer's working copies and gradients in order),
// else an undefined tensor: Q, K and V then take one batched product instead of three.
Tensor stacked3(const Tensor& a, const Tensor& b, const Tensor& c) {
  if (!a.defined() || !b.defined() || !c.defined()) return {};
  if (a.shape() != b.shape() || a.shape() != c.shape() || a.dtype() != b.dtype() || a.dtype() != c.dtype() ||
      a.device() != b.device() || a.device() != c.device())
    return {};
  if (!a.is_contiguous() || !b.is_contiguous() || !c.is_contiguous()) return {};
  const auto* base = static_cast<const char*>(a.data_ptr());
  if (static_cast<const char*>(b.data_ptr()) != base + a.nbytes() ||
      static_cast<const char*>(c.data_ptr()) != base + 2 * a.nbytes())
    return {};
  Shape shape = a.shape();
  shape.insert(shape.begin(), 3);
  return Tensor::wrap(a.data_ptr(), shape, a.dtype(), a.device());
}
}  // namespace

Tensor Attention::positions(int64_t batch, int64_t seq, int64_t offset) {
  std::vector<int32_t> p(static_cast<size_t>(batch * seq));
  for (int64_t i = 0; i < batch * seq; ++i)
    p[static_cast<size_t>(i)] = static_cast<int32_t>(offset + i % seq);
  return Tensor::from_ints({batch * seq}, p);
}

const Tensor& Attention::device_positions(const Ctx& c, int64_t batch, int64_t seq, int64_t offset) const {
  // Uploaded once per (batch, seq, offset, device): the same positions serve every micro-batch.
  const auto hit = [&](const PosCache& e) {
    return e.pos.defined() && e.pos.numel() == batch * seq && e.seq == seq && e.offset == offset &&
           e.pos.device() == c.ex.device;
  };
  for (PosCache& e : pos_cache_)
    if (hit(e)) return e.pos;
  PosCache& slot = pos_cache_[pos_cache_[0].pos.defined() ? 1 : 0];  // else replace the second
  slot.pos = c.to_device(positions(batch, seq, offset));
  slot.seq = seq;
  slot.offset = offset;
  return slot.pos;
}

void Attention::project_qkv(const Ctx& c, const Tensor& x, const Tensor& pos, int64_t batch, int64_t seq,
                            Tensor& q, Tensor& k, Tensor& v, const Tensor* qk_positions,
                            QkNormSaved* norm) const {
  const int64_t t = x.size(0);
  TROUPE_CHECK(!q_norm || norm != nullptr,
               "Attention::project_qkv: the q/k norm needs somewhere to keep its state");
  // The norm writes new q and k rows, so it takes the separate RoPE launches.
  const bool one_rope = qk_positions != nullptr && n_kv_heads == n_heads && !q_norm;
  // q, k (and v, where the weights allow one batched product) rows in one buffer.
  const Tensor w3 = one_rope ? stacked3(wq.w(), wk.w(), wv.w()) : Tensor();
  Tensor rows, qk;  // one_rope: q's rows, then k's (then v's)
  if (one_rope) {
    TROUPE_CHECK(qk_positions->numel() == 2 * t, "Attention::project_qkv: qk_positions has {} rows, want {}",
                 qk_positions->numel(), 2 * t);
    rows = c.empty({(w3.defined() ? 3 : 2) * t, n_heads * head_dim});
    qk = rows.narrow(0, 0, 2 * t);
    q = rows.narrow(0, 0, t);
    k = rows.narrow(0, t, t);
    v = w3.defined() ? rows.narrow(0, 2 * t, t) : c.empty({t, n_kv_heads * head_dim});
  } else {
    q = c.empty({t, n_heads * head_dim});
    k = c.empty({t, n_kv_heads * head_dim});
    v = c.empty({t, n_kv_heads * head_dim});
  }
  if (w3.defined()) {
    Tensor out3 = rows.view({3, t, n_heads * head_dim});
    kernels::matmul(c.ex, x, w3, out3);
  } else {
    kernels::matmul(c.ex, x, wq.w(), q);
    kernels::matmul(c.ex, x, wk.w(), k);
    kernels::matmul(c.ex, x, wv.w(), v);
  }
  if (q_norm) {  // per head: rows of [T*H, Dh]
    q = q_norm->forward(c, q.view({t * n_heads, head_dim}), norm->q).view({t, n_heads * head_dim});
    k = k_norm->forward(c, k.view({t * n_kv_heads, head_dim}), norm->k).view({t, n_kv_heads * head_dim});
  }
  if (one_rope) {
    Tensor qk3 = qk.view({2 * t, n_heads, head_dim});
    kernels::rope_forward(c.ex, qk3, *qk_positions, rope_theta, qk3);
  } else {
    Tensor q3 = q.view({t, n_heads, head_dim}), k3 = k.view({t, n_kv_heads, head_dim});
    kernels::rope_forward(c.ex, q3, pos, rope_theta, q3);
    kernels::rope_forward(c.ex, k3, pos, rope_theta, k3);
  }
  q = q.view({batch, seq, n_heads, head_dim});
  k = k.view({batch, seq, n_kv_heads, head_dim});
  v = v.view({batch, seq, n_kv_heads, head_dim});
}

void Attention::core_forward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                             Tensor& lse) const {
  out = c.empty(q.shape());
  lse = c.empty({q.size(0), q.size(2), q.size(1)}, DType::kF32);
  const float scale = 1.0f / std::sqrt(static_cast<float>(q.size(3)));
  kernels::attention_forward(c.ex, q, k, v, scale, out, lse);
}

Tensor Attention::project_out(const Ctx& c, const Tensor& out) const {
  const int64_t t = out.size(0) * out.size(1);
  Tensor flat = out.view({t, out.size(2) * out.size(3)});
  Tensor y = c.empty({t, wo.value.size(1)});
  kernels::matmul(c.ex, flat, wo.w(), y);
  return y;
}

Tensor Attention::forward(const Ctx& c, const Tensor& x, int64_t batch, int64_t seq, Saved& s) const {
  s.x = x;
  s.pos = device_positions(c, batch, seq);
  // q's and k's rows rotated by one RoPE launch: their positions twice over.
  const Tensor& qk_pos = device_positions(c, 2 * batch, seq);
  project_qkv(c, x, s.pos, batch, seq, s.q, s.k, s.v, &qk_pos, &s.qk_norm);
  core_forward(c, s.q, s.k, s.v, s.out, s.lse);
  return project_out(c, s.out);
}

Tensor Attention::project_out_backward(const Ctx& c, const Tensor& dy, const Tensor& out) {
  const int64_t t = out.size(0) * out.size(1);
  Tensor flat = out.view({t, out.size(2) * out.size(3)});
  Tensor dflat = c.empty(flat.shape());
  kernels::matmul_backward(c.ex, flat, wo.w(), dy, &dflat, nullptr);
  kernels::matmul_backward(c.ex, flat, wo.w(), dy, nullptr, &wo.grad, false, false, wo.accumulate_grad());
  return dflat.view(out.shape());
}

void Attention::core_backward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                              Tensor& dk, Tensor& dv, const Tensor* positions) const {
  if (q.shape() == k.shape() && q.shape() == v.shape()) {  // one buffer: one batched dW product
    const int64_t n = q.numel();
    Tensor d3 = c.empty({3 * n});
    dq = d3.narrow(0, 0, n).view(q.shape());
    dk = d3.narrow(0, n, n).view(k.shape());
    dv = d3.narrow(0, 2 * n, n).view(v.shape());
  } else {
    dq = c.empty(q.shape());
    dk = c.empty(k.shape());
    dv = c.empty(v.shape());
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(q.size(3)));
  const kernels::RopeArgs rope{positions, rope_theta};
  kernels::attention_backward(c.ex, q, k, v, out, lse, dout, scale, dq, dk, dv,
                              positions != nullptr ? &rope : nullptr);
}

Tensor Attention::project_qkv_backward(const Ctx& c, const Tensor& x, const Tensor& pos, Tensor& dq,
                                       Tensor& dk, Tensor& dv, bool rope_undone, const QkNormSaved* norm) {
  const int64_t t = x.size(0);
  Tensor dq3 = dq.view({t, n_heads, head_dim});
  Tensor dk3 = dk.view({t, n_kv_heads, head_dim});
  if (!rope_undone) {
    kernels::rope_backward(c.ex, dq3, pos, rope_theta, dq3);
    kernels::rope_backward(c.ex, dk3, pos, rope_theta, dk3);
  }
  if (q_norm) {
    TROUPE_CHECK(norm != nullptr, "Attention::project_qkv_backward: the q/k norm's state is missing");
    dq = q_norm->backward(c, dq.view({t * n_heads, head_dim}), norm->q);
    dk = k_norm->backward(c, dk.view({t * n_kv_heads, head_dim}), norm->k);
  }
  Tensor dq2 = dq.view({t, n_heads * head_dim});
  Tensor dk2 = dk.view({t, n_kv_heads * head_dim});
  Tensor dv2 = dv.view({t, n_kv_heads * head_dim});
  Tensor dx = c.empty(x.shape());
  // dx is written by the first product and accumulated by the other two. The weight
  // gradients are written on a step's first micro-batch and added to after
  // (accumulate_grad), in one batched product x^T @ [dq, dk, dv] where the gradients and
  // dq, dk, dv lie side by side and the three agree on adding.
  kernels::matmul_backward(c.ex, x, wq.w(), dq2, &dx, nullptr);
  kernels::matmul_backward(c.ex, x, wk.w(), dk2, &dx, nullptr, false, false, true);
  kernels::matmul_backward(c.ex, x, wv.w(), dv2, &dx, nullptr, false, false, true);
  const bool add_q = wq.accumulate_grad(), add_k = wk.accumulate_grad(), add_v = wv.accumulate_grad();
  const Tensor d3 = add_q == add_k && add_q == add_v ? stacked3(dq2, dk2, dv2) : Tensor();
  Tensor dw3 = d3.defined() ? stacked3(wq.grad, wk.grad, wv.grad) : Tensor();
  if (dw3.defined()) {
    kernels::matmul(c.ex, x, d3, dw3, /*trans_a=*/true, false, 1.0f, add_q ? 1.0f : 0.0f);
  } else {
    kernels::matmul_backward(c.ex, x, wq.w(), dq2, nullptr, &wq.grad, false, false, add_q);
    kernels::matmul_backward(c.ex, x, wk.w(), dk2, nullptr, &wk.grad, false, false, add_k);
    kernels::matmul_backward(c.ex, x, wv.w(), dv2, nullptr, &wv.grad, false, false, add_v);
  }
  return dx;
}

Tensor Attention::backward(const Ctx& c, const Tensor& dy, const Saved& s) {
  Tensor dout = project_out_backward(c, dy, s.out);
  Tensor dq, dk, dv;
  core_backward(c, s.q, s.k, s.v, s.out, s.lse, dout, dq, dk, dv, &s.pos);  // RoPE undone in it
  return project_qkv_backward(c, s.x, s.pos, dq, dk, dv, /*rope_undone=*/true, &s.qk_norm);
}

}  // namespace troupe::layers
