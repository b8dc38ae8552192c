// layers/context.cc — Ctx's explicit host<->device copies. The CUDA path uses the
// Exec's CudaContext stream, so the copies are ordered with the ops around them.
#include "layers/context.h"

#include "core/check.h"

#if TROUPE_HAVE_CUDA
#include "core/cuda/device_buffer.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::layers {

Tensor Ctx::to_device(const Tensor& host) const {
  if (!on_device()) return host;
  TROUPE_CHECK(host.device().is_cpu(), "Ctx::to_device: {} is not a host tensor", host.describe());
#if TROUPE_HAVE_CUDA
  TROUPE_CHECK(ex.cuda != nullptr, "Ctx::to_device: Exec on {} has no CudaContext", ex.device);
  return cuda::to_device(host.contiguous(), *alloc, ex.cuda->stream);
#else
  TROUPE_CHECK(false, "Ctx::to_device: this build has no CUDA support (Exec on {})", ex.device);
  return host;
#endif
}

Tensor Ctx::to_host(const Tensor& t) const {
  if (t.device().is_cpu()) return t.contiguous();
#if TROUPE_HAVE_CUDA
  TROUPE_CHECK(ex.cuda != nullptr, "Ctx::to_host: {} needs an Exec with a CudaContext", t.describe());
  return cuda::to_host(t, ex.cuda->stream);
#else
  TROUPE_CHECK(false, "Ctx::to_host: this build has no CUDA support ({})", t.describe());
  return t;
#endif
}

void Ctx::copy_to_device(const Tensor& src, Tensor& dst) const {
  TROUPE_CHECK(src.shape() == dst.shape() && src.dtype() == dst.dtype(), "Ctx::copy_to_device: {} into {}",
               src.describe(), dst.describe());
  if (dst.device().is_cpu()) {
    if (src.data_ptr() != dst.data_ptr()) dst.copy_from(src);
    return;
  }
#if TROUPE_HAVE_CUDA
  TROUPE_CHECK(ex.cuda != nullptr, "Ctx::copy_to_device: Exec on {} has no CudaContext", ex.device);
  cuda::copy_tensor(src.contiguous(), dst, ex.cuda->stream);
#else
  TROUPE_CHECK(false, "Ctx::copy_to_device: this build has no CUDA support ({})", dst.describe());
#endif
}

}  // namespace troupe::layers
