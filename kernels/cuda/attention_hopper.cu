// kernels/cuda/attention_hopper.cu — Hopper (sm_90a) causal attention for bf16 with head
// dim 64 or 128: forward, dK/dV (with dQ by default) and dQ kernels in the
// FlashAttention-3 style.
//
// Every kernel is warp-specialised: warpgroup 0 is the producer (one thread issues TMA
// bulk tensor copies into a ring of shared-memory stages, each completing on its "full"
// mbarrier), warpgroups 1 and 2 (and 3: the forward at head dim 64) are consumers of 64
// rows each, running wgmma from the swizzled tiles and releasing a stage on its "empty"
// mbarrier (one arrival per consumer warp). A block owns 128 rows (192 in that forward):
// queries (forward, dQ) or keys (dK/dV); the other operands stream through the stages,
// and the tiles wholly past the causal diagonal are never loaded (forward, dQ) or skipped
// per warpgroup.
//
// Products, per streamed tile (S = Q K^T in log2 units, P = exp2(S - lse)):
// - forward: S (A = Q, B = K, K-major), online softmax in registers, then O += P V with P
//   as the register A operand and V as an MN-major B; tile i's S is issued before tile
//   i-1's P V, so the softmax of one overlaps the other, and the warpgroups take turns
//   issuing (Turns);
// - dQ: S and dP = dO V^T, dS = P (dP - D) in registers, dQ += dS K;
// - dK/dV (looping over the group's query heads): S^T = K Q^T and dP^T = V dO^T, then
//   dV += P^T dO and dK += dS^T Q with P^T, dS^T as register A operands.
// By default one kernel computes all three gradients (attention_bwd_fused_hopper_kernel:
// FlashAttention-3's 128 x 128 tiles at head dim 64, 128 keys x 64 queries at 128, five
// products per tile, dQ bulk-reduced into an f32 buffer); with kAttentionHopperSplitDq, dQ
// has a kernel of its own that recomputes S and dP (seven products per tile pair instead
// of five, no atomics). The
// block's own rows (Q, dO or K, V) are the A operand of the first products: read from
// shared memory at head dim 128 and in the fused kernel, held in registers in the split
// kernels at 64 (kOwnInRegs).
//
// Tensors: q [B,S,Hq,Dh], k/v [B,S,Hkv,Dh], lse f32 [B,Hq,S] (natural log), read through
// 4-D tensor maps (Dh, H, S, B) with boxes of 64 x 1 x rows x 1: a tile is Dh/64 column
// chunks of `rows` 128-byte rows. Rows past S arrive as zeros and are masked.
#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/rope_angle.cuh"

namespace troupe::kernels::gpu {

// attention.cu: D = rowsum(dO * O) into dsum [B,Hq,S].
void launch_attention_rowdot(const Env& env, const AttentionShape& s, const void* out, const void* dout,
                             float* dsum, DType t);

namespace {

using bf16 = __nv_bfloat16;
using namespace hopper;  // NOLINT(build/namespaces): the Hopper building blocks

constexpr int kThreads = 384;    // producer warpgroup + two consumer warpgroups
constexpr int kBlockRows = 128;  // rows a block owns, 64 per consumer warpgroup
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared memory of one kernel: the block's own operand tiles (kOwnTiles of kBlockRows
// rows), then kStages stages of two streamed tiles of kStreamRows rows, then kExtra bytes
// of the kernel's own (1024-byte aligned), then barriers.
template <int kD, int kOwnTiles, int kStreamRows, int kStages, int kExtra = 0, int kOwnRows = kBlockRows>
struct Smem {
  static constexpr int kOwnBytes = kOwnRows * kD * 2;      // one own tile
  static constexpr int kTileBytes = kStreamRows * kD * 2;  // one streamed tile
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kStagesOffset = kOwnTiles * kOwnBytes;
  static constexpr int kExtraOffset = kStagesOffset + kStages * kStageBytes;
  static constexpr int kBarOffset = kExtraOffset + kExtra;
  static constexpr size_t kBytes = size_t{kBarOffset} + (1 + 2 * kStages) * 8 + 1024;  // + alignment slack
  static_assert(kBytes <= 227 * 1024, "shared memory of one block");
};

// Whether a kernel keeps its own operand rows (Q, dO or K, V of its 64 rows) in registers
// as wgmma A fragments instead of reading them from shared memory for every product:
// with both operands in shared memory a 64 x 64 x 16 product reads 4 KB, which at 128
// bytes per clock is as long as the tensor cores take for it. Head dim 64 only (at 128 the
// fragments would not fit beside the accumulators).
template <int kD>
constexpr bool kOwnInRegs = kD == 64;

// Per-head-dim choices: forward streams 128-key tiles (fewer softmax rescales per flop);
// the backward kernels keep four accumulator sets live and stream 64-row tiles.
// The forward's kCWs consumer warpgroups own 64 queries each: at head dim 64 three (192
// queries a block, as FlashAttention-3 does there: a tile's products are short beside its
// softmax, and a third warpgroup keeps the tensor cores fed while the other two run their
// softmax), with
// Q read from shared memory (160 registers a thread); kWarpgroups2 keeps two (the
// kAttentionHopperFwd2 variant). At head dim 128 always two.
template <int kD, bool kWarpgroups2 = false>
struct FwdCfg {
  static constexpr int kCWs = kD == 64 && !kWarpgroups2 ? 3 : 2;
  static constexpr int kStream = 128, kStages = kCWs == 3 ? 4 : 3;
  static constexpr int kRows = 64 * kCWs;
  static constexpr int kThreads = 128 * (1 + kCWs);
  static constexpr bool kQInRegs = kOwnInRegs<kD> && kCWs == 2;
  using S = Smem<kD, 1, kStream, kStages, 0, kRows>;
};
// The split backward (kAttentionHopperSplitDq): the dK/dV and dQ kernels
// keep four accumulator sets live and stream 64-row tiles.
template <int kD>
struct BwdCfg {
  static constexpr int kStream = 64, kStages = kD == 64 ? 4 : 3;
  using S = Smem<kD, 2, kStream, kStages>;
};
// The fused backward (attention_bwd_fused_hopper_kernel<kD>): own K and V (128 keys), two
// stages of a Q and a dO tile of kStream queries (128 at head dim 64, 64 at 128: 16 KB
// each either way), then the kernel's own: two dS^T buffers (128 keys x kStream queries
// bf16, as 64-query chunks swizzled like a TMA tile), one dQ staging buffer per consumer
// warpgroup (a 64 x 64 f32 quarter or half of the tile's dQ) and, per stage, the tile's
// lse and D (kStream f32 each).
template <int kD_>
struct FusedBwd {
  static constexpr int kD = kD_, kStream = 8192 / kD, kStages = 2;
  static constexpr int kDsBytes = kBlockRows * kStream * 2;
  static constexpr int kDqBytes = 64 * 64 * 4;
  static constexpr int kStatBytes = kStream * 4;
  static constexpr int kDsOffset = 0, kDqOffset = 2 * kDsBytes, kStatOffset = kDqOffset + 2 * kDqBytes;
  using S = Smem<kD, 2, kStream, kStages, kStatOffset + kStages * 2 * kStatBytes>;
};

__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

#ifdef TROUPE_WGMMA_DEVICE
// Descriptor of the k16 step kk of a K-major operand: `rows` rows of the tile at `tile`,
// starting at row `row0` (a multiple of 8).
__device__ __forceinline__ uint64_t kmajor(uint32_t tile, int rows, int row0, int kk) {
  return smem_desc(tile + (kk / 4) * rows * 128 + row0 * 128 + (kk % 4) * 32, 16, 1024);
}
// Descriptor of the k16 step kk of an MN-major operand whose k runs over the tile's rows.
__device__ __forceinline__ uint64_t mnmajor(uint32_t tile, int rows, int kk) {
  return smem_desc(tile + kk * 2048, rows * 128, 1024);
}

// Loads rows [row0, row0 + rows) of head h of batch b, all Dh/64 column chunks.
template <int kD>
__device__ __forceinline__ void load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int rows, int h,
                                          int row0, int b) {
#pragma unroll
  for (int c = 0; c < kD / 64; ++c) tma_load_4d(dst + c * rows * 128, map, bar, c * 64, h, row0, b);
}

// O (64 x kD) += P (64 x kN, register A) V (kN x kD, MN-major in smem).
template <int kD, int kN>
__device__ __forceinline__ void mma_rs(float (&acc)[kD / 2], const uint32_t (&a)[kN / 16][4], uint32_t tile) {
#pragma unroll
  for (int c = 0; c < kN / 16; ++c) {
    if constexpr (kD == 64) {
      wgmma_rs_m64n64k16<1>(acc, a[c], mnmajor(tile, kN, c), 1);
    } else {
      wgmma_rs_m64n128k16<1>(acc, a[c], mnmajor(tile, kN, c), 1);
    }
  }
}

// acc (64 x kN) = A (64 rows from row0 of own tile) B^T (kN rows of a streamed tile), both
// K-major over kD.
template <int kD, int kN, int kOwnRows = kBlockRows>
__device__ __forceinline__ void mma_ss(float (&acc)[kN / 2], uint32_t a_tile, int a_row0, uint32_t b_tile) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint64_t da = kmajor(a_tile, kOwnRows, a_row0, kk), db = kmajor(b_tile, kN, 0, kk);
    if constexpr (kN == 64) {
      wgmma_m64n64k16<0, 0>(acc, da, db, kk > 0 ? 1 : 0);
    } else {
      wgmma_m64n128k16<0, 0>(acc, da, db, kk > 0 ? 1 : 0);
    }
  }
}

