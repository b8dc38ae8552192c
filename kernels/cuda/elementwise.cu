// kernels/cuda/elementwise.cu — memory-bound CUDA kernels: fill, cast, add, axpby,
// scale, sum / sum of squares, sum_rows, SwiGLU, softmax, AdamW and fp8 (de)quantization.
//
// Elementwise ops share one grid-stride kernel moving 8 elements per thread per step as
// packed (up to 16-byte) accesses when every pointer is aligned for it.
#include "core/cuda/host_wait.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

namespace {

constexpr int kVec = 8;
constexpr int kThreads = 256;

template <int V, typename F>
__global__ void elementwise_kernel(int64_t n, F f) {
  pdl_wait();
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * V;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * V; i < n; i += stride) {
    if (i + V <= n) {
      f.template apply<V>(i);
    } else {
      for (int64_t j = i; j < n; ++j) f.template apply<1>(j);
    }
  }
}

// vec_ok: every pointer the functor touches is aligned for kVec-element packs (and, for
// row-structured functors, rows do not straddle packs).
template <typename F>
void run_elementwise(const Env& env, int64_t n, bool vec_ok, const F& f) {
  if (n == 0) return;
  if (vec_ok) {
    launch(env, elementwise_kernel<kVec, F>, grid_for(ceil_div(n, kVec), kThreads, env.num_sms), kThreads, 0,
           n, f);
  } else {
    launch(env, elementwise_kernel<1, F>, grid_for(n, kThreads, env.num_sms), kThreads, 0, n, f);
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

template <typename T>
bool pack_aligned(const void* p) {
  return aligned_to(p, sizeof(T) * kVec);
}

template <typename T>
struct FillOp {
  T* out;
  float value;
  template <int V>
  __device__ void apply(int64_t i) const {
    float v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = value;
    store_floats<V>(out + i, v);
  }
};

template <typename S, typename D>
struct CastOp {
  const S* src;
  D* dst;
  template <int V>
  __device__ void apply(int64_t i) const {
    float v[V];
    load_floats<V>(src + i, v);
    store_floats<V>(dst + i, v);
  }
};

template <typename A, typename B, typename O>
struct AddOp {
  const A* a;
  const B* b;
  O* out;
  template <int V>
  __device__ void apply(int64_t i) const {
    float x[V], y[V];
    load_floats<V>(a + i, x);
    load_floats<V>(b + i, y);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] += y[j];
    store_floats<V>(out + i, x);
  }
};

template <typename X, typename Y>
struct AxpbyOp {
  float alpha, beta;
  const X* x;
  Y* y;
  template <int V>
  __device__ void apply(int64_t i) const {
    float a[V], b[V];
    load_floats<V>(x + i, a);
    if (beta == 0.0f) {  // BLAS convention: y is not read, so stale NaNs do not propagate
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] *= alpha;
    } else {
      load_floats<V>(y + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = alpha * a[j] + beta * b[j];
    }
    store_floats<V>(y + i, a);
  }
};

template <typename T>
struct ScaleOp {
  T* x;
  float alpha;
  template <int V>
  __device__ void apply(int64_t i) const {
    float a[V];
    load_floats<V>(x + i, a);
#pragma unroll
    for (int j = 0; j < V; ++j) a[j] *= alpha;
    store_floats<V>(x + i, a);
  }
};

// ---- storage-type dispatch over every float format (cast) ----------------------------
template <typename F>
void dispatch_any_float(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kF32: f(float{}); break;
    case DType::kBF16: f(__nv_bfloat16{}); break;
    case DType::kF16: f(__half{}); break;
    case DType::kF8E4M3: f(Fp8E4M3{}); break;
    case DType::kF8E5M2: f(Fp8E5M2{}); break;
    default: TROUPE_CHECK(false, "{}: dtype {} is not supported on cuda", what, dtype_name(t));
  }
}

}  // namespace

