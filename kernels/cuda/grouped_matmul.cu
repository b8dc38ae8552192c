// kernels/cuda/grouped_matmul.cu — grouped matmul over per-expert row segments, forward
// and backward, each one launch for all experts with the segment offsets read on the
// device (no host loop over experts, no host sync).
//
// bf16 operands use a tensor-core kernel (mma.sync m16n8k16, fp32 accumulation): 128x128
// output tiles, 32-deep k steps, a 4-stage cp.async pipeline and ldmatrix operand loads.
// Two problem shapes share it:
// - row segments (forward, dx): C[rows of e, :] = A[rows of e, :] @ B_e, blocks of the
//   second grid axis are mapped to (expert, row tile) by scanning the offsets;
// - k segments (dW): C_e = A_e^T @ B_e summed over the rows of expert e (grid axis z = e).
// On a Hopper GPU (sm_90a build) the default is a wgmma kernel instead (see "Hopper kernel"
// below): 128 x 256 tiles, a persistent grid, operands in 128-byte-swizzled shared memory,
// loaded by TMA from a producer warpgroup (forward, dx, f32 dW) or by cp.async (bf16 dW).
// f32 operands (and shapes the tensor-core path cannot take: dims not multiples of 8,
// misaligned pointers) use a plain one-thread-per-output kernel with fp32 accumulation.
#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

