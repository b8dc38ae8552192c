// layers/moe.cc — Router, LocalExpertDispatch and MoELayer.
//
// Two ways to keep the router's balancing statistics. Router::forward (CPU, or
// bench.device_stats = false; groups through the host all-reduce): host loops over
// read-back topk_idx and score sums, three host waits per MoE layer on a device (the
// z-loss also reads back each token's log-sum-exp).
// Router::forward_device (MoELayer::set_device_stats; on GPUs): counts, score sums, the
// z-loss's log-sum-exps and the aux loss (router_forward's RouterStats, logsumexp_forward)
// accumulate on the device (in a group, summed over it by a device all-reduce) and are
// read once per step (Model::end_step, the stage's step_stats); the local dispatch then
// sizes its rows as T*k without reading the counts, so the MoE layer enqueues everything
// without a host wait.
#include "layers/moe.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace troupe::layers {

namespace {
std::vector<float> host_floats(const Tensor& t) { return t.to_floats(); }
}  // namespace

Router::Router(int64_t d_model, const MoEConfig& c) : cfg(c) {
  weight.allocate({d_model, c.num_experts});
  weight.overwrites_grad = true;  // backward: accumulate_grad()
  bias = Tensor::zeros({c.num_experts}, DType::kF32);
}

void Router::init(uint64_t seed, const std::string& prefix, float std) {
  init_normal(weight.value, seed, prefix + ".weight", std);
  bias.fill(0.0f);
}

void Router::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  out.push_back({prefix + ".weight", &weight});
}

double Router::aux_scale(int64_t tokens) const {
  const double td = static_cast<double>(std::max<int64_t>(1, tokens));
  return cfg.aux_loss_coef * static_cast<double>(cfg.num_experts) /
         (td * td * static_cast<double>(cfg.top_k));
}

kernels::RouterConfig Router::router_config() const {
  kernels::RouterConfig rc;
  rc.top_k = static_cast<int>(cfg.top_k);
  rc.score = cfg.score;
  rc.normalize = cfg.normalize_gates || cfg.score == kernels::RouterScore::kSigmoid;
  return rc;
}

double Router::forward(const Ctx& c, const Tensor& x, Saved& s) const {
  const int64_t t = x.size(0), e = cfg.num_experts, k = cfg.top_k;
  s.x = x;
  s.logits = c.empty({t, e}, DType::kF32);
  kernels::matmul(c.ex, x, weight.w(), s.logits);
  s.scores = c.empty({t, e}, DType::kF32);
  s.topk_idx = c.empty({t, k}, DType::kI32);
  s.gates = c.empty({t, k}, DType::kF32);
  const bool use_bias = cfg.bias_update_rate > 0;
  kernels::router_forward(c.ex, s.logits, use_bias ? &bias : nullptr, router_config(), s.scores, s.topk_idx,
                          s.gates);

  // Statistics of this rank's tokens: [selected_e (E) | sum_t scores[t,e] (E) | T | sum_t lse_t^2].
  std::vector<double> stats(static_cast<size_t>(2 * e + 2), 0.0);
  Tensor score_sums;
  if (cfg.aux_loss_coef > 0 && c.on_device()) {
    // Column sums on the device: E floats come back instead of the [T, E] scores.
    score_sums = c.empty({e}, DType::kF32);
    kernels::sum_rows(c.ex, s.scores, score_sums);
  }
  const Tensor idx = c.to_host(s.topk_idx);
  const int32_t* ip = idx.data<int32_t>();
  for (int64_t i = 0; i < t * k; ++i) stats[static_cast<size_t>(ip[i])] += 1.0;
  if (cfg.aux_loss_coef > 0) {
    if (score_sums.defined()) {
      const std::vector<float> col = c.to_host(score_sums).to_floats();
      for (int64_t j = 0; j < e; ++j) stats[static_cast<size_t>(e + j)] = col[static_cast<size_t>(j)];
    } else {
      const std::vector<float> sc = host_floats(s.scores);
      for (int64_t i = 0; i < t; ++i)
        for (int64_t j = 0; j < e; ++j) stats[static_cast<size_t>(e + j)] += sc[static_cast<size_t>(i * e + j)];
    }
  }
  stats[static_cast<size_t>(2 * e)] = static_cast<double>(t);
  s.lse = Tensor();
  if (cfg.z_loss_coef > 0) {
    // Each token's log-sum-exp stays for the z-loss gradient; T of them come back.
    s.lse = c.empty({t}, DType::kF32);
    kernels::logsumexp_forward(c.ex, s.logits, s.lse);
    for (float l : c.to_host(s.lse).to_floats())
      stats[static_cast<size_t>(2 * e + 1)] += static_cast<double>(l) * l;
  }
  if (all_reduce_) all_reduce_(stats);

  s.selected.assign(static_cast<size_t>(e), 0);
  for (int64_t j = 0; j < e; ++j) s.selected[static_cast<size_t>(j)] = std::llround(stats[static_cast<size_t>(j)]);
  s.group_tokens = std::llround(stats[static_cast<size_t>(2 * e)]);
  const double tg = static_cast<double>(std::max<int64_t>(1, s.group_tokens));
  double aux = 0;
  if (cfg.aux_loss_coef > 0) {
    double acc = 0;
    for (int64_t j = 0; j < e; ++j) {
      const double f = stats[static_cast<size_t>(j)] / (tg * static_cast<double>(k));
      acc += f * stats[static_cast<size_t>(e + j)] / tg;
    }
    aux += cfg.aux_loss_coef * static_cast<double>(e) * acc;
  }
  if (cfg.z_loss_coef > 0) aux += cfg.z_loss_coef * stats[static_cast<size_t>(2 * e + 1)] / tg;
  return aux;
}

