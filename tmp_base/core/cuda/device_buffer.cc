// core/cuda/device_buffer.cc — DeviceBuffer and tensor copies between host and device.
#include "core/cuda/device_buffer.h"

#include <atomic>

#include "core/cuda/stream.h"
#include "core/gpu_check.h"

namespace troupe::cuda {

namespace {
std::atomic<int64_t> g_host_waits[2];
}  // namespace

void host_wait(cudaStream_t stream, HostWait kind) {
  g_host_waits[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

int64_t host_wait_count(HostWait kind) {
  return g_host_waits[static_cast<int>(kind)].load(std::memory_order_relaxed);
}

DeviceBuffer::DeviceBuffer(size_t bytes, int device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  cudaError_t err = cudaMalloc(&data_, bytes);
  TROUPE_CHECK(err == cudaSuccess, "cudaMalloc of {} bytes on cuda:{} failed: {}", bytes, device,
               cudaGetErrorString(err));
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = o.device_;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  reset();
}

void DeviceBuffer::reset() {
  if (data_ == nullptr) return;
  DeviceGuard guard(device_);
  CUDA_CHECK(cudaFree(data_));
  data_ = nullptr;
}

void copy_tensor(const Tensor& src, Tensor& dst, cudaStream_t stream) {
  TROUPE_CHECK(src.shape() == dst.shape() && src.dtype() == dst.dtype(), "copy_tensor: {} -> {}",
               src.describe(), dst.describe());
  TROUPE_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy_tensor needs contiguous tensors: {} -> {}",
               src.describe(), dst.describe());
  if (src.numel() == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDefault, stream));
}

Tensor to_device(const Tensor& host, Allocator& alloc, cudaStream_t stream) {
  TROUPE_CHECK(alloc.device().is_cuda(), "to_device needs a CUDA allocator");
  Tensor src = host.contiguous();
  Tensor dev = Tensor::empty(src.shape(), src.dtype(), alloc);
  copy_tensor(src, dev, stream);
  // The host source may be a temporary: finish the copy before it can go away.
  host_wait(stream, HostWait::kUpload);
  return dev;
}

Tensor to_host(const Tensor& dev, cudaStream_t stream) {
  Tensor host = Tensor::empty(dev.shape(), dev.dtype());
  copy_tensor(dev, host, stream);
  host_wait(stream);
  return host;
}

}  // namespace troupe::cuda