namespace {

using bf16 = __nv_bfloat16;
using namespace hopper;  // NOLINT(build/namespaces): the Hopper building blocks

constexpr int kBM = 128, kBN = 128, kPad = 8;

// Elements of one operand tile in shared memory (either stored orientation), and the
// dynamic shared memory of a kStages-deep pipeline of A and B tiles.
template <int kBK>
struct TileSize {
  static constexpr int kA = kBM * (kBK + kPad), kB = kBK * (kBM + kPad);
  static constexpr int kElems = kA > kB ? kA : kB;
};
template <int kBK, int kStages>
constexpr size_t gemm_smem_bytes() {
  return size_t{2} * kStages * TileSize<kBK>::kElems * sizeof(bf16);
}

// 16-byte asynchronous copy global -> shared; zero-fills when `valid` is false.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Issues the cp.async copies of one "outer x inner" tile (inner contiguous, a multiple of
// 8) into smem [kOuter][kInner + kPad]; elements outside [o_lim) x [i_lim) become zero.
template <int kOuter, int kInner, int kGemmThreads>
__device__ __forceinline__ void tile_async(bf16* smem, const bf16* base, int64_t ld, int64_t o0, int64_t o_lim,
                                           int64_t i0, int64_t i_lim) {
  constexpr int kVecs = kOuter * kInner / 8;
#pragma unroll
  for (int r = 0; r < kVecs / kGemmThreads; ++r) {
    const int v = r * kGemmThreads + threadIdx.x;
    const int o = v / (kInner / 8), i = (v % (kInner / 8)) * 8;
    const int64_t go = o0 + o, gi = i0 + i;
    const bool valid = go < o_lim && gi < i_lim;  // dims are multiples of 8: whole vectors
    cp_async16(smem + o * (kInner + kPad) + i, valid ? base + go * ld + gi : base, valid);
  }
}

struct GemmArgs {
  const bf16* a;
  const bf16* b;
  void* c;
  const int32_t* offsets;
  int64_t experts;
  int64_t m, n, k;  // the fixed dimensions (m unused for row segments, k unused for k segments)
  int64_t lda, ldb, ldc;
  int64_t b_expert_stride, c_expert_stride;
  bool accumulate;
  // k segments with a written f32 dW on the TMA kernel (null elsewhere): slot
  // 8 * tile + 4 * consumer warpgroup + warp receives that warp's sum of squares of its
  // accumulators inside the matrix (launch_grouped_matmul_dw's sum_squares).
  float* sum_squares;
};

// kSegK = false: row segments, A row-major (A(m,k) = a[m*lda+k]); B row-major
// (B(k,n) = b[k*ldb+n]) or, with kBCol, column-major (b[n*ldb+k]).
// kSegK = true: k segments, A(m,k) = a[k*lda+m] (column-major), B row-major.
// 2 x kWN warps, each computing 64 x (128 / kWN) with mma.sync m16n8k16; operands come
// from a kStages-deep cp.async pipeline through ldmatrix (.trans where the stored layout
// is the transpose of the fragment's).
template <bool kSegK, bool kBCol, typename OutT, int kWN, int kBK, int kStages>
__global__ void __launch_bounds__(64 * kWN) grouped_gemm_mma_kernel(GemmArgs args) {
  pdl_wait();
  constexpr bool kACol = kSegK;
  constexpr int kTileElems = TileSize<kBK>::kElems;
  constexpr int kGemmThreads = 64 * kWN, kWarpN = kBN / kWN, kNT = kWarpN / 8;
  extern __shared__ __align__(128) unsigned char gemm_smem[];
  bf16* smem_a = reinterpret_cast<bf16*>(gemm_smem);
  bf16* smem_b = smem_a + kStages * kTileElems;

  // ---- which problem and tile this block computes ----
  int64_t e = 0, row0 = 0, m_lim = 0, k_lim = 0, tile_m = 0;
  if constexpr (kSegK) {
    e = blockIdx.z;
    row0 = args.offsets[e];
    k_lim = args.offsets[e + 1] - row0;
    m_lim = args.m;
    tile_m = blockIdx.y;
  } else {
    int64_t seen = 0;
    bool found = false;
    for (int64_t x = 0; x < args.experts && !found; ++x) {
      const int64_t rows = args.offsets[x + 1] - args.offsets[x];
      const int64_t tiles = (rows + kBM - 1) / kBM;
      if (blockIdx.y < seen + tiles) {
        e = x;
        tile_m = blockIdx.y - seen;
        row0 = args.offsets[x];
        m_lim = rows;
        found = true;
      }
      seen += tiles;
    }
    if (!found) return;
    k_lim = args.k;
  }
  const int64_t m0 = tile_m * kBM, n0 = int64_t{blockIdx.x} * kBN;
  const bf16* a = args.a + row0 * args.lda;
  const bf16* b = args.b + (kSegK ? row0 * args.ldb : e * args.b_expert_stride);

  auto issue = [&](int64_t kt, int stage) {
    const int64_t k0 = kt * kBK;
    bf16* sa = smem_a + stage * kTileElems;
    bf16* sb = smem_b + stage * kTileElems;
    if constexpr (kACol) {
      tile_async<kBK, kBM, kGemmThreads>(sa, a, args.lda, k0, k_lim, m0, m_lim);
    } else {
      tile_async<kBM, kBK, kGemmThreads>(sa, a, args.lda, m0, m_lim, k0, k_lim);
    }
    if constexpr (kBCol) {
      tile_async<kBN, kBK, kGemmThreads>(sb, b, args.ldb, n0, args.n, k0, k_lim);
    } else {
      tile_async<kBK, kBN, kGemmThreads>(sb, b, args.ldb, k0, k_lim, n0, args.n);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / kWN, wn = warp % kWN;
  float acc[4][kNT][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

  const int64_t k_tiles = (k_lim + kBK - 1) / kBK;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < k_tiles) issue(st, st);
    cp_async_commit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt landed for everyone; stage (kt-1) % kStages is free again
    if (kt + kStages - 1 < k_tiles) issue(kt + kStages - 1, static_cast<int>((kt + kStages - 1) % kStages));
    cp_async_commit();
    const bf16* sa = smem_a + (kt % kStages) * kTileElems;
    const bf16* sb = smem_b + (kt % kStages) * kTileElems;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t fa[4][4], fb[kNT][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int mrow = wm * 64 + i * 16;
        if constexpr (kACol) {  // stored [k][m]
          const int kr = kk + (lane % 8) + (lane / 16) * 8, mc = mrow + ((lane / 8) % 2) * 8;
          ldsm_x4_trans(fa[i], sa + kr * (kBM + kPad) + mc);
        } else {  // stored [m][k]
          ldsm_x4(fa[i], sa + (mrow + lane % 16) * (kBK + kPad) + kk + (lane / 16) * 8);
        }
      }
#pragma unroll
      for (int j = 0; j < kNT; j += 2) {
        const int ncol = wn * kWarpN + j * 8;
        uint32_t r[4];
        if constexpr (kBCol) {  // stored [n][k]
          const int nr = ncol + (lane % 8) + (lane / 16) * 8, kc = kk + ((lane / 8) % 2) * 8;
          ldsm_x4(r, sb + nr * (kBK + kPad) + kc);
        } else {  // stored [k][n]
          ldsm_x4_trans(r, sb + (kk + lane % 16) * (kBN + kPad) + ncol + (lane / 16) * 8);
        }
        fb[j][0] = r[0];
        fb[j][1] = r[1];
        fb[j + 1][0] = r[2];
        fb[j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < kNT; ++j) mma16816(acc[i][j], fa[i], fb[j][0], fb[j][1]);
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: straight from the accumulators (rows g / g+8, column pairs 2t, 2t+1) ----
  OutT* c = static_cast<OutT*>(args.c) + (kSegK ? e * args.c_expert_stride : row0 * args.ldc);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int64_t gn = n0 + wn * kWarpN + j * 8 + 2 * t;
      if (gn >= args.n) continue;  // n is a multiple of 8: the pair is in or out together
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t gm = m0 + wm * 64 + i * 16 + g + half * 8;
        if (gm >= m_lim) continue;
        float v0 = acc[i][j][2 * half], v1 = acc[i][j][2 * half + 1];
        OutT* p = c + gm * args.ldc + gn;
        if (args.accumulate) {
          v0 += to_float(p[0]);
          v1 += to_float(p[1]);
        }
        if constexpr (std::is_same_v<OutT, float>) {
          *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
  }
}

// ---- Hopper (sm_90a) kernel: wgmma from swizzled shared memory ------------------------
// 128 x kBN output tiles (kBN 128 or 256), 64-deep k steps, two consumer warpgroups of
// 64 x kBN each. Operand tiles are filled by cp.async (16-byte chunks, zero-filled outside
// the problem, which is what masks segment ends) into the 128-byte-swizzled layout that
// wgmma reads through shared-memory descriptors: a K-major operand is stored as rows of 64
// k-elements (128 bytes); an MN-major one (A of dW, B of the forward) as atoms of 64 k-rows
// x 64 MN-elements. The grid is persistent: block b computes tiles b, b + grid, ... and
// the loads run kStages - 2 k-steps ahead across tile boundaries, so the next tile's first
// loads overlap the current tile's epilogue. One wgmma group stays in flight: the buffer a
// step refills was last read two steps earlier, which every warpgroup has waited for
// before the barrier that precedes the refill.
constexpr int kWgBM = 128, kWgBK = 64, kWgThreads = 256;
constexpr int kAtomBytes = 64 * 128;  // one swizzle atom of an MN-major tile: 64 rows x 128 B

template <int kBN, int kStages>
constexpr size_t wgmma_smem_bytes() {
  return size_t{kStages} * (kWgBM * kWgBK + kWgBK * kBN) * sizeof(bf16) + 1024;  // + alignment slack
}

// The tile a persistent block works on, decoded from its index.
struct WgTile {
  int64_t e = 0, row0 = 0, m0 = 0, n0 = 0, m_lim = 0, k_lim = 0;
  int64_t k_steps = 0;  // >= 1: an empty k range still runs one all-zero step (the epilogue writes 0)
};

// Row segments of kTableMinExperts to kTableExperts experts: the TMA kernel keeps each
// expert's first row tile and first row in shared memory (TileTable, 8 bytes an expert
// past the kernel's other shared memory), so that finding a tile's expert is a binary
// search there instead of a scan of the offsets in global memory, one dependent load per
// expert before the tile's first product. With 64 experts of hidden 256 (H200,
// kernel_bench, bench/RESULTS.md) the down projection went from 0.229-0.231 to 0.163-0.166
// ms and the up projection's dx from 0.320-0.322 to 0.251-0.253. The table is a kernel of
// its own (grouped_gemm_tma_kernel's kTable): with it a runtime branch of the one kernel,
// bench_1b (16 experts, which keep the scan) ran 2.3-2.9% slower end to end than before,
// in two calls, though its kernels timed alone did not; the kernel without the table is
// the earlier one, instruction for instruction (its PTX is). More than kTableExperts
// experts keep the scan too.
constexpr int kTableMinExperts = 32, kTableExperts = 1024;
__host__ __device__ constexpr bool use_tile_table(int64_t experts) {
  return experts >= kTableMinExperts && experts <= kTableExperts;
}
// The table's shared memory for `experts` experts (row segments; 0 where the scan runs).
constexpr size_t tile_table_bytes(int64_t experts) {
  return use_tile_table(experts) ? static_cast<size_t>(2 * (experts + 1)) * sizeof(int32_t) : 0;
}
struct TileTable {
  const int32_t* first_tile = nullptr;  // [E + 1]: row tiles of the experts before e
  const int32_t* first_row = nullptr;   // [E + 1]: the offsets
};

// Fills the table from the offsets: one warp, 32 experts a step (a warp scan of the tile
// counts).
__device__ __forceinline__ void fill_tile_table(const GemmArgs& args, int32_t* first_tile, int32_t* first_row,
                                                int lane) {
  const int experts = static_cast<int>(args.experts);
  int carry = 0;
  for (int base = 0; base < experts; base += 32) {
    const int x = base + lane;
    int lo = 0, tiles = 0;
    if (x < experts) {
      lo = args.offsets[x];
      tiles = (args.offsets[x + 1] - lo + kWgBM - 1) / kWgBM;
    }
    int incl = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (x < experts) {
      first_tile[x] = carry + incl - tiles;
      first_row[x] = lo;
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) {
    first_tile[experts] = carry;
    first_row[experts] = args.offsets[experts];
  }
}

// A row tile's expert from the TileTable (row segments): a binary search of the table.
template <int kBN>
__device__ __forceinline__ bool wg_decode_table(const GemmArgs& args, int64_t t, int64_t tiles_n,
                                                WgTile& tile, const TileTable& table) {
  const int64_t nt = t % tiles_n, mt = t / tiles_n;
  tile.n0 = nt * kBN;
  const int experts = static_cast<int>(args.experts);
  if (mt >= table.first_tile[experts]) return false;
  int lo = 0, hi = experts;  // first_tile[lo] <= mt < first_tile[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (table.first_tile[mid] <= mt) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  tile.e = lo;
  tile.row0 = table.first_row[lo];
  tile.m0 = (mt - table.first_tile[lo]) * kWgBM;
  tile.m_lim = table.first_row[lo + 1] - tile.row0;
  tile.k_lim = args.k;
  tile.k_steps = (args.k + kWgBK - 1) / kWgBK;
  return true;
}

template <bool kSegK, int kBN>
__device__ __forceinline__ bool wg_decode(const GemmArgs& args, int64_t t, int64_t tiles_n, WgTile& tile) {
  const int64_t nt = t % tiles_n, mt = t / tiles_n;
  tile.n0 = nt * kBN;
  if constexpr (kSegK) {
    const int64_t tiles_m = (args.m + kWgBM - 1) / kWgBM;
    tile.e = mt / tiles_m;
    if (tile.e >= args.experts) return false;
    tile.m0 = (mt % tiles_m) * kWgBM;
    tile.row0 = args.offsets[tile.e];
    tile.k_lim = args.offsets[tile.e + 1] - tile.row0;
    tile.m_lim = args.m;
  } else {
    int64_t seen = 0;
    for (int64_t x = 0; x < args.experts; ++x) {
      const int64_t lo = args.offsets[x], rows = args.offsets[x + 1] - lo;
      const int64_t tiles = (rows + kWgBM - 1) / kWgBM;
      if (mt < seen + tiles) {
        tile.e = x;
        tile.row0 = lo;
        tile.m0 = (mt - seen) * kWgBM;
        tile.m_lim = rows;
        tile.k_lim = args.k;
        tile.k_steps = (args.k + kWgBK - 1) / kWgBK;
        return true;
      }
      seen += tiles;
    }
    return false;
  }
  tile.k_steps = tile.k_lim > 0 ? (tile.k_lim + kWgBK - 1) / kWgBK : 1;
  return true;
}

// Cursor over the (tile, k step) sequence of one persistent block.
// kTable (row segments): tiles decoded from a TileTable, given to start().
template <bool kSegK, int kBN, bool kTable = false>
struct WgCursor {
  WgTile tile;
  int64_t t = 0, kt = 0, tiles_n = 0;
  bool live = false;
  TileTable table;
  __device__ __forceinline__ bool decode(const GemmArgs& args) {
    if constexpr (kTable) {
      return wg_decode_table<kBN>(args, t, tiles_n, tile, table);
    } else {
      return wg_decode<kSegK, kBN>(args, t, tiles_n, tile);
    }
  }
  __device__ __forceinline__ void start(const GemmArgs& args, int64_t tn, const TileTable& tt = {}) {
    tiles_n = tn;
    t = blockIdx.x;
    kt = 0;
    if constexpr (kTable) table = tt;
    live = decode(args);
  }
  __device__ __forceinline__ void advance(const GemmArgs& args) {
    if (++kt < tile.k_steps) return;
    next_tile(args);
  }
  __device__ __forceinline__ void next_tile(const GemmArgs& args) {
    kt = 0;
    t += gridDim.x;
    live = decode(args);
  }
};

template <bool kSegK, bool kBCol, typename OutT, int kBN, int kStages>
__global__ void __launch_bounds__(kWgThreads, 1) grouped_gemm_wgmma_kernel(GemmArgs args) {
  pdl_wait();
#ifdef TROUPE_WGMMA_DEVICE
  static_assert(kStages >= 3, "one wgmma group in flight needs kStages - 2 >= 1 steps of prefetch");
  constexpr int kAStage = kWgBM * kWgBK * 2, kBStage = kWgBK * kBN * 2;  // bytes
  constexpr int kAhead = kStages - 2;
  constexpr int kAcc = kBN / 2;  // f32 accumulators per thread (64 x kBN per warpgroup)
  extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
  const uint32_t raw = smem_addr(wg_smem_raw);
  const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
  unsigned char* smem = wg_smem_raw + pad;  // 1024-byte aligned: the swizzle pattern's period
  const uint32_t smem_s = raw + pad;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t tiles_n = (args.n + kBN - 1) / kBN;

  // Issues the loads of one k step of `cur` into buffer `buf`.
  auto issue = [&](const WgCursor<kSegK, kBN>& cur, int buf) {
    unsigned char* sa = smem + buf * (kAStage + kBStage);
    unsigned char* sb = sa + kAStage;
    const WgTile& tl = cur.tile;
    const int64_t k0 = cur.kt * kWgBK;
    const bf16* a = args.a + tl.row0 * args.lda;
    const bf16* b = args.b + (kSegK ? tl.row0 * args.ldb : tl.e * args.b_expert_stride);
    // A: 128 x 64 = 1024 chunks of 8 elements, 4 per thread.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = i * kWgThreads + tid;
      if constexpr (kSegK) {  // MN-major: A(m, k) = a[k*lda + m]; atoms [64 k][64 m]
        const int kr = v / 16, mc = v % 16, atom = mc / 8, c = mc % 8;
        const int64_t gk = k0 + kr, gm = tl.m0 + mc * 8;
        const bool ok = gk < tl.k_lim && gm < tl.m_lim;
        cp_async16(sa + atom * kAtomBytes + kr * 128 + ((c ^ (kr & 7)) << 4), ok ? a + gk * args.lda + gm : a, ok);
      } else {  // K-major: A(m, k) = a[m*lda + k]; rows of 64 k
        const int r = v / 8, c = v % 8;
        const int64_t gm = tl.m0 + r, gk = k0 + c * 8;
        const bool ok = gm < tl.m_lim && gk < tl.k_lim;
        cp_async16(sa + r * 128 + ((c ^ (r & 7)) << 4), ok ? a + gm * args.lda + gk : a, ok);
      }
    }
    // B: 64 x kBN = 8 * kBN chunks.
#pragma unroll
    for (int i = 0; i < kBN * 8 / kWgThreads; ++i) {
      const int v = i * kWgThreads + tid;
      if constexpr (kBCol) {  // K-major: B(k, n) = b[n*ldb + k]; rows of 64 k
        const int r = v / 8, c = v % 8;
        const int64_t gn = tl.n0 + r, gk = k0 + c * 8;
        const bool ok = gn < args.n && gk < tl.k_lim;
        cp_async16(sb + r * 128 + ((c ^ (r & 7)) << 4), ok ? b + gn * args.ldb + gk : b, ok);
      } else {  // MN-major: B(k, n) = b[k*ldb + n]; atoms [64 k][64 n]
        constexpr int kRowChunks = kBN / 8;
        const int kr = v / kRowChunks, nc = v % kRowChunks, atom = nc / 8, c = nc % 8;
        const int64_t gk = k0 + kr, gn = tl.n0 + nc * 8;
        const bool ok = gk < tl.k_lim && gn < args.n;
        cp_async16(sb + atom * kAtomBytes + kr * 128 + ((c ^ (kr & 7)) << 4), ok ? b + gk * args.ldb + gn : b, ok);
      }
    }
  };

  WgCursor<kSegK, kBN> ld, cs;
  ld.start(args, tiles_n);
  cs = ld;
  if (!cs.live) return;

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (ld.live) {
      issue(ld, s);
      ld.advance(args);
    }
    cp_async_commit();
  }
  const int warp_in_wg = (tid % 128) / 32, lane = tid % 32;
  int64_t step = 0;  // k steps consumed by this block so far (over all its tiles)
  while (cs.live) {
    for (int64_t kt = 0; kt < cs.tile.k_steps; ++kt, ++step) {
      cp_async_wait<kAhead - 1>();
      fence_proxy_async();  // make this thread's cp.async writes visible to the tensor cores
      __syncthreads();
      if (ld.live) {
        issue(ld, static_cast<int>((step + kAhead) % kStages));
        ld.advance(args);
      }
      cp_async_commit();

      const int buf = static_cast<int>(step % kStages);
      const uint32_t sa = smem_s + buf * (kAStage + kBStage), sb = sa + kAStage;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kWgBK / 16; ++kk) {
        const uint64_t da = kSegK ? smem_desc(sa + wg * kAtomBytes + kk * 2048, kAtomBytes, 1024)
                                  : smem_desc(sa + wg * 64 * 128 + kk * 32, 16, 1024);
        const uint64_t db = kBCol ? smem_desc(sb + kk * 32, 16, 1024) : smem_desc(sb + kk * 2048, kAtomBytes, 1024);
        // The first k step of a tile overwrites the accumulators (scale-d 0) instead of
        // zeroing them, which would make the compiler touch registers still in flight.
        const int scale_d = (kk > 0 || kt > 0) ? 1 : 0;
        if constexpr (kBN == 256) {
          wgmma_m64n256k16<kSegK ? 1 : 0, kBCol ? 0 : 1>(acc, da, db, scale_d);
        } else {
          wgmma_m64n128k16<kSegK ? 1 : 0, kBCol ? 0 : 1>(acc, da, db, scale_d);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(acc);
    }
    wgmma_wait<0>();
    fence_regs(acc);
    // Epilogue: accumulator j*4 + h*2 + c is row 16*warp + lane/4 + 8h, column 8j + 2*(lane%4) + c.
    const WgTile& tl = cs.tile;
    OutT* c = static_cast<OutT*>(args.c) + (kSegK ? tl.e * args.c_expert_stride : tl.row0 * args.ldc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t gm = tl.m0 + wg * 64 + warp_in_wg * 16 + lane / 4 + 8 * h;
      if (gm < tl.m_lim) {
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
          const int64_t gn = tl.n0 + j * 8 + 2 * (lane % 4);
          if (gn < args.n) {  // n is a multiple of 8: the pair is in or out together
            float v0 = acc[j * 4 + h * 2], v1 = acc[j * 4 + h * 2 + 1];
            OutT* p = c + gm * args.ldc + gn;
            if (args.accumulate) {
              v0 += to_float(p[0]);
              v1 += to_float(p[1]);
            }
            if constexpr (std::is_same_v<OutT, float>) {
              *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
            } else {
              *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
            }
          }
        }
      }
    }
    cs.next_tile(args);
  }
  cp_async_wait<0>();
#else
  (void)args;
  __trap();  // built without sm_90a: the launcher never selects this kernel then
#endif
}

template <bool kSegK, bool kBCol, typename OutT, int kBN, int kStages>
void launch_gemm_wgmma(const Env& env, int64_t tiles_bound, const GemmArgs& args) {
  auto kernel = grouped_gemm_wgmma_kernel<kSegK, kBCol, OutT, kBN, kStages>;
  constexpr size_t smem = wgmma_smem_bytes<kBN, kStages>();
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(tiles_bound, env.num_sms));
  launch(env, kernel, static_cast<unsigned>(grid), kWgThreads, smem, args);
  TROUPE_CUDA_LAUNCH_CHECK();
}

template <bool kSegK, bool kBCol, typename OutT, int kWN, int kBK, int kStages>
void launch_gemm_tiled(const Env& env, dim3 grid, const GemmArgs& args) {
  auto kernel = grouped_gemm_mma_kernel<kSegK, kBCol, OutT, kWN, kBK, kStages>;
  constexpr size_t smem = gemm_smem_bytes<kBK, kStages>();
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  launch(env, kernel, grid, 64 * kWN, smem, args);
  TROUPE_CUDA_LAUNCH_CHECK();
}

// ---- Hopper kernel, TMA + warp-specialised variant -----------------------------------
// Same tiles and smem layouts as above (128 x 256, 64-deep k steps, 128-byte swizzle), but
// the operands arrive by the tensor-memory accelerator: warpgroup 0 is the producer (one
// thread issues the bulk tensor copies of each stage, completing on that stage's "full"
// mbarrier), warpgroups 1 and 2 are the consumers (64 x 256 each) that release a stage on
// its "empty" mbarrier once their wgmma reading it has completed. The producer runs up to
// kTmaStages steps ahead across tile boundaries, so the consumers' epilogue overlaps the
// next tile's loads. Rows past a segment's end come from the next expert (the tensor maps
// see the whole [T, .] tensor): harmless for row segments (those output rows are not
// stored); for k segments (dW) the consumers zero those k-rows of A and B before the
// wgmma. Past the tensor's end TMA fills zeros.
//
// Row segments with a bf16 output store full tiles through shared memory and TMA too: each
// consumer writes its 64 x 256 half into a swizzled staging buffer, one thread issues the
// bulk stores, and the warpgroup goes on with the next tile's products while they drain
// (the buffer is reused one tile later, after the stores have read it). A tile that crosses
// its segment's end keeps the direct stores (a box would write the next expert's rows).
// The staging takes one pipeline stage's room: 3 stages instead of 4.
// dW with an f32 output (k segments) stages the same way, each warpgroup's 64 x 256 in two
// rounds of 64 x 128 (4 boxes of 32 f32 columns), and reduces into the output with the
// TMA's add where the product accumulates; every tile of dW is whole (the map's bounds clip
// rows and columns past the expert's matrix). Where dW is written, that epilogue can also
// leave each warp's sum of squares of its accumulators in a slot (GemmArgs::sum_squares):
// the gradient norm folded into the product, a few FMAs per accumulator.
// A written bf16 dW takes the row outputs' staging instead (one round of 4 bf16 boxes),
// and its sum of squares is that of the rounded values it stores.
constexpr int kTmaBN = 256, kTmaThreads = 384;
// v as an O holds it (the value a store of v into an O keeps), as a float.
template <typename O>
__device__ __forceinline__ float round_as(float v) {
  return to_float(from_float<O>(v));
}
constexpr int kTmaStageBytes = kWgBM * kWgBK * 2 + kWgBK * kTmaBN * 2;
constexpr int kStagingBytes = 65536;  // two warpgroups' 32 KB: bf16 64 x 256, or f32 64 x 128
template <bool kSegK, typename OutT>
struct TmaConfig {
  static constexpr bool kStoreRows = !kSegK && std::is_same_v<OutT, bf16>;  // staged TMA stores
  // A bf16 dW stages only where it is written (launch_gemm keeps an adding bf16 dW on the
  // cp.async kernel, whose rounding of the sum it has always had).
  static constexpr bool kStoreDw = kSegK;
  static constexpr bool kStore = kStoreRows || kStoreDw;
  static constexpr int kStages = kStore ? 3 : 4;
  // Without the TileTable, which row segments add at launch (tile_table_bytes).
  static constexpr size_t kSmem =
      size_t{kStages} * kTmaStageBytes + (kStore ? kStagingBytes : 0) + 1024 + 2 * kStages * sizeof(uint64_t);
  static_assert(kSmem + tile_table_bytes(kTableExperts) <= 227 * 1024, "shared memory of one block");
};

#ifdef TROUPE_WGMMA_DEVICE
// Bulk tensor store of one box from shared memory (completes in the thread's bulk group).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Bulk tensor reduction (add) of one box from shared memory into global memory.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                                  int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::
          "l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Until this thread's bulk stores have read their shared-memory source.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until this thread's bulk stores have completed.
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
#endif

// kTable (row segments, use_tile_table): tiles found through a TileTable in shared memory.
template <bool kSegK, bool kBCol, typename OutT, bool kTable = false>
__global__ void __launch_bounds__(kTmaThreads, 1)
    grouped_gemm_tma_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_c, GemmArgs args) {
  pdl_wait();
#ifdef TROUPE_WGMMA_DEVICE
  constexpr int kAStage = kWgBM * kWgBK * 2;
  constexpr int kTmaStages = TmaConfig<kSegK, OutT>::kStages;
  constexpr bool kStore = TmaConfig<kSegK, OutT>::kStore;
  constexpr bool kStoreDw = TmaConfig<kSegK, OutT>::kStoreDw;
  extern __shared__ __align__(1024) unsigned char tma_smem_raw[];
  const uint32_t raw = smem_addr(tma_smem_raw);
  const uint32_t smem_s = (raw + 1023) & ~1023u;
  unsigned char* smem = tma_smem_raw + (smem_s - raw);
  const uint32_t staging0 = smem_s + kTmaStages * kTmaStageBytes;  // kStore: 2 x 32 KB
  const uint32_t full0 = staging0 + (kStore ? kStagingBytes : 0);  // kTmaStages "full" then "empty" barriers
  const uint32_t empty0 = full0 + kTmaStages * 8;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t tiles_n = (args.n + kTmaBN - 1) / kTmaBN;
  static_assert(!kTable || !kSegK, "the tile table is for row segments");
  TileTable table;
  if constexpr (kTable) {
    int32_t* first_tile = reinterpret_cast<int32_t*>(smem + (empty0 + kTmaStages * 8 - smem_s));
    int32_t* first_row = first_tile + args.experts + 1;
    if (tid >= 32 && tid < 64) fill_tile_table(args, first_tile, first_row, tid - 32);
    table = {first_tile, first_row};
  }
  if (tid == 0) {
    for (int s = 0; s < kTmaStages; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 2);  // one arrival per consumer warpgroup
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      WgCursor<kSegK, kTmaBN, kTable> ld;
      ld.start(args, tiles_n, table);
      for (int64_t i = 0; ld.live; ++i) {
        const int s = static_cast<int>(i % kTmaStages);
        mbar_wait(empty0 + 8 * s, static_cast<uint32_t>(((i / kTmaStages) & 1) ^ 1));
        const uint32_t full = full0 + 8 * s, sa = smem_s + s * kTmaStageBytes, sb = sa + kAStage;
        mbar_expect_tx(full, kTmaStageBytes);
        const WgTile& tl = ld.tile;
        const int k0 = static_cast<int>(ld.kt * kWgBK);
        if constexpr (kSegK) {  // A = l [T, P] (MN-major atoms), B = r [T, Q] (MN-major atoms)
          const int kr = static_cast<int>(tl.row0) + k0;
          for (int a = 0; a < 2; ++a) tma_load_3d(sa + a * kAtomBytes, &map_a, full, static_cast<int>(tl.m0) + 64 * a, kr, 0);
          for (int a = 0; a < kTmaBN / 64; ++a) {
            tma_load_3d(sb + a * kAtomBytes, &map_b, full, static_cast<int>(tl.n0) + 64 * a, kr, 0);
          }
        } else {
          tma_load_3d(sa, &map_a, full, k0, static_cast<int>(tl.row0 + tl.m0), 0);
          if constexpr (kBCol) {  // W as [E][N][K]: one box of 256 rows of 64 k
            tma_load_3d(sb, &map_b, full, k0, static_cast<int>(tl.n0), static_cast<int>(tl.e));
          } else {  // W as [E][K][N]: atoms of 64 k-rows x 64 n
            for (int a = 0; a < kTmaBN / 64; ++a) {
              tma_load_3d(sb + a * kAtomBytes, &map_b, full, static_cast<int>(tl.n0) + 64 * a, k0,
                          static_cast<int>(tl.e));
            }
          }
        }
        ld.advance(args);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1, ctid = tid - 128 * wg, warp_in_wg = ctid / 32, lane = tid % 32;
    float acc[kTmaBN / 2];
#pragma unroll
    for (int i = 0; i < kTmaBN / 2; ++i) acc[i] = 0.0f;
    WgCursor<kSegK, kTmaBN, kTable> cs;
    cs.start(args, tiles_n, table);
    int64_t i = 0;
    while (cs.live) {
      for (int64_t kt = 0; kt < cs.tile.k_steps; ++kt, ++i) {
        const int s = static_cast<int>(i % kTmaStages);
        mbar_wait(full0 + 8 * s, static_cast<uint32_t>((i / kTmaStages) & 1));
        const uint32_t sa = smem_s + s * kTmaStageBytes, sb = sa + kAStage;
        if constexpr (kSegK) {
          const int64_t valid = cs.tile.k_lim - kt * kWgBK;  // k-rows of this step inside the segment
          if (valid < kWgBK) {
            // The k-rows past the segment's end are zeroed in A (this warpgroup's atom) and
            // in B (shared: each warpgroup zeroes half of its atoms, then both wait for
            // both): a zero in A alone leaves 0 * NaN where B's rows are not data (a buffer
            // of capacity rows filled up to a count on the device: parallel.device_dispatch).
            // Both consumers take the same tiles, so both come here at the same step.
            unsigned char* stage = smem + s * kTmaStageBytes;
            const int first = valid > 0 ? static_cast<int>(valid) : 0;
            for (int c = first * 8 + ctid; c < kWgBK * 8; c += 128) {
              const uint4 zero = make_uint4(0, 0, 0, 0);  // whole 128-byte rows of each atom
              *reinterpret_cast<uint4*>(stage + cw * kAtomBytes + c * 16) = zero;
              for (int a = cw * (kTmaBN / 128); a < (cw + 1) * (kTmaBN / 128); ++a)
                *reinterpret_cast<uint4*>(stage + kAStage + a * kAtomBytes + c * 16) = zero;
            }
            fence_proxy_async();
            asm volatile("bar.sync 3, 256;\n" ::: "memory");  // both consumer warpgroups
          }
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kWgBK / 16; ++kk) {
          const uint64_t da = kSegK ? smem_desc(sa + cw * kAtomBytes + kk * 2048, kAtomBytes, 1024)
                                    : smem_desc(sa + cw * 64 * 128 + kk * 32, 16, 1024);
          const uint64_t db = kBCol ? smem_desc(sb + kk * 32, 16, 1024) : smem_desc(sb + kk * 2048, kAtomBytes, 1024);
          wgmma_m64n256k16<kSegK ? 1 : 0, kBCol ? 0 : 1>(acc, da, db, (kk > 0 || kt > 0) ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(acc);
        // The previous step's wgmma (this warpgroup's) has completed: release its stage.
        if (kt > 0 && ctid == 0) mbar_arrive(empty0 + 8 * static_cast<int>((i - 1) % kTmaStages));
      }
      wgmma_wait<0>();
      fence_regs(acc);
      if (ctid == 0) mbar_arrive(empty0 + 8 * static_cast<int>((i - 1) % kTmaStages));
      const WgTile& tl = cs.tile;
      if constexpr (kStoreDw) {
        if (args.sum_squares != nullptr) {
          // The norm folded into the product: this warp's sum of squares of its 16 x 256
          // accumulators, in a fixed order (then a fixed butterfly), one slot per (tile,
          // warp): no atomics, bit-identical runs. Accumulators of rows or columns past
          // the matrix are zero (the TMA zero-fills A's columns >= m and B's >= n), but
          // are masked anyway: 0 * inf in them would turn a norm of inf into NaN.
          float ss = 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (tl.m0 + cw * 64 + warp_in_wg * 16 + lane / 4 + 8 * h < tl.m_lim) {
#pragma unroll
              for (int j = 0; j < kTmaBN / 8; ++j) {
                if (tl.n0 + j * 8 + 2 * (lane % 4) < args.n) {  // n is a multiple of 8: pairs in or out
                  // A bf16 dW: the squares of the values stored (rounded as the store rounds).
                  const float v0 = round_as<OutT>(acc[j * 4 + h * 2]);
                  const float v1 = round_as<OutT>(acc[j * 4 + h * 2 + 1]);
                  ss = fmaf(v0, v0, ss);
                  ss = fmaf(v1, v1, ss);
                }
              }
            }
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
          if (lane == 0) args.sum_squares[cs.t * 8 + cw * 4 + warp_in_wg] = ss;
        }
        const uint32_t stg_s = staging0 + cw * (kStagingBytes / 2);
        unsigned char* stg = smem + (stg_s - smem_s);
        if constexpr (std::is_same_v<OutT, bf16>) {
          // A written bf16 dW: the row outputs' staging (one round, 4 boxes of 64 columns),
          // stored into [E][m][n]; the map clips rows and columns past the expert's matrix.
          if (ctid == 0) bulk_wait_read();  // the previous tile's stores have read the buffer
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = warp_in_wg * 16 + lane / 4 + 8 * h;
#pragma unroll
            for (int j = 0; j < kTmaBN / 8; ++j) {
              const int off = (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4) + 4 * (lane % 4);
              *reinterpret_cast<__nv_bfloat162*>(stg + off) =
                  __floats2bfloat162_rn(acc[j * 4 + h * 2], acc[j * 4 + h * 2 + 1]);
            }
          }
          fence_proxy_async();
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
          if (ctid == 0) {
            const int row = static_cast<int>(tl.m0) + cw * 64, e = static_cast<int>(tl.e);
            for (int b = 0; b < kTmaBN / 64; ++b) {
              const int64_t col = tl.n0 + 64 * b;
              if (col >= args.n) break;
              tma_store_3d(&map_c, stg_s + b * 8192, static_cast<int>(col), row, e);
            }
            bulk_commit();
          }
          cs.next_tile(args);
          continue;
        }
        const int q = lane % 4;
#pragma unroll
        for (int round = 0; round < 2; ++round) {
          if (ctid == 0) bulk_wait_read();  // the previous round's (or tile's) stores have read the buffer
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = warp_in_wg * 16 + lane / 4 + 8 * h;
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) {
              const int j = round * 16 + jj;  // columns 8j + 2q, +1 of the tile
              const int off =
                  (jj / 4) * 8192 + r * 128 + (((2 * (jj % 4) + q / 2) ^ (r & 7)) << 4) + (q % 2) * 8;
              *reinterpret_cast<float2*>(stg + off) = make_float2(acc[j * 4 + h * 2], acc[j * 4 + h * 2 + 1]);
            }
          }
          fence_proxy_async();
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
          if (ctid == 0) {
            const int row = static_cast<int>(tl.m0) + cw * 64, e = static_cast<int>(tl.e);
            for (int b = 0; b < 4; ++b) {
              const int64_t col = tl.n0 + round * 128 + 32 * b;
              if (col >= args.n) break;
              if (args.accumulate) {
                tma_reduce_add_3d(&map_c, stg_s + b * 8192, static_cast<int>(col), row, e);
              } else {
                tma_store_3d(&map_c, stg_s + b * 8192, static_cast<int>(col), row, e);
              }
            }
            bulk_commit();
          }
        }
        cs.next_tile(args);
        continue;
      }
      if constexpr (kStore) {
        if (tl.m0 + kWgBM <= tl.m_lim) {  // the whole tile inside its segment
          const uint32_t stg_s = staging0 + cw * (kStagingBytes / 2);
          unsigned char* stg = smem + (stg_s - smem_s);
          if (ctid == 0) bulk_wait_read();  // the previous tile's stores have read the buffer
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
          // Row r of box b (64 columns, 128 bytes) holds its 16-byte chunk c at c ^ (r & 7):
          // the TMA's 128-byte swizzle, and a warp's 8 rows land in 8 different chunks.
          const int r0 = warp_in_wg * 16 + lane / 4;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
#pragma unroll
            for (int j = 0; j < kTmaBN / 8; ++j) {
              const int off = (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4) + 4 * (lane % 4);
              *reinterpret_cast<__nv_bfloat162*>(stg + off) =
                  __floats2bfloat162_rn(acc[j * 4 + h * 2], acc[j * 4 + h * 2 + 1]);
            }
          }
          fence_proxy_async();  // this thread's writes, visible to the bulk copies
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
          if (ctid == 0) {
            const int row = static_cast<int>(tl.row0 + tl.m0) + cw * 64;
            for (int b = 0; b < kTmaBN / 64; ++b) {
              const int64_t col = tl.n0 + 64 * b;
              if (col < args.n) tma_store_3d(&map_c, stg_s + b * 8192, static_cast<int>(col), row, 0);
            }
            bulk_commit();
          }
          cs.next_tile(args);
          continue;
        }
      }
      OutT* c = static_cast<OutT*>(args.c) + (kSegK ? tl.e * args.c_expert_stride : tl.row0 * args.ldc);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t gm = tl.m0 + cw * 64 + warp_in_wg * 16 + lane / 4 + 8 * h;
        if (gm < tl.m_lim) {
#pragma unroll
          for (int j = 0; j < kTmaBN / 8; ++j) {
            const int64_t gn = tl.n0 + j * 8 + 2 * (lane % 4);
            if (gn < args.n) {
              float v0 = acc[j * 4 + h * 2], v1 = acc[j * 4 + h * 2 + 1];
              OutT* p = c + gm * args.ldc + gn;
              if (args.accumulate) {
                v0 += to_float(p[0]);
                v1 += to_float(p[1]);
              }
              if constexpr (std::is_same_v<OutT, float>) {
                *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
              } else {
                *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
              }
            }
          }
        }
      }
      cs.next_tile(args);
    }
    if constexpr (kStore) {
      if (ctid == 0) bulk_wait();
    }
  }
