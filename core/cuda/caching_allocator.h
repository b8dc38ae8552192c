// core/cuda/caching_allocator.h — defines CudaCachingAllocator, the device Allocator:
// freed blocks are kept in per-size free lists and handed out again without cudaMalloc
// or cudaFree (both synchronise the device), as PyTorch's caching allocator does.
//
// Sizes are rounded up (to 512 B below 1 MiB, to 2 MiB above) and a request is served
// by a cached block of the same rounded size. When cudaMalloc fails, every cached block
// is released and the allocation retried once; a second failure aborts naming the size.
//
// Stream contract: a freed block may be handed out again at once. That is safe when all
// kernels that touch the allocator's memory run on one stream (the kernels' stream):
// later work on that stream runs after the earlier user. Code that uses a block on
// another stream must make that stream's work finish (event/sync) before freeing it.
// Thread-safe (one mutex).
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/allocator.h"

namespace troupe::cuda {

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device);
  ~CudaCachingAllocator() override;  // frees every block (cached or, wrongly, still in use)
  CudaCachingAllocator(const CudaCachingAllocator&) = delete;
  CudaCachingAllocator& operator=(const CudaCachingAllocator&) = delete;

  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  Device device() const override { return Device::cuda(device_); }
  // Requested bytes currently handed out (not rounded), and their high-water mark.
  size_t bytes_in_use() const override;
  size_t peak_bytes_in_use() const override;
  void reset_peak() override;

  // Bytes obtained from cudaMalloc (in use + cached), and their high-water mark.
  size_t bytes_reserved() const;
  size_t peak_bytes_reserved() const;
  // Returns every cached (free) block to the driver.
  void empty_cache();
  // Counters for tests and logs.
  size_t num_device_mallocs() const;

  static size_t round_size(size_t bytes);

 private:
  void release_cached_locked();

  int device_;
  mutable std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // rounded size -> free blocks
  std::unordered_map<void*, size_t> live_;               // handed-out block -> rounded size
  size_t in_use_ = 0;
  size_t peak_ = 0;
  size_t reserved_ = 0;
  size_t peak_reserved_ = 0;
  size_t mallocs_ = 0;
};

}  // namespace troupe::cuda
