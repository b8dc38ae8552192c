// layers/block.h — defines Block, the pre-norm transformer block:
//   h = x + attn(norm1(x));  y = h + ffn(norm2(h)),  ffn = dense SwiGLU MLP or MoE.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/mlp.h"
#include "layers/model_config.h"
#include "layers/moe.h"

namespace troupe::layers {

class Block {
 public:
  struct Saved {
    RMSNorm::Saved norm1, norm2;
    Attention::Saved attn;
    SwiGLUMLP::Saved mlp;
    MoELayer::Saved moe;
  };
  // experts: which of an MoE block's experts this block holds (MoELayer; default all).
  Block(const ModelConfig& cfg, bool is_moe, ExpertRange experts = {});
  void init(uint64_t seed, const std::string& prefix, const ModelConfig& cfg);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);
  void collect_buffers(const std::string& prefix, std::vector<NamedBuffer>& out);

  // x [B*S, D] -> [B*S, D]; an MoE block fills moe_stats when given (see MoELayer::forward).
  Tensor forward(const Ctx& c, const Tensor& x, int64_t batch, int64_t seq, Saved& s, MoELayer::Stats* moe_stats);
  Tensor backward(const Ctx& c, const Tensor& dy, Saved& s, float loss_weight);

  bool is_moe() const { return moe != nullptr; }

  RMSNorm norm1, norm2;
  Attention attn;
  std::unique_ptr<SwiGLUMLP> mlp;  // dense blocks
  std::unique_ptr<MoELayer> moe;   // MoE blocks
};

}  // namespace troupe::layers
