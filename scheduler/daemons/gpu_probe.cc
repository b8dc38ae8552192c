// scheduler/daemons/gpu_probe.cc — detect_gpus: the CUDA device count in CUDA builds, where any
// CUDA error (no driver, no device) counts as 0 GPUs; always 0 in CPU builds.
#include "scheduler/daemons/agent.h"

#ifdef TROUPE_AGENT_CUDA
#include <cuda_runtime_api.h>
#endif

namespace troupe::sched {

int detect_gpus() {
#ifdef TROUPE_AGENT_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error state for later users
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

}  // namespace troupe::sched
