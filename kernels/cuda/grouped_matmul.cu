// kernels/cuda/grouped_matmul.cu — grouped matmul over per-expert row segments, forward
// and backward, each one launch for all experts with the segment offsets read on the
// device (no host loop over experts, no host sync).
//
// bf16 operands use a tensor-core kernel (WMMA 16x16x16, fp32 accumulation): 128x128
// output tiles, 32-deep k steps, double-buffered shared memory filled with 16-byte
// loads. Two problem shapes share it:
// - row segments (forward, dx): C[rows of e, :] = A[rows of e, :] @ B_e, blocks of the
//   second grid axis are mapped to (expert, row tile) by scanning the offsets;
// - k segments (dW): C_e = A_e^T @ B_e summed over the rows of expert e (grid axis z = e).
// f32 operands (and shapes the tensor-core path cannot take: dims not multiples of 8,
// misaligned pointers) use a plain one-thread-per-output kernel with fp32 accumulation.
#include <mma.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kBM = 128, kBN = 128, kBK = 32, kGemmThreads = 256, kPad = 8;
constexpr int kTileElems = kBM * (kBK + kPad);  // >= kBK * (kBM + kPad) too

// A tile stored "outer x inner" with the inner (contiguous) dimension a multiple of 8:
// 256 threads move it as 16-byte vectors, zero-filling outside [o_lim, i_lim).
template <int kOuter, int kInner>
struct TileLoader {
  static constexpr int kVecs = kOuter * kInner / 8;
  static constexpr int kPerThread = kVecs / kGemmThreads;
  uint4 regs[kPerThread];

  __device__ void load(const bf16* base, int64_t ld, int64_t o0, int64_t o_lim, int64_t i0, int64_t i_lim) {
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int v = r * kGemmThreads + threadIdx.x;
      const int o = v / (kInner / 8), i = (v % (kInner / 8)) * 8;
      const int64_t go = o0 + o, gi = i0 + i;
      if (go < o_lim && gi + 8 <= i_lim) {
        regs[r] = *reinterpret_cast<const uint4*>(base + go * ld + gi);
      } else {
        bf16 tmp[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          tmp[j] = (go < o_lim && gi + j < i_lim) ? base[go * ld + gi + j] : __float2bfloat16_rn(0.0f);
        }
        regs[r] = *reinterpret_cast<const uint4*>(tmp);
      }
    }
  }
  __device__ void store(bf16* smem) const {
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int v = r * kGemmThreads + threadIdx.x;
      const int o = v / (kInner / 8), i = (v % (kInner / 8)) * 8;
      *reinterpret_cast<uint4*>(smem + o * (kInner + kPad) + i) = regs[r];
    }
  }
};

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
};

