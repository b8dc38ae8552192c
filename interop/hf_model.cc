// interop/hf_model.cc — the families' config.json in both directions, the tensor
// correspondence (HfPiece) and the element moves between the two layouts.
#include "interop/hf_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace troupe::interop {

using checkpoint::Range;
using checkpoint::Slice;
using nlohmann::json;

std::string family_name(HfFamily f) {
  return f == HfFamily::kMixtral ? "mixtral" : "qwen3_moe";
}

Result<HfFamily> parse_family(const std::string& name) {
  if (name == "mixtral") return HfFamily::kMixtral;
  if (name == "qwen3_moe") return HfFamily::kQwen3Moe;
  if (name == "deepseek_v3" || name == "deepseek_v2") {
    return invalid_argument(
        "model family '{}' is not supported: its layout needs multi-head latent attention (MLA: low-rank "
        "compressed keys and values with a decoupled RoPE part), which Troupe does not have (supported: "
        "mixtral, "
        "qwen3_moe)",
        name);
  }
  if (name == "qwen2_moe") {
    return invalid_argument(
        "model family 'qwen2_moe' is not supported: its shared expert is scaled by a sigmoid gate of its own "
        "and "
        "its attention has q/k/v biases, which Troupe's model does not have (supported: mixtral, qwen3_moe)");
  }
  return invalid_argument("model family '{}' is not supported (supported: mixtral, qwen3_moe)", name);
}

// ---- config.json -> ModelConfig ---------------------------------------------------------

namespace {

// Reads config.json keys, every error naming the key and the file.
struct Keys {
  const json& c;
  const std::string& src;

  bool has(const char* k) const { return c.contains(k) && !c[k].is_null(); }
  Result<int64_t> int_(const char* k, std::optional<int64_t> dflt = std::nullopt) const {
    if (!has(k)) {
      if (dflt) return *dflt;
      return invalid_argument("{}: key '{}' is missing", src, k);
    }
    if (!c[k].is_number_integer())
      return invalid_argument("{}: key '{}' must be an integer (got {})", src, k, c[k].dump());
    return c[k].get<int64_t>();
  }
  Result<double> num(const char* k, std::optional<double> dflt = std::nullopt) const {
    if (!has(k)) {
      if (dflt) return *dflt;
      return invalid_argument("{}: key '{}' is missing", src, k);
    }
    if (!c[k].is_number())
      return invalid_argument("{}: key '{}' must be a number (got {})", src, k, c[k].dump());
    return c[k].get<double>();
  }
  Result<bool> boolean(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    if (!c[k].is_boolean())
      return invalid_argument("{}: key '{}' must be true or false (got {})", src, k, c[k].dump());
    return c[k].get<bool>();
  }
};

Status refuse(const std::string& src, const std::string& what) {
  return invalid_argument("{}: {}; Troupe's model cannot express it, so the import would not be exact", src,
                          what);
}

// RoPE: theta from rope_parameters (transformers 5) or rope_theta, and no scaling.
Status read_rope(const Keys& k, double dflt_theta, layers::ModelConfig& m) {
  m.rope_theta = dflt_theta;
  if (k.has("rope_theta")) {
    TROUPE_ASSIGN_OR_RETURN(m.rope_theta, k.num("rope_theta"));
  }
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!k.has(key)) continue;
    const json& r = k.c[key];
    if (!r.is_object())
      return invalid_argument("{}: key '{}' must be an object (got {})", k.src, key, r.dump());
    const std::string type = r.value("rope_type", r.value("type", std::string("default")));
    if (type != "default") {
      return refuse(k.src,
                    fmt::format("RoPE scaling '{}' ({}.rope_type): Troupe's RoPE has no scaling", type, key));
    }
    if (r.contains("partial_rotary_factor") && r["partial_rotary_factor"].is_number() &&
        r["partial_rotary_factor"].get<double>() != 1.0) {
      return refuse(k.src, fmt::format("partial rotary embedding ({}.partial_rotary_factor = {})", key,
                                       r["partial_rotary_factor"].dump()));
    }
    if (r.contains("rope_theta")) {
      if (!r["rope_theta"].is_number())
        return invalid_argument("{}: {}.rope_theta must be a number", k.src, key);
      m.rope_theta = r["rope_theta"].get<double>();
    }
  }
  return ok_status();
}

}  // namespace

