// kernels/cuda/rows.cu — row-structured CUDA kernels: RMSNorm forward/backward, RoPE,
// embedding forward/backward and cross-entropy forward/backward.
//
// Cross-entropy reads each row of logits once (online max and sum in fp32) and keeps
// only two floats per row (loss, lse): no fp32 copy of the logits is ever made.
#include <cstdio>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/rope_angle.cuh"

namespace troupe::kernels::gpu {

// elementwise.cu: out (+)= column sums of f32 partials [splits, cols].
void launch_column_finish(const Env& env, const float* partial, int64_t splits, int64_t cols, void* out,
                          DType ot, bool accumulate);

namespace {

constexpr int kVec = 8;

template <typename T>
bool pack_ok(const void* p, int64_t row_len) {
  return aligned_to(p, sizeof(T) * kVec) && row_len % kVec == 0;
}

// ---- RMSNorm -------------------------------------------------------------------------
// With a residual res (kAdd): h = x + res is stored, rounded to X as add rounds it, and the
// norm is taken of that rounded h (the second pass reads back this thread's own stores).
template <int V, bool kAdd, typename X, typename W>
__global__ void rmsnorm_forward_kernel(const X* x, const X* res, const W* w, float eps, int64_t d, X* h, X* y,
                                       float* rstd) {
  pdl_wait();
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const X* xr = (kAdd ? h : x) + row * d;
  X* yr = y + row * d;
  float ss = 0.0f;
  for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
    float v[V];
    load_floats<V>(x + row * d + c, v);
    if constexpr (kAdd) {
      float rv[V];
      load_floats<V>(res + row * d + c, rv);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = to_float(from_float<X>(v[j] + rv[j]));
      store_floats<V>(h + row * d + c, v);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) ss += v[j] * v[j];
  }
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(d) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
    float v[V], g[V];
    load_floats<V>(xr + c, v);
    load_floats<V>(w + c, g);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = v[j] * r * g[j];
    store_floats<V>(yr + c, v);
  }
}

// The same for rows of d = C * blockDim.x * V (bench_1b's 1024 with 128 threads of 8), R
// rows a block: every row's loads are issued before the first reduction, the rows' sums
// share one pair of barriers, and h and x stay in registers for y (no second read). rstd,
// h and y take the kernel above's operations in its order (a thread's chunks in order,
// then block_sum's lanes and warps).
template <int V, int C, int R, bool kAdd, typename X, typename W>
__global__ void __launch_bounds__(128, C == 1 ? 16 : 1)
    rmsnorm_forward_regs_kernel(const X* x, const X* res, const W* w, float eps, int64_t rows, int64_t d,
                                X* h, X* y, float* rstd) {
  using P = Pack<X, V>;
  pdl_wait();
  __shared__ float shared[R][32];
  P pv[R][C];  // x, or h = x + res rounded to X: what the sums and y read
  const int64_t row0 = int64_t{blockIdx.x} * R;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const bool live = row0 + i < rows;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int64_t c = (row0 + i) * d + (int64_t{k} * blockDim.x + threadIdx.x) * V;
#pragma unroll
      for (int j = 0; j < V; ++j) pv[i][k].v[j] = from_float<X>(0.0f);
      if (live) pv[i][k] = *reinterpret_cast<const P*>(x + c);
      if constexpr (kAdd) {
        if (live) {
          const P pr = *reinterpret_cast<const P*>(res + c);
#pragma unroll
          for (int j = 0; j < V; ++j)
            pv[i][k].v[j] = from_float<X>(to_float(pv[i][k].v[j]) + to_float(pr.v[j]));
          *reinterpret_cast<P*>(h + c) = pv[i][k];
        }
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) ss += to_float(pv[i][k].v[j]) * to_float(pv[i][k].v[j]);
    }
    ss = warp_sum(ss);
    if (lane == 0) shared[i][warp] = ss;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (row0 + i >= rows) break;
    const float r = rsqrtf(warp_sum(lane < warps ? shared[i][lane] : 0.0f) / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) rstd[row0 + i] = r;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int64_t c = int64_t{k} * blockDim.x + threadIdx.x;
      float g[V], o[V];
      load_floats<V>(w + c * V, g);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = to_float(pv[i][k].v[j]) * r * g[j];
      store_floats<V>(y + (row0 + i) * d + c * V, o);
    }
  }
}

// Block b handles rows b, b + grid, ...; its dw partial for every column is kept in
// shared memory (each thread owns the same columns in every row) and written to
// partial[b, :] at the end.
// dres (optional; dx may alias it) is added to dx in f32 before its one rounding.
template <int V, typename X, typename W>
__global__ void rmsnorm_backward_kernel(const X* dy, const X* x, const W* w, const float* rstd, int64_t rows,
                                        int64_t d, const X* dres, X* dx, float* partial) {
  pdl_wait();
  extern __shared__ float dw_acc[];
  __shared__ float shared[32];
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) dw_acc[c] = 0.0f;
  __syncthreads();
  const float inv_d = 1.0f / static_cast<float>(d);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* xr = x + row * d;
    const X* dyr = dy + row * d;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
      float xv[V], gv[V], wv[V];
      load_floats<V>(xr + c, xv);
      load_floats<V>(dyr + c, gv);
      load_floats<V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        dot += gv[j] * wv[j] * xv[j];
        dw_acc[c + j] += gv[j] * xv[j] * r;
      }
    }
    dot = block_sum(dot, shared);
    const float k = r * r * dot * inv_d;
    for (int64_t c = int64_t{threadIdx.x} * V; c < d; c += int64_t{blockDim.x} * V) {
      float xv[V], gv[V], wv[V];
      load_floats<V>(xr + c, xv);
      load_floats<V>(dyr + c, gv);
      load_floats<V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) gv[j] = r * (gv[j] * wv[j] - xv[j] * k);
      if (dres != nullptr) {
        float rv[V];
        load_floats<V>(dres + row * d + c, rv);
        // __fadd_rn is never contracted with the product above into an fma, so with f32 dx
        // the sum is the unfused add's of the stored gradient, bit for bit.
#pragma unroll
        for (int j = 0; j < V; ++j) gv[j] = __fadd_rn(gv[j], rv[j]);
      }
      store_floats<V>(dx + row * d + c, gv);
    }
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) partial[int64_t{blockIdx.x} * d + c] = dw_acc[c];
}

