// kernels/cuda/host_copy.h — small device -> host reads that never wait on a copy engine.
//
// A step reads a few statistics back (loss, norms, counts: bytes, not megabytes). A
// cudaMemcpyAsync device -> host is served by a copy engine in submission order, so behind
// a snapshot's device -> host copy of the whole state (gigabytes, hundreds of milliseconds)
// it waits for all of it, and the compute stream with it. These launchers copy with a
// kernel's stores into page-locked host memory mapped into the device's address space: the
// stores travel over the link beside a bulk copy instead of queueing after it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace troupe::kernels::gpu {

// Page-locked host memory the device can store into (cudaHostAllocMapped); free it with
// cudaFreeHost. Sets *device_alias to the address kernels store through. Returns nullptr
// (the CUDA error cleared) when the allocation fails.
void* alloc_mapped_host(size_t bytes, void** device_alias);

// Enqueues on `stream` the copy of `bytes` from device memory `src` into mapped host
// memory, named by its device alias (alloc_mapped_host). `bytes` is a multiple of 4 and
// both addresses are 4-byte aligned. No CUDA API call but the launch: capturable in a
// CUDA graph. The host may read the memory once an event recorded after it on `stream`
// has completed.
void copy_to_mapped_host(cudaStream_t stream, void* device_alias, const void* src, size_t bytes);

}  // namespace troupe::kernels::gpu