void Router::forward_device(const Ctx& c, const Tensor& x, Saved& s, Tensor* acc) const {
  TROUPE_CHECK(device_stats_ok(c), "Router::forward_device needs, in a group, the device all-reduce");
  const int64_t t = x.size(0), e = cfg.num_experts, k = cfg.top_k;
  s.x = x;
  s.logits = c.empty({t, e}, DType::kF32);
  kernels::matmul(c.ex, x, weight.w(), s.logits);
  s.scores = c.empty({t, e}, DType::kF32);
  s.topk_idx = c.empty({t, k}, DType::kI32);
  s.gates = c.empty({t, k}, DType::kF32);
  const Tensor* route_bias = cfg.bias_update_rate > 0 ? &bias : nullptr;
  s.selected.clear();
  s.group_tokens = t;
  s.counts = Tensor();
  s.score_sums = Tensor();
  s.lse = Tensor();
  if (acc == nullptr) {
    kernels::router_forward(c.ex, s.logits, route_bias, router_config(), s.scores, s.topk_idx, s.gates);
    return;
  }
  TROUPE_CHECK(acc->dtype() == DType::kF32 && acc->numel() == e + 1,
               "Router::forward_device: acc must be f32 [{}], got {}", e + 1, acc->describe());
  // [counts (E) | score column sums (E) | sum of lse^2 (1)]: one buffer, so that a group
  // sums them in one call.
  const bool aux_on = cfg.aux_loss_coef > 0, z_on = cfg.z_loss_coef > 0;
  const int64_t z_at = aux_on ? 2 * e : e;
  Tensor st = c.empty({z_at + (z_on ? 1 : 0)}, DType::kF32);
  s.counts = st.narrow(0, 0, e);
  if (aux_on) s.score_sums = st.narrow(0, e, e);
  // The statistics come from the router's own pass. Alone (no group to sum them over first)
  // it also adds them to acc: the load, and the aux loss over these t tokens.
  kernels::RouterStats rs;
  rs.counts = &s.counts;
  rs.score_sums = aux_on ? &s.score_sums : nullptr;
  if (!device_all_reduce_) {
    rs.acc = acc;
    rs.aux_scale = static_cast<float>(aux_scale(t));
  }
  kernels::router_forward(c.ex, s.logits, route_bias, router_config(), s.scores, s.topk_idx, s.gates, &rs);
  Tensor zsum;
  if (z_on) {
    // z-loss = coef * sum_t lse_t^2 / T: the sum of squares stays on the device.
    s.lse = c.empty({t}, DType::kF32);
    kernels::logsumexp_forward(c.ex, s.logits, s.lse);
    zsum = st.narrow(0, z_at, 1);
    const Tensor* lse_p = &s.lse;
    kernels::sum_squares_into(c.ex, std::span<const Tensor* const>(&lse_p, 1), zsum);
  }
  if (device_all_reduce_) s.group_tokens = t * device_all_reduce_(st);
  Tensor aux_slot = acc->narrow(0, e, 1);
  if (z_on) {
    kernels::axpby(c.ex, static_cast<float>(cfg.z_loss_coef / static_cast<double>(s.group_tokens)), zsum,
                   1.0f, aux_slot);
  }
  if (!device_all_reduce_) return;
  Tensor load = acc->narrow(0, 0, e);
  kernels::axpby(c.ex, 1.0f, s.counts, 1.0f, load);
  if (aux_on) {
    // aux = coef * E * sum_e (counts_e / (T k)) * (score_sums_e / T): a [1,E] x [E,1] product.
    Tensor dot = c.empty({1, 1}, DType::kF32);
    kernels::matmul(c.ex, s.counts.view({1, e}), s.score_sums.view({e, 1}), dot);
    Tensor aux = acc->narrow(0, e, 1);
    kernels::axpby(c.ex, static_cast<float>(aux_scale(s.group_tokens)), dot.view({1}), 1.0f, aux);
  }
}

