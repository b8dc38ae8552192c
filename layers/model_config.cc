// layers/model_config.cc — ModelConfig parsing, validation and parameter counts.
#include "layers/model_config.h"

#include <algorithm>

namespace troupe::layers {

bool ModelConfig::is_moe_block(int64_t i) const {
  if (!moe_layers.empty()) return std::find(moe_layers.begin(), moe_layers.end(), i) != moe_layers.end();
  if (moe_every <= 0 || i < moe_first) return false;
  return (i - moe_first) % moe_every == 0;
}

Status ModelConfig::validate() const {
  auto positive = [](const char* key, int64_t v) -> Status {
    if (v <= 0) return invalid_argument("model.{} must be positive (got {})", key, v);
    return ok_status();
  };
  TROUPE_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  TROUPE_RETURN_IF_ERROR(positive("d_model", d_model));
  TROUPE_RETURN_IF_ERROR(positive("n_layers", n_layers));
  TROUPE_RETURN_IF_ERROR(positive("n_heads", n_heads));
  TROUPE_RETURN_IF_ERROR(positive("n_kv_heads", n_kv_heads));
  TROUPE_RETURN_IF_ERROR(positive("ffn_hidden", ffn_hidden));
  if (head_dim < 0) return invalid_argument("model.head_dim must be >= 0 (got {})", head_dim);
  if (head_dim == 0 && d_model % n_heads != 0) {
    return invalid_argument("model.d_model ({}) must be divisible by model.n_heads ({})", d_model, n_heads);
  }
  if (dh() % 2 != 0) return invalid_argument("model head dim ({}) must be even for RoPE", dh());
  if (n_heads % n_kv_heads != 0) {
    return invalid_argument("model.n_heads ({}) must be divisible by model.n_kv_heads ({})", n_heads, n_kv_heads);
  }
  if (rope_theta <= 0) return invalid_argument("model.rope_theta must be positive");
  if (norm_eps <= 0) return invalid_argument("model.norm_eps must be positive");
  if (init_std <= 0) return invalid_argument("model.init_std must be positive");
  if (moe_every < 0) return invalid_argument("model.moe_every must be >= 0 (got {})", moe_every);
  if (moe_first < 0) return invalid_argument("model.moe_first must be >= 0 (got {})", moe_first);
  for (int64_t i : moe_layers) {
    if (i < 0 || i >= n_layers) {
      return invalid_argument("model.moe_layers: block {} is out of range [0, {})", i, n_layers);
    }
  }
  bool any_moe = false;
  for (int64_t i = 0; i < n_layers; ++i) any_moe |= is_moe_block(i);
  if (any_moe) {
    TROUPE_RETURN_IF_ERROR(positive("moe.num_experts", moe.num_experts));
    TROUPE_RETURN_IF_ERROR(positive("moe.top_k", moe.top_k));
    TROUPE_RETURN_IF_ERROR(positive("moe.expert_hidden", moe.expert_hidden));
    if (moe.top_k > moe.num_experts) {
      return invalid_argument("model.moe.top_k ({}) must not exceed model.moe.num_experts ({})", moe.top_k,
                              moe.num_experts);
    }
    if (moe.aux_loss_coef < 0) return invalid_argument("model.moe.aux_loss_coef must be >= 0");
    if (moe.z_loss_coef < 0) return invalid_argument("model.moe.z_loss_coef must be >= 0");
    if (moe.bias_update_rate < 0) return invalid_argument("model.moe.bias_update_rate must be >= 0");
    if (moe.shared_experts < 0) return invalid_argument("model.moe.shared_experts must be >= 0");
  }
  return ok_status();
}

int64_t ModelConfig::num_params() const {
  const int64_t d = d_model, attn = d * dh() * (2 * n_heads + 2 * n_kv_heads) + (qk_norm ? 2 * dh() : 0);
  int64_t total = vocab_size * d * (tie_embeddings ? 1 : 2) + d;  // embeddings + final norm
  for (int64_t i = 0; i < n_layers; ++i) {
    total += attn + 2 * d;
    if (is_moe_block(i)) {
      total += d * moe.num_experts + moe.num_experts * 3 * d * moe.expert_hidden +
               moe.shared_experts * 3 * d * moe.expert_hidden;
    } else {
      total += 3 * d * ffn_hidden;
    }
  }
  return total;
}

int64_t ModelConfig::num_active_params() const {
  const int64_t d = d_model, attn = d * dh() * (2 * n_heads + 2 * n_kv_heads);
  int64_t total = vocab_size * d;  // the LM head (the input embedding is a lookup)
  for (int64_t i = 0; i < n_layers; ++i) {
    total += attn;
    if (is_moe_block(i)) {
      total += d * moe.num_experts + (moe.top_k + moe.shared_experts) * 3 * d * moe.expert_hidden;
    } else {
      total += 3 * d * ffn_hidden;
    }
  }
  return total;
}

double ModelConfig::train_flops_per_token(int64_t seq_len) const {
  return 6.0 * static_cast<double>(num_active_params()) +
         6.0 * static_cast<double>(n_layers * seq_len * d_model);
}

Result<ModelConfig> parse_model_config(ConfigTable& cfg) {
  ModelConfig m;
  TROUPE_ASSIGN_OR_RETURN(
      m.vocab_size, cfg.get_int("model.vocab_size", m.vocab_size,
                                "embedding rows; must be >= the tokenizer's vocabulary (checked at start)"));
  TROUPE_ASSIGN_OR_RETURN(m.d_model, cfg.get_int("model.d_model", m.d_model, "width of the residual stream"));
  TROUPE_ASSIGN_OR_RETURN(m.n_layers, cfg.get_int("model.n_layers", m.n_layers,
                                                  "transformer blocks; parallel.pp must divide it"));
  TROUPE_ASSIGN_OR_RETURN(m.n_heads,
                          cfg.get_int("model.n_heads", m.n_heads, "query heads; parallel.n must divide it"));
  TROUPE_ASSIGN_OR_RETURN(
      m.n_kv_heads,
      cfg.get_int("model.n_kv_heads", m.n_heads,
                  "key/value heads (grouped-query attention); divides n_heads; parallel.n must divide it",
                  "model.n_heads"));
  TROUPE_ASSIGN_OR_RETURN(m.head_dim,
                          cfg.get_int("model.head_dim", m.head_dim, "per-head width; 0: d_model / n_heads"));
  TROUPE_ASSIGN_OR_RETURN(m.ffn_hidden, cfg.get_int("model.ffn_hidden", m.ffn_hidden,
                                                    "hidden size of a dense block's SwiGLU MLP"));
  TROUPE_ASSIGN_OR_RETURN(m.tie_embeddings, cfg.get_bool("model.tie_embeddings", m.tie_embeddings,
                                                         "the LM head reads the embedding's weight"));
  TROUPE_ASSIGN_OR_RETURN(m.rope_theta, cfg.get_double("model.rope_theta", m.rope_theta, "RoPE base"));
  TROUPE_ASSIGN_OR_RETURN(m.norm_eps, cfg.get_double("model.norm_eps", m.norm_eps, "RMSNorm epsilon"));
  TROUPE_ASSIGN_OR_RETURN(
      m.qk_norm, cfg.get_bool("model.qk_norm", m.qk_norm, "per-head RMSNorm of q and k before RoPE (Qwen3)"));
  TROUPE_ASSIGN_OR_RETURN(m.init_std, cfg.get_double("model.init_std", m.init_std,
                                                     "std of the normal initialisation (projections into the "
                                                     "residual stream: init_std / sqrt(2 n_layers))"));
  TROUPE_ASSIGN_OR_RETURN(m.moe_layers,
                          cfg.get_int_list("model.moe_layers", std::vector<int64_t>{},
                                           "the MoE blocks by index; empty: moe_every and moe_first decide"));
  TROUPE_ASSIGN_OR_RETURN(m.moe_every,
                          cfg.get_int("model.moe_every", m.moe_every,
                                      "every block i >= moe_first with (i - moe_first) % moe_every == 0 is "
                                      "MoE; 0: all dense (dense_lm and parallel_lm refuse MoE blocks)"));
  TROUPE_ASSIGN_OR_RETURN(
      m.moe_first, cfg.get_int("model.moe_first", m.moe_first, "the first MoE block (with moe_every)"));
  TROUPE_ASSIGN_OR_RETURN(m.recompute_swiglu,
                          cfg.get_bool("model.recompute_swiglu", m.recompute_swiglu,
                                       "train_moe: recompute SwiGLU outputs in backward (apps on the "
                                       "transformer program base use train.recompute)"));
  MoEConfig& e = m.moe;
  TROUPE_ASSIGN_OR_RETURN(e.num_experts, cfg.get_int("model.moe.num_experts", e.num_experts,
                                                     "experts of an MoE block; parallel.n must divide it"));
  TROUPE_ASSIGN_OR_RETURN(e.top_k,
                          cfg.get_int("model.moe.top_k", e.top_k, "experts each token is routed to"));
  TROUPE_ASSIGN_OR_RETURN(e.expert_hidden, cfg.get_int("model.moe.expert_hidden", e.expert_hidden,
                                                       "SwiGLU hidden size of one expert"));
  TROUPE_ASSIGN_OR_RETURN(std::string router, cfg.get_string("model.moe.router", "softmax",
                                                             "router scores: \"softmax\" or \"sigmoid\""));
  if (router == "softmax") {
    e.score = kernels::RouterScore::kSoftmax;
  } else if (router == "sigmoid") {
    e.score = kernels::RouterScore::kSigmoid;
  } else {
    return invalid_argument("{}: key 'model.moe.router' must be \"softmax\" or \"sigmoid\" (got \"{}\")",
                            cfg.source(), router);
  }
  TROUPE_ASSIGN_OR_RETURN(e.normalize_gates,
                          cfg.get_bool("model.moe.normalize_gates", e.normalize_gates,
                                       "renormalise the selected scores (always with sigmoid)"));
  TROUPE_ASSIGN_OR_RETURN(e.aux_loss_coef,
                          cfg.get_double("model.moe.aux_loss_coef", e.aux_loss_coef,
                                         "Switch load-balancing loss: coef * E * sum_e f_e * P_e"));
  TROUPE_ASSIGN_OR_RETURN(e.z_loss_coef, cfg.get_double("model.moe.z_loss_coef", e.z_loss_coef,
                                                        "router z-loss: coef * mean logsumexp(logits)^2"));
  TROUPE_ASSIGN_OR_RETURN(e.bias_update_rate,
                          cfg.get_double("model.moe.bias_update_rate", e.bias_update_rate,
                                         "aux-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean "
                                         "- load_e) after each step; 0: off"));
  TROUPE_ASSIGN_OR_RETURN(e.capacity_factor,
                          cfg.get_double("model.moe.capacity_factor", e.capacity_factor,
                                         "<= 0: dropless; else each expert keeps ceil(factor * tokens * "
                                         "top_k / E) copies (layouts with n = 1; n > 1 is refused)"));
  TROUPE_ASSIGN_OR_RETURN(
      e.shared_experts,
      cfg.get_int("model.moe.shared_experts", e.shared_experts,
                  "shared experts: one SwiGLU of hidden shared_experts * expert_hidden every token passes"));
  Status st = m.validate();
  if (!st.ok()) return st.with_context(cfg.source());
  return m;
}

}  // namespace troupe::layers
