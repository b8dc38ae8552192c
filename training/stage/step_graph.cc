// training/stage/step_graph.cc — StepGraph (CUDA graph capture and replay of a step on a
// Ctx's stream) and StatsReadback (pinned, event-tracked read-backs).
#include "training/stage/step_graph.h"

#include <cstring>

#include "core/check.h"

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include "core/cuda/caching_allocator.h"
#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/host_copy.h"
#endif

namespace troupe::training {

#if TROUPE_HAVE_CUDA
struct StepGraph::Cuda {
  cudaStream_t stream = nullptr;
  cuda::CudaCachingAllocator* alloc = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  void destroy() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
};
#else
struct StepGraph::Cuda {};
#endif

StepGraph::StepGraph(const layers::Ctx& c) {
#if TROUPE_HAVE_CUDA
  TROUPE_CHECK(c.on_device() && c.ex.cuda != nullptr, "StepGraph needs a CUDA Ctx");
  cuda_ = std::make_unique<Cuda>();
  cuda_->stream = c.ex.cuda->stream;
  cuda_->alloc = dynamic_cast<cuda::CudaCachingAllocator*>(c.alloc);
  TROUPE_CHECK(cuda_->alloc != nullptr, "StepGraph: the Ctx's allocator is not the CUDA caching allocator");
#else
  (void)c;
  TROUPE_CHECK(false, "StepGraph: this build has no CUDA support");
#endif
}

StepGraph::~StepGraph() {
#if TROUPE_HAVE_CUDA
  if (cuda_ && capturing_) {
    cudaGraph_t g = nullptr;
    (void)cudaStreamEndCapture(cuda_->stream, &g);
    if (g != nullptr) (void)cudaGraphDestroy(g);
    cuda_->alloc->end_graph_pool();
  }
  if (cuda_ && cuda_->exec != nullptr) reset();
#endif
}

Status StepGraph::begin_capture() {
#if TROUPE_HAVE_CUDA
  if (capturing_ || cuda_->exec != nullptr)
    return failed_precondition("StepGraph: a step was already captured");
  if (cudaError_t e = cudaStreamBeginCapture(cuda_->stream, cudaStreamCaptureModeRelaxed); e != cudaSuccess) {
    return internal_error("CUDA graph: cudaStreamBeginCapture: {}", cudaGetErrorString(e));
  }
  cuda_->alloc->begin_graph_pool();
  capturing_ = true;
  return ok_status();
#else
  return failed_precondition("CUDA graphs need a build with CUDA");
#endif
}

Status StepGraph::end_capture() {
#if TROUPE_HAVE_CUDA
  if (!capturing_) return failed_precondition("StepGraph::end_capture without begin_capture");
  capturing_ = false;
  cuda_->alloc->end_graph_pool();
  cudaGraph_t graph = nullptr;
  if (cudaError_t e = cudaStreamEndCapture(cuda_->stream, &graph); e != cudaSuccess) {
    (void)cudaGetLastError();
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    return internal_error(
        "CUDA graph: the step could not be captured ({}): something in it waited on the host or used "
        "another stream without joining it; set bench.cuda_graph = false",
        cudaGetErrorString(e));
  }
  cuda_->graph = graph;
  if (cudaError_t e = cudaGraphInstantiate(&cuda_->exec, graph, 0); e != cudaSuccess) {
    (void)cudaGetLastError();
    cuda_->exec = nullptr;
    cuda_->destroy();
    return internal_error("CUDA graph: cudaGraphInstantiate: {}", cudaGetErrorString(e));
  }
  CUDA_CHECK(cudaGraphUpload(cuda_->exec, cuda_->stream));
  return ok_status();
#else
  return failed_precondition("CUDA graphs need a build with CUDA");
#endif
}

bool StepGraph::captured() const {
#if TROUPE_HAVE_CUDA
  return cuda_ && cuda_->exec != nullptr;
#else
  return false;
#endif
}

void StepGraph::replay() const {
#if TROUPE_HAVE_CUDA
  TROUPE_CHECK(captured(), "StepGraph::replay: no captured step");
  CUDA_CHECK(cudaGraphLaunch(cuda_->exec, cuda_->stream));
#endif
}

void StepGraph::reset() {
#if TROUPE_HAVE_CUDA
  if (!cuda_ || cuda_->exec == nullptr) return;
  CUDA_CHECK(cudaStreamSynchronize(cuda_->stream));
  cuda_->destroy();
  cuda_->alloc->release_graph_pool();
#endif
}

size_t StepGraph::pool_bytes() const {
#if TROUPE_HAVE_CUDA
  return cuda_ ? cuda_->alloc->graph_pool_bytes() : 0;
#else
  return 0;
#endif
}

// ---- StatsReadback -----------------------------------------------------------------------

struct StatsReadback::Slot {
  std::vector<float> host;  // CPU Ctx
#if TROUPE_HAVE_CUDA
  float* pinned = nullptr;
  void* pinned_alias = nullptr;  // its address on the device (mapped host memory)
  size_t bytes = 0;
  cudaEvent_t done = nullptr;
#endif
  bool started = false;
};

StatsReadback::StatsReadback(const layers::Ctx& c, int slots) : ctx_(c) {
  TROUPE_CHECK(slots >= 1, "StatsReadback: {} slots", slots);
  for (int i = 0; i < slots; ++i) slots_.push_back(std::make_unique<Slot>());
}

StatsReadback::~StatsReadback() {
#if TROUPE_HAVE_CUDA
  for (auto& s : slots_) {
    if (s->done != nullptr) (void)cudaEventSynchronize(s->done);
    if (s->done != nullptr) (void)cudaEventDestroy(s->done);
    if (s->pinned != nullptr) (void)cudaFreeHost(s->pinned);
  }
#endif
}

void StatsReadback::start(int slot, const Tensor& src) {
  TROUPE_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "StatsReadback: slot {}", slot);
  TROUPE_CHECK(src.dtype() == DType::kF32 && src.is_contiguous(), "StatsReadback: {} (f32, contiguous)",
               src.describe());
  Slot& s = *slots_[static_cast<size_t>(slot)];
  s.started = true;
  if (!ctx_.on_device()) {
    s.host.assign(src.data<float>(), src.data<float>() + src.numel());
    return;
  }
#if TROUPE_HAVE_CUDA
  cudaStream_t stream = ctx_.ex.cuda->stream;
  if (s.bytes < src.nbytes()) {
    if (s.pinned != nullptr) {
      if (s.done != nullptr) CUDA_CHECK(cudaEventSynchronize(s.done));
      CUDA_CHECK(cudaFreeHost(s.pinned));
    }
    s.pinned = static_cast<float*>(kernels::gpu::alloc_mapped_host(src.nbytes(), &s.pinned_alias));
    TROUPE_CHECK(s.pinned != nullptr, "StatsReadback: no page-locked host memory for {} bytes", src.nbytes());
    s.bytes = src.nbytes();
  }
  if (s.done == nullptr) CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
  // A kernel's stores, not a copy engine: never queued behind a snapshot's bulk copy.
  kernels::gpu::copy_to_mapped_host(stream, s.pinned_alias, src.data_ptr(), src.nbytes());
  CUDA_CHECK(cudaEventRecord(s.done, stream));
#endif
}