// The same for rows of d = C * blockDim.x * V (bench_1b's 1024 with 128 threads of 8):
// a thread's C chunks of x, dy and w stay in registers between the dot's reduction and
// dx (instead of being loaded again), w is loaded once per block, and the dw partial of
// the thread's columns is kept in registers, not in shared memory. The next row's x and dy
// (and this row's dres) are loaded before this row's reduction, so a block's loads are in
// flight while it waits at the block sum's barriers (the row-at-a-time version reached 55%
// of copy bandwidth on bench_1b's rows); the arithmetic is the same, in the same order.
// For one chunk, eight blocks of 128 threads an SM (rmsnorm_backward_blocks' grid in one
// wave) bound the registers to 64 a thread.
template <int V, int C, typename X, typename W>
__global__ void __launch_bounds__(128, C == 1 ? 8 : 1)
    rmsnorm_backward_regs_kernel(const X* dy, const X* x, const W* w, const float* rstd, int64_t rows,
                                 int64_t d, const X* dres, X* dx, float* partial) {
  using P = Pack<X, V>;
  pdl_wait();
  __shared__ float shared[32];
  float wv[C][V], acc[C][V];
#pragma unroll
  for (int k = 0; k < C; ++k) {
    load_floats<V>(w + (int64_t{k} * blockDim.x + threadIdx.x) * V, wv[k]);
#pragma unroll
    for (int j = 0; j < V; ++j) acc[k][j] = 0.0f;
  }
  const float inv_d = 1.0f / static_cast<float>(d);
  P nx[C], ng[C];  // the next row's x and dy, as loaded
  float nr = 0.0f;
  const auto fetch = [&](int64_t row) {
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int64_t c = row * d + (int64_t{k} * blockDim.x + threadIdx.x) * V;
      nx[k] = *reinterpret_cast<const P*>(x + c);
      ng[k] = *reinterpret_cast<const P*>(dy + c);
    }
    nr = rstd[row];
  };
  if (blockIdx.x < rows) fetch(blockIdx.x);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float r = nr;
    P xv[C], gv[C];  // this row's, as loaded (converted where used: fewer registers)
#pragma unroll
    for (int k = 0; k < C; ++k) {
      xv[k] = nx[k];
      gv[k] = ng[k];
    }
    P rv[C];
    if (dres != nullptr) {
#pragma unroll
      for (int k = 0; k < C; ++k)
        rv[k] = *reinterpret_cast<const P*>(dres + row * d + (int64_t{k} * blockDim.x + threadIdx.x) * V);
    }
    if (row + gridDim.x < rows) fetch(row + gridDim.x);
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float g = to_float(gv[k].v[j]), xj = to_float(xv[k].v[j]);
        dot += g * wv[k][j] * xj;
        acc[k][j] += g * xj * r;
      }
    }
    dot = block_sum(dot, shared);
    const float kk = r * r * dot * inv_d;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int64_t c = row * d + (int64_t{k} * blockDim.x + threadIdx.x) * V;
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = r * (to_float(gv[k].v[j]) * wv[k][j] - to_float(xv[k].v[j]) * kk);
      if (dres != nullptr) {
        // __fadd_rn is never contracted with the product above into an fma, so with f32 dx
        // the sum is the unfused add's of the stored gradient, bit for bit.
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = __fadd_rn(o[j], to_float(rv[k].v[j]));
      }
      store_floats<V>(dx + c, o);
    }
  }
#pragma unroll
  for (int k = 0; k < C; ++k) {
    float* out = partial + int64_t{blockIdx.x} * d + (int64_t{k} * blockDim.x + threadIdx.x) * V;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = acc[k][j];
  }
}

// Enough blocks to keep every SM busy (the per-row reductions are latency-bound); each
// block's dw partial is one row of the scratch that column_finish then sums.
int64_t rmsnorm_backward_blocks(const Env& env, int64_t rows) {
  return min64(max64(rows, 1), int64_t{env.num_sms} * 8);
}

}  // namespace

