// core/allocator.h — defines Allocator (the interface every device allocator implements)
// and CpuAllocator (64-byte aligned host memory, with live/peak byte counters).
//
// Allocators are created by main() (or a test) and passed down; nothing here is global
// except cpu_allocator(), a stateless default for host tensors.
#pragma once

#include <atomic>
#include <cstddef>

#include "core/device.h"

namespace troupe {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory for `bytes` bytes (nullptr only when bytes == 0). Aborts on OOM with
  // a message naming the size; callers that can recover use try_allocate.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  virtual Device device() const = 0;
  // Bytes currently handed out, and the most ever handed out at once.
  virtual size_t bytes_in_use() const = 0;
  virtual size_t peak_bytes_in_use() const = 0;
  virtual void reset_peak() = 0;
};

class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  Device device() const override { return Device::cpu(); }
  size_t bytes_in_use() const override { return in_use_.load(); }
  size_t peak_bytes_in_use() const override { return peak_.load(); }
  void reset_peak() override { peak_.store(in_use_.load()); }

 private:
  std::atomic<size_t> in_use_{0};
  std::atomic<size_t> peak_{0};
};

// The process's default host allocator (thread-safe).
CpuAllocator& cpu_allocator();

}  // namespace troupe