#else
  (void)map_a;
  (void)map_b;
  (void)map_c;
  (void)args;
  __trap();
#endif
}

// The tensor maps of one problem (see GemmArgs): row segments read A = a [T, k] and B_e
// from b [E][k][n] (or [E][n][k] with kBCol); k segments read a [T, m] and b [T, n].
template <bool kSegK, bool kBCol, typename OutT>
void launch_gemm_tma(const Env& env, int64_t tiles_bound, int64_t tokens, const GemmArgs& args) {
  CUtensorMap map_a, map_b, map_c{};
  if constexpr (kSegK) {
    map_a = make_tensor_map(args.a, args.m, tokens, 1, 64, 64);
    map_b = make_tensor_map(args.b, args.n, tokens, 1, 64, 64);
  } else {
    map_a = make_tensor_map(args.a, args.k, tokens, 1, 64, kWgBM);
    if constexpr (kBCol) {
      map_b = make_tensor_map(args.b, args.k, args.n, args.experts, 64, kTmaBN);
    } else {
      map_b = make_tensor_map(args.b, args.n, args.k, args.experts, 64, 64);
    }
  }
  // The staged stores write C [tokens, n] (row segments: ldc == n) in bf16 boxes of 64 x 64,
  // or dW [E][m][n] (c_expert_stride == m * n) in f32 boxes of 32 x 64 (bf16: 64 x 64).
  if constexpr (TmaConfig<kSegK, OutT>::kStoreRows)
    map_c = make_tensor_map(args.c, args.n, tokens, 1, 64, 64);
  if constexpr (TmaConfig<kSegK, OutT>::kStoreDw) {
    constexpr bool kF32 = std::is_same_v<OutT, float>;
    TROUPE_CHECK(kF32 || !args.accumulate,
                 "grouped GEMM: the TMA kernel writes a bf16 dW, it does not add to one");
    map_c = make_tensor_map(args.c, args.n, args.m, args.experts, kF32 ? 32 : 64, 64, kF32);
  }
  auto kernel = grouped_gemm_tma_kernel<kSegK, kBCol, OutT>;
  if constexpr (!kSegK) {
    if (use_tile_table(args.experts)) kernel = grouped_gemm_tma_kernel<kSegK, kBCol, OutT, true>;
  }
  const size_t smem = TmaConfig<kSegK, OutT>::kSmem + (kSegK ? 0 : tile_table_bytes(args.experts));
  CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(tiles_bound, env.num_sms));
  launch(env, kernel, static_cast<unsigned>(grid), kTmaThreads, smem, map_a, map_b, map_c, args);
  TROUPE_CUDA_LAUNCH_CHECK();
}

