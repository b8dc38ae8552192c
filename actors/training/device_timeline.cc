// actors/training/device_timeline.cc — DeviceTimeline (device_timeline.h).
#include "actors/training/device_timeline.h"

#include <vector>

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::training {

#if TROUPE_HAVE_CUDA
struct DeviceTimeline::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t origin = nullptr;  // the clock's zero: the first event recorded
  struct Pair {
    cudaEvent_t begin = nullptr, end = nullptr;
  };
  std::map<int64_t, Pair> steps;
  std::vector<cudaEvent_t> free;  // recycled events

  cudaEvent_t take() {
    if (!free.empty()) {
      cudaEvent_t e = free.back();
      free.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));  // with timing
    return e;
  }
  void give(cudaEvent_t e) {
    if (e != nullptr) free.push_back(e);
  }
  void record(cudaEvent_t& slot) {
    CUDA_CHECK(cudaSetDevice(device));  // events belong to the stream's device
    if (slot == nullptr) slot = take();
    CUDA_CHECK(cudaEventRecord(slot, stream));
    if (origin == nullptr) {
      origin = take();
      CUDA_CHECK(cudaEventRecord(origin, stream));
    }
  }
  double since(cudaEvent_t a, cudaEvent_t b) const {  // ms from a to b; both completed
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms);
  }
  ~Impl() {
    for (auto& [step, p] : steps) {
      if (p.begin != nullptr) (void)cudaEventDestroy(p.begin);
      if (p.end != nullptr) (void)cudaEventDestroy(p.end);
    }
    for (cudaEvent_t e : free) (void)cudaEventDestroy(e);
    if (origin != nullptr) (void)cudaEventDestroy(origin);
  }
};

DeviceTimeline::DeviceTimeline(const layers::Ctx& ctx) {
  if (!ctx.on_device() || ctx.ex.cuda == nullptr) return;
  impl_ = std::make_unique<Impl>();
  impl_->device = ctx.ex.device.index;
  impl_->stream = ctx.ex.cuda->stream;
}

void DeviceTimeline::begin(int64_t step) {
  if (impl_) impl_->record(impl_->steps[step].begin);
}

void DeviceTimeline::end(int64_t step) {
  if (impl_) impl_->record(impl_->steps[step].end);
}

DeviceTimeline::Times DeviceTimeline::read(int64_t step) {
  Times t;
  if (!impl_) return t;
  auto it = impl_->steps.find(step);
  if (it == impl_->steps.end() || it->second.begin == nullptr || it->second.end == nullptr) return t;
  CUDA_CHECK(cudaSetDevice(impl_->device));
  CUDA_CHECK(cudaEventSynchronize(it->second.end));
  t.device_ms = impl_->since(it->second.begin, it->second.end);
  t.begin_ms = impl_->since(impl_->origin, it->second.begin);
  t.end_ms = impl_->since(impl_->origin, it->second.end);
  auto prev = impl_->steps.find(step - 1);
  if (prev != impl_->steps.end() && prev->second.end != nullptr) {
    t.gap_ms = impl_->since(prev->second.end, it->second.begin);
  }
  // Older steps are done with: step - 1's end was the last use of theirs.
  for (auto old = impl_->steps.begin(); old != impl_->steps.end() && old->first < step;) {
    impl_->give(old->second.begin);
    impl_->give(old->second.end);
    old = impl_->steps.erase(old);
  }
  return t;
}

void DeviceTimeline::reset() {
  if (!impl_) return;
  for (auto& [step, p] : impl_->steps) {
    impl_->give(p.begin);
    impl_->give(p.end);
  }
  impl_->steps.clear();
}
#else
struct DeviceTimeline::Impl {};
DeviceTimeline::DeviceTimeline(const layers::Ctx&) {}
void DeviceTimeline::begin(int64_t) {}
void DeviceTimeline::end(int64_t) {}
DeviceTimeline::Times DeviceTimeline::read(int64_t) {
  return {};
}
void DeviceTimeline::reset() {}
#endif

DeviceTimeline::~DeviceTimeline() = default;

}  // namespace troupe::training
