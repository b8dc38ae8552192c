// tests/common/visible_gpus.h — how many CUDA devices a GPU test sees: 0 in a build without
// CUDA. The test's target defines TROUPE_TEST_HAVE_CUDA=1 when it links troupe_core_cuda.
#pragma once

#if TROUPE_TEST_HAVE_CUDA
#include "core/cuda/stream.h"
#endif

namespace troupe::test {

inline int visible_gpus() {
#if TROUPE_TEST_HAVE_CUDA
  return troupe::cuda::device_count();
#else
  return 0;
#endif
}

}  // namespace troupe::test
