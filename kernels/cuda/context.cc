// kernels/cuda/context.cc — CudaContext.
#include "kernels/cuda/context.h"

#include <cstdlib>
#include <string_view>

#include "core/cuda/stream.h"
#include "core/gpu_check.h"

namespace troupe::kernels {

namespace {
// cuBLASLt recommends 32 MiB on Hopper for its best kernels.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
}  // namespace

CudaContext::CudaContext(int dev, cudaStream_t s, Allocator* scratch_alloc) : device(dev), stream(s) {
  cuda::DeviceGuard guard(dev);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  num_sms = prop.multiProcessorCount;
  max_smem_per_block = prop.sharedMemPerBlockOptin;
  pdl_supported = prop.major >= 9;
  pdl = pdl_supported;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  matmul_plans = std::make_unique<MatmulPlanCache>();
  workspace_buffer_ = cuda::DeviceBuffer(kWorkspaceBytes, dev);
  workspace = workspace_buffer_.data();
  workspace_bytes = kWorkspaceBytes;
  if (scratch_alloc == nullptr) {
    own_scratch_ = std::make_unique<cuda::CudaCachingAllocator>(dev);
    scratch_alloc = own_scratch_.get();
  }
  TROUPE_CHECK(scratch_alloc->device() == Device::cuda(dev), "CudaContext on cuda:{} given a scratch allocator for {}",
               dev, scratch_alloc->device());
  scratch = scratch_alloc;
}

CudaContext::~CudaContext() {
  cuda::DeviceGuard guard(device);
  // Kernels queued on the stream may still read the workspace.
  (void)cudaStreamSynchronize(stream);
  if (lt != nullptr) (void)cublasLtDestroy(lt);
}

}  // namespace troupe::kernels