void launch_rmsnorm_forward(const Env& env, const void* x, const void* r, DType xt, const void* w, DType wt,
                            float eps, int64_t rows, int64_t d, void* h, void* y, float* rstd) {
  if (rows == 0) return;
  TROUPE_DISPATCH_FLOAT(
      xt, X, "rmsnorm_forward", TROUPE_DISPATCH_FLOAT(wt, W, "rmsnorm_forward", {
        const auto* xp = static_cast<const X*>(x);
        const auto* rp = static_cast<const X*>(r);
        const auto* wp = static_cast<const W*>(w);
        auto* hp = static_cast<X*>(h);
        auto* yp = static_cast<X*>(y);
        const unsigned grid = static_cast<unsigned>(rows);
        const bool vec = pack_ok<X>(x, d) && pack_ok<X>(y, d) && pack_ok<W>(w, d) &&
                         (r == nullptr || (pack_ok<X>(r, d) && pack_ok<X>(h, d)));
        constexpr int64_t kSweep = 128 * kVec;  // a block's elements per chunk
        constexpr int kRows = 2;
        const int64_t chunks = vec && d % kSweep == 0 ? d / kSweep : 0;
        if (chunks >= 1 && chunks <= 2) {
          auto regs = [&](auto add) {
            constexpr bool kA = decltype(add)::value;
            return chunks == 1 ? rmsnorm_forward_regs_kernel<kVec, 1, kRows, kA, X, W>
                               : rmsnorm_forward_regs_kernel<kVec, 2, kRows, kA, X, W>;
          };
          auto kernel = r == nullptr ? regs(std::false_type{}) : regs(std::true_type{});
          launch(env, kernel, static_cast<unsigned>(ceil_div(rows, kRows)), 128, 0, xp, rp, wp, eps, rows, d,
                 hp, yp, rstd);
        } else {
          auto kernel =
              r == nullptr
                  ? (vec ? rmsnorm_forward_kernel<kVec, false, X, W> : rmsnorm_forward_kernel<1, false, X, W>)
                  : (vec ? rmsnorm_forward_kernel<kVec, true, X, W> : rmsnorm_forward_kernel<1, true, X, W>);
          launch(env, kernel, grid, vec ? 128 : 256, 0, xp, rp, wp, eps, d, hp, yp, rstd);
        }
      }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

size_t rmsnorm_backward_scratch_bytes(const Env& env, int64_t rows, int64_t d) {
  return static_cast<size_t>(rmsnorm_backward_blocks(env, rows) * d) * sizeof(float);
}

void launch_rmsnorm_backward(const Env& env, const void* dy, const void* x, DType xt, const void* w, DType wt,
                             const float* rstd, int64_t rows, int64_t d, const void* dres, void* dx, void* dw,
                             DType dwt, bool accumulate_dw, void* scratch) {
  const size_t smem = static_cast<size_t>(d) * sizeof(float);
  TROUPE_CHECK(smem <= 200 * 1024, "rmsnorm_backward on cuda supports rows of at most 51200 elements, got {}",
               d);
  const int64_t blocks = rmsnorm_backward_blocks(env, rows);
  float* partial = static_cast<float*>(scratch);
  if (rows > 0) {
    TROUPE_DISPATCH_FLOAT(
        xt, X, "rmsnorm_backward", TROUPE_DISPATCH_FLOAT(wt, W, "rmsnorm_backward", {
          const bool vec = pack_ok<X>(x, d) && pack_ok<X>(dy, d) && pack_ok<X>(dx, d) && pack_ok<W>(w, d) &&
                           (dres == nullptr || pack_ok<X>(dres, d));
          const auto* dyp = static_cast<const X*>(dy);
          const auto* xp = static_cast<const X*>(x);
          const auto* wp = static_cast<const W*>(w);
          const auto* rp = static_cast<const X*>(dres);
          auto* dxp = static_cast<X*>(dx);
          constexpr int64_t kSweep = 128 * kVec;  // a block's elements per chunk
          const int64_t chunks = vec && d % kSweep == 0 ? d / kSweep : 0;
          if (chunks >= 1 && chunks <= 4) {
            auto kernel = chunks == 1   ? rmsnorm_backward_regs_kernel<kVec, 1, X, W>
                          : chunks == 2 ? rmsnorm_backward_regs_kernel<kVec, 2, X, W>
                          : chunks == 3 ? rmsnorm_backward_regs_kernel<kVec, 3, X, W>
                                        : rmsnorm_backward_regs_kernel<kVec, 4, X, W>;
            launch(env, kernel, static_cast<unsigned>(blocks), 128, 0, dyp, xp, wp, rstd, rows, d, rp, dxp,
                   partial);
          } else {
            auto kernel = vec ? rmsnorm_backward_kernel<kVec, X, W> : rmsnorm_backward_kernel<1, X, W>;
            CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
            launch(env, kernel, static_cast<unsigned>(blocks), vec ? 128 : 256, smem, dyp, xp, wp, rstd, rows,
                   d, rp, dxp, partial);
          }
        }));
    TROUPE_CUDA_LAUNCH_CHECK();
    launch_column_finish(env, partial, blocks, d, dw, dwt, accumulate_dw);
  } else if (!accumulate_dw) {
    CUDA_CHECK(cudaMemsetAsync(dw, 0, static_cast<size_t>(d) * (dwt == DType::kF32 ? 4 : 2), env.stream));
  }
}

// ---- RoPE ----------------------------------------------------------------------------
namespace {
// One thread per (token, frequency): the angle is the same for every head, so its double
// precision sincos (the CPU reference's arithmetic) is computed once and applied to all
// heads (the per-element version spent most of its time there: 4.7 ms of a bench_1b step).
template <typename T>
__global__ void rope_kernel(const T* x, const int32_t* pos, double log_theta, int64_t tokens, int64_t heads,
                            int64_t head_dim, T* out, bool inverse) {
  pdl_wait();
  const int64_t half = head_dim / 2;
  const int64_t n = tokens * half;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t p = i % half, t = i / half;
    const float2 cs =
        rope_cos_sin(pos[t], static_cast<int>(p), static_cast<int>(head_dim), log_theta, inverse);
    const float cf = cs.x, sf = cs.y;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * head_dim;
      const float x1 = to_float(x[base + p]), x2 = to_float(x[base + p + half]);
      out[base + p] = from_float<T>(x1 * cf - x2 * sf);
      out[base + p + half] = from_float<T>(x2 * cf + x1 * sf);
    }
  }
}

// Two adjacent elements of T, loaded and stored as one (bf16x2 or float2).
template <typename T>
struct Pair2;
template <>
struct Pair2<float> {
  using V = float2;
  __device__ static float2 make(float a, float b) { return make_float2(a, b); }
  __device__ static float lo(float2 v) { return v.x; }
  __device__ static float hi(float2 v) { return v.y; }
};
template <>
struct Pair2<__nv_bfloat16> {
  using V = __nv_bfloat162;
  __device__ static V make(float a, float b) { return __floats2bfloat162_rn(a, b); }
  __device__ static float lo(V v) { return __low2float(v); }
  __device__ static float hi(V v) { return __high2float(v); }
};

// The (cos, sin) of a block's n_tok tokens from t0 for every frequency, into cs[tt * half +
// p], in double precision (the CPU reference's arithmetic); sin negated for the inverse.
__device__ void rope_angles(const int32_t* pos, double log_theta, int64_t t0, int n_tok, int head_dim,
                            bool inverse, float2* cs) {
  const int half = head_dim / 2;
  for (int i = threadIdx.x; i < n_tok * half; i += blockDim.x) {
    const int tt = i / half, p = i % half;
    cs[i] = rope_cos_sin(pos[t0 + tt], p, head_dim, log_theta, inverse);
  }
  __syncthreads();
}

// kRopeTokens tokens per block: their angles' (cos, sin) first, into shared memory (the
// same double-precision sincos as rope_kernel, once per token and frequency), then every
// (token, head, pair of frequencies) of the block by one thread: two loads and two stores
// of element pairs. Each element is read and written by the same thread, so in place is
// safe, and no thread waits on its own stores before the next load (rope_kernel's loop
// over the heads, in place, could not batch its loads: 0.040 ms at 40% of copy bandwidth
// on bench_1b's q). Needs head_dim % 4 == 0 and pair-aligned x and out.
constexpr int kRopeTokens = 4;
template <typename T>
__global__ void __launch_bounds__(256)
    rope_pairs_kernel(const T* x, const int32_t* pos, double log_theta, int64_t tokens, int heads,
                      int head_dim, T* out, bool inverse) {
  pdl_wait();
  extern __shared__ float2 rope_cs[];  // [kRopeTokens][half]: (cos, sin)
  using P = Pair2<T>;
  using V = typename P::V;
  const int half = head_dim / 2, pairs = half / 2;
  const int64_t t0 = int64_t{blockIdx.x} * kRopeTokens;
  const int n_tok = static_cast<int>(tokens - t0 < kRopeTokens ? tokens - t0 : kRopeTokens);
  rope_angles(pos, log_theta, t0, n_tok, head_dim, inverse, rope_cs);
  const int per_token = heads * pairs;
  for (int i = threadIdx.x; i < n_tok * per_token; i += blockDim.x) {
    const int tt = i / per_token, r = i % per_token, h = r / pairs, q = 2 * (r % pairs);
    const int64_t base = ((t0 + tt) * heads + h) * head_dim + q;
    const V a = *reinterpret_cast<const V*>(x + base), b = *reinterpret_cast<const V*>(x + base + half);
    const float2 c0 = rope_cs[tt * half + q], c1 = rope_cs[tt * half + q + 1];
    const float x1a = P::lo(a), x1b = P::hi(a), x2a = P::lo(b), x2b = P::hi(b);
    *reinterpret_cast<V*>(out + base) = P::make(x1a * c0.x - x2a * c0.y, x1b * c1.x - x2b * c1.y);
    *reinterpret_cast<V*>(out + base + half) = P::make(x2a * c0.x + x1a * c0.y, x2b * c1.x + x1b * c1.y);
  }
}

// Sixteen bytes a load: each thread takes a (token, head, chunk of kVec frequencies) and
// loads its chunk of the first half and the matching chunk of the second half as one
// uint4 each, all its items' loads issued before any store; kRopeVecTokens tokens a block
// with their (cos, sin) in shared memory as above (same double-precision sincos, same
// float arithmetic per element). rope_pairs_kernel's 4-byte accesses ran at ~50% of copy
// bandwidth on bench_1b's q and k. Needs (head_dim / 2) % kVec == 0 and 16-byte aligned x
// and out; in place is safe (each element is read and written by one thread).
constexpr int kRopeVecTokens = 8, kRopeVecItems = 2;
template <typename T>
__global__ void __launch_bounds__(256)
    rope_vec_kernel(const T* x, const int32_t* pos, double log_theta, int64_t tokens, int heads, int head_dim,
                    T* out, bool inverse) {
  pdl_wait();
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  extern __shared__ float2 rope_cs[];  // [kRopeVecTokens][half]: (cos, sin)
  const int half = head_dim / 2, chunks = half / kVec;
  const int64_t t0 = int64_t{blockIdx.x} * kRopeVecTokens;
  const int n_tok = static_cast<int>(tokens - t0 < kRopeVecTokens ? tokens - t0 : kRopeVecTokens);
  rope_angles(pos, log_theta, t0, n_tok, head_dim, inverse, rope_cs);
  const int per_token = heads * chunks, items = n_tok * per_token;
  for (int i0 = threadIdx.x; i0 < items; i0 += blockDim.x * kRopeVecItems) {
    uint4 a[kRopeVecItems], b[kRopeVecItems];
    int64_t base[kRopeVecItems];
    int tt[kRopeVecItems], f0[kRopeVecItems];
#pragma unroll
    for (int u = 0; u < kRopeVecItems; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < items) {
        tt[u] = i / per_token;
        const int r = i % per_token, h = r / chunks;
        f0[u] = (r % chunks) * kVec;
        base[u] = ((t0 + tt[u]) * heads + h) * head_dim + f0[u];
        a[u] = *reinterpret_cast<const uint4*>(x + base[u]);
        b[u] = *reinterpret_cast<const uint4*>(x + base[u] + half);
      }
    }
#pragma unroll
    for (int u = 0; u < kRopeVecItems; ++u) {
      if (i0 + u * static_cast<int>(blockDim.x) >= items) break;
      const T* av = reinterpret_cast<const T*>(&a[u]);
      const T* bv = reinterpret_cast<const T*>(&b[u]);
      uint4 oa, ob;
      T* oav = reinterpret_cast<T*>(&oa);
      T* obv = reinterpret_cast<T*>(&ob);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float2 c = rope_cs[tt[u] * half + f0[u] + j];
        const float x1 = to_float(av[j]), x2 = to_float(bv[j]);
        oav[j] = from_float<T>(x1 * c.x - x2 * c.y);
        obv[j] = from_float<T>(x2 * c.x + x1 * c.y);
      }
      *reinterpret_cast<uint4*>(out + base[u]) = oa;
      *reinterpret_cast<uint4*>(out + base[u] + half) = ob;
    }
  }
}
// rope_angles into a table in global memory (cs [tokens][head_dim / 2]; (cos, -sin) with
// inverse), kRopeVecTokens tokens a block: attention_backward's rope.
__global__ void __launch_bounds__(256) rope_table_kernel(const int32_t* pos, double log_theta, int64_t tokens,
                                                         int head_dim, bool inverse, float2* cs) {
  pdl_wait();
  const int64_t t0 = int64_t{blockIdx.x} * kRopeVecTokens;
  const int n_tok = static_cast<int>(tokens - t0 < kRopeVecTokens ? tokens - t0 : kRopeVecTokens);
  rope_angles(pos, log_theta, t0, n_tok, head_dim, inverse, cs + t0 * (head_dim / 2));
}
}  // namespace

