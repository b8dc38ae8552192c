// kernels/cpu/moe.cc — CPU reference of the MoE router (softmax or sigmoid scores, top-k
// with a selection-only bias, renormalised gates), the dispatch plan (grouping token
// copies by expert, with capacity dropping) and permute/unpermute, forward and backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {

void router_forward(const Exec&, const Tensor& logits, const Tensor* bias, const RouterConfig& cfg,
                    Tensor& scores, Tensor& topk_idx, Tensor& gates, const RouterStats* stats) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), k = cfg.top_k;
  F32In pl(logits);
  F32Out ps(scores), pg(gates);
  int32_t* pidx = topk_idx.data<int32_t>();
  std::vector<float> bias_v(static_cast<size_t>(experts), 0.0f);
  if (bias != nullptr) {
    F32In pb(*bias);
    for (int64_t e = 0; e < experts; ++e) bias_v[e] = pb[e];
  }
  std::vector<float> rank(static_cast<size_t>(experts));
  std::vector<char> taken(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* lr = pl.get() + t * experts;
    float* sr = ps.get() + t * experts;
    if (cfg.score == RouterScore::kSoftmax) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < experts; ++e) mx = std::max(mx, lr[e]);
      double z = 0.0;
      for (int64_t e = 0; e < experts; ++e) {
        sr[e] = std::exp(lr[e] - mx);
        z += sr[e];
      }
      for (int64_t e = 0; e < experts; ++e) sr[e] = static_cast<float>(sr[e] / z);
    } else {
      for (int64_t e = 0; e < experts; ++e) sr[e] = 1.0f / (1.0f + std::exp(-lr[e]));
    }
    for (int64_t e = 0; e < experts; ++e) rank[e] = sr[e] + bias_v[e];
    std::fill(taken.begin(), taken.end(), 0);
    // k passes of arg-max; strict > keeps the lower index on ties.
    float gsum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (taken[e]) continue;
        if (best < 0 || rank[e] > rank[best]) best = e;
      }
      taken[best] = 1;
      pidx[t * k + j] = static_cast<int32_t>(best);
      pg[t * k + j] = sr[best];
      gsum += sr[best];
    }
    if (cfg.normalize || cfg.score == RouterScore::kSigmoid) {
      for (int64_t j = 0; j < k; ++j) pg[t * k + j] /= gsum;
    }
  }
  if (stats == nullptr) return;
  // Counts are exact; the score sums and the aux term are summed in double here (the CUDA
  // kernels sum in f32 in a fixed order of their own).
  std::vector<double> counts(static_cast<size_t>(experts), 0.0), sums(static_cast<size_t>(experts), 0.0);
  for (int64_t i = 0; i < tokens * k; ++i) counts[static_cast<size_t>(pidx[i])] += 1.0;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < experts; ++e) sums[static_cast<size_t>(e)] += ps[t * experts + e];
  F32Out pc(*stats->counts);
  for (int64_t e = 0; e < experts; ++e) pc[e] = static_cast<float>(counts[static_cast<size_t>(e)]);
  if (stats->score_sums != nullptr) {
    F32Out pss(*stats->score_sums);
    for (int64_t e = 0; e < experts; ++e) pss[e] = static_cast<float>(sums[static_cast<size_t>(e)]);
  }
  if (stats->acc != nullptr) {
    F32Out pa(*stats->acc, /*load=*/true);
    double dot = 0.0;
    for (int64_t e = 0; e < experts; ++e) {
      pa[e] = static_cast<float>(pa[e] + counts[static_cast<size_t>(e)]);
      dot += counts[static_cast<size_t>(e)] *
             static_cast<double>(static_cast<float>(sums[static_cast<size_t>(e)]));
    }
    if (stats->score_sums != nullptr) pa[experts] = static_cast<float>(pa[experts] + stats->aux_scale * dot);
  }
}

