// kernels/cuda/moe.cu — MoE routing kernels: the fused router (scores -> top-k -> gates)
// and its backward, the dispatch plan (per-expert counts, offsets and each copy's row,
// computed on the device in a deterministic order), and permute/unpermute with their
// backwards.
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

namespace {

constexpr int kMaxTopK = 16;

__device__ __forceinline__ float sigmoid_exact(float x) { return 1.0f / (1.0f + expf(-x)); }

// One warp per token, for up to 32 * kPer experts: lane l holds experts l, l + 32, ... in
// registers (coalesced loads and stores), the softmax's max and sum are warp reductions,
// and each of the top_k picks is a warp arg-max over (key, index) that prefers the lower
// index on equal keys (the tie rule of the serial kernel below). Lane j keeps pick j and
// writes it. The gates' sum adds the picks in pick order, as the serial kernel does.
constexpr int kRouterWarpTokens = 8;  // tokens (warps) a block
// With statistics each warp takes this many tokens (blocks of 32 tokens), so that the
// finishing kernel sums fewer block partials.
constexpr int kRouterStatsLoop = 4;
constexpr int kRouterStatsMaxExperts = 256;  // the warp kernel's (8 a lane)
template <int kPer, bool kStats>
__global__ void __launch_bounds__(32 * kRouterWarpTokens)
    router_forward_warp_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                               int64_t tokens, int64_t experts, int top_k, bool sigmoid, bool normalize,
                               float* scores, int32_t* topk_idx, float* gates, float* partial) {
  pdl_wait();
  constexpr int kLoop = kStats ? kRouterStatsLoop : 1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // kStats: this block's copies per expert, and each warp's score sums per expert.
  __shared__ int block_counts[kStats ? kRouterStatsMaxExperts : 1];
  __shared__ float warp_sums[kStats ? kRouterWarpTokens : 1][kStats ? 32 * kPer : 1];
  float ssum[kPer];
  if constexpr (kStats) {
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) block_counts[e] = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) ssum[i] = 0.0f;
    __syncthreads();
  }
  for (int r = 0; r < kLoop; ++r) {
    const int64_t t = (int64_t{blockIdx.x} * kLoop + r) * kRouterWarpTokens + warp;
    if (t >= tokens) break;  // the whole warp: t is the warp's
    const float* l = logits + t * experts;
    float v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = lane + 32 * i;
      v[i] = e < experts ? l[e] : -INFINITY;
    }
    if (sigmoid) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[i] = sigmoid_exact(v[i]);  // sigmoid(-inf) = 0: never picked
    } else {
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPer; ++i) m = fmaxf(m, v[i]);
      m = warp_max(m);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        v[i] = expf(v[i] - m);  // 0 past the experts
        sum += v[i];
      }
      const float inv = 1.0f / warp_sum(sum);
#pragma unroll
      for (int i = 0; i < kPer; ++i) v[i] *= inv;
    }
    float key[kPer];
    bool open[kPer];  // an expert of this token, not picked yet
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = lane + 32 * i;
      open[i] = e < experts;
      if (open[i]) {
        scores[t * experts + e] = v[i];
        key[i] = v[i] + (bias != nullptr ? bias[e] : 0.0f);
        if constexpr (kStats) ssum[i] += v[i];
      }
    }
    int32_t mine_idx = 0;
    float mine_val = 0.0f, total = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      // This lane's best untaken expert (its experts ascend with i, so the strict > keeps the
      // lowest index of equal keys), then the warp's.
      float bk = -INFINITY, bv = 0.0f;
      int32_t bi = INT32_MAX;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (open[i] && (bi == INT32_MAX || key[i] > bk)) {
          bk = key[i];
          bv = v[i];
          bi = lane + 32 * i;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ok = __shfl_xor_sync(0xffffffffu, bk, o), ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi != INT32_MAX && (bi == INT32_MAX || ok > bk || (ok == bk && oi < bi))) {
          bk = ok;
          bv = ov;
          bi = oi;
        }
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) open[i] = open[i] && lane + 32 * i != bi;
      if (lane == j) {
        mine_idx = bi;
        mine_val = bv;
      }
      total += bv;
    }
    if (lane < top_k) {
      const bool renorm = normalize || sigmoid;
      topk_idx[t * top_k + lane] = mine_idx;
      gates[t * top_k + lane] = renorm ? mine_val / total : mine_val;
      if constexpr (kStats) atomicAdd(&block_counts[mine_idx], 1);  // integers: any order
    }
  }
  if constexpr (kStats) {
    // The block's partial [counts | score sums] (warps summed in order): one row of
    // `partial`, which router_stats_finish_kernel sums in order.
#pragma unroll
    for (int i = 0; i < kPer; ++i) warp_sums[warp][lane + 32 * i] = ssum[i];
    __syncthreads();
    float* row = partial + int64_t{blockIdx.x} * 2 * experts;
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kRouterWarpTokens; ++w) s += warp_sums[w][e];
      row[e] = static_cast<float>(block_counts[e]);
      row[experts + e] = s;
    }
  }
}

