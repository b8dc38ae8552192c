// layers/model.cc — Model construction, naming, forward/backward, evaluation.
#include "layers/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace troupe::layers {

namespace {
// A tensor's length in Model's flat device buffers (gradients, working copies, split
// masters' low halves): rounded up to 64 elements, so that every tensor in them starts
// aligned for vectorised kernels (256 bytes in f32, 128 in 16-bit).
int64_t padded_numel(int64_t n) {
  constexpr int64_t kAlign = 64;
  return (n + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

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
  // Gradients that their backward overwrites (every parameter but the embedding, whose
  // backward adds rows by token) are only marked stale; clearing them would cost a pass
  // over memory and make the first micro-batch's products read zeros back to add to.
  std::vector<NamedParameter> params = parameters();
  for (auto& p : params) {
    p.param->grad_stale = p.param->overwrites_grad;
    p.param->reset_grad_products();
  }
  if (!flat_grads_.defined()) {
    for (auto& p : params)
      if (!p.param->grad_stale) kernels::fill(c.ex, p.param->grad, 0.0f);
    return;
  }
  // The flat buffer: one fill per run of gradients that their products add to (padding
  // between them included; the padding elsewhere was zeroed at allocation and nothing
  // writes it); a bf16 gradient (to_device's expert_grads) on its own.
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, padded end) element ranges
  const auto* base = static_cast<const char*>(flat_grads_.data_ptr());
  for (auto& p : params) {
    if (p.param->grad_stale) continue;
    if (!in_flat_grads(*p.param)) {
      kernels::fill(c.ex, p.param->grad, 0.0f);
      continue;
    }
    const int64_t begin = (static_cast<const char*>(p.param->grad.data_ptr()) - base) / 4;
    ranges.emplace_back(begin, std::min(begin + padded_numel(p.param->numel()), flat_grads_.numel()));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    int64_t end = ranges[i].second;
    size_t j = i + 1;
    for (; j < ranges.size() && ranges[j].first <= end; ++j) end = std::max(end, ranges[j].second);
    Tensor run = flat_grads_.narrow(0, ranges[i].first, end - ranges[i].first);
    kernels::fill(c.ex, run, 0.0f);
    i = j;
  }
}

bool Model::in_flat_grads(const Parameter& p) const {
  if (!flat_grads_.defined() || p.grad.dtype() != DType::kF32) return false;
  const auto* base = static_cast<const char*>(flat_grads_.data_ptr());
  const auto* at = static_cast<const char*>(p.grad.data_ptr());
  return at >= base && at < base + flat_grads_.nbytes();
}

double Model::grad_norm_squared(const Ctx& c) const {
  TROUPE_CHECK(flat_grads_.defined(), "Model::grad_norm_squared needs the device layout (to_device)");
  double s = kernels::sum_squares(c.ex, flat_grads_);
  if (low_grads_.defined()) s += kernels::sum_squares(c.ex, low_grads_);
  return s;
}

std::vector<Tensor> Model::flat_runs_outside(const std::vector<NamedParameter>& skip) const {
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) element ranges
  const auto* base = static_cast<const char*>(flat_grads_.data_ptr());
  for (const auto& p : skip) {
    if (!in_flat_grads(*p.param)) continue;  // a bf16 gradient: not in this buffer
    const int64_t begin = (static_cast<const char*>(p.param->grad.data_ptr()) - base) / 4;
    TROUPE_CHECK(begin >= 0 && begin + p.param->numel() <= flat_grads_.numel(),
                 "Model: the gradient of {} is not in the flat buffer", p.name);
    ranges.emplace_back(begin, begin + p.param->numel());
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<Tensor> runs;
  int64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin > at) runs.push_back(flat_grads_.narrow(0, at, begin - at));
    at = std::max(at, end);
  }
  if (at < flat_grads_.numel()) runs.push_back(flat_grads_.narrow(0, at, flat_grads_.numel() - at));
  return runs;
}

