// core/cuda/host_wait.h — defines host_wait, the one counted way the framework waits on a
// CUDA stream for device results, and its counter. Plain C++17 (included by .cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace troupe::cuda {

// Why the host waits: a device->host read-back (to_host, reductions that return a value),
// or a host->device upload that must finish before its host source may go (to_device).
enum class HostWait { kReadBack, kUpload };

// cudaStreamSynchronize(stream), counted by kind: every host wait of the framework on
// device work goes through it, so a training step can report how often its host blocked
// (the step's sync counter).
void host_wait(cudaStream_t stream, HostWait kind = HostWait::kReadBack);
// Calls of host_wait of that kind in this process so far (all threads).
int64_t host_wait_count(HostWait kind = HostWait::kReadBack);

}  // namespace troupe::cuda