// The configuration a request runs with: kAuto stays kAuto where the Hopper kernels can run
// (launch_gemm then picks one per problem); elsewhere it and every Hopper configuration
// fall back to the mma.sync default.
GemmTiling resolve_tiling(GemmTiling tiling) {
  const bool wants_hopper = tiling == GemmTiling::kAuto || tiling == GemmTiling::kWgmma128 ||
                            tiling == GemmTiling::kWgmma256 || tiling == GemmTiling::kWgmmaTma;
  if (!wants_hopper) return tiling;
  if (!wgmma_available()) return GemmTiling::kWarps2x2;
  return tiling;  // kAuto stays: launch_gemm picks per problem
}

// rows_bound: ceil(tokens / 128) + experts for row segments (an upper bound of the row
// tiles, whatever the device offsets say); ceil(m / 128) * experts for k segments.
// Returns whether the kernel that ran filled args.sum_squares (the TMA kernel, in its dW
// epilogue); the others ignore it.
template <bool kSegK, bool kBCol, typename OutT>
bool launch_gemm(const Env& env, int64_t rows_bound, int64_t tokens, const GemmArgs& args,
                 GemmTiling tiling) {
  constexpr bool kTmaFolds = TmaConfig<kSegK, OutT>::kStoreDw;
  const dim3 grid(static_cast<unsigned>(ceil_div(args.n, kBN)),
                  static_cast<unsigned>(kSegK ? ceil_div(args.m, kBM) : rows_bound),
                  static_cast<unsigned>(kSegK ? args.experts : 1));
  switch (resolve_tiling(tiling)) {
    case GemmTiling::kWarps2x2: launch_gemm_tiled<kSegK, kBCol, OutT, 2, 32, 4>(env, grid, args); break;
    case GemmTiling::kWarps2x4: launch_gemm_tiled<kSegK, kBCol, OutT, 4, 32, 4>(env, grid, args); break;
    case GemmTiling::kWarps2x2K64: launch_gemm_tiled<kSegK, kBCol, OutT, 2, 64, 3>(env, grid, args); break;
    case GemmTiling::kWgmma128:
      launch_gemm_wgmma<kSegK, kBCol, OutT, 128, 6>(env, rows_bound * ceil_div(args.n, 128), args);
      break;
    case GemmTiling::kWgmma256:
      launch_gemm_wgmma<kSegK, kBCol, OutT, 256, 4>(env, rows_bound * ceil_div(args.n, 256), args);
      break;
    case GemmTiling::kWgmmaTma:
      if (kSegK && !std::is_same_v<OutT, float> && args.accumulate) {  // (see kAuto)
        launch_gemm_wgmma<kSegK, kBCol, OutT, 256, 4>(env, rows_bound * ceil_div(args.n, 256), args);
        break;
      }
      launch_gemm_tma<kSegK, kBCol, OutT>(env, rows_bound * ceil_div(args.n, kTmaBN), tokens, args);
      return kTmaFolds;
    case GemmTiling::kAuto:
      // Measured (bench_1b shapes, bench/RESULTS.md): TMA wins the row-segment problems
      // (0.53 vs 0.75 ms forward, H200) and the f32 dW problems (down, written: 0.22 vs
      // 0.32 ms, H100 2026-11-26), since its staged epilogue also adds to the output in the
      // TMA's reduction. A written bf16 dW (train.expert_grads = "bf16") stages the same
      // way; an added bf16 dW keeps the cp.async kernel, as does a dW without tokens (a
      // tensor map needs rows).
      if constexpr (kSegK) {
        if ((!std::is_same_v<OutT, float> && args.accumulate) || tokens == 0) {
          launch_gemm_wgmma<kSegK, kBCol, OutT, 256, 4>(env, rows_bound * ceil_div(args.n, 256), args);
        } else {
          launch_gemm_tma<kSegK, kBCol, OutT>(env, rows_bound * ceil_div(args.n, kTmaBN), tokens, args);
          return kTmaFolds;
        }
      } else {
        launch_gemm_tma<kSegK, kBCol, OutT>(env, rows_bound * ceil_div(args.n, kTmaBN), tokens, args);
      }
      break;
  }
  return false;
}