void launch_rope_table(const Env& env, const int32_t* pos, float theta, int64_t tokens, int64_t head_dim,
                       float2* cs) {
  if (tokens == 0 || head_dim < 2) return;
  launch(env, rope_table_kernel, static_cast<unsigned>(ceil_div(tokens, int64_t{kRopeVecTokens})), 256, 0,
         pos, std::log(static_cast<double>(theta)), tokens, static_cast<int>(head_dim), /*inverse=*/true, cs);
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_rope(const Env& env, const void* x, const int32_t* pos, float theta, int64_t tokens,
                 int64_t heads, int64_t head_dim, void* out, DType t, bool inverse) {
  const int64_t n = tokens * (head_dim / 2);
  if (n == 0 || heads == 0) return;
  const double log_theta = std::log(static_cast<double>(theta));
  TROUPE_DISPATCH_FLOAT(t, T, inverse ? "rope_backward" : "rope_forward", {
    const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % (2 * sizeof(T)) == 0; };
    const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    constexpr int64_t kVec = 16 / static_cast<int64_t>(sizeof(T));
    if ((head_dim / 2) % kVec == 0 && aligned16(x) && aligned16(out) &&
        heads * head_dim < (int64_t{1} << 24)) {
      const size_t smem = size_t{kRopeVecTokens} * static_cast<size_t>(head_dim / 2) * sizeof(float2);
      launch(env, rope_vec_kernel<T>, static_cast<unsigned>(ceil_div(tokens, int64_t{kRopeVecTokens})), 256,
             smem, static_cast<const T*>(x), pos, log_theta, tokens, static_cast<int>(heads),
             static_cast<int>(head_dim), static_cast<T*>(out), inverse);
    } else if (head_dim % 4 == 0 && aligned(x) && aligned(out) && heads * head_dim < (int64_t{1} << 24)) {
      const size_t smem = size_t{kRopeTokens} * static_cast<size_t>(head_dim / 2) * sizeof(float2);
      launch(env, rope_pairs_kernel<T>, static_cast<unsigned>(ceil_div(tokens, int64_t{kRopeTokens})), 256,
             smem, static_cast<const T*>(x), pos, log_theta, tokens, static_cast<int>(heads),
             static_cast<int>(head_dim), static_cast<T*>(out), inverse);
    } else {
      launch(env, rope_kernel<T>, grid_for(n, 256, env.num_sms), 256, 0, static_cast<const T*>(x), pos,
             log_theta, tokens, heads, head_dim, static_cast<T*>(out), inverse);
    }
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

// ---- embedding -----------------------------------------------------------------------
namespace {
__device__ __forceinline__ void check_index(int32_t id, int64_t limit, const char* what) {
  if (id < 0 || id >= limit) {
    printf("%s: index %d out of range [0, %lld)\n", what, id, static_cast<long long>(limit));
    __trap();
  }
}

template <int V, typename TT, typename O>
__global__ void embedding_forward_kernel(const int32_t* ids, int64_t tokens, const TT* table, int64_t vocab,
                                         int64_t d, O* out) {
  pdl_wait();
  const int64_t n = tokens * d;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    const int64_t t = i / d, c = i - t * d;
    const int32_t id = ids[t];
    check_index(id, vocab, "embedding_forward");
    float v[V];
    load_floats<V>(table + int64_t{id} * d + c, v);
    store_floats<V>(out + i, v);
  }
}

// The backward is a stable sort of (id, token) pairs by id, then one owner per table row:
// the thread of a run's first pair sums its tokens' rows in token order in f32 and adds
// the sum to dtable once. No atomics, so the gradient is bit-identical from run to run
// (the atomic adds it replaces summed a repeated token's rows in whatever order they
// landed, and a bf16 table rounded after every add).
__global__ void embedding_ids_kernel(const int32_t* ids, int64_t tokens, int64_t vocab, int32_t* rows) {
  pdl_wait();
  for (int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < tokens;
       t += int64_t{gridDim.x} * blockDim.x) {
    check_index(ids[t], vocab, "embedding_backward");
    rows[t] = static_cast<int32_t>(t);
  }
}

template <int V, typename G, typename D>
__global__ void embedding_segment_sum_kernel(const int32_t* keys, const int32_t* rows, int64_t tokens,
                                             const G* dout, int64_t d, D* dtable) {
  pdl_wait();
  const int64_t packs = d / V;
  const int64_t n = tokens * packs;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t p = i / packs, c = (i - p * packs) * V;
    const int32_t key = keys[p];
    if (p > 0 && keys[p - 1] == key) continue;  // not the first of its run
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    for (int64_t j = p; j < tokens && keys[j] == key; ++j) {
      float g[V];
      load_floats<V>(dout + int64_t{rows[j]} * d + c, g);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += g[v];
    }
    D* dst = dtable + int64_t{key} * d + c;
    float cur[V];
    load_floats<V>(dst, cur);
#pragma unroll
    for (int v = 0; v < V; ++v) cur[v] += acc[v];
    store_floats<V>(dst, cur);
  }
}

// Bits of the largest id, so the radix sort makes only the passes the vocabulary needs.
int id_bits(int64_t vocab) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < vocab) ++bits;
  return bits;
}