// One block: the router's statistics from the warp kernel's block partials [rows, 2E],
// summed in a fixed order (each thread a column's rows g, g + groups, ...; then the groups
// in order), into counts, score_sums and acc (see RouterStats).
constexpr int kRouterFinishThreads = 512;
__global__ void __launch_bounds__(kRouterFinishThreads)
    router_stats_finish_kernel(const float* partial, int64_t rows, int64_t experts, float* counts,
                               float* score_sums, float* acc, float aux_scale) {
  pdl_wait();
  __shared__ float group_sums[kRouterFinishThreads];
  __shared__ float totals[2 * kRouterStatsMaxExperts];
  const int64_t cols = 2 * experts;  // <= kRouterFinishThreads
  const int64_t groups = kRouterFinishThreads / cols, c = threadIdx.x % cols, g = threadIdx.x / cols;
  float s = 0.0f;
  if (g < groups) {
#pragma unroll 8
    for (int64_t r = g; r < rows; r += groups) s += partial[r * cols + c];
  }
  group_sums[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x < cols) {
    float t = 0.0f;
    for (int64_t gg = 0; gg < groups; ++gg) t += group_sums[gg * cols + threadIdx.x];
    totals[threadIdx.x] = t;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    counts[e] = totals[e];
    if (score_sums != nullptr) score_sums[e] = totals[experts + e];
    if (acc != nullptr) acc[e] += totals[e];
  }
  if (threadIdx.x == 0 && acc != nullptr && score_sums != nullptr) {
    float dot = 0.0f;
    for (int64_t e = 0; e < experts; ++e) dot += totals[e] * totals[experts + e];
    acc[experts] += aux_scale * dot;
  }
}

// More experts than a warp holds: one thread per token, a serial scan per token, and
// selection by repeated arg-max keeps the tie rule (lower index wins) exact.
__global__ void router_forward_kernel(const float* logits, const float* bias, int64_t tokens, int64_t experts,
                                      int top_k, bool sigmoid, bool normalize, float* scores, int32_t* topk_idx,
                                      float* gates) {
  pdl_wait();
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const float* l = logits + t * experts;
  float* s = scores + t * experts;
  if (sigmoid) {
    for (int64_t e = 0; e < experts; ++e) s[e] = sigmoid_exact(l[e]);
  } else {
    float m = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) m = fmaxf(m, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) sum += expf(l[e] - m);
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < experts; ++e) s[e] = expf(l[e] - m) * inv;
  }
  int32_t chosen[kMaxTopK];
  float picked[kMaxTopK];
  float total = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    int32_t best = -1;
    float best_key = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
      if (taken) continue;
      const float key = s[e] + (bias != nullptr ? bias[e] : 0.0f);
      if (best < 0 || key > best_key) {
        best = static_cast<int32_t>(e);
        best_key = key;
      }
    }
    chosen[j] = best;
    picked[j] = s[best];
    total += picked[j];
  }
  const bool renorm = normalize || sigmoid;
  for (int j = 0; j < top_k; ++j) {
    topk_idx[t * top_k + j] = chosen[j];
    gates[t * top_k + j] = renorm ? picked[j] / total : picked[j];
  }
}

// The same statistics for more experts than the warp kernel takes, from the scores and
// picks the serial router kernel wrote: one block, a shared histogram of the picks, each
// thread a column's sum over the tokens in order (slow, but only for > 256 experts).
__global__ void router_stats_serial_kernel(const float* scores, const int32_t* topk_idx, int64_t tokens,
                                           int64_t experts, int top_k, float* counts, float* score_sums,
                                           float* acc, float aux_scale) {
  pdl_wait();
  extern __shared__ int hist[];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < tokens * top_k; i += blockDim.x) atomicAdd(&hist[topk_idx[i]], 1);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    float s = 0.0f;
    for (int64_t t = 0; t < tokens; ++t) s += scores[t * experts + e];
    counts[e] = static_cast<float>(hist[e]);
    if (score_sums != nullptr) score_sums[e] = s;
    if (acc != nullptr) acc[e] += static_cast<float>(hist[e]);
  }
  __syncthreads();
  if (threadIdx.x == 0 && acc != nullptr && score_sums != nullptr) {
    float dot = 0.0f;
    for (int64_t e = 0; e < experts; ++e) dot += counts[e] * score_sums[e];
    acc[experts] += aux_scale * dot;
  }
}

