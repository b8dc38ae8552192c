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
// CUDA graphs: between begin_graph_pool() and end_graph_pool() (a stream capture, whose
// kernels are recorded with the addresses they were given, and replayed later), every
// block handed out or freed becomes the graph's: freed, it returns to the graph's own
// free lists, which only later captures draw from, so nothing outside the graph ever
// holds an address the graph replays into. Blocks live at the capture's start (weights,
// optimizer state, the graph's inputs) stay the caller's. release_graph_pool() (the graph
// destroyed) gives the graph's blocks back to the shared cache.
//
// Thread-safe (one mutex).
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
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

  // The graph pool (see the file comment). begin/end bracket a capture; capturing twice
  // without end is refused.
  void begin_graph_pool();
  void end_graph_pool();
  void release_graph_pool();  // waits for the device first (a replay may still run)
  bool capturing() const;
  // Rounded bytes of the blocks the graph owns (live or in its free lists).
  size_t graph_pool_bytes() const;

 private:
  void release_cached_locked();
  using FreeLists = std::unordered_map<size_t, std::vector<void*>>;  // rounded size -> blocks
  static void* pop(FreeLists& lists, size_t rounded);

  int device_;
  mutable std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // rounded size -> free blocks (shared)
  std::unordered_map<void*, size_t> live_;               // handed-out block -> rounded size
  size_t in_use_ = 0;
  size_t peak_ = 0;
  size_t reserved_ = 0;
  size_t peak_reserved_ = 0;
  size_t mallocs_ = 0;
  bool capturing_ = false;
  std::unordered_set<void*> graph_owned_;
  FreeLists graph_free_;
  size_t graph_bytes_ = 0;
};

}  // namespace troupe::cuda
