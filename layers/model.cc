// layers/model.cc — Model construction, naming, forward/backward, evaluation.
#include "layers/model.h"

#include <fmt/format.h>

namespace troupe::layers {

Model::Model(const ModelConfig& cfg, uint64_t seed) : embedding(cfg.vocab_size, cfg.d_model), cfg_(cfg) {
  const Status st = cfg.validate();
  TROUPE_CHECK(st.ok(), "invalid model config: {}", st.to_string());
  embedding.init(seed, "embedding", static_cast<float>(cfg.init_std));
  for (int64_t i = 0; i < cfg.n_layers; ++i) {
    blocks.push_back(std::make_unique<Block>(cfg, cfg.is_moe_block(i)));
    blocks.back()->init(seed, fmt::format("blocks.{}", i), cfg);
  }
  head = std::make_unique<LMHead>(cfg.vocab_size, cfg.d_model, static_cast<float>(cfg.norm_eps),
                                  cfg.tie_embeddings ? &embedding.weight : nullptr);
  head->init(seed, static_cast<float>(cfg.init_std));
}

std::vector<NamedParameter> Model::parameters() {
  std::vector<NamedParameter> out;
  embedding.collect("embedding", out);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i]->collect(fmt::format("blocks.{}", i), out);
  head->collect(out);
  return out;
}

std::vector<NamedBuffer> Model::buffers() {
  std::vector<NamedBuffer> out;
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i]->collect_buffers(fmt::format("blocks.{}", i), out);
  return out;
}

int64_t Model::num_moe_blocks() const {
  int64_t n = 0;
  for (const auto& b : blocks) n += b->is_moe() ? 1 : 0;
  return n;
}

Tensor Model::forward_blocks(const Ctx& c, const Tensor& ids, std::vector<Block::Saved>& saved,
                             MicroBatchStats* stats) {
  TROUPE_CHECK(ids.dim() == 2 && ids.dtype() == DType::kI32, "Model: ids must be i32 [B, S], got {}",
               ids.describe());
  const int64_t b = ids.size(0), s = ids.size(1);
  Tensor x = embedding.forward(c, ids.view({b * s}));
  saved.resize(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    MoELayer::Stats ms;
    x = blocks[i]->forward(c, x, b, s, saved[i], stats ? &ms : nullptr);
    if (stats && blocks[i]->is_moe()) {
      stats->aux_loss += ms.aux_loss;
      stats->moe.push_back(std::move(ms));
    }
  }
  return x;
}

namespace {
int64_t count_targets(const Tensor& targets) {
  const Tensor t = targets.contiguous();
  const int32_t* p = t.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += p[i] >= 0 ? 1 : 0;
  return n;
}
}  // namespace

Model::MicroBatchStats Model::forward_backward(const Ctx& c, const Tensor& ids, const Tensor& targets,
                                               float loss_weight) {
  MicroBatchStats st;
  std::vector<Block::Saved> saved;
  Tensor x = forward_blocks(c, ids, saved, &st);
  const Tensor flat_targets = targets.view({targets.numel()});
  st.tokens = count_targets(flat_targets);
  const float grad_scale = st.tokens > 0 ? loss_weight / static_cast<float>(st.tokens) : 0.0f;
  Tensor dx;
  st.lm_loss_sum = head->forward_backward(c, x, flat_targets, grad_scale, dx);
  for (size_t i = blocks.size(); i-- > 0;) {
    dx = blocks[i]->backward(c, dx, saved[i], loss_weight);
    saved[i] = Block::Saved();  // free activations as soon as they are used
  }
  embedding.backward(c, ids.view({ids.numel()}), dx);
  return st;
}

double Model::eval_loss_sum(const Ctx& c, const Tensor& ids, const Tensor& targets, int64_t& tokens) {
  std::vector<Block::Saved> saved;
  Tensor x = forward_blocks(c, ids, saved, nullptr);
  saved.clear();
  const Tensor flat_targets = targets.view({targets.numel()});
  tokens = count_targets(flat_targets);
  return head->loss_sum(c, x, flat_targets);
}

std::vector<float> Model::last_logits(const Ctx& c, const Tensor& ids) {
  std::vector<Block::Saved> saved;
  Tensor x = forward_blocks(c, ids, saved, nullptr);
  saved.clear();
  Tensor lg = head->logits(c, x.narrow(0, x.size(0) - 1, 1));
  return lg.to_floats();
}

void Model::zero_grad(const Ctx& c) {
  for (auto& p : parameters()) kernels::fill(c.ex, p.param->grad, 0.0f);
}

std::vector<std::vector<int64_t>> Model::end_step() {
  std::vector<std::vector<int64_t>> out;
  for (auto& b : blocks) {
    if (!b->is_moe()) continue;
    out.push_back(b->moe->step_load());
    b->moe->update_bias(out.back());
  }
  return out;
}

}  // namespace troupe::layers