// kBranchFreeTiles (a note, not a switch): the backward kernels' tiles that cannot hold a
// masked score (wholly below the diagonal and inside the sequence) skip the mask's index
// arithmetic, 0.785 -> 0.713 ms at head dim 64 (H200). They do so by running in a loop of
// their own, never through a branch on the tile inside one loop: with such a branch
// (`if (masked) ... else ...`, or a masking pass under `if`), ptxas of CUDA 13.0 gave the
// register A fragments of the dS K / dS^T Q products the registers of the own rows' A
// fragments (kOwnInRegs), which every later tile still reads: wrong dQ, dK and dV at head
// dim 64 (caught by kernels_cuda_bf16_test; the SASS showed the fragments overwritten).

// The A fragments (k16 steps over kD) of rows [row0 + 16 * warp, +16) of an own tile in
// shared memory (TMA's 128-byte swizzle: the 16-byte unit u of row r sits at u ^ (r % 8)).
template <int kD>
__device__ __forceinline__ void load_own_frags(uint32_t (&a)[kD / 16][4], uint32_t tile, int row0) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = row0 + 16 * warp + g + 8 * (x & 1), unit = (kk % 4) * 2 + (x >> 1);
      const uint32_t addr =
          tile + (kk / 4) * kBlockRows * 128 + r * 128 + ((unit ^ (r % 8)) << 4) + 4 * t;  // + (2t) bf16
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[kk][x]) : "r"(addr));
    }
  }
}

// acc (64 x kN) = A (registers, 64 x kD) B^T (kN rows of a streamed tile, K-major).
template <int kD, int kN>
__device__ __forceinline__ void mma_rs_kmajor(float (&acc)[kN / 2], const uint32_t (&a)[kD / 16][4],
                                              uint32_t b_tile) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint64_t db = kmajor(b_tile, kN, 0, kk);
    if constexpr (kN == 64) {
      wgmma_rs_m64n64k16<0>(acc, a[kk], db, kk > 0 ? 1 : 0);
    } else {
      wgmma_rs_m64n128k16<0>(acc, a[kk], db, kk > 0 ? 1 : 0);
    }
  }
}

// acc = own rows (registers when kInRegs, else shared memory: an own tile of kOwnRows
// rows) x the streamed tile^T.
template <int kD, int kN, bool kInRegs = kOwnInRegs<kD>, int kOwnRows = kBlockRows>
__device__ __forceinline__ void mma_own(float (&acc)[kN / 2], const uint32_t (&a)[kInRegs ? kD / 16 : 1][4],
                                        uint32_t a_tile, int a_row0, uint32_t b_tile) {
  if constexpr (kInRegs) {
    mma_rs_kmajor<kD, kN>(acc, a, b_tile);
  } else {
    mma_ss<kD, kN, kOwnRows>(acc, a_tile, a_row0, b_tile);
  }
}

// Accumulators (64 x kN per warpgroup) as register A fragments of k16 steps.
template <int kN>
__device__ __forceinline__ void to_a_frags(uint32_t (&a)[kN / 16][4], const float (&p)[kN / 2]) {
#pragma unroll
  for (int c = 0; c < kN / 16; ++c) {
    a[c][0] = pack2(p[8 * c + 0], p[8 * c + 1]);
    a[c][1] = pack2(p[8 * c + 2], p[8 * c + 3]);
    a[c][2] = pack2(p[8 * c + 4], p[8 * c + 5]);
    a[c][3] = pack2(p[8 * c + 6], p[8 * c + 7]);
  }
}

// 2^x by the SFU in one instruction (flush-to-zero: results below 2^-126 become 0, which
// for probabilities already scaled by the row maximum changes nothing measurable).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_add(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Rows (r) [row0, row0 + 16) of a warp's accumulator, as bf16 pairs into a [B,S,H,kD]
// tensor at (b, h), times mul; rows past S are not stored.
template <int kD>
__device__ __forceinline__ void store_rows(bf16* base, const float (&acc)[kD / 2], float mul_lo, float mul_hi,
                                           int64_t b, int64_t row0, int64_t h, int64_t seq, int64_t heads) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + g + 8 * half;
    if (row >= seq) continue;
    bf16* p = base + ((b * seq + row) * heads + h) * kD + 2 * t;
    const float mul = half ? mul_hi : mul_lo;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      *reinterpret_cast<uint32_t*>(p + j * 8) =
          pack2(acc[4 * j + 2 * half] * mul, acc[4 * j + 2 * half + 1] * mul);
    }
  }
}

// store_rows (one multiplier) with the inverse rotary embedding folded in: cs holds each
// token's (cos, -sin) per frequency ([B*S][kD / 2], launch_rope_table), and the thread's
// columns c < kD / 2 (j < kD / 16) pair with c + kD / 2 (j + kD / 16), as rope_backward
// pairs them; the rotation runs on the f32 values, rounded once.
template <int kD>
__device__ __forceinline__ void store_rows_rope(bf16* base, const float (&acc)[kD / 2], float mul, int64_t b,
                                                int64_t row0, int64_t h, int64_t seq, int64_t heads,
                                                const float2* cs) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  constexpr int kHalfJ = kD / 16;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + g + 8 * half;
    if (row >= seq) continue;
    const int64_t token = b * seq + row;
    bf16* p = base + (token * heads + h) * kD + 2 * t;
    const float4* c4 = reinterpret_cast<const float4*>(cs + token * (kD / 2) + 2 * t);
#pragma unroll
    for (int j = 0; j < kHalfJ; ++j) {
      const float4 c = __ldg(c4 + 4 * j);  // (cos, -sin) of frequencies 8j + 2t, + 1
      const float x1a = acc[4 * j + 2 * half] * mul, x1b = acc[4 * j + 2 * half + 1] * mul;
      const float x2a = acc[4 * (j + kHalfJ) + 2 * half] * mul,
                  x2b = acc[4 * (j + kHalfJ) + 2 * half + 1] * mul;
      *reinterpret_cast<uint32_t*>(p + j * 8) = pack2(x1a * c.x - x2a * c.y, x1b * c.z - x2b * c.w);
      *reinterpret_cast<uint32_t*>(p + (j + kHalfJ) * 8) =
          pack2(x2a * c.x + x1a * c.y, x2b * c.z + x1b * c.w);
    }
  }
}

// The barriers of a kernel: [0] the own tiles' load, then kStages "full", kStages "empty"
// (kWarps arrivals each: one per consumer warp).
template <int kStages, int kWarps = 8>
struct Ring {
  uint32_t own, full0, empty0;
  __device__ __forceinline__ explicit Ring(uint32_t bars)
      : own(bars), full0(bars + 8), empty0(bars + 8 + 8 * kStages) {}
  // full_arrivals: the producer's expect_tx arrival, plus any other producer threads'.
  __device__ __forceinline__ void init(int full_arrivals = 1) const {
    mbar_init(own, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, full_arrivals);
      mbar_init(empty0 + 8 * s, kWarps);
    }
    mbar_init_fence();
  }
  __device__ __forceinline__ uint32_t full(int64_t i) const {
    return full0 + 8 * static_cast<int>(i % kStages);
  }
  __device__ __forceinline__ uint32_t empty(int64_t i) const {
    return empty0 + 8 * static_cast<int>(i % kStages);
  }
  __device__ __forceinline__ static uint32_t parity(int64_t i) {
    return static_cast<uint32_t>((i / kStages) & 1);
  }
  // The producer's wait before refilling stage i % kStages.
  __device__ __forceinline__ void wait_empty(int64_t i) const { mbar_wait(empty(i), parity(i) ^ 1); }
  __device__ __forceinline__ void wait_full(int64_t i) const { mbar_wait(full(i), parity(i)); }
  // Every consumer warp, once its reads of stage i are complete.
  __device__ __forceinline__ void release(int64_t i) const {
    if (threadIdx.x % 32 == 0) mbar_arrive(empty(i));
  }
};