// ---- plain fallback ------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ int64_t expert_of_row(const int32_t* offsets, int64_t experts, int64_t row) {
  int64_t lo = 0, hi = experts;  // last e with offsets[e] <= row
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid;
  }
  while (lo + 1 < experts && offsets[lo + 1] <= row) ++lo;  // skip empty experts
  return lo;
}

// out[t, n] = sum_k A(t, k) * B_e(k, n); B_e(k, n) = b[e*bs + k*b_sk + n*b_sn].
template <typename T>
__global__ void grouped_rows_plain_kernel(const T* a, const T* b, const int32_t* offsets, int64_t experts,
                                          int64_t rows, int64_t n, int64_t k, int64_t bs, int64_t b_sk, int64_t b_sn,
                                          T* out) {
  pdl_wait();
  const int64_t total = rows * n;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / n, col = i - t * n;
    const int64_t e = expert_of_row<T>(offsets, experts, t);
    const T* be = b + e * bs;
    float acc = 0.0f;
    for (int64_t kk = 0; kk < k; ++kk) acc += to_float(a[t * k + kk]) * to_float(be[kk * b_sk + col * b_sn]);
    out[i] = from_float<T>(acc);
  }
}

// dw_e[p, q] (+)= sum over rows r of e of l[r, p] * r_[r, q].
template <typename T, typename O>
__global__ void grouped_k_plain_kernel(const T* l, const T* r_, const int32_t* offsets, int64_t experts, int64_t p,
                                       int64_t q, O* dw, bool accumulate) {
  pdl_wait();
  const int64_t total = experts * p * q;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t e = i / (p * q), pq = i - e * p * q, pi = pq / q, qi = pq - pi * q;
    float acc = accumulate ? to_float(dw[i]) : 0.0f;
    for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) acc += to_float(l[row * p + pi]) * to_float(r_[row * q + qi]);
    dw[i] = from_float<O>(acc);
  }
}