Result<HfModelConfig> parse_hf_config(const json& c, const std::string& src) {
  if (!c.is_object()) return invalid_argument("{}: not a JSON object", src);
  const Keys k{c, src};
  if (!k.has("model_type"))
    return invalid_argument("{}: key 'model_type' is missing (not a transformers config.json?)", src);
  HfModelConfig out;
  out.json = c;
  {
    Result<HfFamily> f = parse_family(c["model_type"].is_string() ? c["model_type"].get<std::string>() : "?");
    if (!f.ok()) return f.status().with_context(src);
    out.family = *f;
  }
  const bool mixtral = out.family == HfFamily::kMixtral;
  layers::ModelConfig& m = out.model;
  if (k.has("quantization_config")) {
    return refuse(src,
                  fmt::format("quantized weights (quantization_config {}): dequantize to bf16 or f32 first",
                              c["quantization_config"].value("quant_method", std::string("?"))));
  }
  const std::string act = c.value("hidden_act", std::string("silu"));
  if (act != "silu" && act != "swish")
    return refuse(src, fmt::format("activation '{}' (hidden_act; Troupe's MLPs are SwiGLU)", act));
  TROUPE_ASSIGN_OR_RETURN(m.vocab_size, k.int_("vocab_size"));
  TROUPE_ASSIGN_OR_RETURN(m.d_model, k.int_("hidden_size"));
  TROUPE_ASSIGN_OR_RETURN(m.n_layers, k.int_("num_hidden_layers"));
  TROUPE_ASSIGN_OR_RETURN(m.n_heads, k.int_("num_attention_heads"));
  TROUPE_ASSIGN_OR_RETURN(m.n_kv_heads, k.int_("num_key_value_heads", m.n_heads));
  TROUPE_ASSIGN_OR_RETURN(m.head_dim, k.int_("head_dim", int64_t{0}));
  if (m.head_dim == 0 && m.n_heads > 0 && m.d_model % m.n_heads != 0) {
    return invalid_argument(
        "{}: hidden_size {} is not a multiple of num_attention_heads {} and head_dim is not given", src,
        m.d_model, m.n_heads);
  }
  if (m.head_dim == 0 && m.n_heads > 0) m.head_dim = m.d_model / m.n_heads;
  TROUPE_ASSIGN_OR_RETURN(m.norm_eps, k.num("rms_norm_eps", mixtral ? 1e-5 : 1e-6));
  TROUPE_RETURN_IF_ERROR(read_rope(k, mixtral ? 1e6 : 1e4, m));
  TROUPE_ASSIGN_OR_RETURN(m.tie_embeddings, k.boolean("tie_word_embeddings", false));
  TROUPE_ASSIGN_OR_RETURN(m.init_std, k.num("initializer_range", 0.02));
  TROUPE_ASSIGN_OR_RETURN(out.max_position_embeddings, k.int_("max_position_embeddings", int64_t{0}));
  TROUPE_ASSIGN_OR_RETURN(double attn_dropout, k.num("attention_dropout", 0.0));
  if (attn_dropout != 0.0)
    return refuse(src, fmt::format("attention dropout (attention_dropout = {})", attn_dropout));
  TROUPE_ASSIGN_OR_RETURN(bool attn_bias, k.boolean("attention_bias", false));
  if (attn_bias) return refuse(src, "biases in the attention projections (attention_bias = true)");
  if (k.has("layer_types")) {
    for (const auto& t : c["layer_types"]) {
      if (!t.is_string() || t.get<std::string>() != "full_attention") {
        return refuse(src,
                      fmt::format("layer type {} (layer_types; Troupe's attention is full causal attention)",
                                  t.dump()));
      }
    }
  }
  layers::MoEConfig& e = m.moe;
  e.score = kernels::RouterScore::kSoftmax;
  e.shared_experts = 0;
  e.bias_update_rate = 0;
  std::vector<int64_t> sparse;
  if (mixtral) {
    if (k.has("sliding_window")) {
      return refuse(
          src, fmt::format("sliding-window attention (sliding_window = {})", c["sliding_window"].dump()));
    }
    TROUPE_ASSIGN_OR_RETURN(double jitter, k.num("router_jitter_noise", 0.0));
    if (jitter != 0.0)
      return refuse(src, fmt::format("router jitter noise (router_jitter_noise = {})", jitter));
    TROUPE_ASSIGN_OR_RETURN(e.num_experts, k.int_("num_local_experts"));
    TROUPE_ASSIGN_OR_RETURN(e.top_k, k.int_("num_experts_per_tok"));
    TROUPE_ASSIGN_OR_RETURN(e.expert_hidden, k.int_("intermediate_size"));
    m.ffn_hidden = e.expert_hidden;  // no dense block
    e.normalize_gates = true;        // Mixtral: softmax over all experts, top-k renormalised
    for (int64_t i = 0; i < m.n_layers; ++i) sparse.push_back(i);
  } else {
    TROUPE_ASSIGN_OR_RETURN(bool sw, k.boolean("use_sliding_window", false));
    if (sw) return refuse(src, "sliding-window attention (use_sliding_window = true)");
    if (k.has("shared_expert_intermediate_size") && c["shared_expert_intermediate_size"] != 0) {
      return refuse(src, "a gated shared expert (shared_expert_intermediate_size)");
    }
    m.qk_norm = true;
    const char* ne = k.has("num_experts") ? "num_experts" : "num_local_experts";
    TROUPE_ASSIGN_OR_RETURN(e.num_experts, k.int_(ne));
    TROUPE_ASSIGN_OR_RETURN(e.top_k, k.int_("num_experts_per_tok"));
    TROUPE_ASSIGN_OR_RETURN(e.expert_hidden, k.int_("moe_intermediate_size"));
    TROUPE_ASSIGN_OR_RETURN(m.ffn_hidden, k.int_("intermediate_size"));
    TROUPE_ASSIGN_OR_RETURN(e.normalize_gates, k.boolean("norm_topk_prob", false));
    TROUPE_ASSIGN_OR_RETURN(int64_t step, k.int_("decoder_sparse_step", int64_t{1}));
    if (step < 1) return invalid_argument("{}: decoder_sparse_step must be >= 1 (got {})", src, step);
    std::set<int64_t> dense;
    if (k.has("mlp_only_layers")) {
      if (!c["mlp_only_layers"].is_array())
        return invalid_argument("{}: mlp_only_layers must be a list", src);
      for (const auto& v : c["mlp_only_layers"]) {
        if (!v.is_number_integer())
          return invalid_argument("{}: mlp_only_layers must hold layer indices", src);
        dense.insert(v.get<int64_t>());
      }
    }
    // transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers, experts > 0
    // and (i + 1) % decoder_sparse_step == 0.
    for (int64_t i = 0; i < m.n_layers; ++i)
      if (!dense.count(i) && e.num_experts > 0 && (i + 1) % step == 0) sparse.push_back(i);
  }
  m.moe_layers = sparse;
  m.moe_every = sparse.empty() ? 0 : 1;
  m.moe_first = 0;
  if (sparse.empty()) {  // a model without MoE blocks: the MoE keys are not used
    e.num_experts = std::max<int64_t>(e.num_experts, 1);
    e.top_k = std::clamp<int64_t>(e.top_k, 1, e.num_experts);
    e.expert_hidden = std::max<int64_t>(e.expert_hidden, 1);
  }
  Status st = m.validate();
  if (!st.ok()) return st.with_context(src);
  return out;
}