// The kCWs consumer warpgroups take turns issuing their products, in rotation 0, 1, ...
// (named barrier 1 + c is warpgroup c's turn, 256 threads: it waits, the one before it
// arrives), so one's softmax runs while another's products occupy the tensor cores
// instead of all doing each at once. Every warpgroup calls take() and pass() once per
// streamed tile, the same number of times.
template <int kCWs>
struct Turns {
  int cw;  // consumer warpgroup, 0 .. kCWs - 1
  __device__ __forceinline__ void start() const {
    if (cw == kCWs - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // warpgroup 0 goes first
  }
  __device__ __forceinline__ void take() const {
    asm volatile("bar.sync %0, 256;\n" ::"r"(1 + cw) : "memory");
  }
  // last: the warpgroup's final tile (the last warpgroup's final turn is not taken by anyone).
  __device__ __forceinline__ void pass(bool last) const {
    if (cw < kCWs - 1) {
      asm volatile("bar.arrive %0, 256;\n" ::"r"(2 + cw) : "memory");
    } else if (!last) {
      asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    }
  }
};

__device__ __forceinline__ uint32_t aligned_smem(unsigned char* raw) {
  return (smem_addr(raw) + 1023) & ~1023u;
}
#endif  // TROUPE_WGMMA_DEVICE

// grid (Hq, ceil(S/kRows), B) (block_grid); late (heavier) query blocks first.
template <int kD, bool kWarpgroups2>
__global__ void __launch_bounds__(FwdCfg<kD, kWarpgroups2>::kThreads, 1)
    attention_fwd_hopper_kernel(const __grid_constant__ CUtensorMap map_q,
                                const __grid_constant__ CUtensorMap map_k,
                                const __grid_constant__ CUtensorMap map_v, AttentionShape s, float scale_log2,
                                bf16* out, float* lse) {
  pdl_wait();
#ifdef TROUPE_WGMMA_DEVICE
  using C = FwdCfg<kD, kWarpgroups2>;
  using L = typename C::S;
  constexpr int kN = C::kStream, kRows = C::kRows, kCWs = C::kCWs;
  constexpr bool kQInRegs = C::kQInRegs;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = aligned_smem(smem_raw), sq = base, stages = base + L::kStagesOffset;
  const Ring<C::kStages, 4 * kCWs> ring(base + L::kBarOffset);
  const int tid = threadIdx.x, wg = tid / 128;
  const int b = blockIdx.z, h = blockIdx.x, hk = h / static_cast<int>(s.q_heads / s.kv_heads);
  const int m0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const int seq = static_cast<int>(s.seq);
  const int kv_end = min(seq, m0 + kRows);
  const int tiles = (kv_end + kN - 1) / kN;
  if (tid == 0) ring.init();
  __syncthreads();
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (tid == 0) {
      mbar_expect_tx(ring.own, L::kOwnBytes);
      load_tile<kD>(sq, &map_q, ring.own, kRows, h, m0, b);
      for (int i = 0; i < tiles; ++i) {
        ring.wait_empty(i);
        const uint32_t st = stages + (i % C::kStages) * L::kStageBytes;
        mbar_expect_tx(ring.full(i), L::kStageBytes);
        load_tile<kD>(st, &map_k, ring.full(i), kN, hk, i * kN, b);
        load_tile<kD>(st + L::kTileBytes, &map_v, ring.full(i), kN, hk, i * kN, b);
      }
    }
    return;
  }
  if constexpr (kCWs == 3) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n");
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  }
  const int cw = wg - 1, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg_first = m0 + 64 * cw, row_lo = wg_first + warp * 16 + g, row_hi = row_lo + 8;
  // The key tiles this warpgroup's queries see: with three warpgroups (192 queries, 128-key
  // tiles) the block's last tile can lie wholly past the diagonal of the first one or two;
  // they take their turns and release its stage without computing it (the tail loop).
  const int own_tiles = min(tiles, (wg_first + 63) / kN + 1);
  const Turns<kCWs> turns{cw};
  turns.start();
  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
  uint32_t pa[kN / 16][4];  // P of the previous tile, the A operand of its P V product
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  mbar_wait(ring.own, 0);
  uint32_t qa[kQInRegs ? kD / 16 : 1][4];
  if constexpr (kQInRegs) load_own_frags<kD>(qa, sq, 64 * cw);
  // Tile i's S = Q K^T runs while tile i-1's O += P V does; the softmax of tile i overlaps
  // that product, and O is rescaled once it has landed.
  // The first tile is peeled off the loop: inside it every iteration commits the same two
  // groups, so ptxas can see that wait<1> retires S (with a commit under `if (i > 0)` it
  // could not, and serialised every wgmma of the kernel: warning C7514).
  static_assert(kN <= 128 && kRows % 64 == 0, "a warpgroup skips at most the block's last tiles");
  // The online softmax of tile k0's scores sc (raw S) in place: P = exp2(S * scale_log2 -
  // m); returns O's rescale factors in corr. The row maximum is taken on the raw scores
  // (scale > 0), so each probability costs one FFMA and one EX2.
  auto softmax = [&](float(&sc)[kN / 2], int k0, float(&corr)[2]) {
    const bool masked = k0 + kN - 1 > wg_first || k0 + kN > seq;
    if (masked) {
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int key = k0 + j * 8 + 2 * t + (r & 1), row = r < 2 ? row_lo : row_hi;
          if (key > row || key >= seq) sc[4 * j + r] = -INFINITY;
        }
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) mx[r >> 1] = fmaxf(mx[r >> 1], sc[4 * j + r]);
    }
    float base_m[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float nm = fmaxf(m[x], quad_max(mx[x]) * scale_log2);
      base_m[x] = nm == -INFINITY ? 0.0f : nm;  // fully masked so far: keep exp2 finite
      corr[x] = fast_exp2(m[x] - base_m[x]);
      m[x] = nm;
    }
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float p = fast_exp2(fmaf(sc[4 * j + r], scale_log2, -base_m[r >> 1]));
        sc[4 * j + r] = p;
        sum[r >> 1] += p;
      }
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) l[x] = l[x] * corr[x] + quad_add(sum[x]);
  };
  {
    ring.wait_full(0);
    float sc[kN / 2], corr[2];
#pragma unroll
    for (int x = 0; x < kN / 2; ++x) sc[x] = 0.0f;
    turns.take();
    wgmma_fence();
    mma_own<kD, kN, kQInRegs, kRows>(sc, qa, sq, 64 * cw, stages);
    wgmma_commit();
    turns.pass(tiles == 1);
    wgmma_wait<0>();
    fence_regs(sc);
    softmax(sc, 0, corr);  // O is still zero: nothing to rescale
    to_a_frags<kN>(pa, sc);
  }
  for (int i = 1; i < own_tiles; ++i) {
    const int k0 = i * kN;
    ring.wait_full(i);
    const uint32_t st = stages + (i % C::kStages) * L::kStageBytes;
    const uint32_t prev_v = stages + ((i + C::kStages - 1) % C::kStages) * L::kStageBytes + L::kTileBytes;
    float sc[kN / 2], corr[2];  // per tile: short live ranges (see the dQ kernel)
#pragma unroll
    for (int x = 0; x < kN / 2; ++x) sc[x] = 0.0f;
    turns.take();
    wgmma_fence();
    mma_own<kD, kN, kQInRegs, kRows>(sc, qa, sq, 64 * cw, st);
    wgmma_commit();
    mma_rs<kD, kN>(o, pa, prev_v);
    wgmma_commit();
    turns.pass(i == tiles - 1);
    wgmma_wait<1>();
    fence_regs(sc);
    softmax(sc, k0, corr);
    wgmma_wait<0>();
    fence_regs(o);
    fence_regs(pa);
    ring.release(i - 1);
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      o[4 * j + 0] *= corr[0];
      o[4 * j + 1] *= corr[0];
      o[4 * j + 2] *= corr[1];
      o[4 * j + 3] *= corr[1];
    }
    to_a_frags<kN>(pa, sc);
  }
  wgmma_fence();
  mma_rs<kD, kN>(o, pa, stages + ((own_tiles - 1) % C::kStages) * L::kStageBytes + L::kTileBytes);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
  fence_regs(pa);
  ring.release(own_tiles - 1);
  for (int i = own_tiles; i < tiles; ++i) {  // tiles wholly past this warpgroup's diagonal
    turns.take();
    turns.pass(i == tiles - 1);
    ring.wait_full(i);  // its "empty" phase is the current one only once it is full
    ring.release(i);
  }
  const float inv_lo = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv_hi = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
  store_rows<kD>(out, o, inv_lo, inv_hi, b, wg_first + warp * 16, h, seq, s.q_heads);
  if (t == 0) {
    float* lrow = lse + (static_cast<int64_t>(b) * s.q_heads + h) * seq;
    if (row_lo < seq) lrow[row_lo] = (m[0] + log2f(l[0])) * kLn2;
    if (row_hi < seq) lrow[row_hi] = (m[1] + log2f(l[1])) * kLn2;
  }