void Model::settle_grads(const Ctx& c) {
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
  std::vector<NamedParameter> params = parameters();
  // The gradients whose slots hold their sum of squares this step (enable_grad_norm_fold).
  std::vector<NamedParameter> folded;
  last_folded_elements_ = 0;
  for (const auto& p : params) {
    if (!p.param->grad_sum_squares_valid()) continue;
    folded.push_back(p);
    last_folded_elements_ += p.param->numel();
  }
  std::vector<Tensor> read;  // squared: every other gradient element
  if (flat_grads_.defined()) {
    read = flat_runs_outside(folded);
    for (const auto& p : params)  // bf16 gradients not folded this step
      if (!in_flat_grads(*p.param) && !p.param->grad_sum_squares_valid()) read.push_back(p.param->grad);
  } else {  // the CPU layout: one tensor per parameter
    for (const auto& p : params)
      if (!p.param->grad_sum_squares_valid()) read.push_back(p.param->grad);
  }
  std::vector<const Tensor*> squares, sums;
  for (const Tensor& t : read) squares.push_back(&t);
  for (const auto& p : folded) sums.push_back(&p.param->grad_sum_squares);  // summed, not squared
  kernels::sum_squares_into(c.ex, squares, out, /*accumulate=*/false, sums);
  return out;
}

int64_t Model::enable_grad_norm_fold(const Ctx& c) {
  TROUPE_CHECK(!c.on_device() || flat_grads_.defined(), "Model::enable_grad_norm_fold: call to_device first");
  std::vector<NamedParameter> params = parameters();
  int64_t total = 0, count = 0;
  for (const auto& p : params) total += p.param->grad_sum_squares_slots;
  fold_slots_ = total > 0 ? c.zeros({total}, DType::kF32) : Tensor();
  int64_t at = 0;
  for (auto& p : params) {
    Parameter& prm = *p.param;
    prm.grad_sum_squares = Tensor();
    prm.reset_grad_products();  // not valid before the next zero_grad
    if (prm.grad_sum_squares_slots == 0) continue;
    prm.grad_sum_squares = fold_slots_.narrow(0, at, prm.grad_sum_squares_slots);
    at += prm.grad_sum_squares_slots;
    ++count;
  }
  return count;
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
  if (!c.on_device()) return;
  TROUPE_CHECK(expert_grads == DType::kF32 || expert_grads == DType::kBF16,
               "Model::to_device: expert gradients must be f32 or bf16, not {}", dtype_name(expert_grads));
  std::vector<NamedParameter> params = parameters();
  // Offsets rounded up (padded_numel) keep every gradient aligned for vectorised kernels;
  // the gaps are zeroed at allocation and never written (zero_grad clears only gradients
  // that products add to, and the gaps between them).
  // The matrices' working copies (bf16 where activations are) share one buffer too, in
  // parameter order, so a layer's Q, K and V weights lie side by side (Attention's one
  // batched product), as their gradients do.
  int64_t total = 0, low_total = 0, work_total = 0;
  std::vector<int64_t> offsets, work_offsets;
  std::vector<bool> low;
  const auto has_work = [&](const Parameter& prm) { return prm.value.dim() >= 2 && c.act != DType::kF32; };
  for (const auto& p : params) {
    if (p.param->value.device() == c.ex.device) continue;  // tied: already moved
    const bool lo = expert_grads == DType::kBF16 && p.param->bf16_grad_ok;
    int64_t& at = lo ? low_total : total;
    offsets.push_back(at);
    low.push_back(lo);
    const int64_t padded = padded_numel(p.param->numel());
    at += padded;
    work_offsets.push_back(work_total);
    if (has_work(*p.param)) work_total += padded;
  }
  flat_grads_ = c.zeros({total}, DType::kF32);
  const Tensor works = work_total > 0 ? c.empty({work_total}, c.act) : Tensor();
  low_grads_ = low_total > 0 ? c.zeros({low_total}, DType::kBF16) : Tensor();
  fold_slots_ = Tensor();
  size_t i = 0;
  for (auto& p : params) {
    Parameter& prm = *p.param;
    if (prm.value.device() == c.ex.device) continue;
    prm.value = c.to_device(prm.value);
    const Tensor& buf = low[i] ? low_grads_ : flat_grads_;
    prm.grad = buf.narrow(0, offsets[i], prm.numel()).view(prm.value.shape());
    prm.work =
        has_work(prm) ? works.narrow(0, work_offsets[i], prm.numel()).view(prm.value.shape()) : Tensor();
    ++i;
    prm.grad_sum_squares = Tensor();  // host slots: enable_grad_norm_fold again after the move
  }
  for (auto& b : buffers()) *b.tensor = c.to_device(*b.tensor);
  refresh_working_copies(c);
}