namespace {
std::string toml_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEni") == std::string::npos) s += ".0";
  return s;
}
}  // namespace

std::vector<std::string> model_overrides(const layers::ModelConfig& m) {
  std::vector<std::string> o;
  const auto add = [&o](const std::string& k, const std::string& v) { o.push_back("model." + k + "=" + v); };
  add("vocab_size", std::to_string(m.vocab_size));
  add("d_model", std::to_string(m.d_model));
  add("n_layers", std::to_string(m.n_layers));
  add("n_heads", std::to_string(m.n_heads));
  add("n_kv_heads", std::to_string(m.n_kv_heads));
  add("head_dim", std::to_string(m.head_dim));
  add("ffn_hidden", std::to_string(m.ffn_hidden));
  add("tie_embeddings", m.tie_embeddings ? "true" : "false");
  add("rope_theta", toml_float(m.rope_theta));
  add("norm_eps", toml_float(m.norm_eps));
  add("qk_norm", m.qk_norm ? "true" : "false");
  add("moe_layers", fmt::format("[{}]", fmt::join(m.moe_layers, ", ")));
  add("moe_every", std::to_string(m.moe_every));
  add("moe_first", std::to_string(m.moe_first));
  add("moe.num_experts", std::to_string(m.moe.num_experts));
  add("moe.top_k", std::to_string(m.moe.top_k));
  add("moe.expert_hidden", std::to_string(m.moe.expert_hidden));
  add("moe.router", m.moe.score == kernels::RouterScore::kSigmoid ? "\"sigmoid\"" : "\"softmax\"");
  add("moe.normalize_gates", m.moe.normalize_gates ? "true" : "false");
  add("moe.shared_experts", std::to_string(m.moe.shared_experts));
  return o;
}