size_t sort_temp_bytes(int64_t tokens, int64_t vocab) {
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(tokens), 0,
      id_bits(vocab)));
  return bytes;
}

size_t align_up(size_t n) {
  return (n + 255) / 256 * 256;
}
}  // namespace

void launch_embedding_forward(const Env& env, const int32_t* ids, int64_t tokens, const void* table, DType tt,
                              int64_t vocab, int64_t d, void* out, DType ot) {
  const int64_t n = tokens * d;
  if (n == 0) return;
  TROUPE_DISPATCH_FLOAT(tt, TT, "embedding_forward", TROUPE_DISPATCH_FLOAT(ot, O, "embedding_forward", {
                          const auto* tp = static_cast<const TT*>(table);
                          auto* op = static_cast<O*>(out);
                          if (pack_ok<TT>(table, d) && pack_ok<O>(out, d)) {
                            launch(env, embedding_forward_kernel<kVec, TT, O>,
                                   grid_for(ceil_div(n, kVec), 256, env.num_sms), 256, 0, ids, tokens, tp,
                                   vocab, d, op);
                          } else {
                            launch(env, embedding_forward_kernel<1, TT, O>, grid_for(n, 256, env.num_sms),
                                   256, 0, ids, tokens, tp, vocab, d, op);
                          }
                        }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

size_t embedding_backward_scratch_bytes(int64_t tokens, int64_t vocab) {
  if (tokens == 0) return 0;
  return 3 * align_up(static_cast<size_t>(tokens) * sizeof(int32_t)) + sort_temp_bytes(tokens, vocab);
}

void launch_embedding_backward(const Env& env, const int32_t* ids, int64_t tokens, const void* dout, DType gt,
                               int64_t vocab, int64_t d, void* dtable, DType dtt, void* scratch,
                               size_t scratch_bytes) {
  if (tokens * d == 0) return;
  TROUPE_CHECK(tokens <= std::numeric_limits<int32_t>::max(),
               "embedding_backward on cuda: at most 2^31-1 tokens, got {}", tokens);
  auto* base = static_cast<char*>(scratch);
  const size_t ids_bytes = align_up(static_cast<size_t>(tokens) * sizeof(int32_t));
  auto* rows_in = reinterpret_cast<int32_t*>(base);
  auto* keys = reinterpret_cast<int32_t*>(base + ids_bytes);
  auto* rows = reinterpret_cast<int32_t*>(base + 2 * ids_bytes);
  void* temp = base + 3 * ids_bytes;
  TROUPE_CHECK(scratch_bytes >= 3 * ids_bytes,
               "embedding_backward on cuda: scratch of {} bytes for {} tokens", scratch_bytes, tokens);
  size_t temp_bytes = scratch_bytes - 3 * ids_bytes;  // the sort's share (embedding_backward_scratch_bytes)
  launch(env, embedding_ids_kernel, grid_for(tokens, 256, env.num_sms), 256, 0, ids, tokens, vocab, rows_in);
  TROUPE_CUDA_LAUNCH_CHECK();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, keys, rows_in, rows,
                                             static_cast<int>(tokens), 0, id_bits(vocab), env.stream));
  TROUPE_DISPATCH_FLOAT(
      gt, G, "embedding_backward", TROUPE_DISPATCH_FLOAT(dtt, D, "embedding_backward", {
        const auto* g = static_cast<const G*>(dout);
        auto* dt = static_cast<D*>(dtable);
        if (pack_ok<G>(dout, d) && pack_ok<D>(dtable, d)) {
          launch(env, embedding_segment_sum_kernel<kVec, G, D>,
                 grid_for(tokens * (d / kVec), 256, env.num_sms), 256, 0, keys, rows, tokens, g, d, dt);
        } else {
          launch(env, embedding_segment_sum_kernel<1, G, D>, grid_for(tokens * d, 256, env.num_sms), 256, 0,
                 keys, rows, tokens, g, d, dt);
        }
      }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

// ---- cross-entropy -------------------------------------------------------------------
namespace {
// The log-sum-exp of row lr (the block's threads take V elements at a time): a running
// maximum and rescaled sum per thread, then the block's reductions; every thread returns it.
// A thread loads kXentGroup vectors before it uses the first (bench_1b's 64 KB rows gave a
// 512-thread block only one load in flight per thread, 64% of copy bandwidth). Two keep the
// kernels at 32 registers, four 512-thread blocks an SM; four vectors spilled there.
constexpr int kXentGroup = 2;
// Folds the N packs' values into the running maximum m and the sum s of exp(v - m).
template <int N, typename L, int V>
__device__ __forceinline__ void lse_absorb(const Pack<L, V> (&p)[N], float& m, float& s) {
  float vm = to_float(p[0].v[0]);
#pragma unroll
  for (int u = 0; u < N; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) vm = fmaxf(vm, to_float(p[u].v[j]));
  }
  if (vm > m) {
    s *= __expf(m - vm);
    m = vm;
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
#pragma unroll
    for (int j = 0; j < V; ++j) s += __expf(to_float(p[u].v[j]) - m);
  }
}
template <int V, typename L>
__device__ __forceinline__ float row_lse(const L* lr, int64_t vocab, float* shared) {
  using P = Pack<L, V>;
  float m = -INFINITY, s = 0.0f;
  const int64_t step = int64_t{blockDim.x} * V;
  int64_t c = int64_t{threadIdx.x} * V;
  for (; c + (kXentGroup - 1) * step < vocab; c += kXentGroup * step) {
    P p[kXentGroup];
#pragma unroll
    for (int u = 0; u < kXentGroup; ++u) p[u] = *reinterpret_cast<const P*>(lr + c + u * step);
    lse_absorb(p, m, s);
  }
  for (; c < vocab; c += step) {
    P p[1] = {*reinterpret_cast<const P*>(lr + c)};
    lse_absorb(p, m, s);
  }
  const float row_max = block_max(m, shared);
  s = m == -INFINITY ? 0.0f : s * __expf(m - row_max);
  s = block_sum(s, shared);
  return row_max + logf(s);
}

// The gradient of logits v[0..V) at columns c.. of a row with target t (not ignored).
template <int V>
__device__ __forceinline__ void xent_grad(float (&v)[V], int64_t c, int32_t t, float lse, float grad_scale) {
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = (__expf(v[j] - lse) - (c + j == t ? 1.0f : 0.0f)) * grad_scale;
}

template <int V, typename L>
__global__ void __launch_bounds__(512, 4)
    cross_entropy_forward_kernel(const L* logits, const int32_t* targets, int64_t vocab, float* losses,
                                 float* lse_out) {
  pdl_wait();
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const L* lr = logits + row * vocab;
  const float lse = row_lse<V>(lr, vocab, shared);
  if (threadIdx.x == 0) {
    lse_out[row] = lse;
    const int32_t t = targets[row];
    if (t == -1) {
      losses[row] = 0.0f;
    } else {
      check_index(t, vocab, "cross_entropy_forward (target)");
      losses[row] = lse - to_float(lr[t]);
    }
  }
}

template <typename L, typename D>
struct CrossEntropyBackwardOp {
  const L* logits;
  const int32_t* targets;
  const float* lse;
  float grad_scale;
  int64_t vocab;
  D* dlogits;
  template <int V>
  __device__ void apply(int64_t i) const {
    const int64_t row = i / vocab, c = i - row * vocab;
    const int32_t t = targets[row];
    float v[V];
    if (t == -1) {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = 0.0f;
    } else {
      load_floats<V>(logits + i, v);
      xent_grad<V>(v, c, t, lse[row], grad_scale);
    }
    store_floats<V>(dlogits + i, v);
  }
};

// cross_entropy_forward_kernel's pass, then the backward's gradient with the lse just
// computed (row_lse and xent_grad, as the two kernels: bitwise equal results). The
// second read of the row comes mostly from L2 (a block's row is vocab * sizeof(L) bytes:
// 64 KiB for bench_1b's bf16 32k vocabulary). With dlogits aliasing logits, the target's
// logit is read before the first barrier and each thread rewrites only the elements it
// reads, after every thread's first pass (the reductions' barriers).
template <int V, typename L, typename D>
__global__ void __launch_bounds__(512, 4)
    cross_entropy_fused_kernel(const L* logits, const int32_t* targets, int64_t vocab, float grad_scale,
                               float* losses, float* lse_out, D* dlogits) {
  pdl_wait();
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const L* lr = logits + row * vocab;
  D* dr = dlogits + row * vocab;
  const int32_t t = targets[row];
  float target_logit = 0.0f;
  if (threadIdx.x == 0 && t != -1) {
    check_index(t, vocab, "cross_entropy_forward_backward (target)");
    target_logit = to_float(lr[t]);
  }
  const float lse = row_lse<V>(lr, vocab, shared);
  if (threadIdx.x == 0) {
    lse_out[row] = lse;
    losses[row] = t == -1 ? 0.0f : lse - target_logit;
  }
  const int64_t step = int64_t{blockDim.x} * V;
  if (t == -1) {
    float v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = 0.0f;
    for (int64_t c = int64_t{threadIdx.x} * V; c < vocab; c += step) store_floats<V>(dr + c, v);
    return;
  }
  int64_t c = int64_t{threadIdx.x} * V;
  for (; c + (kXentGroup - 1) * step < vocab; c += kXentGroup * step) {  // loads first, as row_lse
    Pack<L, V> p[kXentGroup];
#pragma unroll
    for (int u = 0; u < kXentGroup; ++u) p[u] = *reinterpret_cast<const Pack<L, V>*>(lr + c + u * step);
#pragma unroll
    for (int u = 0; u < kXentGroup; ++u) {
      float v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = to_float(p[u].v[j]);
      xent_grad<V>(v, c + u * step, t, lse, grad_scale);
      store_floats<V>(dr + c + u * step, v);
    }
  }
  for (; c < vocab; c += step) {
    float v[V];
    load_floats<V>(lr + c, v);
    xent_grad<V>(v, c, t, lse, grad_scale);
    store_floats<V>(dr + c, v);
  }
}

// cross_entropy_fused_kernel for bf16 rows of a whole number of 512 x 8-element sweeps
// (bench_1b's 32k vocabulary: 8), the row staged in shared memory: each thread copies its
// packs there asynchronously (cp.async, all in flight at once) and reads back only its
// own, so the row is read from global memory once (the kernel above reads it twice, the
// second time from L2 where it is still there) and no barrier orders the copies. On
// bench_1b's 4096 x 32768 chunk: 0.167 ms (75% of copy bandwidth), against 0.191 (66%). The lse takes
// row_lse's operations in its order (groups of kXentGroup packs, then one at a time), so losses, lse and
// gradients equal cross_entropy_fused_kernel's and the two kernels' bit for bit. With dlogits aliasing
// logits, every load precedes the reductions' barriers and every store follows them.
constexpr int kXentStagedThreads = 512;
constexpr int64_t kXentStagedSweep = int64_t{kXentStagedThreads} * 8;  // a block's elements per pack
// Rows of up to 14 sweeps (57,344 elements, 112 KiB of shared memory: two blocks an SM at
// least; bench_1b's 64 KiB rows leave room for three).
constexpr int64_t kXentStagedMaxVocab = 14 * kXentStagedSweep;

template <typename D>
__global__ void __launch_bounds__(kXentStagedThreads)
    cross_entropy_fused_staged_kernel(const __nv_bfloat16* logits, const int32_t* targets, int64_t vocab,
                                      float grad_scale, float* losses, float* lse_out, D* dlogits) {
  constexpr int V = 8;
  using P = Pack<__nv_bfloat16, V>;
  extern __shared__ __align__(16) unsigned char xent_row[];
  __shared__ float shared[32];
  const auto* row_smem = reinterpret_cast<const __nv_bfloat16*>(xent_row);
  pdl_wait();
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* lr = logits + row * vocab;
  D* dr = dlogits + row * vocab;
  const int packs = static_cast<int>(vocab / kXentStagedSweep);
  const int64_t c0 = int64_t{threadIdx.x} * V;
  for (int u = 0; u < packs; ++u) {
    const int64_t c = c0 + u * kXentStagedSweep;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(xent_row + c * 2))),
                 "l"(lr + c));
  }
  asm volatile("cp.async.commit_group;\n" ::);
  const int32_t t = targets[row];
  float target_logit = 0.0f;
  if (threadIdx.x == 0 && t != -1) {
    check_index(t, vocab, "cross_entropy_forward_backward (target)");
    target_logit = to_float(lr[t]);
  }
  asm volatile("cp.async.wait_all;\n" ::);  // this thread's own copies (the only ones it reads)
  float m = -INFINITY, s = 0.0f;
  int u = 0;
  for (; u + kXentGroup <= packs; u += kXentGroup) {
    P p[kXentGroup];
#pragma unroll
    for (int k = 0; k < kXentGroup; ++k)
      p[k] = *reinterpret_cast<const P*>(row_smem + c0 + (u + k) * kXentStagedSweep);
    lse_absorb(p, m, s);
  }
  for (; u < packs; ++u) {
    P p[1] = {*reinterpret_cast<const P*>(row_smem + c0 + u * kXentStagedSweep)};
    lse_absorb(p, m, s);
  }
  const float row_max = block_max(m, shared);
  s = m == -INFINITY ? 0.0f : s * __expf(m - row_max);
  s = block_sum(s, shared);
  const float lse = row_max + logf(s);
  if (threadIdx.x == 0) {
    lse_out[row] = lse;
    losses[row] = t == -1 ? 0.0f : lse - target_logit;
  }
  for (u = 0; u < packs; ++u) {
    const int64_t c = c0 + u * kXentStagedSweep;
    float v[V];
    if (t == -1) {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = 0.0f;
    } else {
      load_floats<V>(row_smem + c, v);
      xent_grad<V>(v, c, t, lse, grad_scale);
    }
    store_floats<V>(dr + c, v);
  }
}

template <int V, typename F>
__global__ void rows_elementwise_kernel(int64_t n, F f) {
  pdl_wait();
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * V; i < n; i += stride)
    f.template apply<V>(i);
}
}  // namespace