const float* StatsReadback::wait(int slot) {
  TROUPE_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "StatsReadback: slot {}", slot);
  Slot& s = *slots_[static_cast<size_t>(slot)];
  TROUPE_CHECK(s.started, "StatsReadback::wait({}) before start", slot);
  if (!ctx_.on_device()) return s.host.data();
#if TROUPE_HAVE_CUDA
  CUDA_CHECK(cudaEventSynchronize(s.done));
  return s.pinned;
#else
  return nullptr;
#endif
}

// ---- DeviceMarks --------------------------------------------------------------------------

struct DeviceMarks::Events {
#if TROUPE_HAVE_CUDA
  cudaEvent_t begin = nullptr, end = nullptr;
#endif
  bool begun = false, ended = false;
};

DeviceMarks::DeviceMarks(const layers::Ctx& c, int slots) : ctx_(c) {
  TROUPE_CHECK(slots >= 2, "DeviceMarks: {} slots", slots);
  for (int i = 0; i < slots; ++i) slots_.push_back(std::make_unique<Events>());
}

DeviceMarks::~DeviceMarks() {
#if TROUPE_HAVE_CUDA
  for (auto& e : slots_) {
    if (e->begin != nullptr) (void)cudaEventDestroy(e->begin);
    if (e->end != nullptr) (void)cudaEventDestroy(e->end);
  }
#endif
}

void DeviceMarks::begin(int slot) {
  Events& e = *slots_.at(static_cast<size_t>(slot));
  e.begun = true;
  e.ended = false;
#if TROUPE_HAVE_CUDA
  if (!ctx_.on_device()) return;
  if (e.begin == nullptr) {
    CUDA_CHECK(cudaEventCreate(&e.begin));
    CUDA_CHECK(cudaEventCreate(&e.end));
  }
  CUDA_CHECK(cudaEventRecord(e.begin, ctx_.ex.cuda->stream));
  // An NVTX range "step" around the step's enqueue, so profilers select its kernels
  // (`ncu --nvtx --nvtx-include step/`, bench/gpu_host.sh profile).
  nvtxRangePushA("step");
#endif
}

void DeviceMarks::end(int slot) {
  Events& e = *slots_.at(static_cast<size_t>(slot));
  TROUPE_CHECK(e.begun, "DeviceMarks::end({}) before begin", slot);
  e.ended = true;
#if TROUPE_HAVE_CUDA
  if (ctx_.on_device()) {
    CUDA_CHECK(cudaEventRecord(e.end, ctx_.ex.cuda->stream));
    nvtxRangePop();
  }
#endif
}

double DeviceMarks::ms(int slot) const {
  const Events& e = *slots_.at(static_cast<size_t>(slot));
  if (!e.ended) return -1;
#if TROUPE_HAVE_CUDA
  if (!ctx_.on_device()) return -1;
  float ms = 0.0f;
  CUDA_CHECK(cudaEventSynchronize(e.end));
  CUDA_CHECK(cudaEventElapsedTime(&ms, e.begin, e.end));
  return ms;
#else
  return -1;
#endif
}

double DeviceMarks::gap_ms(int prev, int slot) const {
  const Events& p = *slots_.at(static_cast<size_t>(prev));
  const Events& e = *slots_.at(static_cast<size_t>(slot));
  if (!p.ended || !e.begun) return -1;
#if TROUPE_HAVE_CUDA
  if (!ctx_.on_device()) return -1;
  float ms = 0.0f;
  CUDA_CHECK(cudaEventSynchronize(e.begin));
  CUDA_CHECK(cudaEventElapsedTime(&ms, p.end, e.begin));
  return ms;
#else
  return -1;
#endif
}

}  // namespace troupe::training