// ---- ModelConfig -> config.json -----------------------------------------------------------

Result<json> hf_config_for(const layers::ModelConfig& m, HfFamily family, DType dtype) {
  const std::string fam = family_name(family);
  const auto cannot = [&](const std::string& what) {
    return failed_precondition("cannot export as {}: {}", fam, what);
  };
  if (dtype != DType::kBF16 && dtype != DType::kF32)
    return invalid_argument("export dtype must be bf16 or f32");
  std::vector<int64_t> dense;
  bool any_moe = false;
  for (int64_t i = 0; i < m.n_layers; ++i) {
    if (m.is_moe_block(i)) {
      any_moe = true;
    } else {
      dense.push_back(i);
    }
  }
  if (any_moe) {
    if (m.moe.score != kernels::RouterScore::kSoftmax) {
      return cannot(
          "the router scores experts with a sigmoid (model.moe.router = \"sigmoid\", DeepSeek-V3's); "
          "the family's router is a softmax over all experts");
    }
    if (m.moe.shared_experts > 0)
      return cannot("the model has shared experts (model.moe.shared_experts), the family has none");
    if (m.moe.bias_update_rate > 0) {
      return cannot(
          "the aux-loss-free selection bias (model.moe.bias_update_rate > 0) changes which experts a token "
          "picks; the family routes by the scores alone");
    }
  }
  const char* dt = dtype == DType::kBF16 ? "bfloat16" : "float32";
  json c;
  c["hidden_act"] = "silu";
  c["hidden_size"] = m.d_model;
  c["num_hidden_layers"] = m.n_layers;
  c["num_attention_heads"] = m.n_heads;
  c["num_key_value_heads"] = m.n_kv_heads;
  c["head_dim"] = m.dh();
  c["vocab_size"] = m.vocab_size;
  c["rms_norm_eps"] = m.norm_eps;
  // transformers 5 reads rope_parameters; rope_theta is what earlier readers (and serving
  // engines) look for. Both say the same.
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
  c["rope_theta"] = m.rope_theta;
  c["tie_word_embeddings"] = m.tie_embeddings;
  c["initializer_range"] = m.init_std;
  c["attention_dropout"] = 0.0;
  c["num_experts_per_tok"] = m.moe.top_k;
  c["num_local_experts"] = m.moe.num_experts;
  c["router_aux_loss_coef"] = m.moe.aux_loss_coef;
  c["output_router_logits"] = false;
  c["sliding_window"] = nullptr;
  c["use_cache"] = true;
  c["dtype"] = dt;
  c["torch_dtype"] = dt;  // the key transformers 4 reads
  if (family == HfFamily::kMixtral) {
    if (!dense.empty()) {
      return cannot(
          fmt::format("Mixtral has an MoE feed-forward in every layer but block {} is dense (export as "
                      "qwen3_moe: its dense layers are mlp_only_layers)",
                      dense.front()));
    }
    if (m.qk_norm)
      return cannot("Mixtral has no q/k norm but the model has one (model.qk_norm; export as qwen3_moe)");
    if (!m.moe.normalize_gates) {
      return cannot(
          "Mixtral renormalises the top-k gates but model.moe.normalize_gates = false (export as "
          "qwen3_moe: norm_topk_prob = false)");
    }
    c["architectures"] = {"MixtralForCausalLM"};
    c["model_type"] = "mixtral";
    c["intermediate_size"] = m.moe.expert_hidden;
    c["router_jitter_noise"] = 0.0;
  } else {
    if (!m.qk_norm) {
      return cannot(
          "Qwen3-MoE normalises q and k per head (q_norm, k_norm) but the model has no q/k norm "
          "(model.qk_norm = false)");
    }
    c["architectures"] = {"Qwen3MoeForCausalLM"};
    c["model_type"] = "qwen3_moe";
    c["attention_bias"] = false;
    c["intermediate_size"] = m.ffn_hidden;
    c["moe_intermediate_size"] = m.moe.expert_hidden;
    c["num_experts"] = m.moe.num_experts;  // the key of the Qwen3 checkpoints on the hub
    c["norm_topk_prob"] = m.moe.normalize_gates;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = dense;
    c["use_sliding_window"] = false;
  }
  return c;
}

