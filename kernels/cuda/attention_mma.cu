// kernels/cuda/attention_mma.cu — the tensor-core attention kernels used for bf16 tensors
// with head dim 64 or 128 where the Hopper kernels (attention_hopper.cu) do not run, and
// the dispatch between the two (attention.cu keeps the fp32 path for everything else).
//
// Flash-attention-2 structure on mma.sync m16n8k16 (bf16 in, fp32 accumulate): a block
// of 4 warps owns 64 rows (queries for forward and dQ, keys for dK/dV), each warp 16 of
// them, with its operand rows held as A fragments in registers. The other operand streams
// through shared memory in 64-row tiles. Score accumulators are reused directly as the A
// fragments of the next product (P·V, dS·K, P^T·dO, dS^T·Q), so S x S never leaves
// registers; B fragments come from shared memory as 32-bit loads (row-major operand) or
// ldmatrix.trans (when the product needs the tile transposed). Softmax is online in log2
// units; lse is saved in natural-log units [B,Hq,S].
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

// attention.cu: D = rowsum(dO * O) into dsum [B,Hq,S].
void launch_attention_rowdot(const Env& env, const AttentionShape& s, const void* out, const void* dout, float* dsum,
                             DType t);
// attention_hopper.cu: the sm_90a kernels.
void launch_attention_forward_hopper(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                     const void* v, float scale, void* out, float* lse, bool two_warpgroups);
// Returns whether dq and dk were rotated back (rope given and the fused kernel ran).
bool launch_attention_backward_hopper(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                      const void* v, const void* out, const float* lse, const void* dout,
                                      float scale, void* dq, void* dk, void* dv, void* scratch, bool fused_dq,
                                      const AttentionRope* rope);

namespace {

using bf16 = __nv_bfloat16;
constexpr int kRows = 64;  // rows of a streamed tile (K/V, Q/dO) in shared memory
constexpr float kLog2eF = 1.4426950408889634f;
constexpr float kLn2F = 0.6931471805599453f;

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1, const bf16* p) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t ld32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A fragments (16 rows x kD) of rows [r0, r0+16) of a [B,S,H,kD] tensor at (b, h); rows
// past S are zero.
template <int kD>
__device__ void load_a_frags(uint32_t (&f)[kD / 16][4], const bf16* base, int64_t b, int64_t r0, int64_t h,
                             int64_t seq, int64_t heads) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t ra = r0 + g, rb = r0 + g + 8;
  const bf16* pa = base + ((b * seq + ra) * heads + h) * kD;
  const bf16* pb = base + ((b * seq + rb) * heads + h) * kD;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const int c = kk * 16 + 2 * t;
    f[kk][0] = ra < seq ? ld32(pa + c) : 0u;
    f[kk][1] = rb < seq ? ld32(pb + c) : 0u;
    f[kk][2] = ra < seq ? ld32(pa + c + 8) : 0u;
    f[kk][3] = rb < seq ? ld32(pb + c + 8) : 0u;
  }
}

// Rows [r0, r0+64) of two [B,S,H,kD] tensors x and y at (b, h), staged through registers
// into smem [64][kD+8] each (16-byte moves; rows past S are zero), by kThreads threads.
// fetch() issues every load of both tiles before any store (a loop of load-store pairs
// would wait for each load in turn), and with kPrefetchTiles the kernels fetch the next
// tile before computing on the current one, so the loads overlap the tensor-core work.
// Head dim 64 prefetches the next tile during the current one's math; 128 has no
// registers to spare for that (it would spill) and loads each tile just before use.
template <int kD>
constexpr bool kPrefetchTiles = kD == 64;

template <int kD, int kThreads>
struct TilePair {
  static constexpr int kVecPerRow = kD / 8, kLd = kD + 8, kIters = kRows * kVecPerRow / kThreads;
  static_assert(kRows * kVecPerRow % kThreads == 0, "whole 16-byte vectors per thread");
  uint4 vx[kIters], vy[kIters];

  __device__ __forceinline__ void fetch(const bf16* x, const bf16* y, int64_t b, int64_t r0, int64_t h, int64_t seq,
                                        int64_t heads) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = it * kThreads + static_cast<int>(threadIdx.x);
      const int r = i / kVecPerRow, c = (i % kVecPerRow) * 8;
      const int64_t gr = r0 + r;
      vx[it] = vy[it] = make_uint4(0, 0, 0, 0);
      if (gr < seq) {
        const int64_t off = ((b * seq + gr) * heads + h) * kD + c;
        vx[it] = *reinterpret_cast<const uint4*>(x + off);
        vy[it] = *reinterpret_cast<const uint4*>(y + off);
      }
    }
  }
  __device__ __forceinline__ void put(bf16* dx, bf16* dy) const {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = it * kThreads + static_cast<int>(threadIdx.x);
      const int r = i / kVecPerRow, c = (i % kVecPerRow) * 8;
      *reinterpret_cast<uint4*>(dx + r * kLd + c) = vx[it];
      *reinterpret_cast<uint4*>(dy + r * kLd + c) = vy[it];
    }
  }
};