#else
  (void)map_q;
  (void)map_k;
  (void)map_v;
  (void)s;
  (void)scale_log2;
  (void)out;
  (void)lse;
  __trap();
#endif
}

// grid (Hq, ceil(S/128), B): dQ of 128 queries; streams K and V tiles of 64 keys.
template <int kD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_dq_hopper_kernel(const __grid_constant__ CUtensorMap map_q,
                               const __grid_constant__ CUtensorMap map_do,
                               const __grid_constant__ CUtensorMap map_k,
                               const __grid_constant__ CUtensorMap map_v, AttentionShape s, const float* lse,
                               const float* dsum, float scale, bf16* dq) {
  pdl_wait();
#ifdef TROUPE_WGMMA_DEVICE
  using C = BwdCfg<kD>;
  using L = typename C::S;
  constexpr int kN = C::kStream;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = aligned_smem(smem_raw), sq = base, sdo = base + L::kOwnBytes;
  const uint32_t stages = base + L::kStagesOffset;
  const Ring<C::kStages> ring(base + L::kBarOffset);
  const int tid = threadIdx.x, wg = tid / 128;
  const int b = blockIdx.z, h = blockIdx.x, hk = h / static_cast<int>(s.q_heads / s.kv_heads);
  const int m0 = (gridDim.y - 1 - blockIdx.y) * kBlockRows;
  const int seq = static_cast<int>(s.seq);
  const int tiles = (min(seq, m0 + kBlockRows) + kN - 1) / kN;
  if (tid == 0) ring.init();
  __syncthreads();
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (tid == 0) {
      mbar_expect_tx(ring.own, 2 * L::kOwnBytes);
      load_tile<kD>(sq, &map_q, ring.own, kBlockRows, h, m0, b);
      load_tile<kD>(sdo, &map_do, ring.own, kBlockRows, h, m0, b);
      for (int i = 0; i < tiles; ++i) {
        ring.wait_empty(i);
        const uint32_t st = stages + (i % C::kStages) * L::kStageBytes;
        mbar_expect_tx(ring.full(i), L::kStageBytes);
        load_tile<kD>(st, &map_k, ring.full(i), kN, hk, i * kN, b);
        load_tile<kD>(st + L::kTileBytes, &map_v, ring.full(i), kN, hk, i * kN, b);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int cw = wg - 1, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg_first = m0 + 64 * cw, row_lo = wg_first + warp * 16 + g, row_hi = row_lo + 8;
  const float scale_log2 = scale * kLog2e;
  float lse2[2], dd[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int row = x ? row_hi : row_lo;
    const int64_t idx = (static_cast<int64_t>(b) * s.q_heads + h) * seq + (row < seq ? row : 0);
    lse2[x] = lse[idx] * kLog2e;
    dd[x] = dsum[idx];
  }
  float acc[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) acc[i] = 0.0f;
  mbar_wait(ring.own, 0);
  uint32_t qa[kOwnInRegs<kD> ? kD / 16 : 1][4], doa[kOwnInRegs<kD> ? kD / 16 : 1][4];
  if constexpr (kOwnInRegs<kD>) {
    load_own_frags<kD>(qa, sq, 64 * cw);
    load_own_frags<kD>(doa, sdo, 64 * cw);
  }
  // One streamed tile; `masked` (std::bool_constant) tells whether it can hold keys past
  // the diagonal or the sequence's end.
  auto tile = [&](int i, auto masked) {
    const int k0 = i * kN;
    ring.wait_full(i);
    const uint32_t st = stages + (i % C::kStages) * L::kStageBytes;
    if (k0 <= wg_first + 63) {
      // Declared (and zeroed) per tile: their values die with the tile, which keeps the
      // accumulators' live ranges short (measured: 30% faster than hoisting them).
      float sc[kN / 2], dp[kN / 2];
#pragma unroll
      for (int x = 0; x < kN / 2; ++x) sc[x] = dp[x] = 0.0f;
      wgmma_fence();
      mma_own<kD, kN>(sc, qa, sq, 64 * cw, st);
      mma_own<kD, kN>(dp, doa, sdo, 64 * cw, st + L::kTileBytes);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      fence_regs(dp);
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float p = fast_exp2(fmaf(sc[4 * j + r], scale_log2, -lse2[r >> 1]));
          if constexpr (decltype(masked)::value) {
            const int key = k0 + j * 8 + 2 * t + (r & 1), row = r < 2 ? row_lo : row_hi;
            if (key > row || key >= seq) p = 0.0f;
          }
          sc[4 * j + r] = p * (dp[4 * j + r] - dd[r >> 1]);  // dS
        }
      }
      uint32_t da[kN / 16][4];
      to_a_frags<kN>(da, sc);
      wgmma_fence();
      mma_rs<kD, kN>(acc, da, st);  // dQ += dS K
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc);
      fence_regs(da);
    }
    ring.release(i);
  };
  // The tiles wholly below the diagonal and inside the sequence first, then the rest, in
  // two loops with no branch on `masked` inside either (see kBranchFreeTiles).
  const int unmasked = min(tiles, min(wg_first, seq) / kN);
  for (int i = 0; i < unmasked; ++i) tile(i, std::false_type{});
  for (int i = unmasked; i < tiles; ++i) tile(i, std::true_type{});
  store_rows<kD>(dq, acc, scale, scale, b, wg_first + warp * 16, h, seq, s.q_heads);
#else
  (void)map_q;
  (void)map_do;
  (void)map_k;
  (void)map_v;
  (void)s;
  (void)lse;
  (void)dsum;
  (void)scale;
  (void)dq;
  __trap();
#endif
}

#ifdef TROUPE_WGMMA_DEVICE
// The producer thread of a key-block backward kernel (L: its Smem layout): the block's K and
// V rows (kBlockRows from n0, on the ring's "own" barrier), then Q and dO tiles of kN queries
// from n0 on, per query head of the group (per_head tiles each), into the ring's stages.
template <int kD, int kN, class L, int kStages>
__device__ __forceinline__ void load_key_block(const Ring<kStages>& ring, uint32_t sk, uint32_t sv,
                                               uint32_t stages, const CUtensorMap* map_q,
                                               const CUtensorMap* map_do, const CUtensorMap* map_k,
                                               const CUtensorMap* map_v, int hk, int n0, int b, int group,
                                               int per_head) {
  mbar_expect_tx(ring.own, 2 * L::kOwnBytes);
  load_tile<kD>(sk, map_k, ring.own, kBlockRows, hk, n0, b);
  load_tile<kD>(sv, map_v, ring.own, kBlockRows, hk, n0, b);
  for (int i = 0; i < group * per_head; ++i) {
    const int h = hk * group + i / per_head, q0 = n0 + (i % per_head) * kN;
    ring.wait_empty(i);
    const uint32_t st = stages + (i % kStages) * L::kStageBytes;
    mbar_expect_tx(ring.full(i), L::kStageBytes);
    load_tile<kD>(st, map_q, ring.full(i), kN, h, q0, b);
    load_tile<kD>(st + L::kTileBytes, map_do, ring.full(i), kN, h, q0, b);
  }
}
#endif  // TROUPE_WGMMA_DEVICE