void Router::backward(const Ctx& c, const Tensor& dgates, const Saved& s, float loss_weight, Tensor& dx) {
  const int64_t t = s.x.size(0), e = cfg.num_experts;
  const double tg = static_cast<double>(std::max<int64_t>(1, s.group_tokens));
  // The aux loss's gradient on the scores is one [E] row for every token: d aux / d
  // scores[t,e] = coef * E * f_e / T with f_e the share of copies routed to e. The kernel
  // reads it as that row times a scale (no [T,E] broadcast).
  // The row is the counts (on the device after forward_device, else the host's counts
  // uploaded), its scale loss_weight * aux_scale.
  Tensor row;
  const float row_scale = static_cast<float>(loss_weight * aux_scale(s.group_tokens));
  if (cfg.aux_loss_coef > 0 && s.counts.defined()) {
    row = s.counts;
  } else if (cfg.aux_loss_coef > 0) {
    Tensor counts = Tensor::empty({e}, DType::kF32);
    for (int64_t j = 0; j < e; ++j)
      counts.data<float>()[j] = static_cast<float>(s.selected[static_cast<size_t>(j)]);
    row = c.on_device() ? c.to_device(counts) : counts;
  }
  // Without a z-loss the kernel writes dlogits in the activation dtype of the product below
  // (one rounding, no cast); the z-loss adds to f32 dlogits first.
  Tensor dlogits = c.empty({t, e}, cfg.z_loss_coef > 0 ? DType::kF32 : c.act);
  kernels::router_backward(c.ex, s.scores, s.topk_idx, dgates, row.defined() ? &row : nullptr,
                           router_config(), dlogits, row_scale);
  if (cfg.z_loss_coef > 0) {
    // d/dlogits of coef * sum_t lse_t^2 / T = coef * 2 * lse_t * softmax(logits_t) / T.
    TROUPE_CHECK(s.lse.defined(), "Router::backward: the z-loss needs the forward's log-sum-exps");
    kernels::logsumexp_backward(c.ex, s.logits, s.lse, s.lse,
                                static_cast<float>(loss_weight * cfg.z_loss_coef * 2.0 / tg), dlogits);
  }
  // The product runs in the activation dtype (x and the working weight).
  Tensor dl = dlogits;
  if (dlogits.dtype() != c.act) {
    dl = c.empty({t, e});
    kernels::cast(c.ex, dlogits, dl);
  }
  TROUPE_CHECK(dx.shape() == s.x.shape(), "Router::backward: dx {} for x {}", dx.describe(), s.x.describe());
  // dx adds to the experts' input gradient; the weight gradient is written on a step's
  // first micro-batch (accumulate_grad).
  const bool add_w = weight.accumulate_grad();
  if (add_w) {
    kernels::matmul_backward(c.ex, s.x, weight.w(), dl, &dx, &weight.grad, false, false, /*accumulate=*/true);
  } else {
    kernels::matmul_backward(c.ex, s.x, weight.w(), dl, &dx, nullptr, false, false, /*accumulate=*/true);
    kernels::matmul_backward(c.ex, s.x, weight.w(), dl, nullptr, &weight.grad, false, false,
                             /*accumulate=*/false);
  }
}