// acc[j] (16 x 8, j over 8 column tiles of 64 tile rows) += A (16 x kD) @ tile^T, where the
// tile is [64][kD] row-major: B(k = d, n = tile row) = tile[n][d].
template <int kD>
__device__ __forceinline__ void mma_a_tileT(float (&acc)[8][4], const uint32_t (&a)[kD / 16][4], const bf16* tile) {
  constexpr int kLd = kD + 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bf16* p = tile + (j * 8 + g) * kLd + kk * 16 + 2 * t;
      mma16816(acc[j], a[kk], ld32(p), ld32(p + 8));
    }
  }
}

// out[n] (16 x 8, n over kD/8 column tiles) += P (16 x 64, from score accumulators) @ tile,
// the tile [64][kD] row-major: B(k = tile row, n = d) via ldmatrix.trans.
template <int kD>
__device__ __forceinline__ void mma_p_tile(float (&out)[kD / 8][4], const float (&p)[8][4], const bf16* tile) {
  constexpr int kLd = kD + 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t a[4];
    a[0] = pack2(p[2 * c][0], p[2 * c][1]);
    a[1] = pack2(p[2 * c][2], p[2 * c][3]);
    a[2] = pack2(p[2 * c + 1][0], p[2 * c + 1][1]);
    a[3] = pack2(p[2 * c + 1][2], p[2 * c + 1][3]);
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      uint32_t b0, b1;
      ldmatrix_x2_trans(b0, b1, tile + (c * 16 + (lane % 16)) * kLd + n * 8);
      mma16816(out[n], a, b0, b1);
    }
  }
}

template <int kD>
__device__ void store_rows(bf16* base, const float (&acc)[kD / 8][4], float mul_lo, float mul_hi, int64_t b,
                           int64_t r0, int64_t h, int64_t seq, int64_t heads) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t ra = r0 + g, rb = r0 + g + 8;
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
    const int c = n * 8 + 2 * t;
    if (ra < seq) {
      *reinterpret_cast<uint32_t*>(base + ((b * seq + ra) * heads + h) * kD + c) =
          pack2(acc[n][0] * mul_lo, acc[n][1] * mul_lo);
    }
    if (rb < seq) {
      *reinterpret_cast<uint32_t*>(base + ((b * seq + rb) * heads + h) * kD + c) =
          pack2(acc[n][2] * mul_hi, acc[n][3] * mul_hi);
    }
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_add(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// grid (ceil(S/(16*kWarps)), Hq, B); late (heavier) query tiles are scheduled first.
template <int kD, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) attention_forward_mma_kernel(AttentionShape s, const bf16* q,
                                                                            const bf16* k, const bf16* v,
                                                                            float scale_log2, bf16* out, float* lse) {
  pdl_wait();
  constexpr int kLd = kD + 8;
  __shared__ __align__(16) bf16 ks[kRows * kLd];
  __shared__ __align__(16) bf16 vs[kRows * kLd];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (s.q_heads / s.kv_heads);
  const int64_t tile = gridDim.x - 1 - blockIdx.x;
  const int64_t qw = tile * 16 * kWarps + warp * 16;  // this warp's first query
  uint32_t qf[kD / 16][4];
  load_a_frags<kD>(qf, q, b, qw, h, s.seq, s.q_heads);
  float o[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int64_t kv_end = min64(s.seq, (tile + 1) * 16 * kWarps);
  TilePair<kD, 32 * kWarps> tiles;
  if constexpr (kPrefetchTiles<kD>) tiles.fetch(k, v, b, 0, hk, s.seq, s.kv_heads);
  for (int64_t k0 = 0; k0 < kv_end; k0 += kRows) {
    __syncthreads();
    if constexpr (!kPrefetchTiles<kD>) tiles.fetch(k, v, b, k0, hk, s.seq, s.kv_heads);
    tiles.put(ks, vs);
    __syncthreads();
    if constexpr (kPrefetchTiles<kD>) {
      if (k0 + kRows < kv_end) tiles.fetch(k, v, b, k0 + kRows, hk, s.seq, s.kv_heads);
    }
    if (k0 > qw + 15) continue;  // every key of this tile is after every query of this warp
    float sc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
    mma_a_tileT<kD>(sc, qf, ks);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t key = k0 + j * 8 + 2 * t + (r & 1), row = qw + g + (r >= 2 ? 8 : 0);
        const float x = (key <= row && key < s.seq) ? sc[j][r] * scale_log2 : -INFINITY;
        sc[j][r] = x;
        mx[r >> 1] = fmaxf(mx[r >> 1], x);
      }
    }
    float corr[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float nm = fmaxf(m[i], quad_max(mx[i]));
      base[i] = nm == -INFINITY ? 0.0f : nm;  // fully masked so far: keep exp2 finite
      corr[i] = exp2f(m[i] - base[i]);
      m[i] = nm;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float p = exp2f(sc[j][r] - base[r >> 1]);
        sc[j][r] = p;
        sum[r >> 1] += p;
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * corr[i] + quad_add(sum[i]);
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][0] *= corr[0];
      o[n][1] *= corr[0];
      o[n][2] *= corr[1];
      o[n][3] *= corr[1];
    }
    mma_p_tile<kD>(o, sc, vs);
  }
  const float inv0 = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv1 = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
  store_rows<kD>(out, o, inv0, inv1, b, qw, h, s.seq, s.q_heads);
  if (t == 0) {
    const int64_t ra = qw + g, rb = qw + g + 8;
    if (ra < s.seq) lse[(b * s.q_heads + h) * s.seq + ra] = (m[0] + log2f(l[0])) * kLn2F;
    if (rb < s.seq) lse[(b * s.q_heads + h) * s.seq + rb] = (m[1] + log2f(l[1])) * kLn2F;
  }
}