// ---- tensors ------------------------------------------------------------------------------

std::vector<TroupeTensor> troupe_tensors(const layers::ModelConfig& m) {
  const int64_t d = m.d_model, dh = m.dh(), v = m.vocab_size;
  std::vector<TroupeTensor> out;
  out.push_back({"embedding.weight", {v, d}});
  for (int64_t i = 0; i < m.n_layers; ++i) {
    const std::string b = fmt::format("blocks.{}.", i);
    out.push_back({b + "norm1.weight", {d}});
    out.push_back({b + "attn.wq", {d, m.n_heads * dh}});
    out.push_back({b + "attn.wk", {d, m.n_kv_heads * dh}});
    out.push_back({b + "attn.wv", {d, m.n_kv_heads * dh}});
    out.push_back({b + "attn.wo", {m.n_heads * dh, d}});
    if (m.qk_norm) {
      out.push_back({b + "attn.q_norm.weight", {dh}});
      out.push_back({b + "attn.k_norm.weight", {dh}});
    }
    out.push_back({b + "norm2.weight", {d}});
    if (m.is_moe_block(i)) {
      const int64_t e = m.moe.num_experts, f = m.moe.expert_hidden;
      out.push_back({b + "moe.router.weight", {d, e}});
      out.push_back({b + "moe.experts.w1", {e, d, 2 * f}});
      out.push_back({b + "moe.experts.w2", {e, f, d}});
      if (m.moe.shared_experts > 0) {
        const int64_t s = m.moe.shared_experts * f;
        out.push_back({b + "moe.shared.w1", {d, 2 * s}});
        out.push_back({b + "moe.shared.w2", {s, d}});
      }
    } else {
      out.push_back({b + "mlp.w1", {d, 2 * m.ffn_hidden}});
      out.push_back({b + "mlp.w2", {m.ffn_hidden, d}});
    }
  }
  out.push_back({"final_norm.weight", {d}});
  if (!m.tie_embeddings) out.push_back({"lm_head.weight", {v, d}});
  return out;
}

