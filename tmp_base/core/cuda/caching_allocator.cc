// core/cuda/caching_allocator.cc — CudaCachingAllocator.
#include "core/cuda/caching_allocator.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/cuda/stream.h"
#include "core/gpu_check.h"

namespace troupe::cuda {

namespace {
constexpr size_t kSmallLimit = size_t{1} << 20;
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t{2} << 20;
}  // namespace

size_t CudaCachingAllocator::round_size(size_t bytes) {
  const size_t r = bytes < kSmallLimit ? kSmallRound : kLargeRound;
  return (bytes + r - 1) / r * r;
}

CudaCachingAllocator::CudaCachingAllocator(int device) : device_(device) {}

CudaCachingAllocator::~CudaCachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard(device_);
  // Freeing memory that kernels may still use would be a use-after-free on the device.
  (void)cudaDeviceSynchronize();
  for (auto& [p, size] : live_) (void)cudaFree(p);
  live_.clear();
  for (auto& [size, blocks] : graph_free_)
    for (void* p : blocks) (void)cudaFree(p);
  graph_free_.clear();
  release_cached_locked();
}

void* CudaCachingAllocator::pop(FreeLists& lists, size_t rounded) {
  auto it = lists.find(rounded);
  if (it == lists.end() || it->second.empty()) return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  return p;
}

void* CudaCachingAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  // A capture takes the graph's own blocks first, then the shared cache's.
  void* p = capturing_ ? pop(graph_free_, rounded) : nullptr;
  if (p == nullptr) p = pop(free_, rounded);
  if (p == nullptr) {
    DeviceGuard guard(device_);
    cudaError_t err = cudaMalloc(&p, rounded);
    if (err == cudaErrorMemoryAllocation && !capturing_) {  // (a capture may not wait for the device)
      (void)cudaGetLastError();
      release_cached_locked();
      err = cudaMalloc(&p, rounded);
    }
    TROUPE_CHECK(err == cudaSuccess,
                 "cuda:{} out of memory allocating {} bytes ({} in use, {} reserved{}): {}", device_, bytes,
                 in_use_, reserved_,
                 graph_bytes_ > 0 ? fmt::format(", {} held by a CUDA graph of the step", graph_bytes_) : "",
                 cudaGetErrorString(err));
    reserved_ += rounded;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
    ++mallocs_;
  }
  if (capturing_ && graph_owned_.insert(p).second) graph_bytes_ += rounded;
  live_.emplace(p, rounded);
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return p;
}

void CudaCachingAllocator::deallocate(void* p, size_t bytes) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  TROUPE_CHECK(it != live_.end(), "cuda:{}: deallocate of a pointer this allocator did not hand out",
               device_);
  TROUPE_CHECK(round_size(bytes) == it->second,
               "cuda:{}: deallocate with {} bytes, allocated as {} (rounded)", device_, bytes, it->second);
  if (capturing_ && graph_owned_.insert(p).second) graph_bytes_ += it->second;
  (graph_owned_.count(p) != 0 ? graph_free_ : free_)[it->second].push_back(p);
  live_.erase(it);
  in_use_ -= bytes;
}

size_t CudaCachingAllocator::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}
size_t CudaCachingAllocator::peak_bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}
void CudaCachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = in_use_;
  peak_reserved_ = reserved_;
}
size_t CudaCachingAllocator::bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}
size_t CudaCachingAllocator::peak_bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_reserved_;
}
size_t CudaCachingAllocator::num_device_mallocs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mallocs_;
}

void CudaCachingAllocator::begin_graph_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  TROUPE_CHECK(!capturing_, "cuda:{}: begin_graph_pool while a capture is already open", device_);
  capturing_ = true;
}

void CudaCachingAllocator::end_graph_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  TROUPE_CHECK(capturing_, "cuda:{}: end_graph_pool without begin_graph_pool", device_);
  capturing_ = false;
}

void CudaCachingAllocator::release_graph_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  TROUPE_CHECK(!capturing_, "cuda:{}: release_graph_pool during a capture", device_);
  {
    DeviceGuard guard(device_);
    CUDA_CHECK(cudaDeviceSynchronize());  // a replay may still use the blocks
  }
  for (auto& [size, blocks] : graph_free_) {
    std::vector<void*>& shared = free_[size];
    shared.insert(shared.end(), blocks.begin(), blocks.end());
  }
  graph_free_.clear();
  graph_owned_.clear();  // live ones return to the shared cache when freed
  graph_bytes_ = 0;
}

bool CudaCachingAllocator::capturing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capturing_;
}

size_t CudaCachingAllocator::graph_pool_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return graph_bytes_;
}

void CudaCachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void CudaCachingAllocator::release_cached_locked() {
  DeviceGuard guard(device_);
  // Cached blocks may still be read by queued kernels of their last user.
  CUDA_CHECK(cudaDeviceSynchronize());
  for (auto& [size, blocks] : free_) {
    for (void* p : blocks) {
      CUDA_CHECK(cudaFree(p));
      reserved_ -= size;
    }
  }
  free_.clear();
}

}  // namespace troupe::cuda