// The second pass of a dW sum of squares where the product did not fold it: block b writes
// slots[b] = the sum of squares of x[b * chunk, (b + 1) * chunk) (double inside the block,
// a fixed order: deterministic); slots gridDim.x .. count - 1 get zeros.
template <typename O>
__global__ void __launch_bounds__(256)
    sum_squares_slots_kernel(const O* x, int64_t n, int64_t chunk, float* slots, int64_t count) {
  pdl_wait();
  __shared__ double shared[32];
  const int64_t lo = int64_t{blockIdx.x} * chunk, hi = lo + chunk < n ? lo + chunk : n;
  double s = 0.0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const double v = to_float(x[i]);
    s += v * v;
  }
  s = block_sum(s, shared);
  if (threadIdx.x == 0) slots[blockIdx.x] = static_cast<float>(s);
  for (int64_t i = gridDim.x + int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    slots[i] = 0.0f;
  }
}

template <typename O>
void launch_sum_squares_slots(const Env& env, const O* x, int64_t n, float* slots, int64_t count) {
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>({count, int64_t{env.num_sms} * 4, ceil_div(n, 2048)}));
  const int64_t chunk = ceil_div(n, blocks);
  launch(env, sum_squares_slots_kernel<O>, static_cast<unsigned>(blocks), 256, 0, x, n, chunk, slots, count);
  TROUPE_CUDA_LAUNCH_CHECK();
}