// ---- LocalExpertDispatch ---------------------------------------------------------------

namespace {
struct LocalDispatchState final : DispatchState {
  Tensor row_map, offsets, yp, gates;
  Experts::Saved experts;
  int64_t tokens = 0;
};
}  // namespace

LocalExpertDispatch::LocalExpertDispatch(Experts& experts, int64_t top_k, double capacity_factor)
    : experts_(experts), top_k_(top_k), capacity_factor_(capacity_factor) {}

Tensor LocalExpertDispatch::forward(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                                    std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept) {
  return combine(c, x, topk_idx, gates, state, kept, nullptr);
}

Tensor LocalExpertDispatch::forward_add(const Ctx& c, const Tensor& x, const Tensor& topk_idx,
                                        const Tensor& gates, std::unique_ptr<DispatchState>& state,
                                        std::vector<int64_t>& kept, const Tensor& residual) {
  return combine(c, x, topk_idx, gates, state, kept, &residual);
}

Tensor LocalExpertDispatch::combine(const Ctx& c, const Tensor& x, const Tensor& topk_idx,
                                    const Tensor& gates, std::unique_ptr<DispatchState>& state,
                                    std::vector<int64_t>& kept, const Tensor* residual) {
  auto st = std::make_unique<LocalDispatchState>();
  const int64_t t = x.size(0), e = experts_.w1.value.size(0);
  int64_t capacity = -1;
  if (capacity_factor_ > 0) {
    capacity = static_cast<int64_t>(
        std::ceil(capacity_factor_ * static_cast<double>(t * top_k_) / static_cast<double>(e)));
  }
  st->row_map = c.empty({t * top_k_}, DType::kI32);
  Tensor counts = c.empty({e}, DType::kI32);
  st->offsets = c.empty({e + 1}, DType::kI32);
  kernels::moe_dispatch_plan(c.ex, topk_idx, e, capacity, st->row_map, counts, st->offsets);
  int64_t rows = 0;
  if (defer_counts_ && capacity < 0) {
    rows = t * top_k_;  // dropless: every copy is kept; the counts stay on the device
    kept.clear();
  } else {
    const Tensor hc = c.to_host(counts);
    kept.assign(static_cast<size_t>(e), 0);
    for (int64_t j = 0; j < e; ++j) {
      kept[static_cast<size_t>(j)] = hc.data<int32_t>()[j];
      rows += kept[static_cast<size_t>(j)];  // offsets[E] = sum of the counts
    }
  }
  Tensor xp = c.empty({rows, x.size(1)});
  kernels::moe_permute(c.ex, x, st->row_map, top_k_, xp);
  st->yp = experts_.forward(c, xp, st->offsets, st->experts);
  Tensor y = c.empty(x.shape());
  kernels::moe_unpermute(c.ex, st->yp, st->row_map, gates, y, residual);
  st->gates = gates;
  st->tokens = t;
  state = std::move(st);
  return y;
}

