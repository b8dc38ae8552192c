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
// f32 operands (and shapes the tensor-core path cannot take: dims not multiples of 8,
// misaligned pointers) use a plain one-thread-per-output kernel with fp32 accumulation.
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

namespace {

using bf16 = __nv_bfloat16;

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

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
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
};

// kSegK = false: row segments, A row-major (A(m,k) = a[m*lda+k]); B row-major
// (B(k,n) = b[k*ldb+n]) or, with kBCol, column-major (b[n*ldb+k]).
// kSegK = true: k segments, A(m,k) = a[k*lda+m] (column-major), B row-major.
// 2 x kWN warps, each computing 64 x (128 / kWN) with mma.sync m16n8k16; operands come
// from a kStages-deep cp.async pipeline through ldmatrix (.trans where the stored layout
// is the transpose of the fragment's).
template <bool kSegK, bool kBCol, typename OutT, int kWN, int kBK, int kStages>
__global__ void __launch_bounds__(64 * kWN) grouped_gemm_mma_kernel(GemmArgs args) {
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

template <bool kSegK, bool kBCol, typename OutT, int kWN, int kBK, int kStages>
void launch_gemm_tiled(const Env& env, dim3 grid, const GemmArgs& args) {
  auto kernel = grouped_gemm_mma_kernel<kSegK, kBCol, OutT, kWN, kBK, kStages>;
  constexpr size_t smem = gemm_smem_bytes<kBK, kStages>();
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, 64 * kWN, smem, env.stream>>>(args);
  TROUPE_CUDA_LAUNCH_CHECK();
}

template <bool kSegK, bool kBCol, typename OutT>
void launch_gemm(const Env& env, dim3 grid, const GemmArgs& args, GemmTiling tiling) {
  switch (tiling) {
    case GemmTiling::kWarps2x2: launch_gemm_tiled<kSegK, kBCol, OutT, 2, 32, 4>(env, grid, args); break;
    case GemmTiling::kWarps2x4: launch_gemm_tiled<kSegK, kBCol, OutT, 4, 32, 4>(env, grid, args); break;
    case GemmTiling::kWarps2x2K64: launch_gemm_tiled<kSegK, kBCol, OutT, 2, 64, 3>(env, grid, args); break;
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
  dim3 grid(static_cast<unsigned>(ceil_div(nb, kBN)), static_cast<unsigned>(ceil_div(tokens, kBM) + experts));
  if (b_col) {
    launch_gemm<false, true, bf16>(env, grid, args, tiling);
  } else {
    launch_gemm<false, false, bf16>(env, grid, args, tiling);
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
    grouped_rows_plain_kernel<T><<<grid_for(tokens * n, 256, env.num_sms), 256, 0, env.stream>>>(
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
    grouped_rows_plain_kernel<T><<<grid_for(tokens * k, 256, env.num_sms), 256, 0, env.stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(w), offsets, experts, tokens, k, n, k * n,
        trans_w ? k : 1, trans_w ? 1 : n, static_cast<T*>(dx));
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_grouped_matmul_dw(const Env& env, const void* x, const void* dout, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dw,
                              DType dwt, bool accumulate, DType t, GemmTiling tiling) {
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
    TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward (dw)", launch_gemm<true, false, O>(env, grid, args, tiling));
    return;
  }
  TROUPE_DISPATCH_FLOAT(t, T, "grouped_matmul_backward", TROUPE_DISPATCH_FLOAT(dwt, O, "grouped_matmul_backward", {
    grouped_k_plain_kernel<T, O><<<grid_for(experts * p * q, 256, env.num_sms), 256, 0, env.stream>>>(
        static_cast<const T*>(l), static_cast<const T*>(r), offsets, experts, p, q, static_cast<O*>(dw), accumulate);
  }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace troupe::kernels::gpu