bool tensor_core_ok(DType t, std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> dims) {
  if (t != DType::kBF16) return false;
  for (const void* p : ptrs) {
    if (!aligned_to(p, 16)) return false;
  }
  for (int64_t d : dims) {
    if (d % 8 != 0) return false;
  }
  return true;
}

// Row-segment problem: C[rows of e] = A[rows of e] (lda = ka) @ B_e.
void run_row_segments(const Env& env, const bf16* a, int64_t ka, const bf16* b, bool b_col, int64_t ldb, int64_t nb,
                      const int32_t* offsets, int64_t tokens, int64_t experts, bf16* c, GemmTiling tiling) {
  GemmArgs args{};
  args.a = a;
  args.b = b;
  args.c = c;
  args.offsets = offsets;
  args.experts = experts;
  args.n = nb;
  args.k = ka;
  args.lda = ka;
  args.ldb = ldb;
  args.ldc = nb;
  args.b_expert_stride = ka * nb;
  const int64_t rows_bound = ceil_div(tokens, kBM) + experts;
  if (b_col) {
    launch_gemm<false, true, bf16>(env, rows_bound, tokens, args, tiling);
  } else {
    launch_gemm<false, false, bf16>(env, rows_bound, tokens, args, tiling);
  }
}

}  // namespace

