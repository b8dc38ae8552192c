// kernels/cuda/context.h — defines CudaContext: what every CUDA op needs besides its
// tensors: the device, the stream ops are enqueued on, a cuBLASLt handle with its
// workspace, and an allocator for op-internal scratch memory.
//
// Ownership: the context owns the cuBLASLt handle, the workspace and (when none is given)
// its scratch allocator; it borrows the stream. Create one per device per thread of
// work; a context is not thread-safe (ops on it are serialised by its stream anyway).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "core/allocator.h"
#include "core/cuda/caching_allocator.h"
#include "core/cuda/device_buffer.h"
#include "kernels/cuda/matmul_lt.h"

namespace troupe::kernels {

struct CudaContext {
  // stream: borrowed (nullptr = the legacy default stream). scratch: allocator for op
  // temporaries (nullptr = a private CudaCachingAllocator); it must serve `device` and
  // follow the caching allocator's one-stream contract with `stream`.
  CudaContext(int device, cudaStream_t stream, Allocator* scratch = nullptr);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt workspace
  size_t workspace_bytes = 0;
  Allocator* scratch = nullptr;
  int num_sms = 0;
  size_t max_smem_per_block = 0;  // opt-in limit (bytes)
  // Kernels launch with programmatic dependent launch (gpu::Env::pdl) where the device
  // has it (pdl_supported: compute capability 9.0 and up), unless the run turns it off
  // (the config's bench.pdl = false, handed down by RunDevice::set_pdl, for comparison).
  bool pdl_supported = false;
  bool pdl = false;
  // The Hopper attention backward at head dim 64 computes dQ inside its dK/dV kernel, each
  // key block adding its share in no fixed order (faster; runs agree to rounding); false:
  // dQ in its own kernel, bitwise the same every run (gpu::Env::attention_fused_dq;
  // train_moe's train.attention_fused_dq).
  bool attention_fused_dq = true;
  std::unique_ptr<MatmulPlanCache> matmul_plans;  // cuBLASLt algorithm per problem shape

 private:
  std::unique_ptr<cuda::CudaCachingAllocator> own_scratch_;
  cuda::DeviceBuffer workspace_buffer_;
};

}  // namespace troupe::kernels
