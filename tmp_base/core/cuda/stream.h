// core/cuda/stream.h — defines CudaStream and CudaEvent (move-only RAII owners of a
// cudaStream_t / cudaEvent_t) and DeviceGuard (sets the current device for a scope).
//
// Contract: an owner destroys its handle on the device it was created on; views of the
// raw handle (get()) never own it. All calls abort via CUDA_CHECK on error.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace troupe::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no device (never aborts).
int device_count();

// Makes `device` current for the lifetime of the guard, restoring the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

class CudaStream {
 public:
  CudaStream() = default;  // empty: get() is the legacy default stream (0)
  // Creates a non-blocking stream on `device` (priority 0 = default, lower = higher).
  static CudaStream create(int device, int priority = 0);
  ~CudaStream();
  CudaStream(CudaStream&& o) noexcept { *this = std::move(o); }
  CudaStream& operator=(CudaStream&& o) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  void synchronize() const;

 private:
  void reset();
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  // timing = false gives a cheaper event usable only for ordering.
  static CudaEvent create(int device, bool timing = true);
  ~CudaEvent();
  CudaEvent(CudaEvent&& o) noexcept { *this = std::move(o); }
  CudaEvent& operator=(CudaEvent&& o) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) const;
  // Makes `stream` wait (on the device) until this event has completed.
  void wait_on(cudaStream_t stream) const;
  void synchronize() const;
  bool query() const;  // true once completed
  // Milliseconds between two recorded timing events (both completed).
  static float elapsed_ms(const CudaEvent& start, const CudaEvent& end);

 private:
  void reset();
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
};

}  // namespace troupe::cuda
