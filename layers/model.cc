// layers/model.cc — Model construction, naming, forward/backward, evaluation.
#include "layers/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

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

int64_t Model::target_tokens(const Ctx& c, const Tensor& targets) {
  const Tensor t = c.to_host(targets);
  const int32_t* p = t.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += p[i] >= 0 ? 1 : 0;
  return n;
}

std::vector<int64_t> Model::pending_selections() const {
  std::vector<int64_t> out;
  for (const auto& b : blocks)
    if (b->is_moe()) out.push_back(b->moe->pending_selections());
  return out;
}

void Model::add_pending_selections(const std::vector<int64_t>& per_moe_block) {
  size_t i = 0;
  for (auto& b : blocks) {
    if (!b->is_moe()) continue;
    TROUPE_CHECK(i < per_moe_block.size(), "Model::add_pending_selections: {} values for more MoE blocks",
                 per_moe_block.size());
    b->moe->add_pending_selections(per_moe_block[i++]);
  }
  TROUPE_CHECK(i == per_moe_block.size(), "Model::add_pending_selections: {} values for {} MoE blocks",
               per_moe_block.size(), i);
}

Model::MicroBatchStats Model::forward_backward(const Ctx& c, const Tensor& ids_in, const Tensor& targets_in,
                                               float loss_weight, int64_t tokens) {
  MicroBatchStats st;
  // Host batches go to the device here (and the target count is taken on the host copy).
  st.tokens = tokens >= 0 ? tokens : target_tokens(c, targets_in.view({targets_in.numel()}));
  const Tensor ids = ids_in.device() == c.ex.device ? ids_in : c.to_device(ids_in);
  const Tensor targets = targets_in.device() == c.ex.device ? targets_in : c.to_device(targets_in);
  std::vector<Block::Saved> saved;
  Tensor x = forward_blocks(c, ids, saved, &st);
  const Tensor flat_targets = targets.view({targets.numel()});
  const float grad_scale = st.tokens > 0 ? loss_weight / static_cast<float>(st.tokens) : 0.0f;
  Tensor dx;
  const Tensor losses = head->forward_backward_losses(c, x, flat_targets, grad_scale, dx);
  for (size_t i = blocks.size(); i-- > 0;) {
    dx = blocks[i]->backward(c, dx, saved[i], loss_weight);
    saved[i] = Block::Saved();  // free activations as soon as they are used
  }
  embedding.backward(c, ids.view({ids.numel()}), dx);
  settle_grads(c);
  if (stats_dev_.defined()) {  // summed on the device, read with the step's statistics
    Tensor lm = stats_dev_.narrow(0, 0, 1);
    kernels::sum_rows(c.ex, losses.view({losses.numel(), 1}), lm, /*accumulate=*/true);
    return st;
  }
  // The one read-back of the micro-batch, after its whole backward is enqueued.
  st.lm_loss_sum = kernels::sum(c.ex, losses);
  return st;
}

double Model::eval_loss_sum(const Ctx& c, const Tensor& ids_in, const Tensor& targets_in, int64_t& tokens) {
  const Tensor ids = ids_in.device() == c.ex.device ? ids_in : c.to_device(ids_in);
  const Tensor targets = targets_in.device() == c.ex.device ? targets_in : c.to_device(targets_in);
  std::vector<Block::Saved> saved;
  Tensor x = forward_blocks(c, ids, saved, nullptr);
  saved.clear();
  const Tensor flat_targets = targets.view({targets.numel()});
  tokens = target_tokens(c, flat_targets);
  return head->loss_sum(c, x, flat_targets);
}

std::vector<float> Model::last_logits(const Ctx& c, const Tensor& ids_in) {
  const Tensor ids = ids_in.device() == c.ex.device ? ids_in : c.to_device(ids_in);
  std::vector<Block::Saved> saved;
  Tensor x = forward_blocks(c, ids, saved, nullptr);
  saved.clear();
  Tensor lg = head->logits(c, x.narrow(0, x.size(0) - 1, 1));
  return c.to_host(lg).to_floats();
}

void Model::zero_grad(const Ctx& c) {
  if (buf_.built()) {
    buf_.zero_grad(c);
    return;
  }
  // Each Parameter holds its own tensors: the same marks, one fill per gradient.
  for (auto& p : parameters()) {
    p.param->grad_stale = p.param->overwrites_grad;
    p.param->reset_grad_products();
    if (!p.param->grad_stale) kernels::fill(c.ex, p.param->grad, 0.0f);
  }
}

double Model::grad_norm_squared(const Ctx& c) const {
  TROUPE_CHECK(buf_.built(), "Model::grad_norm_squared needs the flat layout (to_device)");
  return buf_.grad_norm_squared(c);
}