// Gradient with respect to the scores of expert e (selection held constant).
__device__ __forceinline__ float router_dscore(int64_t e, const float* s, const int32_t* idx, const float* dg,
                                               const float* ds, float ds_scale, int top_k, bool renorm,
                                               float total, float gdot) {
  float d = ds != nullptr ? ds_scale * ds[e] : 0.0f;
  for (int j = 0; j < top_k; ++j) {
    if (idx[j] == e) d += renorm ? (dg[j] - gdot) / total : dg[j];
  }
  return d;
}

// One token's view of the router's gradient: its scores, picks, upstream gate gradients and
// score gradient row ([T,E] dscores, or with ds_row the one [E] row every token shares),
// and the picks' total and gate dot, summed in pick order. gate_j = s_j / total: the
// renormalised gates give (dg_j - sum_l dg_l gate_l) / total.
struct RouterGradToken {
  const float* s;
  const int32_t* idx;
  const float* dg;
  const float* ds;
  bool renorm;
  float total = 0.0f, gdot = 0.0f;
  __device__ RouterGradToken(const float* scores, const int32_t* topk_idx, const float* dgates,
                             const float* dscores, bool ds_row, int64_t t, int64_t experts, int top_k,
                             bool renormalised)
      : s(scores + t * experts),
        idx(topk_idx + t * top_k),
        dg(dgates + t * top_k),
        ds(dscores == nullptr ? nullptr
           : ds_row           ? dscores
                              : dscores + t * experts),
        renorm(renormalised) {
    for (int j = 0; j < top_k; ++j) total += s[idx[j]];
    for (int j = 0; j < top_k; ++j) gdot += dg[j] * (s[idx[j]] / total);
  }
};

// dscores: [T,E], or with ds_row one [E] row that every token shares; times ds_scale.
template <typename OutT>
__global__ void router_backward_kernel(const float* scores, const int32_t* topk_idx, const float* dgates,
                                       const float* dscores, bool ds_row, float ds_scale, int64_t tokens,
                                       int64_t experts, int top_k, bool sigmoid, bool normalize,
                                       OutT* dlogits) {
  pdl_wait();
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const RouterGradToken g(scores, topk_idx, dgates, dscores, ds_row, t, experts, top_k, sigmoid || normalize);
  const float *s = g.s, *ds = g.ds, *dg = g.dg;
  const int32_t* idx = g.idx;
  const bool renorm = g.renorm;
  const float total = g.total, gdot = g.gdot;
  OutT* dl = dlogits + t * experts;
  if (sigmoid) {
    for (int64_t e = 0; e < experts; ++e) {
      dl[e] = from_float<OutT>(router_dscore(e, s, idx, dg, ds, ds_scale, top_k, renorm, total, gdot) * s[e] *
                               (1.0f - s[e]));
    }
  } else {
    float dot = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      dot += router_dscore(e, s, idx, dg, ds, ds_scale, top_k, renorm, total, gdot) * s[e];
    }
    for (int64_t e = 0; e < experts; ++e) {
      dl[e] = from_float<OutT>(
          s[e] * (router_dscore(e, s, idx, dg, ds, ds_scale, top_k, renorm, total, gdot) - dot));
    }
  }
}

// The same gradient with a warp per token for up to 32 * kPer experts (lane l holds experts
// l, l + 32, ...): coalesced loads of the scores and stores of dlogits (the thread-per-token
// kernel above stores each row in experts' strides: twice as slow with bf16 dlogits), the
// softmax's dot a warp sum. Every lane computes the gates' total and dot over the top-k
// picks in pick order, as the serial kernel does.
template <int kPer, typename OutT>
__global__ void __launch_bounds__(32 * kRouterWarpTokens)
    router_backward_warp_kernel(const float* __restrict__ scores, const int32_t* __restrict__ topk_idx,
                                const float* __restrict__ dgates, const float* __restrict__ dscores,
                                bool ds_row, float ds_scale, int64_t tokens, int64_t experts, int top_k,
                                bool sigmoid, bool normalize, OutT* dlogits) {
  pdl_wait();
  const int64_t t = int64_t{blockIdx.x} * kRouterWarpTokens + threadIdx.x / 32;
  if (t >= tokens) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const RouterGradToken g(scores, topk_idx, dgates, dscores, ds_row, t, experts, top_k, sigmoid || normalize);
  const float *s = g.s, *ds = g.ds, *dg = g.dg;
  const int32_t* idx = g.idx;
  const bool renorm = g.renorm;
  const float total = g.total, gdot = g.gdot;
  float sv[kPer], d[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t e = lane + 32 * i;
    sv[i] = e < experts ? s[e] : 0.0f;
    d[i] = e < experts && ds != nullptr ? ds_scale * ds[e] : 0.0f;
  }
  for (int j = 0; j < top_k; ++j) {
    const int32_t e = idx[j];
    const float add = renorm ? (dg[j] - gdot) / total : dg[j];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (lane + 32 * i == e) d[i] += add;
    }
  }
  OutT* dl = dlogits + t * experts;
  if (sigmoid) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = lane + 32 * i;
      if (e < experts) dl[e] = from_float<OutT>(d[i] * sv[i] * (1.0f - sv[i]));
    }
  } else {
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) dot += d[i] * sv[i];  // 0 past the experts
    dot = warp_sum(dot);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = lane + 32 * i;
      if (e < experts) dl[e] = from_float<OutT>(sv[i] * (d[i] - dot));
    }
  }
}

