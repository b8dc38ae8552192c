// interop/hf_model.h — defines the Hugging Face model families Troupe reads and writes
// (Mixtral, Qwen3-MoE), their config.json <-> ModelConfig in both directions (refusing,
// by name, every feature one side cannot express), and the correspondence between
// Troupe's global tensors and the tensors transformers saves (HfPiece).
//
// Names on each side, per block i (Troupe's ModelConfig names; HF's as transformers 5
// save_pretrained writes them, per expert, though the loaded module fuses experts):
//   embedding.weight [V, D]            model.embed_tokens.weight [V, D]
//   blocks.i.norm1.weight              model.layers.i.input_layernorm.weight
//   blocks.i.attn.wq [D, Hq*Dh]        model.layers.i.self_attn.q_proj.weight [Hq*Dh, D] (transposed;
//                                      wk, wv, wo likewise: k_proj, v_proj, o_proj)
//   blocks.i.attn.q_norm.weight [Dh]   self_attn.q_norm.weight (Qwen3; k_norm likewise)
//   blocks.i.norm2.weight              model.layers.i.post_attention_layernorm.weight
//   blocks.i.moe.router.weight [D, E]  <moe>.gate.weight [E, D]  (<moe> = block_sparse_moe for
//                                      Mixtral, mlp for Qwen3-MoE)
//   blocks.i.moe.experts.w1 [E, D, 2F] <moe>.experts.e.{w1,w3}.weight [F, D] (Mixtral) or
//                                      .{gate_proj,up_proj}.weight (Qwen3): w1[e][:, :F]^T is the
//                                      gate, w1[e][:, F:]^T the up projection
//   blocks.i.moe.experts.w2 [E, F, D]  <moe>.experts.e.w2.weight / .down_proj.weight [D, F]
//   blocks.i.mlp.w1 [D, 2F], w2 [F, D] mlp.{gate_proj, up_proj, down_proj}.weight (Qwen3 dense blocks)
//   final_norm.weight                  model.norm.weight
//   lm_head.weight [V, D]              lm_head.weight (absent when tied)
// Files that hold fused experts (<moe>.experts.gate_up_proj [E, 2F, D], down_proj
// [E, D, F], the module's own layout) are read too.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/slice.h"
#include "core/status.h"
#include "core/tensor.h"
#include "layers/model_config.h"

namespace troupe::interop {

enum class HfFamily { kMixtral, kQwen3Moe };
// "mixtral", "qwen3_moe" (config.json's model_type).
std::string family_name(HfFamily f);
// The family of a --family argument or a model_type; an unsupported one is refused with
// what it would need (DeepSeek-V3: multi-head latent attention, ...).
Result<HfFamily> parse_family(const std::string& name);

// A config.json read for import: the family and the architecture as a ModelConfig (only
// the architecture's fields are meaningful: the training knobs keep their defaults).
struct HfModelConfig {
  HfFamily family = HfFamily::kMixtral;
  layers::ModelConfig model;
  int64_t max_position_embeddings = 0;  // 0: not given
  nlohmann::json json;                  // config.json as read
};
// Refuses (InvalidArgument naming the key) what Troupe's model cannot express exactly:
// sliding-window attention, RoPE scaling, attention biases, router jitter, shared experts,
// quantization, activations other than SiLU, ...
Result<HfModelConfig> parse_hf_config(const nlohmann::json& config, const std::string& source);

// The [model] keys of a run that starts from such a checkpoint ("model.d_model=64", ...):
// every architecture key of ModelConfig, so the run builds exactly the imported model.
std::vector<std::string> model_overrides(const layers::ModelConfig& m);

// config.json for a Troupe model exported as `family` with weights in `dtype` (bf16 or
// f32); FailedPrecondition naming the feature the family cannot express (a dense block in
// Mixtral, a sigmoid router, shared experts, the selection bias, no q/k norm in Qwen3, ...).
Result<nlohmann::json> hf_config_for(const layers::ModelConfig& m, HfFamily family, DType dtype);

// One Troupe global tensor (or part of one) <-> one HF tensor. `box` is the part of the
// Troupe tensor (its global coordinates); the HF tensor holds exactly those elements:
// leading dimensions of the box of length 1 that HF does not have are dropped, and with
// `transpose` HF's last two dimensions are the box's last two swapped.
struct HfPiece {
  std::string hf_name;
  Shape hf_shape;
  checkpoint::Slice box;
  bool transpose = false;
};

// A Troupe global tensor: name and shape (as Model::parameters() names them).
struct TroupeTensor {
  std::string name;
  Shape shape;
};
// Every parameter of a model of config m, in Model::parameters() order, without building
// it (export plans huge models on a host that could not hold them).
std::vector<TroupeTensor> troupe_tensors(const layers::ModelConfig& m);

// The HF tensors of a Troupe tensor (several for the experts' and the MLP's fused
// weights). fused_experts: the experts as <moe>.experts.gate_up_proj / down_proj (a file
// that holds them so) instead of one tensor per expert.
Result<std::vector<HfPiece>> hf_pieces(const layers::ModelConfig& m, HfFamily family, const TroupeTensor& t,
                                       bool fused_experts = false);

// ---- moving elements between the two layouts --------------------------------------------
// Copies the elements of `region` (Troupe global coordinates, inside piece.box and
// troupe_box) from the HF tensor `hf` (the whole tensor, row-major, dtype hf_dtype: F32,
// BF16 or F16) into `dst`, f32 row-major holding troupe_box.
void hf_to_troupe(const HfPiece& piece, const std::byte* hf, DType hf_dtype, const checkpoint::Slice& region,
                  float* dst, const checkpoint::Slice& troupe_box);
// The other way: from `src` (f32 holding troupe_box) into the HF tensor's bytes; `hf`
// holds hf_box (HF coordinates, row-major, dtype hf_dtype: F32 or BF16, rounded to
// nearest even), the HF image of `region` or a box containing it.
void troupe_to_hf(const HfPiece& piece, const float* src, const checkpoint::Slice& troupe_box,
                  const checkpoint::Slice& region, std::byte* hf, DType hf_dtype,
                  const checkpoint::Slice& hf_box);
// The HF coordinates of a region of piece.box (Troupe coordinates).
checkpoint::Slice hf_box_of(const HfPiece& piece, const checkpoint::Slice& region);

}  // namespace troupe::interop