void launch_grouped_matmul(const Env& env, const void* x, const void* w, const int32_t* offsets, int64_t tokens,
                           int64_t experts, int64_t k, int64_t n, bool trans_w, void* out, DType t,
                           GemmTiling tiling) {
  if (tokens == 0 || n == 0) return;
  if (tensor_core_ok(t, {x, w, out}, {k, n})) {
    // W_e [K,N]: B(k,n) = w[k*N+n] (row); trans: W_e [N,K]: B(k,n) = w[n*K+k] (column).
    run_row_segments(env, static_cast<const bf16*>(x), k, static_cast<const bf16*>(w), trans_w, trans_w ? k : n, n,
                     offsets, tokens, experts, static_cast<bf16*>(out), tiling);
    return;
  }
  TROUPE_DISPATCH_FLOAT(t, T, "grouped_matmul", {
    launch(env, grouped_rows_plain_kernel<T>, grid_for(tokens * n, 256, env.num_sms), 256, 0,
           static_cast<const T*>(x), static_cast<const T*>(w), offsets, experts, tokens, n, k, k * n,
           trans_w ? 1 : n, trans_w ? k : 1, static_cast<T*>(out));
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_grouped_matmul_dx(const Env& env, const void* dout, const void* w, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dx,
                              DType t, GemmTiling tiling) {
  if (tokens == 0 || k == 0) return;
  // dx = dout [T,N] @ B'_e with B'(j, i) = op(W_e)(i, j): W_e [K,N] gives w[i*N+j]
  // (column layout, ld N); trans (W_e [N,K]) gives w[j*K+i] (row layout, ld K).
  if (tensor_core_ok(t, {dout, w, dx}, {k, n})) {
    run_row_segments(env, static_cast<const bf16*>(dout), n, static_cast<const bf16*>(w), !trans_w, trans_w ? k : n,
                     k, offsets, tokens, experts, static_cast<bf16*>(dx), tiling);
    return;
  }
  TROUPE_DISPATCH_FLOAT(t, T, "grouped_matmul_backward", {
    launch(env, grouped_rows_plain_kernel<T>, grid_for(tokens * k, 256, env.num_sms), 256, 0,
           static_cast<const T*>(dout), static_cast<const T*>(w), offsets, experts, tokens, k, n, k * n,
           trans_w ? k : 1, trans_w ? 1 : n, static_cast<T*>(dx));
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

bool grouped_matmul_hopper_available() {
  return wgmma_available();
}

bool launch_grouped_matmul_dw(const Env& env, const void* x, const void* dout, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dw,
                              DType dwt, bool accumulate, DType t, GemmTiling tiling, float* sum_squares,
                              int64_t slots) {
  TROUPE_CHECK(sum_squares == nullptr || !accumulate,
               "grouped_matmul_backward: a dW sum of squares needs a written dW, not an accumulated one");
  TROUPE_CHECK(sum_squares == nullptr || slots >= 1,
               "grouped_matmul_backward: no slot for the dW sum of squares");
  // dW_e [P,Q] = L_e^T @ R_e: (L, R) = (x, dout) for W [E,K,N], (dout, x) for [E,N,K].
  const void* l = trans_w ? dout : x;
  const void* r = trans_w ? x : dout;
  const int64_t p = trans_w ? n : k, q = trans_w ? k : n;
  // Where the product does not fold the sum of squares: a second pass over the written dW.
  auto second_pass = [&] {
    if (sum_squares == nullptr) return;
    TROUPE_DISPATCH_FLOAT(
        dwt, O, "grouped_matmul_backward (dw sum of squares)",
        launch_sum_squares_slots(env, static_cast<const O*>(dw), experts * p * q, sum_squares, slots));
  };
  if (experts == 0 || k == 0 || n == 0) {
    second_pass();  // dW is empty: zeros
    return false;
  }
  if (tensor_core_ok(t, {x, dout, dw}, {k, n})) {
    GemmArgs args{};
    args.a = static_cast<const bf16*>(l);
    args.b = static_cast<const bf16*>(r);
    args.c = dw;
    args.offsets = offsets;
    args.experts = experts;
    args.m = p;
    args.n = q;
    args.lda = p;
    args.ldb = q;
    args.ldc = q;
    args.c_expert_stride = p * q;
    args.accumulate = accumulate;
    args.sum_squares = sum_squares;
    const int64_t rows_bound = ceil_div(p, kBM) * experts;
    bool folded = false;
    if (sum_squares != nullptr) {
      // The TMA kernel's slots: 8 per 128 x 256 tile (grouped_matmul_dw_sum_squares_slots).
      const int64_t used = 8 * experts * ceil_div(p, kWgBM) * ceil_div(q, kTmaBN);
      TROUPE_CHECK(slots >= used,
                   "grouped_matmul_backward: {} slots for the dW sum of squares, the kernel needs {}", slots,
                   used);
      TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward (dw)",
                            folded = launch_gemm<true, false, O>(env, rows_bound, tokens, args, tiling));
      if (folded && used < slots) {
        CUDA_CHECK(cudaMemsetAsync(sum_squares + used, 0, static_cast<size_t>(slots - used) * sizeof(float),
                                   env.stream));
      }
    } else {
      TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward (dw)",
                            launch_gemm<true, false, O>(env, rows_bound, tokens, args, tiling));
    }
    if (!folded) second_pass();
    return folded;
  }
  TROUPE_DISPATCH_FLOAT(
      t, T, "grouped_matmul_backward", TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward", {
        launch(env, grouped_k_plain_kernel<T, O>, grid_for(experts * p * q, 256, env.num_sms), 256, 0,
               static_cast<const T*>(l), static_cast<const T*>(r), offsets, experts, p, q,
               static_cast<O*>(dw), accumulate);
      }));
  TROUPE_CUDA_LAUNCH_CHECK();
  second_pass();
  return false;
}

}  // namespace troupe::kernels::gpu