// ---- row log-sum-exp (the router z-loss) ---------------------------------------------
// One warp per row: the running maximum and rescaled sum over the row's columns, then the
// warp's reductions (a fixed order: runs are bit-identical).
constexpr int kLseWarps = 8;

__device__ __forceinline__ float row_lse_warp(const float* r, int64_t cols, int lane) {
  float m = -INFINITY, s = 0.f;
  for (int64_t j = lane; j < cols; j += 32) {
    const float v = r[j];
    if (v > m) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  const float wm = warp_max(m);
  s = m == -INFINITY ? 0.f : s * expf(m - wm);
  s = warp_sum(s);
  return wm + logf(s);
}

__global__ void __launch_bounds__(32 * kLseWarps)
    logsumexp_forward_kernel(const float* x, int64_t rows, int64_t cols, float* lse) {
  pdl_wait();
  const int lane = threadIdx.x % 32;
  const int64_t t = int64_t{blockIdx.x} * kLseWarps + threadIdx.x / 32;
  if (t >= rows) return;
  const float l = row_lse_warp(x + t * cols, cols, lane);
  if (lane == 0) lse[t] = l;
}

__global__ void logsumexp_backward_kernel(const float* x, const float* lse, const float* dlse, float scale,
                                          int64_t rows, int64_t cols, float* dx) {
  pdl_wait();
  const int64_t n = rows * cols;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / cols;
    dx[i] += scale * dlse[t] * expf(x[i] - lse[t]);
  }
}

// ---- dispatch plan: three deterministic passes over chunks of copies -----------------
constexpr int kPlanChunk = 2048;
constexpr int kPlanThreads = 256;

// chunk_counts[c, e] = copies of expert e in chunk c.
__global__ void plan_count_kernel(const int32_t* idx, int64_t copies, int64_t experts, int32_t* chunk_counts) {
  pdl_wait();
  extern __shared__ int32_t counts[];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t c0 = int64_t{blockIdx.x} * kPlanChunk;
  const int64_t c1 = min64(copies, c0 + kPlanChunk);
  for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
    const int32_t e = idx[i];
    if (e < 0 || e >= experts) {
      printf("moe_dispatch_plan: expert index %d out of range [0, %lld)\n", e, static_cast<long long>(experts));
      __trap();
    }
    atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) chunk_counts[int64_t{blockIdx.x} * experts + e] = counts[e];
}

// One block: chunk_base[c, e] = copies of e before chunk c; counts and offsets.
__global__ void plan_scan_kernel(int32_t* chunk_counts, int64_t chunks, int64_t experts, int64_t capacity,
                                 int32_t* counts, int32_t* offsets) {
  pdl_wait();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t n = chunk_counts[c * experts + e];
      chunk_counts[c * experts + e] = run;  // now the base
      run += n;
    }
    counts[e] = capacity < 0 ? run : static_cast<int32_t>(min64(run, capacity));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t off = 0;
    for (int64_t e = 0; e < experts; ++e) {
      offsets[e] = off;
      off += counts[e];
    }
    offsets[experts] = off;
  }
}

// Thread e of block c walks chunk c in order and numbers the copies of expert e.
__global__ void plan_assign_kernel(const int32_t* idx, int64_t copies, int64_t experts, int64_t capacity,
                                   const int32_t* chunk_base, const int32_t* offsets, int32_t* row_map) {
  pdl_wait();
  extern __shared__ int32_t chunk[];
  const int64_t c0 = int64_t{blockIdx.x} * kPlanChunk;
  const int64_t n = min64(copies, c0 + kPlanChunk) - c0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = idx[c0 + i];
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t rank = chunk_base[int64_t{blockIdx.x} * experts + e];
    const int32_t base = offsets[e];
    for (int64_t i = 0; i < n; ++i) {
      if (chunk[i] != e) continue;
      row_map[c0 + i] = (capacity < 0 || rank < capacity) ? base + rank : -1;
      ++rank;
    }
  }
}

