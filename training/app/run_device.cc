// training/app/run_device.cc — RunDevice: the CPU Ctx, or the CUDA stream, caching
// allocator and CudaContext of this process's device.
#include "training/app/run_device.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string>

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include "core/cuda/caching_allocator.h"
#include "core/cuda/host_wait.h"
#include "core/cuda/stream.h"
#include "core/env.h"
#include "core/gpu_check.h"
#include "core/job_env.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/host_copy.h"
#endif

namespace troupe::training {

#if TROUPE_HAVE_CUDA
struct RunDevice::Cuda {
  // Destroyed in reverse order: the context and the allocator's blocks before the stream.
  cuda::CudaStream stream;
  std::unique_ptr<cuda::CudaCachingAllocator> alloc;
  std::unique_ptr<kernels::CudaContext> ctx;
  cudaGraph_t graph = nullptr;  // a captured step (begin_capture / end_capture)
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t begin[2] = {}, end[2] = {};  // mark_begin / mark_end, per slot
  float* pinned = nullptr;                 // read_async's buffer
  size_t pinned_bytes = 0;
  void* pinned_alias = nullptr;  // its address on the device (mapped host memory)
  cudaEvent_t read_done = nullptr;
  ~Cuda() {
    for (int i = 0; i < 2; ++i) {
      if (begin[i] != nullptr) (void)cudaEventDestroy(begin[i]);
      if (end[i] != nullptr) (void)cudaEventDestroy(end[i]);
    }
    if (read_done != nullptr) (void)cudaEventDestroy(read_done);
    if (pinned != nullptr) (void)cudaFreeHost(pinned);
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  }
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

int64_t RunDevice::host_syncs() const {
#if TROUPE_HAVE_CUDA
  return cuda_ ? cuda::host_wait_count(cuda::HostWait::kReadBack) : 0;
#else
  return 0;
#endif
}

int64_t RunDevice::upload_waits() const {
#if TROUPE_HAVE_CUDA
  return cuda_ ? cuda::host_wait_count(cuda::HostWait::kUpload) : 0;
#else
  return 0;
#endif
}

Status RunDevice::begin_capture() {
#if TROUPE_HAVE_CUDA
  if (!cuda_) return failed_precondition("CUDA graphs need --backend cuda");
  if (cuda_->exec != nullptr) return failed_precondition("a CUDA graph of the step was already captured");
  if (cudaError_t e = cudaStreamBeginCapture(cuda_->stream.get(), cudaStreamCaptureModeRelaxed);
      e != cudaSuccess) {
    return internal_error("CUDA graph: cudaStreamBeginCapture: {}", cudaGetErrorString(e));
  }
  cuda_->alloc->begin_graph_pool();
  return ok_status();
#else
  return failed_precondition("CUDA graphs need a build with CUDA");
#endif
}

Status RunDevice::end_capture() {
#if TROUPE_HAVE_CUDA
  if (!cuda_ || !cuda_->alloc->capturing()) return failed_precondition("end_capture without begin_capture");
  cuda_->alloc->end_graph_pool();
  cudaGraph_t graph = nullptr;
  if (cudaError_t e = cudaStreamEndCapture(cuda_->stream.get(), &graph); e != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(
        "CUDA graph: the step could not be captured ({}): something in it waited on the host or used "
        "another stream; set bench.cuda_graph = false",
        cudaGetErrorString(e));
  }
  cuda_->graph = graph;
  if (cudaError_t e = cudaGraphInstantiate(&cuda_->exec, graph, 0); e != cudaSuccess) {
    (void)cudaGetLastError();
    cuda_->exec = nullptr;
    return internal_error("CUDA graph: cudaGraphInstantiate: {}", cudaGetErrorString(e));
  }
  CUDA_CHECK(cudaGraphUpload(cuda_->exec, cuda_->stream.get()));
  return ok_status();
#else
  return failed_precondition("CUDA graphs need a build with CUDA");
#endif
}

void RunDevice::mark_begin(int slot) const {
  TROUPE_CHECK(slot == 0 || slot == 1, "RunDevice::mark_begin: slot {} (0 or 1)", slot);
#if TROUPE_HAVE_CUDA
  if (!cuda_) return;
  if (cuda_->begin[slot] == nullptr) {
    CUDA_CHECK(cudaEventCreate(&cuda_->begin[slot]));
    CUDA_CHECK(cudaEventCreate(&cuda_->end[slot]));
  }
  CUDA_CHECK(cudaEventRecord(cuda_->begin[slot], cuda_->stream.get()));
#endif
}

void RunDevice::mark_end(int slot) const {
  TROUPE_CHECK(slot == 0 || slot == 1, "RunDevice::mark_end: slot {} (0 or 1)", slot);
#if TROUPE_HAVE_CUDA
  if (!cuda_) return;
  TROUPE_CHECK(cuda_->end[slot] != nullptr, "RunDevice::mark_end before mark_begin");
  CUDA_CHECK(cudaEventRecord(cuda_->end[slot], cuda_->stream.get()));
#endif
}

double RunDevice::device_ms(int slot) const {
  TROUPE_CHECK(slot == 0 || slot == 1, "RunDevice::device_ms: slot {} (0 or 1)", slot);
#if TROUPE_HAVE_CUDA
  if (!cuda_ || cuda_->end[slot] == nullptr) return 0.0;
  float ms = 0.0f;
  CUDA_CHECK(cudaEventSynchronize(cuda_->end[slot]));
  CUDA_CHECK(cudaEventElapsedTime(&ms, cuda_->begin[slot], cuda_->end[slot]));
  return ms;
#else
  return 0.0;
#endif
}

void RunDevice::read_async(const Tensor& src) {
  TROUPE_CHECK(src.dtype() == DType::kF32 && src.is_contiguous(),
               "RunDevice::read_async: {} (f32, contiguous)", src.describe());
#if TROUPE_HAVE_CUDA
  if (cuda_) {
    if (cuda_->pinned_bytes < src.nbytes()) {
      if (cuda_->pinned != nullptr) CUDA_CHECK(cudaFreeHost(cuda_->pinned));
      cuda_->pinned =
          static_cast<float*>(kernels::gpu::alloc_mapped_host(src.nbytes(), &cuda_->pinned_alias));
      TROUPE_CHECK(cuda_->pinned != nullptr, "RunDevice: no page-locked host memory for {} bytes",
                   src.nbytes());
      cuda_->pinned_bytes = src.nbytes();
    }
    if (cuda_->read_done == nullptr)
      CUDA_CHECK(cudaEventCreateWithFlags(&cuda_->read_done, cudaEventDisableTiming));
    // A kernel's stores, not a copy engine: never queued behind a snapshot's bulk copy.
    kernels::gpu::copy_to_mapped_host(cuda_->stream.get(), cuda_->pinned_alias, src.data_ptr(), src.nbytes());
    CUDA_CHECK(cudaEventRecord(cuda_->read_done, cuda_->stream.get()));
    return;
  }
#endif
  host_read_ = src.clone();
}

const float* RunDevice::read_wait() {
#if TROUPE_HAVE_CUDA
  if (cuda_) {
    TROUPE_CHECK(cuda_->read_done != nullptr, "RunDevice::read_wait before read_async");
    CUDA_CHECK(cudaEventSynchronize(cuda_->read_done));
    return cuda_->pinned;
  }
#endif
  TROUPE_CHECK(host_read_.defined(), "RunDevice::read_wait before read_async");
  return host_read_.data<float>();
}

void RunDevice::launch_graph() const {
#if TROUPE_HAVE_CUDA
  TROUPE_CHECK(has_graph(), "RunDevice::launch_graph: no captured graph");
  CUDA_CHECK(cudaGraphLaunch(cuda_->exec, cuda_->stream.get()));
#endif
}

bool RunDevice::has_graph() const {
#if TROUPE_HAVE_CUDA
  return cuda_ && cuda_->exec != nullptr;
#else
  return false;
#endif
}

size_t RunDevice::graph_pool_bytes() const {
#if TROUPE_HAVE_CUDA
  return cuda_ ? cuda_->alloc->graph_pool_bytes() : 0;
#else
  return 0;
#endif
}

void RunDevice::range_push(const char* name) const {
#if TROUPE_HAVE_CUDA
  if (cuda_) nvtxRangePushA(name);
#else
  (void)name;
#endif
}

void RunDevice::range_pop() const {
#if TROUPE_HAVE_CUDA
  if (cuda_) nvtxRangePop();
#endif
}

}  // namespace troupe::training