// Gates g_j = s_j / S (S = sum of selected scores) when renormalised, else g_j = s_j.
// ds_i = (dg_i - sum_j dg_j g_j) / S for selected i (or dg_i), plus dscores if given;
// then through the score function: softmax  dl = s (ds - sum(ds s)), sigmoid  dl = ds s (1 - s).
void router_backward(const Exec&, const Tensor& scores, const Tensor& topk_idx, const Tensor& dgates,
                     const Tensor* dscores, const RouterConfig& cfg, Tensor& dlogits, float dscores_scale) {
  const int64_t tokens = scores.size(0), experts = scores.size(1), k = cfg.top_k;
  F32In ps(scores), pdg(dgates);
  const int32_t* pidx = topk_idx.data<int32_t>();
  F32Out pdl(dlogits);
  std::vector<float> dscores_v;
  if (dscores != nullptr) {
    // [E] (one row for every token) or [T,E], times the scale (rounded to f32 as the CUDA
    // kernel rounds it).
    F32In pds(*dscores);
    const bool row = dscores->dim() == 1;
    dscores_v.resize(static_cast<size_t>(tokens * experts));
    for (int64_t i = 0; i < tokens * experts; ++i) dscores_v[i] = dscores_scale * pds[row ? i % experts : i];
  }
  const bool renorm = cfg.normalize || cfg.score == RouterScore::kSigmoid;
  std::vector<float> ds(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* sr = ps.get() + t * experts;
    for (int64_t e = 0; e < experts; ++e) ds[e] = dscores_v.empty() ? 0.0f : dscores_v[t * experts + e];
    const int32_t* idx = pidx + t * k;
    const float* dg = pdg.get() + t * k;
    for (int64_t j = 0; j < k; ++j) {
      TROUPE_CHECK(idx[j] >= 0 && idx[j] < experts, "router_backward: topk_idx[{}, {}] = {} outside [0, {})",
                   t, j, idx[j], experts);
    }
    if (renorm) {
      float ssum = 0.0f;
      for (int64_t j = 0; j < k; ++j) ssum += sr[idx[j]];
      float dot = 0.0f;
      for (int64_t j = 0; j < k; ++j) dot += dg[j] * (sr[idx[j]] / ssum);
      for (int64_t j = 0; j < k; ++j) ds[idx[j]] += (dg[j] - dot) / ssum;
    } else {
      for (int64_t j = 0; j < k; ++j) ds[idx[j]] += dg[j];
    }
    float* dl = pdl.get() + t * experts;
    if (cfg.score == RouterScore::kSoftmax) {
      double dot = 0.0;
      for (int64_t e = 0; e < experts; ++e) dot += static_cast<double>(ds[e]) * sr[e];
      for (int64_t e = 0; e < experts; ++e) dl[e] = sr[e] * (ds[e] - static_cast<float>(dot));
    } else {
      for (int64_t e = 0; e < experts; ++e) dl[e] = ds[e] * sr[e] * (1.0f - sr[e]);
    }
  }
}

void logsumexp_forward(const Exec&, const Tensor& x, Tensor& lse) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* px = x.data<float>();
  float* pl = lse.data<float>();
  for (int64_t t = 0; t < rows; ++t) {
    const float* r = px + t * cols;
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, static_cast<double>(r[j]));
    double s = 0.0;
    for (int64_t j = 0; j < cols; ++j) s += std::exp(static_cast<double>(r[j]) - m);
    pl[t] = static_cast<float>(m + std::log(s));
  }
}

void logsumexp_backward(const Exec&, const Tensor& x, const Tensor& lse, const Tensor& dlse, float scale,
                        Tensor& dx) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const float *px = x.data<float>(), *pl = lse.data<float>(), *pg = dlse.data<float>();
  float* pd = dx.data<float>();
  for (int64_t t = 0; t < rows; ++t) {
    const double w = static_cast<double>(scale) * pg[t];
    for (int64_t j = 0; j < cols; ++j) {
      pd[t * cols + j] += static_cast<float>(w * std::exp(static_cast<double>(px[t * cols + j]) - pl[t]));
    }
  }
}

