// kernels/cuda/common.cuh — device helpers shared by the CUDA kernels: float <-> storage
// conversions, dtype dispatch, packed (vector) loads and stores, warp/block reductions,
// and the launch-check macro.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "core/check.h"
#include "core/dtype.h"
#include "core/gpu_check.h"
#include "kernels/cuda/launch.h"

// Every launcher ends with this: a bad launch configuration surfaces here, not later.
#define TROUPE_CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// Runs `...` with `T` bound to the device storage type of float dtype `dt` (f32, bf16).
#define TROUPE_DISPATCH_FLOAT(dt, T, what, ...)                                         \
  do {                                                                                  \
    switch (dt) {                                                                       \
      case ::troupe::DType::kF32: {                                                     \
        using T = float;                                                                \
        __VA_ARGS__;                                                                    \
        break;                                                                          \
      }                                                                                 \
      case ::troupe::DType::kBF16: {                                                    \
        using T = __nv_bfloat16;                                                        \
        __VA_ARGS__;                                                                    \
        break;                                                                          \
      }                                                                                 \
      default:                                                                          \
        TROUPE_CHECK(false, "{}: dtype {} is not supported on cuda (f32 or bf16)", what, \
                     ::troupe::dtype_name(dt));                                         \
    }                                                                                   \
  } while (0)

namespace troupe::kernels::gpu {

struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(int32_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(Fp8E4M3 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
}
__device__ __forceinline__ float to_float(Fp8E5M2 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E5M2)));
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ int32_t from_float<int32_t>(float x) { return static_cast<int32_t>(x); }
// e4m3 ("fn") saturates overflow and infinities to +-448; NaN stays NaN.
template <>
__device__ __forceinline__ Fp8E4M3 from_float<Fp8E4M3>(float x) {
  return Fp8E4M3{static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3))};
}
// e5m2 saturates finite overflow to +-57344 but keeps infinities (as the CPU reference does).
template <>
__device__ __forceinline__ Fp8E5M2 from_float<Fp8E5M2>(float x) {
  if (isinf(x)) return Fp8E5M2{static_cast<uint8_t>(x > 0 ? 0x7C : 0xFC)};
  return Fp8E5M2{static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2))};
}

// V consecutive elements moved as one access (V * sizeof(T) must be 4, 8 or 16 bytes and
// the address aligned to it), or element by element when V == 1.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[V]) {
  Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(pk.v[i]);
}

template <int V, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int i = 0; i < V; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block-wide sum / max, result broadcast to every thread. blockDim.x must be a multiple
// of 32 and at most 1024; `shared` holds 32 values. Contains __syncthreads().
template <typename F>
__device__ __forceinline__ F block_sum(F x, F* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : F(0);
  return warp_sum(x);
}
__device__ __forceinline__ float block_max(float x, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(x);
}

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid for a grid-stride loop over `work` items with `threads` per block.
inline unsigned grid_for(int64_t work, int threads, int num_sms) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(work, threads));
  return static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{num_sms} * 16));
}

// ---- programmatic dependent launch (Hopper) ----------------------------------------------
// Every kernel in kernels/cuda calls pdl_wait() before its first access to global memory
// (read or write), in every thread, before any early return. Launched through launch()
// with Env::pdl set, a kernel may then be scheduled while its predecessor on the stream
// still runs: its blocks do their set-up (shared memory, barriers) and wait there, and
// the launch latency between the two kernels is hidden. griddepcontrol.wait returns
// once the predecessor grid has completed and its memory is visible, so the order of
// memory effects is the plain stream order's. After the wait, each block lets the next
// kernel's launch begin (pdl_wait does both). Without the launch attribute, or before
// sm_90, both instructions are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, env.stream>>>(args...), with programmatic stream
// serialisation allowed when env.pdl (the kernel must call pdl_wait() as above).
template <typename... Params, typename... Args>
void launch(const Env& env, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = env.stream;
  cfg.attrs = attr;
  cfg.numAttrs = env.pdl ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace troupe::kernels::gpu
