// core/cuda/stream.cc — CudaStream, CudaEvent and DeviceGuard.
#include "core/cuda/stream.h"

#include "core/gpu_check.h"

namespace troupe::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver/device" error
    return 0;
  }
  return n;
}

DeviceGuard::DeviceGuard(int device) {
  CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  (void)cudaSetDevice(previous_);
}

CudaStream CudaStream::create(int device, int priority) {
  DeviceGuard guard(device);
  CudaStream s;
  s.device_ = device;
  CUDA_CHECK(cudaStreamCreateWithPriority(&s.stream_, cudaStreamNonBlocking, priority));
  return s;
}

CudaStream& CudaStream::operator=(CudaStream&& o) noexcept {
  if (this != &o) {
    reset();
    stream_ = std::exchange(o.stream_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

CudaStream::~CudaStream() {
  reset();
}

void CudaStream::reset() {
  if (stream_ == nullptr) return;
  DeviceGuard guard(device_);
  CUDA_CHECK(cudaStreamDestroy(stream_));
  stream_ = nullptr;
}

void CudaStream::synchronize() const {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

CudaEvent CudaEvent::create(int device, bool timing) {
  DeviceGuard guard(device);
  CudaEvent e;
  e.device_ = device;
  CUDA_CHECK(cudaEventCreateWithFlags(&e.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}

CudaEvent& CudaEvent::operator=(CudaEvent&& o) noexcept {
  if (this != &o) {
    reset();
    event_ = std::exchange(o.event_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

CudaEvent::~CudaEvent() {
  reset();
}

void CudaEvent::reset() {
  if (event_ == nullptr) return;
  DeviceGuard guard(device_);
  CUDA_CHECK(cudaEventDestroy(event_));
  event_ = nullptr;
}

void CudaEvent::record(cudaStream_t stream) const {
  CUDA_CHECK(cudaEventRecord(event_, stream));
}
void CudaEvent::wait_on(cudaStream_t stream) const {
  CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}
void CudaEvent::synchronize() const {
  CUDA_CHECK(cudaEventSynchronize(event_));
}

bool CudaEvent::query() const {
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  CUDA_CHECK(err);
  return true;
}

float CudaEvent::elapsed_ms(const CudaEvent& start, const CudaEvent& end) {
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

}  // namespace troupe::cuda