// grid (Hkv, ceil(S/128), B): dK and dV of 128 keys, summed over the group's query heads;
// streams Q and dO tiles of 64 queries from the block's first key on. Early (heavier)
// key blocks first. With attention_dq_hopper_kernel, the split backward: S and dP are
// computed in both (seven products per tile pair), with no atomics.
template <int kD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_dkdv_hopper_kernel(const __grid_constant__ CUtensorMap map_q,
                                 const __grid_constant__ CUtensorMap map_do,
                                 const __grid_constant__ CUtensorMap map_k,
                                 const __grid_constant__ CUtensorMap map_v, AttentionShape s,
                                 const float* lse, const float* dsum, float scale, bf16* dk, bf16* dv) {
  pdl_wait();
#ifdef TROUPE_WGMMA_DEVICE
  using C = BwdCfg<kD>;
  using L = typename C::S;
  constexpr int kN = C::kStream;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = aligned_smem(smem_raw), sk = base, sv = base + L::kOwnBytes;
  const uint32_t stages = base + L::kStagesOffset;
  const Ring<C::kStages> ring(base + L::kBarOffset);
  const int tid = threadIdx.x, wg = tid / 128;
  const int b = blockIdx.z, hk = blockIdx.x, group = static_cast<int>(s.q_heads / s.kv_heads);
  const int n0 = blockIdx.y * kBlockRows;
  const int seq = static_cast<int>(s.seq);
  const int per_head = (seq - n0 + kN - 1) / kN;  // query tiles from n0 on (n0 is a multiple of kN)
  const int tiles = group * per_head;
  if (tid == 0) ring.init();
  __syncthreads();
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (tid == 0) {
      load_key_block<kD, kN, L>(ring, sk, sv, stages, &map_q, &map_do, &map_k, &map_v, hk, n0, b, group,
                                per_head);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int cw = wg - 1, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg_first = n0 + 64 * cw, key_lo = wg_first + warp * 16 + g, key_hi = key_lo + 8;
  const float scale_log2 = scale * kLog2e;
  float dka[kD / 2], dva[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dka[i] = dva[i] = 0.0f;
  mbar_wait(ring.own, 0);
  uint32_t ka[kOwnInRegs<kD> ? kD / 16 : 1][4], va[kOwnInRegs<kD> ? kD / 16 : 1][4];
  if constexpr (kOwnInRegs<kD>) {
    load_own_frags<kD>(ka, sk, 64 * cw);
    load_own_frags<kD>(va, sv, 64 * cw);
  }
  auto tile = [&](int i, auto masked) {  // as in the dQ kernel
    const int h = hk * group + i / per_head, q0 = n0 + (i % per_head) * kN;
    ring.wait_full(i);
    const uint32_t st = stages + (i % C::kStages) * L::kStageBytes;
    if (q0 + kN - 1 >= wg_first) {
      float sc[kN / 2], dp[kN / 2];  // per tile, as in the dQ kernel
#pragma unroll
      for (int x = 0; x < kN / 2; ++x) sc[x] = dp[x] = 0.0f;
      wgmma_fence();
      mma_own<kD, kN>(sc, ka, sk, 64 * cw, st);                  // S^T: keys x queries
      mma_own<kD, kN>(dp, va, sv, 64 * cw, st + L::kTileBytes);  // dP^T
      wgmma_commit();
      // lse and D of this tile's queries (this thread's columns), loaded while the products run.
      const float* lrow = lse + (static_cast<int64_t>(b) * s.q_heads + h) * seq;
      const float* drow = dsum + (static_cast<int64_t>(b) * s.q_heads + h) * seq;
      float l2[kN / 8][2], dq_[kN / 8][2];
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int query = q0 + j * 8 + 2 * t + e, qc = query < seq ? query : seq - 1;
          l2[j][e] = __ldg(lrow + qc) * kLog2e;
          dq_[j][e] = __ldg(drow + qc);
        }
      }
      wgmma_wait<0>();
      fence_regs(sc);
      fence_regs(dp);
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = 2 * half + e;
            float p = fast_exp2(fmaf(sc[4 * j + r], scale_log2, -l2[j][e]));
            if constexpr (decltype(masked)::value) {
              const int query = q0 + j * 8 + 2 * t + e, key = half ? key_hi : key_lo;
              if (key > query || query >= seq) p = 0.0f;
            }
            sc[4 * j + r] = p;
            dp[4 * j + r] = p * (dp[4 * j + r] - dq_[j][e]);  // dS^T
          }
        }
      }
      uint32_t pa[kN / 16][4], da[kN / 16][4];
      to_a_frags<kN>(pa, sc);
      to_a_frags<kN>(da, dp);
      wgmma_fence();
      mma_rs<kD, kN>(dva, pa, st + L::kTileBytes);  // dV += P^T dO
      mma_rs<kD, kN>(dka, da, st);                  // dK += dS^T Q
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(dva);
      fence_regs(dka);
      fence_regs(pa);
      fence_regs(da);
    }
    ring.release(i);
  };
  if constexpr (kD == 64) {
    // Per query head: the diagonal tiles (one for warpgroup 0, two for warpgroup 1, whose
    // first is skipped), the unmasked middle, then a partial last tile (kBranchFreeTiles).
    for (int hh = 0; hh < group; ++hh) {
      const int first = hh * per_head, lead = min(per_head, cw + 1);
      const int tail = max(lead, per_head - (seq % kN != 0 ? 1 : 0));
      for (int q = 0; q < lead; ++q) tile(first + q, std::true_type{});
      for (int q = lead; q < tail; ++q) tile(first + q, std::false_type{});
      for (int q = tail; q < per_head; ++q) tile(first + q, std::true_type{});
    }
  } else {
    // Head dim 128: three inlined copies of the tile spill (508 bytes against 108), and
    // the split measured slower (0.670 against 0.655 ms); every tile takes the masked copy.
    for (int i = 0; i < tiles; ++i) tile(i, std::true_type{});
  }
  store_rows<kD>(dk, dka, scale, scale, b, wg_first + warp * 16, hk, seq, s.kv_heads);
  store_rows<kD>(dv, dva, 1.0f, 1.0f, b, wg_first + warp * 16, hk, seq, s.kv_heads);
#else
  (void)map_q;
  (void)map_do;
  (void)map_k;
  (void)map_v;
  (void)s;
  (void)lse;
  (void)dsum;
  (void)scale;
  (void)dk;
  (void)dv;
  __trap();
#endif
}