void launch_cross_entropy_forward(const Env& env, const void* logits, DType lt, const int32_t* targets,
                                  int64_t rows, int64_t vocab, float* losses, float* lse) {
  if (rows == 0) return;
  TROUPE_DISPATCH_FLOAT(lt, L, "cross_entropy_forward", {
    const auto* lp = static_cast<const L*>(logits);
    if (pack_ok<L>(logits, vocab)) {
      launch(env, cross_entropy_forward_kernel<kVec, L>, static_cast<unsigned>(rows), 512, 0, lp, targets,
             vocab, losses, lse);
    } else {
      launch(env, cross_entropy_forward_kernel<1, L>, static_cast<unsigned>(rows), 512, 0, lp, targets, vocab,
             losses, lse);
    }
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_cross_entropy_backward(const Env& env, const void* logits, DType lt, const int32_t* targets,
                                   const float* lse, float grad_scale, int64_t rows, int64_t vocab,
                                   void* dlogits, DType dt) {
  const int64_t n = rows * vocab;
  if (n == 0) return;
  TROUPE_DISPATCH_FLOAT(
      lt, L, "cross_entropy_backward", TROUPE_DISPATCH_FLOAT(dt, D, "cross_entropy_backward", {
        CrossEntropyBackwardOp<L, D> op{static_cast<const L*>(logits), targets, lse, grad_scale, vocab,
                                        static_cast<D*>(dlogits)};
        if (pack_ok<L>(logits, vocab) && pack_ok<D>(dlogits, vocab)) {
          launch(env, rows_elementwise_kernel<kVec, CrossEntropyBackwardOp<L, D>>,
                 grid_for(ceil_div(n, kVec), 256, env.num_sms), 256, 0, n, op);
        } else {
          launch(env, rows_elementwise_kernel<1, CrossEntropyBackwardOp<L, D>>, grid_for(n, 256, env.num_sms),
                 256, 0, n, op);
        }
      }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

namespace {
// cross_entropy_fused_staged_kernel where it applies (bf16 logits, rows of 1 to 14 sweeps;
// the caller checked the packs' alignment); false elsewhere.
template <typename L, typename D>
bool launch_cross_entropy_staged(const Env& env, const L* logits, const int32_t* targets, int64_t vocab,
                                 float grad_scale, int64_t rows, float* losses, float* lse, D* dlogits) {
  if constexpr (!std::is_same_v<L, __nv_bfloat16>) {
    return false;
  } else {
    if (vocab % kXentStagedSweep != 0 || vocab > kXentStagedMaxVocab) return false;
    const size_t smem = static_cast<size_t>(vocab) * sizeof(L);
    auto kernel = cross_entropy_fused_staged_kernel<D>;
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    launch(env, kernel, static_cast<unsigned>(rows), kXentStagedThreads, smem, logits, targets, vocab,
           grad_scale, losses, lse, dlogits);
    return true;
  }
}
}  // namespace

void launch_cross_entropy_forward_backward(const Env& env, const void* logits, DType lt,
                                           const int32_t* targets, float grad_scale, int64_t rows,
                                           int64_t vocab, float* losses, float* lse, void* dlogits,
                                           DType dt) {
  if (rows == 0) return;
  TROUPE_DISPATCH_FLOAT(lt, L, "cross_entropy_forward_backward",
                        TROUPE_DISPATCH_FLOAT(dt, D, "cross_entropy_forward_backward", {
                          const auto* lp = static_cast<const L*>(logits);
                          auto* dp = static_cast<D*>(dlogits);
                          const bool vec = pack_ok<L>(logits, vocab) && pack_ok<D>(dlogits, vocab);
                          if (!vec) {
                            launch(env, cross_entropy_fused_kernel<1, L, D>, static_cast<unsigned>(rows), 512,
                                   0, lp, targets, vocab, grad_scale, losses, lse, dp);
                          } else if (!launch_cross_entropy_staged(env, lp, targets, vocab, grad_scale, rows,
                                                                  losses, lse, dp)) {
                            launch(env, cross_entropy_fused_kernel<kVec, L, D>, static_cast<unsigned>(rows),
                                   512, 0, lp, targets, vocab, grad_scale, losses, lse, dp);
                          }
                        }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace troupe::kernels::gpu