Result<std::vector<HfPiece>> hf_pieces(const layers::ModelConfig& m, HfFamily family, const TroupeTensor& t,
                                       bool fused_experts) {
  const Shape& s = t.shape;
  std::vector<HfPiece> out;
  const auto whole = [&](const std::string& hf, bool transpose) {
    HfPiece p{hf, s, checkpoint::full_slice(s), transpose};
    if (transpose) std::swap(p.hf_shape[s.size() - 2], p.hf_shape[s.size() - 1]);
    out.push_back(std::move(p));
  };
  if (t.name == "embedding.weight") {
    whole("model.embed_tokens.weight", false);
    return out;
  }
  if (t.name == "final_norm.weight") {
    whole("model.norm.weight", false);
    return out;
  }
  if (t.name == "lm_head.weight") {
    whole("lm_head.weight", false);
    return out;
  }
  int64_t block = -1;
  char rest[128] = {0};
  if (std::sscanf(t.name.c_str(), "blocks.%ld.%127s", &block, rest) != 2 || block < 0 ||
      block >= m.n_layers) {
    return invalid_argument("tensor '{}' has no Hugging Face counterpart", t.name);
  }
  const std::string r = rest;
  const std::string L = fmt::format("model.layers.{}.", block);
  const std::string moe = L + (family == HfFamily::kMixtral ? "block_sparse_moe." : "mlp.");
  if (r == "norm1.weight") {
    whole(L + "input_layernorm.weight", false);
  } else if (r == "norm2.weight") {
    whole(L + "post_attention_layernorm.weight", false);
  } else if (r == "attn.wq" || r == "attn.wk" || r == "attn.wv" || r == "attn.wo") {
    whole(L + "self_attn." + r.substr(6, 1) + "_proj.weight", true);
  } else if (r == "attn.q_norm.weight" || r == "attn.k_norm.weight") {
    whole(L + "self_attn." + r.substr(5), false);
  } else if (r == "moe.router.weight") {
    whole(moe + "gate.weight", true);
  } else if (r == "moe.experts.w1" || r == "moe.experts.w2") {
    const bool w1 = r == "moe.experts.w1";
    const int64_t e = s[0], d = w1 ? s[1] : s[2], f = w1 ? s[2] / 2 : s[1];
    if (fused_experts) {
      whole(moe + (w1 ? "experts.gate_up_proj" : "experts.down_proj"), true);
      return out;
    }
    const bool mix = family == HfFamily::kMixtral;
    for (int64_t x = 0; x < e; ++x) {
      const std::string pre = fmt::format("{}experts.{}.", moe, x);
      if (w1) {
        out.push_back(
            {pre + (mix ? "w1.weight" : "gate_proj.weight"), {f, d}, {{x, 1}, {0, d}, {0, f}}, true});
        out.push_back({pre + (mix ? "w3.weight" : "up_proj.weight"), {f, d}, {{x, 1}, {0, d}, {f, f}}, true});
      } else {
        out.push_back(
            {pre + (mix ? "w2.weight" : "down_proj.weight"), {d, f}, {{x, 1}, {0, f}, {0, d}}, true});
      }
    }
  } else if (r == "mlp.w1" && family == HfFamily::kQwen3Moe) {
    const int64_t d = s[0], f = s[1] / 2;
    out.push_back({L + "mlp.gate_proj.weight", {f, d}, {{0, d}, {0, f}}, true});
    out.push_back({L + "mlp.up_proj.weight", {f, d}, {{0, d}, {f, f}}, true});
  } else if (r == "mlp.w2" && family == HfFamily::kQwen3Moe) {
    whole(L + "mlp.down_proj.weight", true);
  } else {
    return failed_precondition("tensor '{}' has no counterpart in a {} checkpoint", t.name,
                               family_name(family));
  }
  return out;
}