// grid (Hkv, ceil(S/128), B): dK and dV of 128 keys and their share of dQ, in
// FlashAttention-3's shapes (128 keys x kN = 128 queries at head dim 64, 128 x 64 at 128).
// S and dP are computed once for all three gradients: five products per tile instead of
// the split kernels' seven.
//
// Warpgroup 0: thread 0 loads K and V, then streams kN-query tiles of Q and dO into two
// stages; warp 2 copies the tile's lse and D into the stage (a 1-D tensor map over [B,Hq,S]
// measured "illegal instruction" on the H200); warp 1 bulk-reduces the consumers' staged
// dQ into dq_acc. Consumer warpgroup c (keys n0 + 64c..) per tile:
// - S^T = K_c Q^T and dP^T = V_c dO^T (64 x kN each, both operands in shared memory);
//   P = exp2(S * scale log2e - lse log2e) (warp 2 stages lse log2e) while dP^T is still running, dS^T = P
//   (dP^T - D);
// - its dS^T rows into the tile's dS buffer, then dV += P^T dO (P^T as register A);
// - once both warpgroups' rows are in (named barrier 1), its quarter (head dim 64: queries
//   64c..) or half (128: columns 64c..) of the tile's dQ = dS K summed over all 128 keys (dS
//   as an MN-major A from the buffer, K as an MN-major B), and dK += dS^T Q (register A);
//   that dQ (64 x 64 f32) is staged in fragment order (thread t's values 4j..4j+3 at float4
//   j * 128 + t) for warp 1 (named barriers 2 + c "full", 4 + c "empty").
// The two dS buffers alternate by tile, so a warpgroup writes tile i + 1's rows while the
// other may still read tile i's for its dQ; it cannot reach tile i + 2's before the other
// has passed barrier 1 of tile i + 1, after its dQ of tile i completed. One reduce of 16 KB
// per warpgroup and tile: at head dim 64, half the L2 reduction traffic of 64-query tiles.
template <int kD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_fused_hopper_kernel(const __grid_constant__ CUtensorMap map_q,
                                      const __grid_constant__ CUtensorMap map_do,
                                      const __grid_constant__ CUtensorMap map_k,
                                      const __grid_constant__ CUtensorMap map_v, AttentionShape s,
                                      const float* lse, const float* dsum, float scale, bf16* dk, bf16* dv,
                                      float* dq_acc, const float2* rope_cs) {
  pdl_wait();
#ifdef TROUPE_WGMMA_DEVICE
  using C = FusedBwd<kD>;
  using L = typename C::S;
  constexpr int kN = C::kStream;
  // Which 64 x 64 part of the tile's dQ (kN x kD) consumer warpgroup c computes: rows 64c..
  // at head dim 64, columns 64c.. at 128.
  constexpr bool kDqByRows = kN == kBlockRows;
  static_assert(kN * kD == 8192 && (kDqByRows || kD == 128), "the fused backward's tile shapes");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = aligned_smem(smem_raw), sk = base, sv = base + L::kOwnBytes;
  const uint32_t stages = base + L::kStagesOffset, extra = base + L::kExtraOffset;
  const uint32_t ds0 = extra + C::kDsOffset, dq0 = extra + C::kDqOffset, stats = extra + C::kStatOffset;
  const Ring<C::kStages> ring(base + L::kBarOffset);
  const int tid = threadIdx.x, wg = tid / 128;
  const int b = blockIdx.z, hk = blockIdx.x, group = static_cast<int>(s.q_heads / s.kv_heads);
  const int n0 = blockIdx.y * kBlockRows;
  const int seq = static_cast<int>(s.seq);
  const int per_head = (seq - n0 + kN - 1) / kN;  // query tiles from n0 on (n0 is a multiple of kN)
  const int tiles = group * per_head, q_tiles = (seq + kN - 1) / kN;
  if (tid == 0) ring.init(1 + 32);  // thread 0's expect_tx, then each lane of warp 2
  __syncthreads();
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (tid == 0) {
      load_key_block<kD, kN, L>(ring, sk, sv, stages, &map_q, &map_do, &map_k, &map_v, hk, n0, b, group,
                                per_head);
    } else if (tid / 32 == 2) {
      // The tile's lse (in log2 units) and D into its stage (0 past the sequence), then each
      // lane's arrival.
      const int lane = tid % 32;
      for (int i = 0; i < tiles; ++i) {
        const int h = hk * group + i / per_head, q0 = n0 + (i % per_head) * kN;
        ring.wait_empty(i);
        const uint32_t stat = stats + (i % C::kStages) * 2 * C::kStatBytes;
        const int64_t row = (static_cast<int64_t>(b) * s.q_heads + h) * seq;
#pragma unroll
        for (int k = 0; k < kN / 32; ++k) {
          const int q = q0 + 32 * k + lane;
          const float l = q < seq ? __ldg(lse + row + q) * kLog2e : 0.0f;
          const float d = q < seq ? __ldg(dsum + row + q) : 0.0f;
          asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(stat + (32 * k + lane) * 4), "f"(l) : "memory");
          asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(stat + C::kStatBytes + (32 * k + lane) * 4), "f"(d)
                       : "memory");
        }
        mbar_arrive(ring.full(i));  // release: the stores above are seen by whoever waits on it
      }
    } else if (tid / 32 == 1) {
      // The dQ writer: each warpgroup's staged partial, reduced into its half of the tile's block.
      const int lane = tid % 32;
      asm volatile("bar.arrive 4, 160;\n" ::: "memory");  // both staging buffers start empty
      asm volatile("bar.arrive 5, 160;\n" ::: "memory");
      for (int i = 0; i < tiles; ++i) {
        const int h = hk * group + i / per_head, q0 = n0 + (i % per_head) * kN;
        float* dst = dq_acc + ((static_cast<int64_t>(b) * s.q_heads + h) * q_tiles + q0 / kN) * (kN * kD);
        asm volatile("bar.sync 2, 160;\n" ::: "memory");
        if (lane == 0) {
          bulk_reduce_add_f32(dst, dq0, C::kDqBytes);
          bulk_commit();
        }
        asm volatile("bar.sync 3, 160;\n" ::: "memory");
        if (lane == 0) {
          bulk_reduce_add_f32(dst + C::kDqBytes / 4, dq0 + C::kDqBytes, C::kDqBytes);
          bulk_commit();
        }
        if (i + 1 == tiles) break;  // no one waits for the last tile's buffers
        if (lane == 0) bulk_wait_read<1>();
        __syncwarp();
        asm volatile("bar.arrive 4, 160;\n" ::: "memory");
        if (lane == 0) bulk_wait_read<0>();
        __syncwarp();
        asm volatile("bar.arrive 5, 160;\n" ::: "memory");
      }
      if (lane == 0) bulk_wait<0>();  // the reduces have read their buffers and landed
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int cw = wg - 1, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg_first = n0 + 64 * cw, key_lo = wg_first + warp * 16 + g, key_hi = key_lo + 8;
  const float scale_log2 = scale * kLog2e;
  const uint32_t dq_stage = dq0 + cw * C::kDqBytes;
  float dka[kD / 2], dva[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dka[i] = dva[i] = 0.0f;
  mbar_wait(ring.own, 0);
  auto tile = [&](int i, auto masked) {
    const int q0 = n0 + (i % per_head) * kN, slot = i % C::kStages;
    ring.wait_full(i);
    const uint32_t sq = stages + slot * L::kStageBytes, sdo = sq + L::kTileBytes;
    const uint32_t slse = stats + slot * 2 * C::kStatBytes, sdd = slse + C::kStatBytes;
    const uint32_t ds = ds0 + (i & 1) * C::kDsBytes;
    float sc[kN / 2], dp[kN / 2];  // per tile (see the dQ kernel)
#pragma unroll
    for (int x = 0; x < kN / 2; ++x) sc[x] = dp[x] = 0.0f;
    wgmma_fence();
    mma_ss<kD, kN>(sc, sk, 64 * cw, sq);  // S^T: keys x queries
    wgmma_commit();
    mma_ss<kD, kN>(dp, sv, 64 * cw, sdo);  // dP^T
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(sc);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      float l0, l1;  // lse (log2 units) of this thread's two queries of column group j
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                   : "=f"(l0), "=f"(l1)
                   : "r"(slse + (8 * j + 2 * t) * 4));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float p = fast_exp2(fmaf(sc[4 * j + r], scale_log2, -(r & 1 ? l1 : l0)));
        if constexpr (decltype(masked)::value) {
          const int query = q0 + j * 8 + 2 * t + (r & 1), key = r < 2 ? key_lo : key_hi;
          if (key > query || query >= seq) p = 0.0f;
        }
        sc[4 * j + r] = p;
      }
    }
    // P as bf16 A fragments now, so that its f32 values die before dP^T lands; dS^T is
    // computed from the bf16 P (the P that dV's product uses too), which keeps the peak at
    // dP^T plus P's fragments (240 registers: with the f32 P kept, ptxas spilled).
    uint32_t pa[kN / 16][4], da[kN / 16][4];
    to_a_frags<kN>(pa, sc);
    wgmma_wait<0>();
    fence_regs(dp);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      float d0, d1;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                   : "=f"(d0), "=f"(d1)
                   : "r"(sdd + (8 * j + 2 * t) * 4));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t w = pa[j / 2][2 * (j % 2) + half];  // P of rows g (+8), columns 8j + 2t, +1
        const int r = 2 * half;
        dp[4 * j + r] = __uint_as_float(w << 16) * (dp[4 * j + r] - d0);  // dS^T
        dp[4 * j + r + 1] = __uint_as_float(w & 0xffff0000u) * (dp[4 * j + r + 1] - d1);
      }
    }
    to_a_frags<kN>(da, dp);
    // dS^T rows into the buffer: fragment word x of k16 step c is key row 16 * warp + g (+ 8
    // for odd x) of this warpgroup, queries 16c + 8 (x / 2) + 2t, +1: chunk c / 4, 16-byte
    // unit 2 (c % 4) + x / 2 of the row, swizzled by the row's g.
    const uint32_t row = ds + (64 * cw + 16 * warp + g) * 128 + 4 * t;
#pragma unroll
    for (int c = 0; c < kN / 16; ++c) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int unit = 2 * (c % 4) + (x >> 1);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(row + (c / 4) * (kBlockRows * 128) +
                                                       (x & 1) * 8 * 128 + ((unit ^ g) << 4)),
                     "r"(da[c][x])
                     : "memory");
      }
    }
    fence_proxy_async();
    wgmma_fence();
    mma_rs<kD, kN>(dva, pa, sdo);  // dV += P^T dO
    wgmma_commit();
    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both warpgroups' dS^T rows are in
    float dqa[32];
    wgmma_fence();
    // dQ's part (queries 64cw.. or columns 64cw..) = dS K over all 128 keys: dS's 64-query
    // chunk, K's 64-column chunk.
    const uint32_t ds_chunk = ds + (kDqByRows ? cw : 0) * (kBlockRows * 128);
    const uint32_t k_chunk = sk + (kDqByRows ? 0 : cw) * (kBlockRows * 128);