void launch_fill(const Env& env, void* out, DType dt, int64_t n, float value) {
  if (value == 0.0f && !std::signbit(value) && n > 0) {
    // Zero is all-zero bits in every dtype here (f32, bf16, f16, fp8, i32), and the copy
    // engine's memset writes at close to the copy bandwidth (the elementwise kernel did
    // not: gradient zeroing was 3 ms of a bench_1b step).
    CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(n) * dtype_size(dt), env.stream));
    return;
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    run_elementwise(env, n, pack_aligned<T>(out), FillOp<T>{static_cast<T*>(out), value});
  };
  if (dt == DType::kI32) {
    run(int32_t{});
  } else {
    dispatch_any_float(dt, "fill", run);
  }
}

void launch_cast(const Env& env, const void* src, DType st, void* dst, DType dt, int64_t n) {
  dispatch_any_float(st, "cast", [&](auto s_tag) {
    using S = decltype(s_tag);
    dispatch_any_float(dt, "cast", [&](auto d_tag) {
      using D = decltype(d_tag);
      run_elementwise(env, n, pack_aligned<S>(src) && pack_aligned<D>(dst),
                      CastOp<S, D>{static_cast<const S*>(src), static_cast<D*>(dst)});
    });
  });
}

void launch_add(const Env& env, const void* a, DType at, const void* b, DType bt, void* out, DType ot, int64_t n) {
  TROUPE_DISPATCH_FLOAT(at, A, "add", TROUPE_DISPATCH_FLOAT(bt, B, "add", TROUPE_DISPATCH_FLOAT(ot, O, "add", {
    run_elementwise(env, n, pack_aligned<A>(a) && pack_aligned<B>(b) && pack_aligned<O>(out),
                    AddOp<A, B, O>{static_cast<const A*>(a), static_cast<const B*>(b), static_cast<O*>(out)});
  })));
}

void launch_axpby(const Env& env, float alpha, const void* x, DType xt, float beta, void* y, DType yt, int64_t n) {
  TROUPE_DISPATCH_FLOAT(xt, X, "axpby", TROUPE_DISPATCH_FLOAT(yt, Y, "axpby", {
    run_elementwise(env, n, pack_aligned<X>(x) && pack_aligned<Y>(y),
                    AxpbyOp<X, Y>{alpha, beta, static_cast<const X*>(x), static_cast<Y*>(y)});
  }));
}

void launch_scale(const Env& env, void* x, DType t, int64_t n, float alpha) {
  TROUPE_DISPATCH_FLOAT(t, T, "scale",
                        run_elementwise(env, n, pack_aligned<T>(x), ScaleOp<T>{static_cast<T*>(x), alpha}));
}

// ---- sum, sum of squares -------------------------------------------------------------
namespace {
constexpr int kReduceBlocks = 1024;

template <typename T>
__global__ void sum_kernel(const T* x, int64_t n, bool squares, double* partials) {
  pdl_wait();
  __shared__ double shared[32];
  double acc = 0.0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = to_float(x[i]);
    acc += squares ? v * v : v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
}  // namespace

size_t reduce_scratch_bytes() { return kReduceBlocks * sizeof(double); }

double launch_sum(const Env& env, const void* x, DType t, int64_t n, bool squares, void* partials) {
  if (n == 0) return 0.0;
  const unsigned blocks = std::min<unsigned>(kReduceBlocks, grid_for(n, kThreads, env.num_sms));
  TROUPE_DISPATCH_FLOAT(t, T, squares ? "sum_squares" : "sum", {
    launch(env, sum_kernel<T>, blocks, kThreads, 0, static_cast<const T*>(x), n, squares,
           static_cast<double*>(partials));
  });
  TROUPE_CUDA_LAUNCH_CHECK();
  double host[kReduceBlocks];
  CUDA_CHECK(cudaMemcpyAsync(host, partials, blocks * sizeof(double), cudaMemcpyDeviceToHost, env.stream));
  cuda::host_wait(env.stream);
  double total = 0.0;
  for (unsigned i = 0; i < blocks; ++i) total += host[i];  // fixed order: deterministic
  return total;
}

// ---- sum_rows: column sums of [R, C] in two deterministic passes --------------------
namespace {
constexpr int kColTile = 32;
constexpr int kRowThreads = 8;
constexpr int kRowsPerSplit = 64;

int64_t sum_rows_splits(int64_t rows) { return std::min<int64_t>(ceil_div(std::max<int64_t>(rows, 1), kRowsPerSplit), 256); }

// partial[split, c] = sum of x[r, c] over this split's rows.
template <typename T>
__global__ void column_partial_kernel(const T* x, int64_t rows, int64_t cols, int64_t rows_per_split, float* partial) {
  pdl_wait();
  __shared__ float tile[kRowThreads][kColTile + 1];
  const int64_t c = int64_t{blockIdx.x} * kColTile + threadIdx.x;
  const int64_t r0 = int64_t{blockIdx.y} * rows_per_split;
  const int64_t r1 = min64(rows, r0 + rows_per_split);
  float acc = 0.0f;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowThreads) acc += to_float(x[r * cols + c]);
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowThreads; ++i) s += tile[i][threadIdx.x];
    partial[int64_t{blockIdx.y} * cols + c] = s;
  }
}