void Model::settle_grads(const Ctx& c) {
  if (buf_.built()) {
    buf_.settle_grads(c);
    return;
  }
  for (auto& p : parameters()) {
    if (!p.param->grad_stale) continue;
    kernels::fill(c.ex, p.param->grad, 0.0f);  // no backward wrote it: its gradient is zero
    p.param->grad_stale = false;
  }
}

std::vector<std::vector<int64_t>> Model::end_step() { return end_step(Ctx::cpu()); }

bool Model::enable_device_stats(const Ctx& c) {
  std::vector<MoELayer*> moes;
  for (auto& b : blocks) {
    if (!b->is_moe()) continue;
    if (!b->moe->router.device_stats_ok(c)) return false;
    moes.push_back(b->moe.get());
  }
  const int64_t e = moes.empty() ? 0 : moes.front()->router.cfg.num_experts;
  stats_stride_ = (e + 1 + 3) / 4 * 4;  // 16-byte aligned rows
  stats_dev_ = c.zeros({4 + static_cast<int64_t>(moes.size()) * stats_stride_}, DType::kF32);
  for (size_t i = 0; i < moes.size(); ++i) {
    const bool ok = moes[i]->set_device_stats(
        c, stats_dev_.narrow(0, 4 + static_cast<int64_t>(i) * stats_stride_, e + 1));
    TROUPE_CHECK(ok, "Model::enable_device_stats: MoE block {} refused after device_stats_ok", i);
  }
  return true;
}

Tensor Model::grad_norm_squared_on_device(const Ctx& c) {
  TROUPE_CHECK(stats_dev_.defined(), "Model::grad_norm_squared_on_device needs enable_device_stats");
  Tensor out = stats_dev_.narrow(0, 1, 1);
  if (buf_.built()) {
    last_folded_elements_ = buf_.grad_norm_squared_into(c, out);
    return out;
  }
  std::vector<const Tensor*> squares;
  for (const auto& p : parameters()) squares.push_back(&p.param->grad);
  kernels::sum_squares_into(c.ex, squares, out, /*accumulate=*/false);
  last_folded_elements_ = 0;
  return out;
}

int64_t Model::enable_grad_norm_fold(const Ctx& c) {
  if (!buf_.built()) to_device(c);
  return buf_.enable_grad_norm_fold(c);
}

std::vector<std::vector<int64_t>> Model::end_step(const Ctx& c) {
  if (!stats_dev_.defined()) return end_step_with(c, nullptr);
  // The step's one read: losses, norm, counts and aux losses together; then zeroed (after
  // they are taken: on the CPU the read is the buffer itself).
  const Tensor h = c.to_host(stats_dev_);
  std::vector<std::vector<int64_t>> out = end_step_with(c, h.data<float>());
  clear_device_stats(c);
  return out;
}

void Model::clear_device_stats(const Ctx& c) {
  TROUPE_CHECK(stats_dev_.defined(), "Model::clear_device_stats needs enable_device_stats");
  kernels::fill(c.ex, stats_dev_, 0.0f);
}

bool Model::updates_between_steps() const {
  for (const auto& b : blocks)
    if (b->is_moe() && b->moe->router.cfg.bias_update_rate > 0) return true;
  return false;
}

std::vector<std::vector<int64_t>> Model::end_step_with(const Ctx& c, const float* p) {
  TROUPE_CHECK(p != nullptr || !stats_dev_.defined(),
               "Model::end_step_with: device mode needs the statistics read");
  std::vector<std::vector<int64_t>> out;
  if (stats_dev_.defined()) {
    last_stats_ = StepStats{p[0], p[1], 0.0};
    int64_t i = 0;
    for (auto& b : blocks) {
      if (!b->is_moe()) continue;
      last_stats_.aux_loss += b->moe->absorb_device_stats(p + 4 + i * stats_stride_);
      ++i;
    }
  }
  for (auto& b : blocks) {
    if (!b->is_moe()) continue;
    out.push_back(b->moe->step_load());
    b->moe->update_bias(c, out.back());
  }
  return out;
}

void Model::to_device(const Ctx& c, DType expert_grads) {
  ParamBuffer::Options o;
  o.expert_grads = expert_grads;
  buf_.build(c, parameters(), o);
  for (auto& b : buffers()) *b.tensor = c.to_device(*b.tensor);
}

void Model::refresh_working_copies(const Ctx& c) {
  buf_.refresh_working_copies(c);
}

int64_t Model::split_masters(const Ctx& c) {
  TROUPE_CHECK(c.on_device() && buf_.built(),
               "Model::split_masters: the split master is for a device layout (after to_device)");
  return buf_.split_masters(c);
}

void Model::sync_master_values(const Ctx& c) {
  buf_.sync_master_values(c);
}

void Model::to_host(const Ctx& c) {
  if (!buf_.built()) return;
  buf_.to_host(c);
  for (auto& b : buffers()) *b.tensor = c.to_host(*b.tensor);
}

}  // namespace troupe::layers