// ---- element moves --------------------------------------------------------------------------

namespace {

// Index maths of a piece: for every Troupe dimension d, its stride in the Troupe buffer
// and its stride in the HF buffer (0 for a dropped leading dimension), and the offset
// that turns a global Troupe index into an HF buffer index.
struct Strides {
  int rank = 0;
  std::vector<int64_t> ts, hs, t0, h0;  // per Troupe dim: strides; starts to subtract
};

std::vector<int64_t> row_major(const Slice& box) {
  std::vector<int64_t> st(box.size(), 1);
  for (size_t d = box.size(); d-- > 1;) st[d - 1] = st[d] * box[d].length;
  return st;
}

Strides strides(const HfPiece& p, const Slice& troupe_box, const Slice& hf_box) {
  Strides s;
  s.rank = static_cast<int>(p.box.size());
  const int h = static_cast<int>(p.hf_shape.size());
  const int drop = s.rank - h;
  s.ts = row_major(troupe_box);
  const std::vector<int64_t> hst = row_major(hf_box);
  s.hs.assign(static_cast<size_t>(s.rank), 0);
  s.t0.resize(static_cast<size_t>(s.rank));
  s.h0.assign(static_cast<size_t>(s.rank), 0);
  for (int d = 0; d < s.rank; ++d) {
    s.t0[static_cast<size_t>(d)] = troupe_box[static_cast<size_t>(d)].start;
    if (d < drop) {
      s.h0[static_cast<size_t>(d)] = p.box[static_cast<size_t>(d)].start;
      continue;
    }
    int hd = d - drop;
    if (p.transpose && d == s.rank - 2) hd = h - 1;
    if (p.transpose && d == s.rank - 1) hd = h - 2;
    s.hs[static_cast<size_t>(d)] = hst[static_cast<size_t>(hd)];
    s.h0[static_cast<size_t>(d)] =
        p.box[static_cast<size_t>(d)].start + hf_box[static_cast<size_t>(hd)].start;
  }
  return s;
}

// Calls f(troupe_offset, hf_offset) for every element of `region`, in an order that walks
// the HF buffer forwards in tiles (a transposed piece reads or writes the Troupe side in
// 64 x 64 tiles, so both sides stay in cache).
template <class F>
void for_each(const Strides& s, const Slice& region, F&& f) {
  const int r = s.rank;
  if (r == 0) return;
  for (const Range& x : region)
    if (x.length == 0) return;
  // The last two dimensions (one for a 1-d tensor) are the plane; the rest an odometer.
  const int pa = r >= 2 ? r - 2 : -1, pb = r - 1;
  std::vector<int64_t> idx(static_cast<size_t>(r));
  for (int d = 0; d < r; ++d) idx[static_cast<size_t>(d)] = region[static_cast<size_t>(d)].start;
  const auto at = [&](int d) { return static_cast<size_t>(d); };
  while (true) {
    int64_t tb = 0, hb = 0;
    for (int d = 0; d < (pa >= 0 ? pa : pb); ++d) {
      tb += (idx[at(d)] - s.t0[at(d)]) * s.ts[at(d)];
      hb += (idx[at(d)] - s.h0[at(d)]) * s.hs[at(d)];
    }
    const int64_t a0 = pa >= 0 ? region[at(pa)].start : 0, an = pa >= 0 ? region[at(pa)].length : 1;
    const int64_t b0 = region[at(pb)].start, bn = region[at(pb)].length;
    const int64_t ta = pa >= 0 ? s.ts[at(pa)] : 0, ha = pa >= 0 ? s.hs[at(pa)] : 0;
    const int64_t tb1 = s.ts[at(pb)], hb1 = s.hs[at(pb)];
    tb += (pa >= 0 ? (a0 - s.t0[at(pa)]) * ta : 0) + (b0 - s.t0[at(pb)]) * tb1;
    hb += (pa >= 0 ? (a0 - s.h0[at(pa)]) * ha : 0) + (b0 - s.h0[at(pb)]) * hb1;
    if (hb1 == 1 || ha != 1) {  // HF rows follow Troupe rows: both walk b contiguously
      for (int64_t a = 0; a < an; ++a)
        for (int64_t b = 0; b < bn; ++b) f(tb + a * ta + b * tb1, hb + a * ha + b * hb1);
    } else {  // transposed: HF rows are Troupe columns
      constexpr int64_t kTile = 64;
      for (int64_t bt = 0; bt < bn; bt += kTile)
        for (int64_t at0 = 0; at0 < an; at0 += kTile)
          for (int64_t b = bt; b < std::min(bn, bt + kTile); ++b)
            for (int64_t a = at0; a < std::min(an, at0 + kTile); ++a)
              f(tb + a * ta + b * tb1, hb + a * ha + b * hb1);
    }
    // Next plane.
    int d = (pa >= 0 ? pa : pb) - 1;
    for (; d >= 0; --d) {
      if (++idx[at(d)] < region[at(d)].end()) break;
      idx[at(d)] = region[at(d)].start;
    }
    if (d < 0) return;
  }
}

float load(const std::byte* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, p + i * 4, 4);
      return v;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p + i * 2, 2);
      return bf16_bits_to_float(b);
    }
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, p + i * 2, 2);
      return f16_bits_to_float(b);
    }
    default:
      TROUPE_CHECK(false, "hf_to_troupe: dtype {} is not a weights dtype", dtype_name(t));
  }
  return 0;
}

}  // namespace