// out[c] (+)= sum over splits of partial[split, c]. A block takes kFinishCols columns (a
// 32-byte sector of each split's row) and kFinishRows threads per column, each summing
// every kFinishRows-th split with four independent accumulators (loads in flight), so
// bench_1b's 1024 columns fill 128 blocks: the 32-column version's 32 blocks of serial
// loads took 6.4 us a launch inside the step (38 launches).
constexpr int kFinishCols = 8;
constexpr int kFinishRows = 32;
template <typename O>
__global__ void column_finish_kernel(const float* partial, int64_t splits, int64_t cols, O* out, bool accumulate) {
  pdl_wait();
  __shared__ float tile[kFinishRows][kFinishCols + 1];
  const int64_t c = int64_t{blockIdx.x} * kFinishCols + threadIdx.x;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (c < cols) {
    int64_t i = threadIdx.y;
    for (; i + 3 * kFinishRows < splits; i += 4 * kFinishRows) {
#pragma unroll
      for (int u = 0; u < 4; ++u) s[u] += partial[(i + u * kFinishRows) * cols + c];
    }
    for (; i < splits; i += kFinishRows) s[0] += partial[i * cols + c];
  }
  tile[threadIdx.y][threadIdx.x] = (s[0] + s[1]) + (s[2] + s[3]);
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = accumulate ? to_float(out[c]) : 0.0f;
#pragma unroll
    for (int i = 0; i < kFinishRows; ++i) total += tile[i][threadIdx.x];
    out[c] = from_float<O>(total);
  }
}
}  // namespace

size_t sum_rows_scratch_bytes(int64_t rows, int64_t cols) {
  return static_cast<size_t>(sum_rows_splits(rows) * cols) * sizeof(float);
}

