// kernels/cuda/host_copy.cu — see host_copy.h.
#include <algorithm>
#include <cstdint>

#include "core/check.h"
#include "core/gpu_check.h"
#include "kernels/cuda/host_copy.h"

namespace troupe::kernels::gpu {
namespace {

__global__ void copy_words_kernel(uint32_t* __restrict__ dst, const uint32_t* __restrict__ src, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

void* alloc_mapped_host(size_t bytes, void** device_alias) {
  void* p = nullptr;
  *device_alias = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (cudaHostGetDevicePointer(device_alias, p, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFreeHost(p);
    *device_alias = nullptr;
    return nullptr;
  }
  return p;
}

void copy_to_mapped_host(cudaStream_t stream, void* device_alias, const void* src, size_t bytes) {
  TROUPE_CHECK(bytes % 4 == 0 && reinterpret_cast<uintptr_t>(device_alias) % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 4 == 0,
               "copy_to_mapped_host: {} bytes at {} -> {} (4-byte words, aligned)", bytes, src, device_alias);
  if (bytes == 0) return;
  const size_t n = bytes / 4;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<size_t>((n + kThreads - 1) / kThreads, 64));
  copy_words_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint32_t*>(device_alias),
                                                     static_cast<const uint32_t*>(src), n);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace troupe::kernels::gpu
