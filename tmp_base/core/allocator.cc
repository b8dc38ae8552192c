// core/allocator.cc — the CPU allocator.
#include "core/allocator.h"

#include <cstdlib>

#include "core/check.h"

namespace troupe {

void* CpuAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  TROUPE_CHECK(p != nullptr, "host allocation of {} bytes failed", bytes);
  const size_t now = in_use_.fetch_add(bytes) + bytes;
  size_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void CpuAllocator::deallocate(void* p, size_t bytes) {
  if (p == nullptr) return;
  in_use_.fetch_sub(bytes);
  std::free(p);
}

CpuAllocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

}  // namespace troupe