// Shared with rows.cu (RMSNorm's dw): out (+)= column sums of f32 partials [splits, cols].
void launch_column_finish(const Env& env, const float* partial, int64_t splits, int64_t cols, void* out, DType ot,
                          bool accumulate) {
  TROUPE_DISPATCH_FLOAT(ot, O, "sum_rows", {
    launch(env, column_finish_kernel<O>, static_cast<unsigned>(ceil_div(cols, kFinishCols)),
           dim3(kFinishCols, kFinishRows), 0, partial, splits, cols, static_cast<O*>(out), accumulate);
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_sum_rows(const Env& env, const void* x, DType xt, int64_t rows, int64_t cols, void* out, DType ot,
                     bool accumulate, void* scratch) {
  if (cols == 0) return;
  const int64_t splits = sum_rows_splits(rows);
  float* partial = static_cast<float*>(scratch);
  dim3 grid(static_cast<unsigned>(ceil_div(cols, kColTile)), static_cast<unsigned>(splits));
  TROUPE_DISPATCH_FLOAT(xt, T, "sum_rows", {
    launch(env, column_partial_kernel<T>, grid, dim3(kColTile, kRowThreads), 0, static_cast<const T*>(x),
           rows, cols, kRowsPerSplit, partial);
  });
  TROUPE_CUDA_LAUNCH_CHECK();
  launch_column_finish(env, partial, splits, cols, out, ot, accumulate);
}

// ---- SwiGLU --------------------------------------------------------------------------
// h [rows, 2f] holds the gate (columns [0, f)) and the up projection ([f, 2f)) of each row.
// The packed backward walks rows (a block per two rows at a time, its threads over the
// rows' kVec-element packs) so no index needs a division: 0.351 -> 0.242 ms on bench_1b's
// expert rows (H100, 92.5% of copy bandwidth); the same for the forward measured slower
// than the flat elementwise kernel (0.154 vs 0.143 ms), which it keeps.
namespace {
// x * sigmoid(x) and sigmoid(x) with a fast reciprocal (the exp dominates the error).
__device__ __forceinline__ float sigmoidf(float x) {
  return __frcp_rn(1.0f + __expf(-x));
}

template <typename T>
struct SwigluForwardOp {
  const T* h;
  T* out;
  int64_t f;
  template <int V>
  __device__ void apply(int64_t i) const {
    const int64_t r = i / f, c = i - r * f;
    float g[V], u[V];
    load_floats<V>(h + r * 2 * f + c, g);
    load_floats<V>(h + r * 2 * f + f + c, u);
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] = g[j] * sigmoidf(g[j]) * u[j];
    store_floats<V>(out + i, g);
  }
};

template <typename T>
struct SwigluBackwardOp {
  const T* h;
  const T* dout;
  T* dh;
  int64_t f;
  template <int V>
  __device__ void apply(int64_t i) const {
    const int64_t r = i / f, c = i - r * f;
    float g[V], u[V], d[V], dg[V], du[V];
    load_floats<V>(h + r * 2 * f + c, g);
    load_floats<V>(h + r * 2 * f + f + c, u);
    load_floats<V>(dout + i, d);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float s = sigmoidf(g[j]);
      const float silu = g[j] * s;
      du[j] = d[j] * silu;
      dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
    }
    store_floats<V>(dh + r * 2 * f + c, dg);
    store_floats<V>(dh + r * 2 * f + f + c, du);
  }
};

constexpr int kRowsInFlight = 2;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_rows_kernel(const T* h, const T* dout, T* dh, int64_t rows, int64_t f) {
  pdl_wait();
  for (int64_t r0 = int64_t{blockIdx.x} * kRowsInFlight; r0 < rows;
       r0 += int64_t{gridDim.x} * kRowsInFlight) {
    for (int64_t c = int64_t{threadIdx.x} * kVec; c < f; c += int64_t{kThreads} * kVec) {
      float g[kRowsInFlight][kVec], u[kRowsInFlight][kVec], d[kRowsInFlight][kVec];
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) {
        if (r0 + k >= rows) break;
        load_floats<kVec>(h + (r0 + k) * 2 * f + c, g[k]);
        load_floats<kVec>(h + (r0 + k) * 2 * f + f + c, u[k]);
        load_floats<kVec>(dout + (r0 + k) * f + c, d[k]);
      }
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) {
        if (r0 + k >= rows) break;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float sg = sigmoidf(g[k][j]);
          const float dk = d[k][j];
          const float du = dk * g[k][j] * sg;  // d * silu(g)
          g[k][j] = dk * u[k][j] * sg * (1.0f + g[k][j] * (1.0f - sg));
          u[k][j] = du;
        }
        store_floats<kVec>(dh + (r0 + k) * 2 * f + c, g[k]);
        store_floats<kVec>(dh + (r0 + k) * 2 * f + f + c, u[k]);
      }
    }
  }
}

unsigned swiglu_grid(const Env& env, int64_t rows) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div(rows, kRowsInFlight), int64_t{env.num_sms} * 8)));
}
}  // namespace