#pragma unroll
    for (int kk = 0; kk < kBlockRows / 16; ++kk) {
      wgmma_m64n64k16<1, 1>(dqa, smem_desc(ds_chunk + kk * 2048, 64 * 128, 1024),
                            mnmajor(k_chunk, kBlockRows, kk), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    mma_rs<kD, kN>(dka, da, sq);  // dK += dS^T Q
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(dva);
    fence_regs(pa);
    fence_regs(dqa);
    asm volatile("bar.sync %0, 160;\n" ::"r"(4 + cw) : "memory");  // the staging buffer is free
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dq_stage + j * 2048 + (tid % 128) * 16),
                   "f"(dqa[4 * j]), "f"(dqa[4 * j + 1]), "f"(dqa[4 * j + 2]), "f"(dqa[4 * j + 3])
                   : "memory");
    }
    fence_proxy_async();
    asm volatile("bar.arrive %0, 160;\n" ::"r"(2 + cw) : "memory");
    wgmma_wait<0>();
    fence_regs(dka);
    fence_regs(da);
    ring.release(i);
  };
  if constexpr (kD == 64) {
    // Per query head: the diagonal tile, the unmasked middle, then a partial last tile,
    // each in a loop of its own (kBranchFreeTiles).
    for (int hh = 0; hh < group; ++hh) {
      const int first = hh * per_head;
      const int tail = max(1, per_head - (seq % kN != 0 ? 1 : 0));
      tile(first, std::true_type{});
      for (int q = 1; q < tail; ++q) tile(first + q, std::false_type{});
      for (int q = tail; q < per_head; ++q) tile(first + q, std::true_type{});
    }
  } else {
    // Head dim 128: every tile takes the masked copy. ptxas of CUDA 13.0 spilled 332 bytes
    // with the three loops above, 272 with two (masked diagonal, unmasked rest), 68 with one.
    for (int i = 0; i < tiles; ++i) tile(i, std::true_type{});
  }
  if (rope_cs != nullptr) {
    store_rows_rope<kD>(dk, dka, scale, b, wg_first + warp * 16, hk, seq, s.kv_heads, rope_cs);
  } else {
    store_rows<kD>(dk, dka, scale, scale, b, wg_first + warp * 16, hk, seq, s.kv_heads);
  }
  store_rows<kD>(dv, dva, 1.0f, 1.0f, b, wg_first + warp * 16, hk, seq, s.kv_heads);
#else
  (void)map_q;
  (void)map_do;
  (void)map_k;
  (void)map_v;
  (void)s;
  (void)lse;
  (void)dsum;
  (void)scale;
  (void)dk;
  (void)dv;
  (void)dq_acc;
  (void)rope_cs;
  __trap();
#endif
}

// dq [B,S,Hq,kD] = scale * dq_acc, whose blocks [B][Hq][ceil(S/kN)] of kN queries x kD
// hold the fused kernel's dQ fragments in two 64 x 64 halves, of 64 queries each (kN = 128,
// head dim 64) or of 64 columns (kN = 64, head dim 128); within a half, float4 j * 128 + t
// holds warp t / 32's rows g and g + 8, columns 8j + 2(t % 4), +1, with g = t % 32 / 4.
// grid: one block of 256 threads per block of dq_acc (blockDim must be 256); the fragments
// go through shared memory so that dq is written in whole rows. rope_cs (null: none): each
// token's (cos, -sin) per frequency ([B*S][kD / 2]), the inverse rotary embedding applied
// to the f32 values before their one rounding (columns c and c + kD / 2 by one thread).
template <int kD, int kN>
__global__ void __launch_bounds__(256)
    attention_dq_convert_kernel(AttentionShape s, const float* dq_acc, float scale, bf16* dq,
                                const float2* rope_cs) {
  pdl_wait();
  constexpr int kPad = kD + 4;        // row stride in floats: 16-byte aligned, rows on different banks
  constexpr int kHalf = 64 * 64 / 4;  // float4s of one half
  constexpr bool kHalvesByRows = kN == 128;
  static_assert(kN * kD == 8192, "two 64 x 64 halves a block");
  __shared__ __align__(16) float tile[kN * kPad];
  const int64_t block = blockIdx.x;
  const int q_tiles = static_cast<int>((s.seq + kN - 1) / kN);
  const int qt = static_cast<int>(block % q_tiles);
  const int64_t bh = block / q_tiles, h = bh % s.q_heads, b = bh / s.q_heads;
  const float4* src = reinterpret_cast<const float4*>(dq_acc + block * (kN * kD));
  constexpr int kLoads = kN * kD / 4 / 256;  // float4s per thread, all loaded before any store
  static_assert(kN * kD % 1024 == 0, "whole float4s per thread");
  float4 v[kLoads];
#pragma unroll
  for (int n = 0; n < kLoads; ++n) v[n] = src[threadIdx.x + 256 * n];
#pragma unroll
  for (int n = 0; n < kLoads; ++n) {
    const int f = threadIdx.x + 256 * n;
    const int w = f % kHalf, j = w / 128, t = w % 128, g = t % 32 / 4;
    const int half = f / kHalf;
    const int row = (kHalvesByRows ? 64 * half : 0) + 16 * (t / 32) + g;
    const int col = (kHalvesByRows ? 0 : 64 * half) + 8 * j + 2 * (t % 4);
    tile[row * kPad + col] = v[n].x;
    tile[row * kPad + col + 1] = v[n].y;
    tile[(row + 8) * kPad + col] = v[n].z;
    tile[(row + 8) * kPad + col + 1] = v[n].w;
  }
  __syncthreads();
  if (rope_cs != nullptr) {
    constexpr int kChunks = kD / 16;  // 8-column chunks of the first half
    for (int u = threadIdx.x; u < kN * kChunks; u += blockDim.x) {
      const int row = u / kChunks, col = 8 * (u % kChunks);
      const int64_t q = int64_t{qt} * kN + row;
      if (q >= s.seq) continue;
      const int64_t token = b * s.seq + q;
      const float4* c4 = reinterpret_cast<const float4*>(rope_cs + token * (kD / 2) + col);
      const float* x1 = &tile[row * kPad + col];
      const float* x2 = x1 + kD / 2;
      uint32_t o1[4], o2[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // frequencies col + 2i, + 1
        const float4 c = __ldg(c4 + i);
        const float a1 = x1[2 * i] * scale, b1 = x1[2 * i + 1] * scale;
        const float a2 = x2[2 * i] * scale, b2 = x2[2 * i + 1] * scale;
        o1[i] = pack2(a1 * c.x - a2 * c.y, b1 * c.z - b2 * c.w);
        o2[i] = pack2(a2 * c.x + a1 * c.y, b2 * c.z + b1 * c.w);
      }
      bf16* out = dq + (token * s.q_heads + h) * kD + col;
      *reinterpret_cast<uint4*>(out) = make_uint4(o1[0], o1[1], o1[2], o1[3]);
      *reinterpret_cast<uint4*>(out + kD / 2) = make_uint4(o2[0], o2[1], o2[2], o2[3]);
    }
    return;
  }
  for (int u = threadIdx.x; u < kN * kD / 8; u += blockDim.x) {
    const int row = u / (kD / 8), col = 8 * (u % (kD / 8));
    const int64_t q = int64_t{qt} * kN + row;
    if (q >= s.seq) continue;
    const float4 lo = *reinterpret_cast<const float4*>(&tile[row * kPad + col]);
    const float4 hi = *reinterpret_cast<const float4*>(&tile[row * kPad + col + 4]);
    uint4 out;
    out.x = pack2(lo.x * scale, lo.y * scale);
    out.y = pack2(lo.z * scale, lo.w * scale);
    out.z = pack2(hi.x * scale, hi.y * scale);
    out.w = pack2(hi.z * scale, hi.w * scale);
    *reinterpret_cast<uint4*>(dq + ((b * s.seq + q) * s.q_heads + h) * kD + col) = out;
  }
}

// The tensor map of a [B,S,H,Dh] bf16 tensor read in boxes of `rows` rows of one head.
CUtensorMap head_map(const void* p, const AttentionShape& s, int64_t heads, int rows) {
  const cuuint64_t dh = static_cast<cuuint64_t>(s.head_dim), h = static_cast<cuuint64_t>(heads);
  const cuuint64_t dims[4] = {dh, h, static_cast<cuuint64_t>(s.seq), static_cast<cuuint64_t>(s.batch)};
  const cuuint64_t strides[3] = {dh * 2, h * dh * 2, static_cast<cuuint64_t>(s.seq) * h * dh * 2};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(rows), 1};
  return make_tensor_map(p, 4, dims, strides, box);
}

template <typename F>
void dispatch_head_dim(int64_t dh, F&& f) {
  if (dh == 64) {
    f(std::integral_constant<int, 64>{});
  } else {
    f(std::integral_constant<int, 128>{});
  }
}

template <typename K>
void allow_smem(K kernel, size_t bytes) {
  CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// grid (heads, row blocks, B): blocks start in x, then y order, so within a sequence the row
// blocks of one weight (the heaviest first: late query blocks, early key blocks) run for all
// heads before the next, and a sequence's last blocks are its lightest. (With the row block
// in x, every head's heaviest block was among its first, and the last head's started near the
// end of the grid: a tail of up to one heavy block.)
dim3 block_grid(const AttentionShape& s, int64_t heads, int rows = kBlockRows) {
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(ceil_div(s.seq, int64_t{rows})),
              static_cast<unsigned>(s.batch));
}

}  // namespace

bool attention_hopper_available(const AttentionShape& s) {
  // Rows are int coordinates of the tensor maps, row blocks of 128 the grid's y (at most 65535).
  return hopper::wgmma_available() && (s.head_dim == 64 || s.head_dim == 128) &&
         ceil_div(s.seq, int64_t{kBlockRows}) <= 65535 && s.batch <= 65535;
}

