// core/cuda/device_buffer.h — defines DeviceBuffer (a move-only owner of a cudaMalloc'd
// block) and the host<->device tensor copies (copy_tensor, to_device, to_host); their
// waits go through host_wait (core/cuda/host_wait.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "core/cuda/host_wait.h"
#include "core/tensor.h"

namespace troupe::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // cudaMalloc on `device`; aborts naming the size on failure.
  DeviceBuffer(size_t bytes, int device);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  void reset();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

// Copies src into dst (same shape and dtype, both contiguous, any devices) on `stream`.
// Host memory that is not pinned makes the copy synchronous with respect to the host.
void copy_tensor(const Tensor& src, Tensor& dst, cudaStream_t stream);
// A device copy of a host tensor (allocated from `alloc`), and a host copy of a device
// tensor. to_host synchronises `stream` before returning.
Tensor to_device(const Tensor& host, Allocator& alloc, cudaStream_t stream);
Tensor to_host(const Tensor& dev, cudaStream_t stream);

}  // namespace troupe::cuda