void launch_swiglu_forward(const Env& env, const void* h, void* out, DType t, int64_t rows, int64_t f) {
  TROUPE_DISPATCH_FLOAT(t, T, "swiglu_forward", {
    const bool vec = f % kVec == 0 && pack_aligned<T>(h) && pack_aligned<T>(out);
    run_elementwise(env, rows * f, vec, SwigluForwardOp<T>{static_cast<const T*>(h), static_cast<T*>(out), f});
  });
}

void launch_swiglu_backward(const Env& env, const void* h, const void* dout, void* dh, DType t, int64_t rows,
                            int64_t f) {
  if (rows == 0 || f == 0) return;
  TROUPE_DISPATCH_FLOAT(t, T, "swiglu_backward", {
    const bool vec = f % kVec == 0 && pack_aligned<T>(h) && pack_aligned<T>(dout) && pack_aligned<T>(dh);
    if (vec) {
      launch(env, swiglu_backward_rows_kernel<T>, swiglu_grid(env, rows), kThreads, 0,
             static_cast<const T*>(h), static_cast<const T*>(dout), static_cast<T*>(dh), rows, f);
      TROUPE_CUDA_LAUNCH_CHECK();
    } else {
      run_elementwise(
          env, rows * f, false,
          SwigluBackwardOp<T>{static_cast<const T*>(h), static_cast<const T*>(dout), static_cast<T*>(dh), f});
    }
  });
}

// ---- softmax (one block per row) -----------------------------------------------------
namespace {
template <typename T>
__global__ void softmax_forward_kernel(const T* x, T* y, int64_t cols) {
  pdl_wait();
  __shared__ float shared[32];
  const T* xr = x + int64_t{blockIdx.x} * cols;
  T* yr = y + int64_t{blockIdx.x} * cols;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_float(xr[c]));
  m = block_max(m, shared);
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += __expf(to_float(xr[c]) - m);
  s = block_sum(s, shared);
  const float inv = 1.0f / s;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = from_float<T>(__expf(to_float(xr[c]) - m) * inv);
}
template <typename T>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, int64_t cols) {
  pdl_wait();
  __shared__ float shared[32];
  const int64_t base = int64_t{blockIdx.x} * cols;
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += to_float(y[base + c]) * to_float(dy[base + c]);
  dot = block_sum(dot, shared);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    dx[base + c] = from_float<T>(to_float(y[base + c]) * (to_float(dy[base + c]) - dot));
  }
}
}  // namespace