Tensor ExpertDispatch::forward_add(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                                   std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept,
                                   const Tensor& residual) {
  Tensor y = forward(c, x, topk_idx, gates, state, kept);
  kernels::add(c.ex, residual, y, y);
  return y;
}

Tensor LocalExpertDispatch::backward(const Ctx& c, const Tensor& dy, DispatchState& state, Tensor& dgates) {
  auto& st = static_cast<LocalDispatchState&>(state);
  Tensor dyp = c.empty(st.yp.shape());
  dgates = c.empty(st.gates.shape(), st.gates.dtype());
  kernels::moe_unpermute_backward(c.ex, dy, st.yp, st.row_map, st.gates, dyp, dgates);
  Tensor dxp = experts_.backward(c, dyp, st.experts);
  Tensor dx = c.empty({st.tokens, dy.size(1)});
  kernels::moe_permute_backward(c.ex, dxp, st.row_map, top_k_, dx);
  return dx;
}

// ---- MoELayer ----------------------------------------------------------------------------

namespace {
ExpertRange checked_range(const MoEConfig& cfg, ExpertRange r) {
  if (r.count < 0) return ExpertRange{0, cfg.num_experts};
  TROUPE_CHECK(r.first >= 0 && r.count > 0 && r.first + r.count <= cfg.num_experts,
               "MoELayer: experts [{}, {}) are not a range of the block's {}", r.first, r.first + r.count,
               cfg.num_experts);
  return r;
}
}  // namespace

MoELayer::MoELayer(int64_t d_model, const MoEConfig& cfg, bool recompute, ExpertRange held)
    : router(d_model, cfg),
      experts(checked_range(cfg, held).count, d_model, cfg.expert_hidden, recompute),
      first_expert_(checked_range(cfg, held).first) {
  if (cfg.shared_experts > 0) {
    shared = std::make_unique<SwiGLUMLP>(d_model, cfg.shared_experts * cfg.expert_hidden, recompute);
  }
  if (experts.w1.value.size(0) == cfg.num_experts) {
    local_ = std::make_unique<LocalExpertDispatch>(experts, cfg.top_k, cfg.capacity_factor);
  }
  dispatch_ = local_.get();
  step_load_.assign(static_cast<size_t>(cfg.num_experts), 0);
}

void MoELayer::init(uint64_t seed, const std::string& prefix, float std, float out_std) {
  router.init(seed, prefix + ".router", std);
  experts.init(seed, prefix + ".experts", std, out_std, first_expert_);
  if (shared) shared->init(seed, prefix + ".shared", std, out_std);
}

void MoELayer::collect(const std::string& prefix, std::vector<NamedParameter>& out) {
  router.collect(prefix + ".router", out);
  experts.collect(prefix + ".experts", out);
  if (shared) shared->collect(prefix + ".shared", out);
}

void MoELayer::collect_buffers(const std::string& prefix, std::vector<NamedBuffer>& out) {
  out.push_back({prefix + ".router.bias", &router.bias});
}