// The same numbering, parallel (up to kPlanRankExperts experts): the chunk is taken in
// rounds of blockDim copies in order, thread i of a round taking its i-th copy, whose rank
// among the chunk's copies of its expert is: the chunk's base, plus the copies of that
// expert in earlier rounds (running), in earlier warps of this round (warp_counts) and in
// earlier lanes of its warp (__match_any_sync). plan_assign_kernel walked the chunk once
// per expert, one thread each: 34 us of serial loads per bench_1b layer on an H100.
constexpr int kPlanRankExperts = 256;
__global__ void __launch_bounds__(kPlanThreads)
    plan_assign_ranked_kernel(const int32_t* idx, int64_t copies, int64_t experts, int64_t capacity,
                              const int32_t* chunk_base, const int32_t* offsets, int32_t* row_map) {
  pdl_wait();
  constexpr int kWarps = kPlanThreads / 32;
  __shared__ int32_t warp_counts[kWarps][kPlanRankExperts];
  __shared__ int32_t running[kPlanRankExperts];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c0 = int64_t{blockIdx.x} * kPlanChunk;
  const int64_t n = min64(copies, c0 + kPlanChunk) - c0;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    running[e] = chunk_base[int64_t{blockIdx.x} * experts + e];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) warp_counts[w][e] = 0;
  }
  __syncthreads();
  for (int64_t r0 = 0; r0 < n; r0 += blockDim.x) {
    const int64_t i = r0 + threadIdx.x;
    const bool live = i < n;
    const int32_t e = live ? idx[c0 + i] : -1;  // (-1: no expert's key)
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int below = __popc(peers & ((1u << lane) - 1u));
    if (live && below == 0) warp_counts[warp][e] = __popc(peers);
    __syncthreads();
    if (live) {
      int32_t rank = running[e] + below;
      for (int w = 0; w < warp; ++w) rank += warp_counts[w][e];
      row_map[c0 + i] = (capacity < 0 || rank < capacity) ? offsets[e] + rank : -1;
    }
    __syncthreads();
    for (int64_t x = threadIdx.x; x < experts; x += blockDim.x) {
      int32_t add = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        add += warp_counts[w][x];
        warp_counts[w][x] = 0;
      }
      running[x] += add;
    }
    __syncthreads();
  }
}

// ---- permutation ----------------------------------------------------------------------
// Rows move as V-element packs (V = 8 when the row length and pointers allow 16-byte
// bf16 accesses, else 1).
// One block per token: its row is read once and written to each of its top_k copies' rows
// (one block per copy read every row top_k times: 0.046 ms on bench_1b's 16384 x 1024, k 2,
// 51% of copy bandwidth on an H200).
template <int V, typename T>
__global__ void permute_kernel(const T* x, int64_t d, const int32_t* row_map, int64_t top_k, T* xp) {
  pdl_wait();
  const int64_t t = blockIdx.x;
  const T* src = x + t * d;
  for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
    const Pack<T, V> v = *reinterpret_cast<const Pack<T, V>*>(src + c);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = row_map[t * top_k + j];
      if (row >= 0) *reinterpret_cast<Pack<T, V>*>(xp + int64_t{row} * d + c) = v;
    }
  }
}

template <int V, typename T>
__global__ void permute_backward_kernel(const T* dxp, const int32_t* row_map, int64_t top_k, int64_t d, T* dx) {
  pdl_wait();
  const int64_t t = blockIdx.x;
  for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
    float acc[V] = {};
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = row_map[t * top_k + j];
      if (row < 0) continue;
      float v[V];
      load_floats<V>(dxp + int64_t{row} * d + c, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += v[i];
    }
    store_floats<V>(dx + t * d + c, acc);
  }
}

// residual (or null) is added after the sum, in f32, before the one rounding into y.
template <int V, typename T, typename G>
__global__ void unpermute_kernel(const T* yp, const int32_t* row_map, const G* gates, int64_t top_k,
                                 int64_t d, T* y, const T* residual) {
  pdl_wait();
  const int64_t t = blockIdx.x;
  for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
    float acc[V] = {};
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = row_map[t * top_k + j];
      if (row < 0) continue;
      const float g = to_float(gates[t * top_k + j]);
      float v[V];
      load_floats<V>(yp + int64_t{row} * d + c, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += g * v[i];
    }
    if (residual != nullptr) {
      float r[V];
      load_floats<V>(residual + t * d + c, r);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += r[i];
    }
    store_floats<V>(y + t * d + c, acc);
  }
}

