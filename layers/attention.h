// layers/attention.h — defines Attention: causal grouped-query self-attention with RoPE,
// q/k/v/o projections without biases, and optionally a per-head RMSNorm of q and k
// between their projections and RoPE (Qwen3's q_norm / k_norm).
//
// The layer is three separable steps so sequence-parallel code (Ulysses) can put an
// all-to-all between them: project_qkv (GEMMs + RoPE, per token) -> core (attention over
// whole sequences, per head) -> project_out (GEMM, per token). forward/backward chain
// the three for one process.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/context.h"
#include "layers/embedding.h"
#include "layers/parameter.h"

namespace troupe::layers {

class Attention {
 public:
  // With the q/k norm: what its backward needs (the projections before the norm, the
  // per-row rstd), one per head row [T*H, Dh].
  struct QkNormSaved {
    RMSNorm::Saved q, k;
  };
  struct Saved {
    Tensor x;          // [T, D] input (the normed residual)
    Tensor pos;        // i32 [T] positions inside each sequence
    Tensor q, k, v;    // after RoPE: [B, S, Hq, Dh], [B, S, Hkv, Dh]
    Tensor out, lse;   // core output [B, S, Hq, Dh], log-sum-exp f32 [B, Hq, S]
    QkNormSaved qk_norm;
  };
  // qk_norm: a per-head RMSNorm (epsilon norm_eps) of q and k before RoPE.
  Attention(int64_t d_model, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float rope_theta,
            bool qk_norm = false, float norm_eps = 1e-6f);
  void init(uint64_t seed, const std::string& prefix, float std, float out_std);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);

  // x [B*S, D] -> [B*S, D].
  Tensor forward(const Ctx& c, const Tensor& x, int64_t batch, int64_t seq, Saved& s) const;
  // Returns dx; accumulates the weight gradients.
  Tensor backward(const Ctx& c, const Tensor& dy, const Saved& s);

  // The separable steps. positions: i32 [T] (position of each token in its sequence).
  // qk_positions (optional): i32 [2T], positions then positions again. Where q and k have
  // the same heads (and no q/k norm), q and k are then rows of one buffer that one RoPE
  // launch rotates. norm: where the q/k norm keeps its state (required with the norm).
  void project_qkv(const Ctx& c, const Tensor& x, const Tensor& positions, int64_t batch, int64_t seq,
                   Tensor& q, Tensor& k, Tensor& v, const Tensor* qk_positions = nullptr,
                   QkNormSaved* norm = nullptr) const;
  void core_forward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                    Tensor& lse) const;
  Tensor project_out(const Ctx& c, const Tensor& out) const;
  Tensor project_out_backward(const Ctx& c, const Tensor& dy, const Tensor& out);  // returns dout
  // positions (optional; the q and k rows' positions, as project_qkv took them): dq and dk
  // come back with RoPE undone (kernels::RopeArgs; on the Hopper backward in its stores).
  void core_backward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                     const Tensor* positions = nullptr) const;
  // dq, dk, dv are consumed (RoPE is undone in place unless rope_undone: core_backward did
  // it; then the q/k norm's backward, from `norm`, project_qkv's); returns dx.
  Tensor project_qkv_backward(const Ctx& c, const Tensor& x, const Tensor& positions, Tensor& dq, Tensor& dk,
                              Tensor& dv, bool rope_undone = false, const QkNormSaved* norm = nullptr);

  // Host i32 [B*S]: offset + t % seq (offset: where a sequence shard starts, Ulysses).
  static Tensor positions(int64_t batch, int64_t seq, int64_t offset = 0);
  // positions() on the Exec's device, cached (uploaded again only when the shape or offset
  // changes; two at a time: forward asks for batch and 2 * batch, see project_qkv). A step
  // captured as a CUDA graph replays their address, and an upload inside it would wait.
  const Tensor& device_positions(const Ctx& c, int64_t batch, int64_t seq, int64_t offset = 0) const;

  Parameter wq, wk, wv, wo;  // [D, Hq*Dh], [D, Hkv*Dh], [D, Hkv*Dh], [Hq*Dh, D]
  std::unique_ptr<RMSNorm> q_norm, k_norm;  // weights [Dh]; null without the q/k norm
  int64_t n_heads, n_kv_heads, head_dim;
  float rope_theta;

 private:
  struct PosCache {
    Tensor pos;
    int64_t seq = 0, offset = 0;
  };
  mutable PosCache pos_cache_[2];
};

}  // namespace troupe::layers