Tensor MoELayer::forward(const Ctx& c, const Tensor& x, Saved& s, Stats* stats, const Tensor* residual) {
  TROUPE_CHECK(
      dispatch_ != nullptr,
      "MoELayer holds experts [{}, {}) of {}: it needs a dispatch that reaches the others (set_dispatch)",
      first_expert_, first_expert_ + experts.w1.value.size(0), router.cfg.num_experts);
  // The routed experts' output, with the residual folded into the combine unless a shared
  // expert's output comes first (then (routed + shared) + residual, the order of before).
  const auto routed = [&](std::vector<int64_t>& kept) {
    if (residual != nullptr && !shared) {
      return dispatch_->forward_add(c, x, s.router.topk_idx, s.router.gates, s.dispatch, kept, *residual);
    }
    Tensor y = dispatch_->forward(c, x, s.router.topk_idx, s.router.gates, s.dispatch, kept);
    if (shared) {
      Tensor ys = shared->forward(c, x, s.shared);
      kernels::add(c.ex, y, ys, y);
      if (residual != nullptr) kernels::add(c.ex, *residual, y, y);
    }
    return y;
  };
  if (device_stats_.defined()) {
    router.forward_device(c, x, s.router, stats ? &device_stats_ : nullptr);
    if (stats) device_selections_ += s.router.group_tokens * router.cfg.top_k;
    std::vector<int64_t> kept;
    Tensor y = routed(kept);
    if (stats) {  // the aux loss and counts arrive with the step's one read (Model::end_step)
      stats->aux_loss = 0;
      stats->selected.clear();
      stats->kept = std::move(kept);
    }
    return y;
  }
  const double aux = router.forward(c, x, s.router);
  std::vector<int64_t> kept;
  Tensor y = routed(kept);
  if (stats) {
    stats->aux_loss = aux;
    stats->selected = s.router.selected;
    stats->kept = std::move(kept);
    for (size_t j = 0; j < step_load_.size(); ++j) step_load_[j] += stats->selected[j];
  }
  return y;
}

Tensor MoELayer::backward(const Ctx& c, const Tensor& dy, Saved& s, float loss_weight) {
  Tensor dgates;
  Tensor dx = dispatch_->backward(c, dy, *s.dispatch, dgates);
  router.backward(c, dgates, s.router, loss_weight, dx);
  if (shared) {
    Tensor dxs = shared->backward(c, dy, s.shared);
    kernels::add(c.ex, dx, dxs, dx);
  }
  return dx;
}

bool MoELayer::set_device_stats(const Ctx& c, Tensor row) {
  if (!router.device_stats_ok(c)) return false;
  TROUPE_CHECK(
      row.dtype() == DType::kF32 && row.numel() == router.cfg.num_experts + 1 && row.device() == c.ex.device,
      "MoELayer::set_device_stats: row must be f32 [{}] on {}, got {}", router.cfg.num_experts + 1,
      c.ex.device, row.describe());
  device_stats_ = std::move(row);
  device_selections_ = 0;
  if (local_) local_->set_defer_counts(true);
  return true;
}

double MoELayer::absorb_device_stats(const float* row, int64_t replicas) {
  const size_t e = step_load_.size();
  int64_t total = 0;
  for (size_t j = 0; j < e; ++j) {
    step_load_[j] = std::llround(static_cast<double>(row[j]));
    total += step_load_[j];
  }
  const int64_t expected = device_selections_ * replicas;
  device_selections_ = 0;
  if (total != expected) {
    // An app's input, not an invariant of this code: thrown, so the worker reports it.
    throw std::runtime_error(fmt::format(
        "MoE device statistics: the routers counted {} expert selections where group members routing equal "
        "token counts would give {}; the members of a group must route the same number of tokens per "
        "micro-batch (or set bench.device_stats = false)",
        total, expected));
  }
  return static_cast<double>(row[e]);
}

void MoELayer::update_bias(const std::vector<int64_t>& load) { update_bias(Ctx::cpu(), load); }

void MoELayer::update_bias(const Ctx& c, const std::vector<int64_t>& load) {
  const double rate = router.cfg.bias_update_rate;
  if (rate > 0 && !load.empty()) {
    double mean = 0;
    for (int64_t l : load) mean += static_cast<double>(l);
    mean /= static_cast<double>(load.size());
    Tensor hb = c.to_host(router.bias);  // the bias itself on the CPU
    float* b = hb.data<float>();
    for (size_t j = 0; j < load.size(); ++j) {
      const double d = mean - static_cast<double>(load[j]);
      b[j] += static_cast<float>(rate * (d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0)));
    }
    c.copy_to_device(hb, router.bias);
  }
  std::fill(step_load_.begin(), step_load_.end(), 0);
  device_selections_ = 0;  // a discarded step's statistics are zeroed with it
}

}  // namespace troupe::layers