void launch_softmax_forward(const Env& env, const void* x, void* y, DType t, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  TROUPE_DISPATCH_FLOAT(t, T, "softmax_forward", {
    launch(env, softmax_forward_kernel<T>, static_cast<unsigned>(rows), kThreads, 0, static_cast<const T*>(x),
           static_cast<T*>(y), cols);
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_softmax_backward(const Env& env, const void* y, const void* dy, void* dx, DType t, int64_t rows,
                             int64_t cols) {
  if (rows == 0) return;
  TROUPE_DISPATCH_FLOAT(t, T, "softmax_backward", {
    launch(env, softmax_backward_kernel<T>, static_cast<unsigned>(rows), kThreads, 0,
           static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx), cols);
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

// ---- AdamW ---------------------------------------------------------------------------
namespace {
template <typename G>
struct AdamWOp {
  float* param;
  const G* grad;
  float* m;
  float* v;
  AdamWArgs a;
  template <int V>
  __device__ void apply(int64_t i) const {
    float p[V], g[V], mm[V], vv[V];
    load_floats<V>(param + i, p);
    load_floats<V>(grad + i, g);
    load_floats<V>(m + i, mm);
    load_floats<V>(v + i, vv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gj = g[j] * a.grad_scale;
      mm[j] = a.beta1 * mm[j] + (1.0f - a.beta1) * gj;
      vv[j] = a.beta2 * vv[j] + (1.0f - a.beta2) * gj * gj;
      const float mhat = mm[j] / a.bias_correction1;
      const float vhat = vv[j] / a.bias_correction2;
      p[j] -= a.lr * (mhat / (sqrtf(vhat) + a.eps) + a.weight_decay * p[j]);
    }
    store_floats<V>(param + i, p);
    store_floats<V>(m + i, mm);
    store_floats<V>(v + i, vv);
  }
};
}  // namespace

void launch_adamw(const Env& env, float* param, const void* grad, DType gt, float* m, float* v, int64_t n,
                  const AdamWArgs& args) {
  TROUPE_DISPATCH_FLOAT(gt, G, "adamw_step", {
    const bool vec = pack_aligned<float>(param) && pack_aligned<G>(grad) && pack_aligned<float>(m) &&
                     pack_aligned<float>(v);
    run_elementwise(env, n, vec, AdamWOp<G>{param, static_cast<const G*>(grad), m, v, args});
  });
}

// ---- fp8 -----------------------------------------------------------------------------
namespace {
// One block per (row, scale block).
template <typename X, typename Q>
__global__ void quantize_fp8_kernel(const X* x, int64_t cols, int64_t block, int64_t nb, float fp8_max, Q* q,
                                    float* scales) {
  pdl_wait();
  __shared__ float shared[32];
  const int64_t r = blockIdx.x / nb, b = blockIdx.x % nb;
  const int64_t c0 = b * block, c1 = min64(cols, c0 + block);
  const X* xr = x + r * cols;
  float amax = 0.0f;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) amax = fmaxf(amax, fabsf(to_float(xr[c])));
  amax = block_max(amax, shared);
  const float scale = amax > 0.0f ? amax / fp8_max : 1.0f;
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) q[r * cols + c] = from_float<Q>(to_float(xr[c]) / scale);
}

template <typename Q, typename O>
struct DequantOp {
  const Q* q;
  const float* scales;
  O* out;
  int64_t cols, block, nb;
  template <int V>
  __device__ void apply(int64_t i) const {
    float v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t r = (i + j) / cols, c = (i + j) - r * cols;
      v[j] = to_float(q[i + j]) * scales[r * nb + c / block];
    }
    store_floats<V>(out + i, v);
  }
};

template <typename F>
void dispatch_fp8(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::kF8E4M3: f(Fp8E4M3{}); break;
    case DType::kF8E5M2: f(Fp8E5M2{}); break;
    default: TROUPE_CHECK(false, "{}: {} is not an fp8 dtype", what, dtype_name(t));
  }
}
}  // namespace

void launch_quantize_fp8(const Env& env, const void* x, DType xt, int64_t rows, int64_t cols, int64_t block_size,
                         void* q, DType qt, float* scales) {
  if (rows == 0 || cols == 0) return;
  const int64_t block = block_size == 0 ? cols : block_size;
  const int64_t nb = ceil_div(cols, block);
  const float fp8_max = qt == DType::kF8E4M3 ? kFp8E4M3Max : kFp8E5M2Max;
  TROUPE_DISPATCH_FLOAT(xt, X, "quantize_fp8", dispatch_fp8(qt, "quantize_fp8", [&](auto tag) {
    using Q = decltype(tag);
    launch(env, quantize_fp8_kernel<X, Q>, static_cast<unsigned>(rows * nb), 128, 0, static_cast<const X*>(x),
           cols, block, nb, fp8_max, static_cast<Q*>(q), scales);
  }));
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_dequantize_fp8(const Env& env, const void* q, DType qt, const float* scales, int64_t rows, int64_t cols,
                           int64_t block_size, void* out, DType ot) {
  const int64_t block = block_size == 0 ? cols : block_size;
  const int64_t nb = block == 0 ? 1 : ceil_div(cols, block);
  dispatch_fp8(qt, "dequantize_fp8", [&](auto tag) {
    using Q = decltype(tag);
    TROUPE_DISPATCH_FLOAT(ot, O, "dequantize_fp8", {
      run_elementwise(env, rows * cols, pack_aligned<Q>(q) && pack_aligned<O>(out),
                      DequantOp<Q, O>{static_cast<const Q*>(q), scales, static_cast<O*>(out), cols, block, nb});
    });
  });
}

}  // namespace troupe::kernels::gpu