// grid (ceil(S/(16*kWarps)), Hq, B): dQ for 16*kWarps queries.
template <int kD, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) attention_dq_mma_kernel(AttentionShape s, const bf16* q, const bf16* k,
                                                                       const bf16* v, const float* lse,
                                                                       const bf16* dout, const float* dsum,
                                                                       float scale, bf16* dq) {
  pdl_wait();
  constexpr int kLd = kD + 8;
  __shared__ __align__(16) bf16 ks[kRows * kLd];
  __shared__ __align__(16) bf16 vs[kRows * kLd];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (s.q_heads / s.kv_heads);
  const int64_t tile = gridDim.x - 1 - blockIdx.x;
  const int64_t qw = tile * 16 * kWarps + warp * 16;
  const float scale_log2 = scale * kLog2eF;
  uint32_t qf[kD / 16][4], df[kD / 16][4];
  load_a_frags<kD>(qf, q, b, qw, h, s.seq, s.q_heads);
  load_a_frags<kD>(df, dout, b, qw, h, s.seq, s.q_heads);
  float lse2[2], dd[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = qw + g + 8 * i;
    const int64_t idx = (b * s.q_heads + h) * s.seq + (row < s.seq ? row : 0);
    lse2[i] = lse[idx] * kLog2eF;
    dd[i] = dsum[idx];
  }
  float acc[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const int64_t kv_end = min64(s.seq, (tile + 1) * 16 * kWarps);
  TilePair<kD, 32 * kWarps> tiles;
  if constexpr (kPrefetchTiles<kD>) tiles.fetch(k, v, b, 0, hk, s.seq, s.kv_heads);
  for (int64_t k0 = 0; k0 < kv_end; k0 += kRows) {
    __syncthreads();
    if constexpr (!kPrefetchTiles<kD>) tiles.fetch(k, v, b, k0, hk, s.seq, s.kv_heads);
    tiles.put(ks, vs);
    __syncthreads();
    if constexpr (kPrefetchTiles<kD>) {
      if (k0 + kRows < kv_end) tiles.fetch(k, v, b, k0 + kRows, hk, s.seq, s.kv_heads);
    }
    if (k0 > qw + 15) continue;
    float sc[8][4], dp[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) sc[j][r] = dp[j][r] = 0.0f;
    }
    mma_a_tileT<kD>(sc, qf, ks);
    mma_a_tileT<kD>(dp, df, vs);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t key = k0 + j * 8 + 2 * t + (r & 1), row = qw + g + (r >= 2 ? 8 : 0);
        const float p = (key <= row && key < s.seq) ? exp2f(sc[j][r] * scale_log2 - lse2[r >> 1]) : 0.0f;
        sc[j][r] = p * (dp[j][r] - dd[r >> 1]);  // dS
      }
    }
    mma_p_tile<kD>(acc, sc, ks);
  }
  store_rows<kD>(dq, acc, scale, scale, b, qw, h, s.seq, s.q_heads);
}

