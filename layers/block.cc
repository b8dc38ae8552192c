// layers/block.cc — Block forward/backward.
#include "layers/block.h"

#include <cmath>

namespace troupe::layers {

Block::Block(const ModelConfig& cfg, bool is_moe, ExpertRange experts)
    : norm1(cfg.d_model, static_cast<float>(cfg.norm_eps)),
      norm2(cfg.d_model, static_cast<float>(cfg.norm_eps)),
      attn(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.dh(), static_cast<float>(cfg.rope_theta),
           cfg.qk_norm, static_cast<float>(cfg.norm_eps)) {
  if (is_moe) {
    moe = std::make_unique<MoELayer>(cfg.d_model, cfg.moe, cfg.recompute_swiglu, experts);
  } else {
    mlp = std::make_unique<SwiGLUMLP>(cfg.d_model, cfg.ffn_hidden, cfg.recompute_swiglu);
  }
}

void Block::init(uint64_t seed, const std::string& prefix, const ModelConfig& cfg) {
  const float std = static_cast<float>(cfg.init_std);
  // Output projections scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual stream's
  // variance does not grow with depth.
  const float out_std = std / std::sqrt(2.0f * static_cast<float>(cfg.n_layers));
  norm1.init();
  norm2.init();
  attn.init(seed, prefix + ".attn", std, out_std);
  if (mlp) mlp->init(seed, prefix + ".mlp", std, out_std);
  if (moe) moe->init(seed, prefix + ".moe", std, out_std);
}

void Block::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  norm1.collect(prefix + ".norm1", out);
  attn.collect(prefix + ".attn", out);
  norm2.collect(prefix + ".norm2", out);
  if (mlp) mlp->collect(prefix + ".mlp", out);
  if (moe) moe->collect(prefix + ".moe", out);
}

void Block::collect_buffers(const std::string& prefix, std::vector<NamedBuffer>& out) {
  if (moe) moe->collect_buffers(prefix + ".moe", out);
}

Tensor Block::forward(const Ctx& c, const Tensor& x, int64_t batch, int64_t seq, Saved& s,
                      MoELayer::Stats* moe_stats) {
  Tensor a = attn.forward(c, norm1.forward(c, x, s.norm1), batch, seq, s.attn);
  Tensor h;  // x + a, from the norm's pass
  Tensor n2 = norm2.forward_add(c, x, a, h, s.norm2);
  if (moe) return moe->forward(c, n2, s.moe, moe_stats, &h);  // h joins the experts' combine
  Tensor f = mlp->forward(c, n2, s.mlp);
  kernels::add(c.ex, h, f, f);
  return f;
}

Tensor Block::backward(const Ctx& c, const Tensor& dy, Saved& s, float loss_weight) {
  Tensor dn2 = moe ? moe->backward(c, dy, s.moe, loss_weight) : mlp->backward(c, dy, s.mlp);
  // The residual branches' gradients join in the norms' passes.
  Tensor dh = norm2.backward(c, dn2, s.norm2, &dy);
  Tensor dn1 = attn.backward(c, dh, s.attn);
  return norm1.backward(c, dn1, s.norm1, &dh);
}

}  // namespace troupe::layers