Slice hf_box_of(const HfPiece& p, const Slice& region) {
  const size_t drop = p.box.size() - p.hf_shape.size();
  Slice out;
  for (size_t d = drop; d < region.size(); ++d)
    out.push_back({region[d].start - p.box[d].start, region[d].length});
  if (p.transpose && out.size() >= 2) std::swap(out[out.size() - 2], out[out.size() - 1]);
  return out;
}

void hf_to_troupe(const HfPiece& piece, const std::byte* hf, DType hf_dtype, const Slice& region, float* dst,
                  const Slice& troupe_box) {
  const Strides s = strides(piece, troupe_box, checkpoint::full_slice(piece.hf_shape));
  if (hf_dtype == DType::kF32) {
    const auto* src = reinterpret_cast<const float*>(hf);  // safetensors data is 8-byte aligned
    for_each(s, region, [&](int64_t t, int64_t h) { dst[t] = src[h]; });
  } else {
    for_each(s, region, [&](int64_t t, int64_t h) { dst[t] = load(hf, hf_dtype, h); });
  }
}

void troupe_to_hf(const HfPiece& piece, const float* src, const Slice& troupe_box, const Slice& region,
                  std::byte* hf, DType hf_dtype, const Slice& hf_box) {
  const Strides s = strides(piece, troupe_box, hf_box);
  if (hf_dtype == DType::kF32) {
    auto* out = reinterpret_cast<float*>(hf);
    for_each(s, region, [&](int64_t t, int64_t h) { out[h] = src[t]; });
  } else {
    TROUPE_CHECK(hf_dtype == DType::kBF16, "troupe_to_hf: weights are written as f32 or bf16, not {}",
                 dtype_name(hf_dtype));
    auto* out = reinterpret_cast<uint16_t*>(hf);
    for_each(s, region, [&](int64_t t, int64_t h) { out[h] = float_to_bf16_bits(src[t]); });
  }
}

}  // namespace troupe::interop
