// layers/model_config.h — defines ModelConfig (the architecture of an MoE transformer:
// sizes, which blocks are MoE, router and expert settings), its strict parsing from the
// [model] table of a TOML config and its validation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/status.h"
#include "kernels/ops.h"

namespace troupe::layers {

struct MoEConfig {
  int64_t num_experts = 8;
  int64_t top_k = 2;
  int64_t expert_hidden = 256;  // F: SwiGLU hidden size of one expert (w1 is [E, D, 2F])
  kernels::RouterScore score = kernels::RouterScore::kSoftmax;
  bool normalize_gates = true;  // renormalise the selected scores (always on for sigmoid)
  double aux_loss_coef = 0.01;  // Switch load-balancing loss: coef * E * sum_e f_e * P_e
  double z_loss_coef = 0.0;     // router z-loss: coef * mean_t logsumexp(logits_t)^2
  // Aux-loss-free balancing (DeepSeek-V3): after each step bias_e += rate * sign(mean - load_e).
  // 0 disables the bias (it stays zero and is not used for selection).
  double bias_update_rate = 0.0;
  // <= 0: dropless. Otherwise capacity = ceil(factor * tokens * top_k / E) copies per expert.
  double capacity_factor = 0.0;
  int64_t shared_experts = 0;  // shared expert(s): one SwiGLU of hidden shared_experts * F
};

struct ModelConfig {
  int64_t vocab_size = 1024;
  int64_t d_model = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;
  int64_t head_dim = 0;       // 0: d_model / n_heads
  int64_t ffn_hidden = 512;   // hidden size of dense SwiGLU blocks
  bool tie_embeddings = true;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  // Per-head RMSNorm of q and k after their projections, before RoPE (Qwen3): weights
  // blocks.<i>.attn.q_norm.weight and k_norm.weight of [head dim], with norm_eps.
  bool qk_norm = false;
  double init_std = 0.02;
  // Which blocks are MoE: moe_layers (explicit indices) when given, else every block i
  // with i >= moe_first and (i - moe_first) % moe_every == 0. moe_every = 0: all dense.
  std::vector<int64_t> moe_layers;
  int64_t moe_every = 1;
  int64_t moe_first = 0;
  MoEConfig moe;
  // Selective recomputation: expert / MLP SwiGLU outputs are recomputed in backward.
  bool recompute_swiglu = false;

  int64_t dh() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  bool is_moe_block(int64_t i) const;
  Status validate() const;
  // Parameter counts (total and active per token, the input embedding excluded from active
  // as in the usual 6*N FLOP estimate).
  int64_t num_params() const;
  int64_t num_active_params() const;
  // Model FLOPs of one trained token (forward and backward) at sequence length `seq_len`:
  // 6 x num_active_params() + causal attention's 6 x n_layers x seq_len x d_model. The one
  // formula behind every MFU figure (core/peak_flops.h has the peak it is divided by).
  double train_flops_per_token(int64_t seq_len) const;
};

// Reads every key of the [model] table (and [model.moe]) from `cfg`; unknown keys are left
// for ConfigTable::check_all_keys_used to report.
Result<ModelConfig> parse_model_config(ConfigTable& cfg);

}  // namespace troupe::layers
