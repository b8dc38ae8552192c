// kernels/cuda/compress.cu — the communication codec kernels: the expert permute fused
// with fp8 e4m3 quantisation, one fp32 scale per row (the rows MegaScale-MoE dispatches in
// fp8), and the fp32 sum of the chunks a bf16 reduce-scatter receives. The e4m3 encoding is
// core/fp8.h's, the same as the CPU's and the communication codec's, so every side
// produces the same bytes.
#include "core/fp8.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compress.h"

namespace troupe::kernels::gpu {
namespace {

constexpr int kThreads = 256;

// One block per (token, slot) copy; rows mapped by no copy are cleared by clear_kernel.
template <typename T>
__global__ void permute_fp8_kernel(const T* __restrict__ x, int64_t d, const int32_t* __restrict__ row_map,
                                   int64_t top_k, uint8_t* __restrict__ q, float* __restrict__ scales) {
  pdl_wait();
  const int64_t copy = blockIdx.x;
  const int32_t r = row_map[copy];
  if (r < 0) return;
  const T* src = x + (copy / top_k) * d;
  float amax = 0.0f;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) amax = fmaxf(amax, fabsf(to_float(src[c])));
  __shared__ float red[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float m = red[0];
  const float scale = (m > 0.0f && isfinite(m)) ? m / 448.0f : 1.0f;
  const float inv = 1.0f / scale;
  uint8_t* dst = q + static_cast<int64_t>(r) * d;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = fp8e4m3_encode(to_float(src[c]) * inv);
  if (threadIdx.x == 0) scales[r] = scale;
}

__global__ void clear_kernel(int64_t rows, int64_t d, uint8_t* q, float* scales) {
  pdl_wait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < rows * d) q[i] = 0;
  if (i < rows) scales[i] = 1.0f;
}

template <typename T>
__global__ void sum_chunks_kernel(const T* __restrict__ in, int64_t n, int64_t m, float* __restrict__ out) {
  pdl_wait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m) return;
  float s = to_float(in[i]);
  for (int64_t k = 1; k < n; ++k) s = __fadd_rn(s, to_float(in[k * m + i]));  // in order, no FMA contraction
  out[i] = s;
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

}  // namespace

void launch_moe_permute_fp8(const Env& env, const void* x, DType xt, int64_t tokens, int64_t d,
                            const int32_t* row_map, int64_t top_k, int64_t rows, uint8_t* q, float* scales) {
  const int64_t total = std::max(rows * d, rows);
  if (total > 0) {
    launch(env, clear_kernel, blocks_for(total), kThreads, 0, rows, d, q, scales);
    TROUPE_CUDA_LAUNCH_CHECK();
  }
  if (tokens * top_k == 0 || d == 0) return;
  TROUPE_DISPATCH_FLOAT(xt, T, "moe_permute_fp8", {
    launch(env, permute_fp8_kernel<T>, static_cast<unsigned>(tokens * top_k), kThreads, 0,
           static_cast<const T*>(x), d, row_map, top_k, q, scales);
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_sum_chunks(const Env& env, const void* in, DType it, int64_t n, int64_t m, float* out) {
  if (m == 0) return;
  TROUPE_DISPATCH_FLOAT(it, T, "sum_chunks", {
    launch(env, sum_chunks_kernel<T>, blocks_for(m), kThreads, 0, static_cast<const T*>(in), n, m, out);
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace troupe::kernels::gpu