// kSegK = false: row segments, A row-major (A(m,k) = a[m*lda+k]); B row-major
// (B(k,n) = b[k*ldb+n]) or, with kBCol, column-major (b[n*ldb+k]).
// kSegK = true: k segments, A(m,k) = a[k*lda+m] (column-major), B row-major.
template <bool kSegK, bool kBCol, typename OutT>
__global__ void __launch_bounds__(kGemmThreads) grouped_gemm_wmma_kernel(GemmArgs args) {
  using namespace nvcuda;
  constexpr bool kACol = kSegK;
  __shared__ __align__(128) bf16 smem_a[2][kTileElems];
  __shared__ __align__(128) bf16 smem_b[2][kTileElems];

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

  // A tile: row layout [kBM][kBK] (outer m), column layout [kBK][kBM] (outer k).
  TileLoader<kACol ? kBK : kBM, kACol ? kBM : kBK> load_a;
  // B tile: row layout [kBK][kBN] (outer k), column layout [kBN][kBK] (outer n).
  TileLoader<kBCol ? kBN : kBK, kBCol ? kBK : kBN> load_b;
  auto fetch = [&](int64_t k0) {
    if constexpr (kACol) {
      load_a.load(a, args.lda, k0, k_lim, m0, m_lim);
    } else {
      load_a.load(a, args.lda, m0, m_lim, k0, k_lim);
    }
    if constexpr (kBCol) {
      load_b.load(b, args.ldb, n0, args.n, k0, k_lim);
    } else {
      load_b.load(b, args.ldb, k0, k_lim, n0, args.n);
    }
  };

  const int warp = threadIdx.x / 32;
  const int wm = warp / 4, wn = warp % 4;  // 2 x 4 warps, each 64 x 32
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  using ALayout = std::conditional_t<kACol, wmma::col_major, wmma::row_major>;
  using BLayout = std::conditional_t<kBCol, wmma::col_major, wmma::row_major>;
  const int64_t k_tiles = (k_lim + kBK - 1) / kBK;
  if (k_tiles > 0) {
    fetch(0);
    load_a.store(smem_a[0]);
    load_b.store(smem_b[0]);
  }
  __syncthreads();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < k_tiles) fetch((kt + 1) * kBK);  // global loads in flight during the math
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, ALayout> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, BLayout> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = wm * 64 + i * 16;
        if constexpr (kACol) {
          wmma::load_matrix_sync(fa[i], smem_a[buf] + kk * (kBM + kPad) + row, kBM + kPad);
        } else {
          wmma::load_matrix_sync(fa[i], smem_a[buf] + row * (kBK + kPad) + kk, kBK + kPad);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = wn * 32 + j * 16;
        if constexpr (kBCol) {
          wmma::load_matrix_sync(fb[j], smem_b[buf] + col * (kBK + kPad) + kk, kBK + kPad);
        } else {
          wmma::load_matrix_sync(fb[j], smem_b[buf] + kk * (kBN + kPad) + col, kBN + kPad);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    if (kt + 1 < k_tiles) {
      load_a.store(smem_a[buf ^ 1]);
      load_b.store(smem_b[buf ^ 1]);
    }
    __syncthreads();
  }

  // ---- epilogue: each warp stages one 16x16 fragment at a time through shared memory ----
  float* stage = reinterpret_cast<float*>(smem_a[0]) + warp * 256;
  OutT* c = static_cast<OutT*>(args.c) + (kSegK ? e * args.c_expert_stride : row0 * args.ldc);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int r = lane / 2, c8 = (lane % 2) * 8;
      const int64_t gm = m0 + wm * 64 + i * 16 + r;
      const int64_t gn0 = n0 + wn * 32 + j * 16 + c8;
      if (gm < m_lim) {
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          const int64_t gn = gn0 + x;
          if (gn < args.n) {
            float v = stage[r * 16 + c8 + x];
            OutT* p = c + gm * args.ldc + gn;
            if (args.accumulate) v += to_float(*p);
            *p = from_float<OutT>(v);
          }
        }
      }
      __syncwarp();
    }
  }
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
  const int64_t total = experts * p * q;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t e = i / (p * q), pq = i - e * p * q, pi = pq / q, qi = pq - pi * q;
    float acc = accumulate ? to_float(dw[i]) : 0.0f;
    for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) acc += to_float(l[row * p + pi]) * to_float(r_[row * q + qi]);
    dw[i] = from_float<O>(acc);
  }
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
                      const int32_t* offsets, int64_t tokens, int64_t experts, bf16* c) {
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
  dim3 grid(static_cast<unsigned>(ceil_div(nb, kBN)), static_cast<unsigned>(ceil_div(tokens, kBM) + experts));
  if (b_col) {
    grouped_gemm_wmma_kernel<false, true, bf16><<<grid, kGemmThreads, 0, env.stream>>>(args);
  } else {
    grouped_gemm_wmma_kernel<false, false, bf16><<<grid, kGemmThreads, 0, env.stream>>>(args);
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_grouped_matmul(const Env& env, const void* x, const void* w, const int32_t* offsets, int64_t tokens,
                           int64_t experts, int64_t k, int64_t n, bool trans_w, void* out, DType t) {
  if (tokens == 0 || n == 0) return;
  if (tensor_core_ok(t, {x, w, out}, {k, n})) {
    // W_e [K,N]: B(k,n) = w[k*N+n] (row); trans: W_e [N,K]: B(k,n) = w[n*K+k] (column).
    run_row_segments(env, static_cast<const bf16*>(x), k, static_cast<const bf16*>(w), trans_w, trans_w ? k : n, n,
                     offsets, tokens, experts, static_cast<bf16*>(out));
    return;
  }
  TROUPE_DISPATCH_FLOAT(t, T, "grouped_matmul", {
    grouped_rows_plain_kernel<T><<<grid_for(tokens * n, 256, env.num_sms), 256, 0, env.stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), offsets, experts, tokens, n, k, k * n,
        trans_w ? 1 : n, trans_w ? k : 1, static_cast<T*>(out));
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_grouped_matmul_dx(const Env& env, const void* dout, const void* w, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dx,
                              DType t) {
  if (tokens == 0 || k == 0) return;
  // dx = dout [T,N] @ B'_e with B'(j, i) = op(W_e)(i, j): W_e [K,N] gives w[i*N+j]
  // (column layout, ld N); trans (W_e [N,K]) gives w[j*K+i] (row layout, ld K).
  if (tensor_core_ok(t, {dout, w, dx}, {k, n})) {
    run_row_segments(env, static_cast<const bf16*>(dout), n, static_cast<const bf16*>(w), !trans_w, trans_w ? k : n,
                     k, offsets, tokens, experts, static_cast<bf16*>(dx));
    return;
  }
  TROUPE_DISPATCH_FLOAT(t, T, "grouped_matmul_backward", {
    grouped_rows_plain_kernel<T><<<grid_for(tokens * k, 256, env.num_sms), 256, 0, env.stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(w), offsets, experts, tokens, k, n, k * n,
        trans_w ? k : 1, trans_w ? 1 : n, static_cast<T*>(dx));
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_grouped_matmul_dw(const Env& env, const void* x, const void* dout, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dw,
                              DType dwt, bool accumulate, DType t) {
  (void)tokens;  // the segments come from the device offsets
  if (experts == 0 || k == 0 || n == 0) return;
  // dW_e [P,Q] = L_e^T @ R_e: (L, R) = (x, dout) for W [E,K,N], (dout, x) for [E,N,K].
  const void* l = trans_w ? dout : x;
  const void* r = trans_w ? x : dout;
  const int64_t p = trans_w ? n : k, q = trans_w ? k : n;
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
    dim3 grid(static_cast<unsigned>(ceil_div(q, kBN)), static_cast<unsigned>(ceil_div(p, kBM)),
              static_cast<unsigned>(experts));
    TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward (dw)", {
      grouped_gemm_wmma_kernel<true, false, O><<<grid, kGemmThreads, 0, env.stream>>>(args);
    });
    TROUPE_CUDA_LAUNCH_CHECK();
    return;
  }
  TROUPE_DISPATCH_FLOAT(t, T, "grouped_matmul_backward", TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward", {
    grouped_k_plain_kernel<T, O><<<grid_for(experts * p * q, 256, env.num_sms), 256, 0, env.stream>>>(
        static_cast<const T*>(l), static_cast<const T*>(r), offsets, experts, p, q, static_cast<O*>(dw), accumulate);
  }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace troupe::kernels::gpu