void moe_dispatch_plan(const Exec&, const Tensor& topk_idx, int64_t num_experts, int64_t capacity,
                       Tensor& row_map, Tensor& expert_counts, Tensor& expert_offsets) {
  const int64_t copies = topk_idx.numel();
  const int32_t* pidx = topk_idx.data<int32_t>();
  int32_t* rows = row_map.data<int32_t>();
  int32_t* counts = expert_counts.data<int32_t>();
  int32_t* offsets = expert_offsets.data<int32_t>();
  std::fill(counts, counts + num_experts, 0);
  // Pass 1, in (token, choice) order: rank of each kept copy inside its expert.
  for (int64_t c = 0; c < copies; ++c) {
    const int32_t e = pidx[c];
    TROUPE_CHECK(e >= 0 && e < num_experts, "moe_dispatch_plan: topk_idx[{}] = {} outside [0, {})", c, e,
                 num_experts);
    if (capacity >= 0 && counts[e] >= capacity) {
      rows[c] = -1;
    } else {
      rows[c] = counts[e]++;
    }
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  // Pass 2: rank -> row of the permuted buffer.
  for (int64_t c = 0; c < copies; ++c) {
    if (rows[c] >= 0) rows[c] += offsets[pidx[c]];
  }
}

namespace {
void check_row(const char* op, int64_t copy, int32_t row, int64_t rows) {
  TROUPE_CHECK(row >= -1 && row < rows, "{}: row_map[{}] = {} outside [-1, {})", op, copy, row, rows);
}
}  // namespace

void moe_permute(const Exec&, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& xp) {
  const int64_t tokens = x.size(0), dim = x.size(1), rows = xp.size(0);
  const int32_t* pm = row_map.data<int32_t>();
  F32In px(x);
  F32Out pxp(xp);
  // Rows no copy maps to (padding beyond the kept copies) are zeroed, never left stale.
  std::fill(pxp.get(), pxp.get() + xp.numel(), 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t r = pm[t * top_k + j];
      check_row("moe_permute", t * top_k + j, r, rows);
      if (r < 0) continue;
      std::copy(px.get() + t * dim, px.get() + (t + 1) * dim, pxp.get() + r * dim);
    }
  }
}

void moe_permute_backward(const Exec&, const Tensor& dxp, const Tensor& row_map, int64_t top_k, Tensor& dx) {
  const int64_t tokens = dx.size(0), dim = dx.size(1), rows = dxp.size(0);
  const int32_t* pm = row_map.data<int32_t>();
  F32In pdxp(dxp);
  F32Out pdx(dx);
  for (int64_t t = 0; t < tokens; ++t) {
    float* dst = pdx.get() + t * dim;
    std::fill(dst, dst + dim, 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t r = pm[t * top_k + j];
      check_row("moe_permute_backward", t * top_k + j, r, rows);
      if (r < 0) continue;
      const float* src = pdxp.get() + r * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += src[d];
    }
  }
}

void moe_unpermute(const Exec&, const Tensor& yp, const Tensor& row_map, const Tensor& gates, Tensor& y,
                   const Tensor* residual) {
  const int64_t tokens = y.size(0), dim = y.size(1), rows = yp.size(0), top_k = gates.size(1);
  const int32_t* pm = row_map.data<int32_t>();
  F32In pyp(yp), pg(gates);
  std::optional<F32In> pres;
  if (residual != nullptr) pres.emplace(*residual);
  F32Out py(y);
  for (int64_t t = 0; t < tokens; ++t) {
    float* dst = py.get() + t * dim;
    std::fill(dst, dst + dim, 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t r = pm[t * top_k + j];
      check_row("moe_unpermute", t * top_k + j, r, rows);
      if (r < 0) continue;
      const float g = pg[t * top_k + j];
      const float* src = pyp.get() + r * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += g * src[d];
    }
    if (pres) {  // after the sum: what a separate add of the residual gives
      const float* res = pres->get() + t * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += res[d];
    }
  }
}

void moe_unpermute_backward(const Exec&, const Tensor& dy, const Tensor& yp, const Tensor& row_map,
                            const Tensor& gates, Tensor& dyp, Tensor& dgates) {
  const int64_t tokens = dy.size(0), dim = dy.size(1), rows = yp.size(0), top_k = gates.size(1);
  const int32_t* pm = row_map.data<int32_t>();
  F32In pdy(dy), pyp(yp), pg(gates);
  F32Out pdyp(dyp), pdg(dgates);
  // Rows no copy maps to (padding beyond the kept copies) get a zero gradient.
  std::fill(pdyp.get(), pdyp.get() + dyp.numel(), 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* dyr = pdy.get() + t * dim;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t r = pm[t * top_k + j];
      check_row("moe_unpermute_backward", t * top_k + j, r, rows);
      if (r < 0) {
        pdg[t * top_k + j] = 0.0f;
        continue;
      }
      const float g = pg[t * top_k + j];
      const float* ypr = pyp.get() + r * dim;
      float* dst = pdyp.get() + r * dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < dim; ++d) {
        dst[d] = g * dyr[d];
        dot += dyr[d] * ypr[d];
      }
      pdg[t * top_k + j] = dot;
    }
  }
}

}  // namespace troupe::kernels::cpu