// grid (ceil(S/(16*kWarps)), Hkv, B): dK and dV for 16*kWarps keys, summed over the
// group's query heads.
template <int kD, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) attention_dkdv_mma_kernel(AttentionShape s, const bf16* q,
                                                                         const bf16* k, const bf16* v,
                                                                         const float* lse, const bf16* dout,
                                                                         const float* dsum, float scale, bf16* dk,
                                                                         bf16* dv) {
  pdl_wait();
  constexpr int kLd = kD + 8;
  __shared__ __align__(16) bf16 qs[kRows * kLd];
  __shared__ __align__(16) bf16 dos[kRows * kLd];
  __shared__ float lse2s[kRows], dds[kRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.z, hk = blockIdx.y, group = s.q_heads / s.kv_heads;
  const int64_t tile = gridDim.x - 1 - blockIdx.x;
  const int64_t k_blk = tile * 16 * kWarps, kw = k_blk + warp * 16;  // this warp's first key
  const float scale_log2 = scale * kLog2eF;
  uint32_t kf[kD / 16][4], vf[kD / 16][4];
  load_a_frags<kD>(kf, k, b, kw, hk, s.seq, s.kv_heads);
  load_a_frags<kD>(vf, v, b, kw, hk, s.seq, s.kv_heads);
  float dka[kD / 8][4], dva[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 4; ++r) dka[n][r] = dva[n][r] = 0.0f;
  }
  TilePair<kD, 32 * kWarps> tiles;
  if constexpr (kPrefetchTiles<kD>) tiles.fetch(q, dout, b, k_blk, hk * group, s.seq, s.q_heads);
  for (int64_t gi = 0; gi < group; ++gi) {
    const int64_t h = hk * group + gi;
    for (int64_t q0 = k_blk; q0 < s.seq; q0 += kRows) {
      __syncthreads();
      if constexpr (!kPrefetchTiles<kD>) tiles.fetch(q, dout, b, q0, h, s.seq, s.q_heads);
      tiles.put(qs, dos);
      if constexpr (kPrefetchTiles<kD>) {
        // The next (head, query tile) of this block's walk, fetched while this one computes.
        if (q0 + kRows < s.seq) {
          tiles.fetch(q, dout, b, q0 + kRows, h, s.seq, s.q_heads);
        } else if (gi + 1 < group) {
          tiles.fetch(q, dout, b, k_blk, h + 1, s.seq, s.q_heads);
        }
      }
      for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
        const int64_t row = q0 + i;
        const int64_t idx = (b * s.q_heads + h) * s.seq + (row < s.seq ? row : 0);
        lse2s[i] = lse[idx] * kLog2eF;
        dds[i] = dsum[idx];
      }
      __syncthreads();
      if (q0 + kRows - 1 < kw) continue;  // every query of the tile is before this warp's keys
      float sc[8][4], dp[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[j][r] = dp[j][r] = 0.0f;
      }
      mma_a_tileT<kD>(sc, kf, qs);   // S^T: keys x queries
      mma_a_tileT<kD>(dp, vf, dos);  // dP^T
      float ds[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int col = j * 8 + 2 * t + (r & 1);
          const int64_t query = q0 + col, key = kw + g + (r >= 2 ? 8 : 0);
          const float p = (key <= query && query < s.seq) ? exp2f(sc[j][r] * scale_log2 - lse2s[col]) : 0.0f;
          sc[j][r] = p;
          ds[j][r] = p * (dp[j][r] - dds[col]);
        }
      }
      mma_p_tile<kD>(dva, sc, dos);  // dV += P^T dO
      mma_p_tile<kD>(dka, ds, qs);   // dK += dS^T Q
    }
  }
  store_rows<kD>(dk, dka, scale, scale, b, kw, hk, s.seq, s.kv_heads);
  store_rows<kD>(dv, dva, 1.0f, 1.0f, b, kw, hk, s.seq, s.kv_heads);
}

dim3 mma_grid(const AttentionShape& s, int64_t heads, int warps) {
  return dim3(static_cast<unsigned>(ceil_div(s.seq, 16 * warps)), static_cast<unsigned>(heads),
              static_cast<unsigned>(s.batch));
}