void launch_attention_forward_hopper(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                     const void* v, float scale, void* out, float* lse, bool two_warpgroups) {
  auto run = [&](auto d, auto two) {
    using C = FwdCfg<d(), two()>;
    using L = typename C::S;
    const CUtensorMap mq = head_map(q, s, s.q_heads, C::kRows);
    const CUtensorMap mk = head_map(k, s, s.kv_heads, C::kStream);
    const CUtensorMap mv = head_map(v, s, s.kv_heads, C::kStream);
    auto kernel = attention_fwd_hopper_kernel<d(), two()>;
    allow_smem(kernel, L::kBytes);
    launch(env, kernel, block_grid(s, s.q_heads, C::kRows), C::kThreads, L::kBytes, mq, mk, mv, s,
           scale * kLog2e, static_cast<bf16*>(out), lse);
  };
  dispatch_head_dim(s.head_dim, [&](auto d) {
    if constexpr (d() == 64) {
      if (!two_warpgroups) {
        run(d, std::false_type{});
        return;
      }
    }
    run(d, std::true_type{});  // two consumer warpgroups
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

// The fused backward's preparation in one pass (FlashAttention-3's preprocess does the
// first two): D = rowsum(dO * O) of each (token, head) row (8 lanes of kD / 8 columns, then
// a butterfly; at head dim 64 as attention_rowdot_packed_kernel sums it); dQ's f32
// accumulator cleared, each row clearing kD floats at acc + kD r (a clear does not care
// about the buffer's tile layout; the caller clears what lies past rows * kD); and, with
// RoPE, the token's (cos, -sin) table ([tokens][kD / 2], launch_rope_table's values),
// written by its head-0 row. Three launches before (rowdot, table, memset): one now.
template <int kD>
__global__ void __launch_bounds__(256)
    attention_bwd_prep_kernel(AttentionShape s, const bf16* out, const bf16* dout, float* dsum, float* acc,
                              const int32_t* pos, double log_theta, float2* cs) {
  pdl_wait();
  constexpr int kLanes = 8, kCols = kD / kLanes;
  const int64_t rows = s.batch * s.seq * s.q_heads;
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t r = t / kLanes;
  const int part = static_cast<int>(t % kLanes);
  float a = 0.0f;
  if (r < rows) {
#pragma unroll
    for (int c = 0; c < kCols; c += 8) {
      float o[8], g[8];
      load_floats<8>(out + r * kD + part * kCols + c, o);
      load_floats<8>(dout + r * kD + part * kCols + c, g);
#pragma unroll
      for (int j = 0; j < 8; ++j) a += o[j] * g[j];
    }
    float4* z = reinterpret_cast<float4*>(acc + r * kD + part * kCols);
#pragma unroll
    for (int c = 0; c < kCols / 4; ++c) z[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (cs != nullptr && r % s.q_heads == 0) {
      const int64_t token = r / s.q_heads;
#pragma unroll
      for (int p = part * (kCols / 2); p < (part + 1) * (kCols / 2); ++p)
        cs[token * (kD / 2) + p] = rope_cos_sin(pos[token], p, kD, log_theta, true);
    }
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) a += __shfl_xor_sync(0xffffffffu, a, o);  // whole warps
  if (r < rows && part == 0) {
    const int64_t h = r % s.q_heads, bi = r / s.q_heads, b = bi / s.seq, i = bi % s.seq;
    dsum[(b * s.q_heads + h) * s.seq + i] = a;
  }
}

size_t attention_fused_dq_bytes(const AttentionShape& s) {
  int64_t n = 0;  // queries a tile
  dispatch_head_dim(s.head_dim, [&](auto d) { n = FusedBwd<d()>::kStream; });
  return static_cast<size_t>(s.batch * s.q_heads * ceil_div(s.seq, n) * n * s.head_dim) * sizeof(float);
}

bool launch_attention_backward_hopper(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                      const void* v, const void* out, const float* lse, const void* dout,
                                      float scale, void* dq, void* dk, void* dv, void* scratch, bool fused_dq,
                                      const AttentionRope* rope) {
  float* dsum = static_cast<float*>(scratch);
  const CUtensorMap mk = head_map(k, s, s.kv_heads, kBlockRows), mv = head_map(v, s, s.kv_heads, kBlockRows);
  if (fused_dq) {
    float* acc = dsum + attention_dsum_floats(s);
    float2* cs = nullptr;
    if (rope != nullptr) {  // the rotation table after dQ's accumulator (attention_rope_bytes)
      cs = reinterpret_cast<float2*>(reinterpret_cast<unsigned char*>(acc) + attention_fused_dq_bytes(s));
    }
    dispatch_head_dim(s.head_dim, [&](auto d) {
      using C = FusedBwd<d()>;
      constexpr int kN = C::kStream;
      const CUtensorMap mq = head_map(q, s, s.q_heads, kN), mdo = head_map(dout, s, s.q_heads, kN);
      const int64_t rows = s.batch * s.seq * s.q_heads;
      if (aligned_to(out, 16) && aligned_to(dout, 16)) {  // D, the clear and the table in one pass
        launch(env, attention_bwd_prep_kernel<d()>, static_cast<unsigned>(ceil_div(rows * 8, int64_t{256})),
               256, 0, s, static_cast<const bf16*>(out), static_cast<const bf16*>(dout), dsum, acc,
               rope != nullptr ? rope->pos : nullptr,
               rope != nullptr ? std::log(static_cast<double>(rope->theta)) : 0.0, cs);
        TROUPE_CUDA_LAUNCH_CHECK();
        const size_t cleared = static_cast<size_t>(rows * d()) * sizeof(float);
        if (attention_fused_dq_bytes(s) > cleared) {  // query tiles past the sequence's end
          CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<unsigned char*>(acc) + cleared, 0,
                                     attention_fused_dq_bytes(s) - cleared, env.stream));
        }
      } else {
        launch_attention_rowdot(env, s, out, dout, dsum, DType::kBF16);
        if (rope != nullptr) launch_rope_table(env, rope->pos, rope->theta, s.batch * s.seq, s.head_dim, cs);
        CUDA_CHECK(cudaMemsetAsync(acc, 0, attention_fused_dq_bytes(s), env.stream));
      }
      auto kernel = attention_bwd_fused_hopper_kernel<d()>;
      allow_smem(kernel, C::S::kBytes);
      launch(env, kernel, block_grid(s, s.kv_heads), kThreads, C::S::kBytes, mq, mdo, mk, mv, s, lse, dsum,
             scale, static_cast<bf16*>(dk), static_cast<bf16*>(dv), acc, static_cast<const float2*>(cs));
      TROUPE_CUDA_LAUNCH_CHECK();
      const int64_t blocks = s.batch * s.q_heads * ceil_div(s.seq, int64_t{kN});
      launch(env, attention_dq_convert_kernel<d(), kN>, dim3(static_cast<unsigned>(blocks)), 256, 0, s,
             static_cast<const float*>(acc), scale, static_cast<bf16*>(dq), static_cast<const float2*>(cs));
      TROUPE_CUDA_LAUNCH_CHECK();
    });
    return rope != nullptr;
  }
  launch_attention_rowdot(env, s, out, dout, dsum, DType::kBF16);
  dispatch_head_dim(s.head_dim, [&](auto d) {
    using L = typename BwdCfg<d()>::S;
    constexpr int kN = BwdCfg<d()>::kStream;
    {
      const CUtensorMap mq = head_map(q, s, s.q_heads, kN), mdo = head_map(dout, s, s.q_heads, kN);
      auto kernel = attention_dkdv_hopper_kernel<d()>;
      allow_smem(kernel, L::kBytes);
      launch(env, kernel, block_grid(s, s.kv_heads), kThreads, L::kBytes, mq, mdo, mk, mv, s, lse, dsum,
             scale, static_cast<bf16*>(dk), static_cast<bf16*>(dv));
      TROUPE_CUDA_LAUNCH_CHECK();
    }
    {
      const CUtensorMap mq_own = head_map(q, s, s.q_heads, kBlockRows),
                        mdo_own = head_map(dout, s, s.q_heads, kBlockRows);
      const CUtensorMap mk_s = head_map(k, s, s.kv_heads, kN), mv_s = head_map(v, s, s.kv_heads, kN);
      auto kernel = attention_dq_hopper_kernel<d()>;
      allow_smem(kernel, L::kBytes);
      launch(env, kernel, block_grid(s, s.q_heads), kThreads, L::kBytes, mq_own, mdo_own, mk_s, mv_s, s, lse,
             dsum, scale, static_cast<bf16*>(dq));
    }
  });
  TROUPE_CUDA_LAUNCH_CHECK();
  return false;
}

}  // namespace troupe::kernels::gpu