// V = 8 where rows_packable (16-byte packs), else 1: each thread V elements of the row at a time.
template <int V, typename T, typename G>
__global__ void unpermute_backward_kernel(const T* dy, const T* yp, const int32_t* row_map, const G* gates,
                                          int64_t top_k, int64_t d, T* dyp, G* dgates) {
  pdl_wait();
  __shared__ float shared[32];
  const int64_t t = blockIdx.x;
  for (int64_t j = 0; j < top_k; ++j) {
    const int32_t row = row_map[t * top_k + j];
    if (row < 0) {  // uniform across the block
      if (threadIdx.x == 0) dgates[t * top_k + j] = from_float<G>(0.0f);
      continue;
    }
    const float g = to_float(gates[t * top_k + j]);
    float dot = 0.0f;
    for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
      float v[V], y[V];
      load_floats<V>(dy + t * d + c, v);
      load_floats<V>(yp + int64_t{row} * d + c, y);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        dot += v[i] * y[i];
        v[i] *= g;
      }
      store_floats<V>(dyp + int64_t{row} * d + c, v);
    }
    dot = block_sum(dot, shared);
    if (threadIdx.x == 0) dgates[t * top_k + j] = from_float<G>(dot);
  }
}

template <typename T>
bool rows_packable(int64_t d, std::initializer_list<const void*> ptrs) {
  if (d % 8 != 0) return false;
  for (const void* p : ptrs) {
    if (!aligned_to(p, 8 * sizeof(T))) return false;
  }
  return true;
}

unsigned row_threads(int64_t d) { return d >= 1024 ? 256 : 128; }

}  // namespace