// Rows (queries of the forward and dQ, keys of dK/dV) per block: 16 per warp, 4 or 8 warps.
// 8 warps read each streamed 64-row tile once for twice the rows, but at 192-252 registers
// a thread they fit one block (8 warps) per SM where 4-warp blocks fit two or three: on an
// H200 4 warps measured faster (kAttentionDefaultWarps).
template <typename F>
void dispatch_warps(int warps, F&& f) {
  if (warps == 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

template <typename F>
void dispatch_mma_head_dim(int64_t dh, F&& f) {
  if (dh == 64) {
    f(std::integral_constant<int, 64>{});
  } else {
    f(std::integral_constant<int, 128>{});
  }
}

// True for the Hopper kernels: asked for (kAttentionHopper, refused where they cannot run),
// or kAttentionAuto where they can.
bool use_hopper(const AttentionShape& s, int variant) {
  if (variant == kAttentionHopper || variant == kAttentionHopperSplitDq || variant == kAttentionHopperFwd2) {
    TROUPE_CHECK(attention_hopper_available(s),
                 "attention: the Hopper kernels need an sm_90a build on a compute-capability 9.0 GPU, head "
                 "dim 64 or 128, at most 65535 x 128 positions and 65535 sequences (got head dim {}, {} "
                 "positions, {} sequences)",
                 s.head_dim, s.seq, s.batch);
    return true;
  }
  return variant == kAttentionAuto && attention_hopper_available(s);
}

int mma_warps(int variant) {
  const int warps = variant == kAttentionAuto ? kAttentionDefaultWarps : variant;
  TROUPE_CHECK(warps == 4 || warps == 8,
               "attention: variant must be 0 (auto), 1 (Hopper), 2 (Hopper, dQ on its own), 3 (Hopper, a "
               "two-warpgroup forward), 4 or 8 (mma.sync warps), got {}",
               variant);
  return warps;
}

}  // namespace

bool attention_mma_supported(const AttentionShape& s, DType t, std::initializer_list<const void*> ptrs) {
  if (t != DType::kBF16 || (s.head_dim != 64 && s.head_dim != 128)) return false;
  for (const void* p : ptrs) {
    if (!aligned_to(p, 16)) return false;
  }
  return true;
}

void launch_attention_forward_mma(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                  const void* v, float scale, void* out, float* lse, int variant) {
  if (use_hopper(s, variant)) {
    launch_attention_forward_hopper(env, s, q, k, v, scale, out, lse, variant == kAttentionHopperFwd2);
    return;
  }
  const int warps = mma_warps(variant);
  dispatch_mma_head_dim(s.head_dim, [&](auto d) {
    dispatch_warps(warps, [&](auto w) {
      launch(env, attention_forward_mma_kernel<d(), w()>, mma_grid(s, s.q_heads, w()), 32 * w(), 0, s,
             static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v),
             scale * kLog2eF, static_cast<bf16*>(out), lse);
    });
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

bool launch_attention_backward_mma(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                   const void* v, const void* out, const float* lse, const void* dout,
                                   float scale, void* dq, void* dk, void* dv, void* scratch, int variant,
                                   const AttentionRope* rope) {
  if (use_hopper(s, variant)) {
    const bool split =
        variant == kAttentionHopperSplitDq || (variant == kAttentionAuto && !env.attention_fused_dq);
    return launch_attention_backward_hopper(env, s, q, k, v, out, lse, dout, scale, dq, dk, dv, scratch,
                                            !split, rope);
  }
  const int warps = mma_warps(variant);
  float* dsum = static_cast<float*>(scratch);
  launch_attention_rowdot(env, s, out, dout, dsum, DType::kBF16);
  dispatch_mma_head_dim(s.head_dim, [&](auto d) {
    dispatch_warps(warps, [&](auto w) {
      const auto* qp = static_cast<const bf16*>(q);
      const auto* kp = static_cast<const bf16*>(k);
      const auto* vp = static_cast<const bf16*>(v);
      const auto* dop = static_cast<const bf16*>(dout);
      launch(env, attention_dkdv_mma_kernel<d(), w()>, mma_grid(s, s.kv_heads, w()), 32 * w(), 0, s, qp, kp,
             vp, lse, dop, dsum, scale, static_cast<bf16*>(dk), static_cast<bf16*>(dv));
      TROUPE_CUDA_LAUNCH_CHECK();
      launch(env, attention_dq_mma_kernel<d(), w()>, mma_grid(s, s.q_heads, w()), 32 * w(), 0, s, qp, kp, vp,
             lse, dop, dsum, scale, static_cast<bf16*>(dq));
    });
  });
  TROUPE_CUDA_LAUNCH_CHECK();
  return false;
}

}  // namespace troupe::kernels::gpu