void Model::refresh_working_copies(const Ctx& c) {
  for (auto& p : parameters()) {
    Parameter& prm = *p.param;
    if (prm.work_lo.defined()) {
      // Splitting a value that is behind would undo the optimizer's steps since.
      TROUPE_CHECK(!prm.value_stale,
                   "Model::refresh_working_copies: {} is behind its split master (the optimizer wrote the "
                   "working copy itself); call sync_master_values before reading or rewriting values",
                   p.name);
      kernels::master_split(c.ex, prm.value, prm.work, prm.work_lo);
      prm.value_stale = false;
    } else if (prm.work.defined()) {
      kernels::cast(c.ex, prm.value, prm.work);
    }
  }
}

int64_t Model::split_masters(const Ctx& c) {
  TROUPE_CHECK(c.on_device(),
               "Model::split_masters: the split master is for a device layout (after to_device)");
  const auto splits = [](const Parameter& prm) {
    return prm.work.defined() && prm.work.dtype() == DType::kBF16 && !prm.reads_value &&
           !prm.work_lo.defined();
  };
  int64_t total = 0;
  std::vector<NamedParameter> params = parameters();
  for (const auto& p : params)
    if (splits(*p.param)) total += padded_numel(p.param->numel());
  if (total == 0) return 0;
  master_lo_ = c.empty({total}, DType::kI16);
  int64_t at = 0, n = 0;
  for (auto& p : params) {
    Parameter& prm = *p.param;
    if (!splits(prm)) continue;
    prm.work_lo = master_lo_.narrow(0, at, prm.numel()).view(prm.value.shape());
    kernels::master_split(c.ex, prm.value, prm.work, prm.work_lo);
    prm.value_stale = false;
    at += padded_numel(prm.numel());
    ++n;
  }
  return n;
}

void Model::sync_master_values(const Ctx& c) {
  for (auto& p : parameters()) {
    Parameter& prm = *p.param;
    if (!prm.value_stale) continue;
    kernels::master_join(c.ex, prm.work, prm.work_lo, prm.value);
    prm.value_stale = false;
  }
}

void Model::to_host(const Ctx& c) {
  if (!c.on_device()) return;
  sync_master_values(c);
  for (auto& p : parameters()) {
    Parameter& prm = *p.param;
    if (prm.value.device().is_cpu()) continue;  // tied: already copied
    prm.value = c.to_host(prm.value);
    prm.grad = c.to_host(prm.grad);
    if (prm.grad.dtype() != DType::kF32) {  // a bf16 expert gradient: f32 on the host, as ever
      Tensor f = Tensor::empty(prm.grad.shape(), DType::kF32);
      kernels::cast(kernels::Exec::cpu(), prm.grad, f);
      prm.grad = f;
    }
    prm.work = Tensor();
    prm.work_lo = Tensor();
    prm.grad_sum_squares = Tensor();  // folding ends with the device layout
  }
  for (auto& b : buffers()) *b.tensor = c.to_host(*b.tensor);
  flat_grads_ = Tensor();
  low_grads_ = Tensor();
  master_lo_ = Tensor();
  fold_slots_ = Tensor();
}

}  // namespace troupe::layers
