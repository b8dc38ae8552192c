// training/app/run_device.cc — RunDevice: the CPU Ctx, or the CUDA stream, caching
// allocator and CudaContext of this process's device.
#include "training/app/run_device.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string>

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda/caching_allocator.h"
#include "core/cuda/stream.h"
#include "core/env.h"
#include "core/gpu_check.h"
#include "core/job_env.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::training {

#if TROUPE_HAVE_CUDA
struct RunDevice::Cuda {
  // Destroyed in reverse order: the context and the allocator's blocks before the stream.
  cuda::CudaStream stream;
  std::unique_ptr<cuda::CudaCachingAllocator> alloc;
  std::unique_ptr<kernels::CudaContext> ctx;
};
#else
struct RunDevice::Cuda {};
#endif

RunDevice::~RunDevice() {
  if (cuda_) synchronize();
}

Result<std::unique_ptr<RunDevice>> RunDevice::create(const std::string& backend) {
  std::unique_ptr<RunDevice> d(new RunDevice());
  if (backend == "cpu") return d;
  if (backend != "cuda") return invalid_argument("--backend must be cpu or cuda, not '{}'", backend);
#if TROUPE_HAVE_CUDA
  const int n = cuda::device_count();
  if (n <= 0) {
    return failed_precondition(
        "--backend cuda: no CUDA device is visible (no driver, no GPU, or CUDA_VISIBLE_DEVICES hides them); "
        "use --backend cpu");
  }
  // A distributed worker takes GPU (local rank mod visible GPUs): under `troupe run` the
  // scheduler sets CUDA_VISIBLE_DEVICES to the worker's slot (one GPU, device 0); the
  // standalone launcher's workers see every GPU and take TROUPE_LOCAL_RANK's (the launcher
  // gives each the lowest index no live worker holds).
  int kDevice = 0;
  if (env::get_or(job_env::kRole) == "worker") {
    TROUPE_ASSIGN_OR_RETURN(int64_t local, env::get_int(job_env::kLocalRank, -1));
    if (local < 0) {
      TROUPE_ASSIGN_OR_RETURN(local, env::get_int(job_env::kRank, -1));
    }
    // With several GPUs visible, a worker past the last one would share a GPU with
    // another rank (NCCL refuses that); one visible GPU is the scheduler's per-slot view.
    if (n > 1 && local >= n) {
      return failed_precondition(
          "--backend cuda: worker {} needs its own GPU but only {} are visible (one GPU per worker)", local,
          n);
    }
    if (local > 0) kDevice = static_cast<int>(local % n);
  }
  cuda::DeviceGuard guard(kDevice);
  d->cuda_ = std::make_unique<Cuda>();
  d->cuda_->stream = cuda::CudaStream::create(kDevice);
  d->cuda_->alloc = std::make_unique<cuda::CudaCachingAllocator>(kDevice);
  d->cuda_->ctx =
      std::make_unique<kernels::CudaContext>(kDevice, d->cuda_->stream.get(), d->cuda_->alloc.get());
  d->ctx_.ex.device = Device::cuda(kDevice);
  d->ctx_.ex.cuda = d->cuda_->ctx.get();
  d->ctx_.alloc = d->cuda_->alloc.get();
  d->ctx_.act = DType::kBF16;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, kDevice));
  d->name_ = fmt::format("cuda:{} ({})", kDevice, prop.name);
  CUDA_CHECK(cudaSetDevice(kDevice));  // this thread's current device from now on
  return d;
#else
  return unimplemented(
      "--backend cuda: this build of train_moe has no CUDA support (CMake found no CUDA toolkit); rebuild "
      "where "
      "nvcc is available, or use --backend cpu");
#endif
}

void RunDevice::set_attention_fused_dq(bool on) {
#if TROUPE_HAVE_CUDA
  if (cuda_) cuda_->ctx->attention_fused_dq = on;
#else
  (void)on;
#endif
}

void RunDevice::set_pdl(bool on) {
#if TROUPE_HAVE_CUDA
  if (cuda_) cuda_->ctx->pdl = on && cuda_->ctx->pdl_supported;
#else
  (void)on;
#endif
}

void RunDevice::synchronize() const {
#if TROUPE_HAVE_CUDA
  if (cuda_) cuda_->stream.synchronize();
#endif
}

}  // namespace troupe::training