namespace {
// Calls f with std::integral_constant<int, kPer>, the experts a lane holds in the router's
// warp kernels (1, 2, 4 or 8: up to 256 experts); false (f not called) beyond.
template <typename F>
bool with_router_lanes(int64_t experts, F&& f) {
  if (experts <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (experts <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (experts <= 128) {
    f(std::integral_constant<int, 4>{});
  } else if (experts <= 256) {
    f(std::integral_constant<int, 8>{});
  } else {
    return false;
  }
  return true;
}
}  // namespace

size_t router_stats_scratch_bytes(int64_t tokens, int64_t experts) {
  const int64_t blocks = ceil_div(max64(tokens, 1), int64_t{kRouterWarpTokens} * kRouterStatsLoop);
  return static_cast<size_t>(blocks * 2 * experts) * sizeof(float);
}

void launch_router_forward(const Env& env, const float* logits, const float* bias, int64_t tokens,
                           int64_t experts, int top_k, bool sigmoid, bool normalize, float* scores,
                           int32_t* topk_idx, float* gates, const RouterStatsArgs* stats, void* scratch) {
  TROUPE_CHECK(top_k >= 1 && top_k <= kMaxTopK && top_k <= experts, "router_forward on cuda: top_k {} with {} experts",
               top_k, experts);
  if (stats != nullptr && experts > kRouterStatsMaxExperts) {
    launch_router_forward(env, logits, bias, tokens, experts, top_k, sigmoid, normalize, scores, topk_idx,
                          gates);
    const size_t smem = static_cast<size_t>(experts) * sizeof(int);
    TROUPE_CHECK(smem <= 48 * 1024, "router_forward on cuda: statistics for at most 12288 experts, got {}",
                 experts);
    launch(env, router_stats_serial_kernel, 1, 1024, smem, static_cast<const float*>(scores),
           static_cast<const int32_t*>(topk_idx), tokens, experts, top_k, stats->counts, stats->score_sums,
           stats->acc, stats->aux_scale);
    TROUPE_CUDA_LAUNCH_CHECK();
    return;
  }
  if (stats != nullptr) {
    TROUPE_CHECK(scratch != nullptr && stats->counts != nullptr,
                 "router_forward on cuda: statistics need scratch");
    auto* partial = static_cast<float*>(scratch);
    const int64_t blocks = ceil_div(max64(tokens, 1), int64_t{kRouterWarpTokens} * kRouterStatsLoop);
    auto warp = [&](auto kernel) {
      launch(env, kernel, static_cast<unsigned>(blocks), 32 * kRouterWarpTokens, 0, logits, bias, tokens,
             experts, top_k, sigmoid, normalize, scores, topk_idx, gates, partial);
    };
    with_router_lanes(experts,
                      [&](auto per) { warp(router_forward_warp_kernel<decltype(per)::value, true>); });
    TROUPE_CUDA_LAUNCH_CHECK();
    launch(env, router_stats_finish_kernel, 1, kRouterFinishThreads, 0, static_cast<const float*>(partial),
           blocks, experts, stats->counts, stats->score_sums, stats->acc, stats->aux_scale);
    TROUPE_CUDA_LAUNCH_CHECK();
    return;
  }
  if (tokens == 0) return;
  auto warp = [&](auto kernel) {
    launch(env, kernel, static_cast<unsigned>(ceil_div(tokens, int64_t{kRouterWarpTokens})),
           32 * kRouterWarpTokens, 0, logits, bias, tokens, experts, top_k, sigmoid, normalize, scores,
           topk_idx, gates, static_cast<float*>(nullptr));
  };
  if (!with_router_lanes(experts,
                         [&](auto per) { warp(router_forward_warp_kernel<decltype(per)::value, false>); })) {
    launch(env, router_forward_kernel, static_cast<unsigned>(ceil_div(tokens, 128)), 128, 0, logits, bias,
           tokens, experts, top_k, sigmoid, normalize, scores, topk_idx, gates);
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_router_backward(const Env& env, const float* scores, const int32_t* topk_idx, const float* dgates,
                            const float* dscores, bool dscores_row, float dscores_scale, int64_t tokens,
                            int64_t experts, int top_k, bool sigmoid, bool normalize, void* dlogits,
                            DType dlogits_type) {
  if (tokens == 0) return;
  TROUPE_CHECK(dlogits_type == DType::kF32 || dlogits_type == DType::kBF16,
               "router_backward on cuda: dlogits must be f32 or bf16, not {}", dtype_name(dlogits_type));
  auto run = [&](auto* out) {
    using OutT = std::remove_pointer_t<decltype(out)>;
    auto warp = [&](auto kernel) {
      launch(env, kernel, static_cast<unsigned>(ceil_div(tokens, int64_t{kRouterWarpTokens})),
             32 * kRouterWarpTokens, 0, scores, topk_idx, dgates, dscores, dscores_row, dscores_scale, tokens,
             experts, top_k, sigmoid, normalize, out);
    };
    if (!with_router_lanes(
            experts, [&](auto per) { warp(router_backward_warp_kernel<decltype(per)::value, OutT>); })) {
      launch(env, router_backward_kernel<OutT>, static_cast<unsigned>(ceil_div(tokens, 128)), 128, 0, scores,
             topk_idx, dgates, dscores, dscores_row, dscores_scale, tokens, experts, top_k, sigmoid,
             normalize, out);
    }
  };
  if (dlogits_type == DType::kBF16) {
    run(static_cast<__nv_bfloat16*>(dlogits));
  } else {
    run(static_cast<float*>(dlogits));
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_logsumexp_forward(const Env& env, const float* x, int64_t rows, int64_t cols, float* lse) {
  if (rows == 0) return;
  launch(env, logsumexp_forward_kernel, static_cast<unsigned>(ceil_div(rows, kLseWarps)), 32 * kLseWarps, 0,
         x, rows, cols, lse);
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_logsumexp_backward(const Env& env, const float* x, const float* lse, const float* dlse,
                               float scale, int64_t rows, int64_t cols, float* dx) {
  if (rows * cols == 0) return;
  launch(env, logsumexp_backward_kernel, grid_for(rows * cols, 256, env.num_sms), 256, 0, x, lse, dlse, scale,
         rows, cols, dx);
  TROUPE_CUDA_LAUNCH_CHECK();
}

size_t dispatch_plan_scratch_bytes(int64_t copies, int64_t experts) {
  return static_cast<size_t>(max64(1, ceil_div(copies, kPlanChunk)) * experts) * sizeof(int32_t);
}

void launch_moe_dispatch_plan(const Env& env, const int32_t* topk_idx, int64_t copies, int64_t experts,
                              int64_t capacity, int32_t* row_map, int32_t* counts, int32_t* offsets, void* scratch) {
  const int64_t chunks = ceil_div(copies, kPlanChunk);
  auto* chunk_counts = static_cast<int32_t*>(scratch);
  const size_t count_smem = static_cast<size_t>(experts) * sizeof(int32_t);
  TROUPE_CHECK(count_smem <= 48 * 1024, "moe_dispatch_plan on cuda: at most 12288 experts, got {}", experts);
  if (chunks > 0) {
    launch(env, plan_count_kernel, static_cast<unsigned>(chunks), kPlanThreads, count_smem, topk_idx, copies,
           experts, chunk_counts);
    TROUPE_CUDA_LAUNCH_CHECK();
  }
  launch(env, plan_scan_kernel, 1, 1024, 0, chunk_counts, chunks, experts, capacity, counts, offsets);
  TROUPE_CUDA_LAUNCH_CHECK();
  if (chunks > 0 && experts <= kPlanRankExperts) {
    launch(env, plan_assign_ranked_kernel, static_cast<unsigned>(chunks), kPlanThreads, 0, topk_idx, copies,
           experts, capacity, chunk_counts, offsets, row_map);
    TROUPE_CUDA_LAUNCH_CHECK();
  } else if (chunks > 0) {
    launch(env, plan_assign_kernel, static_cast<unsigned>(chunks), kPlanThreads, kPlanChunk * sizeof(int32_t),
           topk_idx, copies, experts, capacity, chunk_counts, offsets, row_map);
    TROUPE_CUDA_LAUNCH_CHECK();
  }
}

void launch_moe_permute(const Env& env, const void* x, int64_t tokens, int64_t d, const int32_t* row_map,
                        int64_t top_k, void* xp, DType t) {
  if (tokens * top_k == 0) return;
  TROUPE_DISPATCH_FLOAT(t, T, "moe_permute", {
    const auto* xs = static_cast<const T*>(x);
    auto* xd = static_cast<T*>(xp);
    const auto grid = static_cast<unsigned>(tokens);
    if (rows_packable<T>(d, {x, xp})) {
      launch(env, permute_kernel<8, T>, grid, 128, 0, xs, d, row_map, top_k, xd);
    } else {
      launch(env, permute_kernel<1, T>, grid, row_threads(d), 0, xs, d, row_map, top_k, xd);
    }
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_moe_permute_backward(const Env& env, const void* dxp, const int32_t* row_map, int64_t tokens,
                                 int64_t top_k, int64_t d, void* dx, DType t) {
  if (tokens == 0) return;
  TROUPE_DISPATCH_FLOAT(t, T, "moe_permute_backward", {
    const auto* src = static_cast<const T*>(dxp);
    auto* dst = static_cast<T*>(dx);
    if (rows_packable<T>(d, {dxp, dx})) {
      launch(env, permute_backward_kernel<8, T>, static_cast<unsigned>(tokens), 128, 0, src, row_map, top_k,
             d, dst);
    } else {
      launch(env, permute_backward_kernel<1, T>, static_cast<unsigned>(tokens), row_threads(d), 0, src,
             row_map, top_k, d, dst);
    }
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_moe_unpermute(const Env& env, const void* yp, const int32_t* row_map, const void* gates, DType gt,
                          int64_t tokens, int64_t top_k, int64_t d, void* y, DType t, const void* residual) {
  if (tokens == 0) return;
  TROUPE_DISPATCH_FLOAT(t, T, "moe_unpermute", TROUPE_DISPATCH_FLOAT(gt, G, "moe_unpermute", {
    const auto* src = static_cast<const T*>(yp);
    const auto* gp = static_cast<const G*>(gates);
    const auto* res = static_cast<const T*>(residual);
    auto* dst = static_cast<T*>(y);
    if (rows_packable<T>(d, {yp, y}) && rows_packable<T>(d, {residual != nullptr ? residual : y})) {
      launch(env, unpermute_kernel<8, T, G>, static_cast<unsigned>(tokens), 128, 0, src, row_map, gp, top_k,
             d, dst, res);
    } else {
      launch(env, unpermute_kernel<1, T, G>, static_cast<unsigned>(tokens), row_threads(d), 0, src, row_map,
             gp, top_k, d, dst, res);
    }
  }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_moe_unpermute_backward(const Env& env, const void* dy, const void* yp, const int32_t* row_map,
                                   const void* gates, DType gt, int64_t tokens, int64_t top_k, int64_t d, void* dyp,
                                   void* dgates, DType t) {
  if (tokens == 0) return;
  TROUPE_DISPATCH_FLOAT(
      t, T, "moe_unpermute_backward", TROUPE_DISPATCH_FLOAT(gt, G, "moe_unpermute_backward", {
        if (rows_packable<T>(d, {dy, yp, dyp})) {
          const int64_t threads = std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(d / 8, 32) * 32));
          launch(env, unpermute_backward_kernel<8, T, G>, static_cast<unsigned>(tokens),
                 static_cast<unsigned>(threads), 0, static_cast<const T*>(dy), static_cast<const T*>(yp),
                 row_map, static_cast<const G*>(gates), top_k, d, static_cast<T*>(dyp),
                 static_cast<G*>(dgates));
        } else {
          launch(env, unpermute_backward_kernel<1, T, G>, static_cast<unsigned>(tokens), row_threads(d), 0,
                 static_cast<const T*>(dy), static_cast<const T*>(yp), row_map, static_cast<const G*>(gates),
                 top_k, d, static_cast<T*>(dyp), static_cast<G*>(dgates));
        }
      }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace troupe::kernels::gpu
