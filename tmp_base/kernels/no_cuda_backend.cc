// kernels/no_cuda_backend.cc — cuda_backend() of a build without CUDA.
#include "kernels/backend.h"

namespace troupe::kernels {
const Backend* cuda_backend() {
  return nullptr;
}
}  // namespace troupe::kernels
