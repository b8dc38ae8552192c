// comm/nccl_communicator.h — defines make_nccl_communicator(): the GPU backend of
// Communicator over NCCL (2.28.3 API floor: no ncclCommRevoke). Built as troupe_comm_nccl
// in CUDA builds with NCCL; this header needs no CUDA headers.
//
// Life cycle:
// - Rank 0 makes the unique id and publishes it in the RendezvousStore (key
//   "<ns>/<name>/nccl_id"); the others read it. ncclCommInitRankConfig runs non-blocking
//   (blocking = 0) and is polled until spec.options.init_timeout; on timeout the half-made
//   communicator is aborted and creation fails.
// - Operations enqueue on OpOptions::stream (a cudaStream_t) or on the communicator's own
//   non-blocking stream, then record a CUDA event. A watchdog thread polls those events
//   and ncclCommGetAsyncError (every 50 us while work is pending, 1 ms when idle): an
//   event done completes its Work; an async error or a Work past its deadline (counted
//   from enqueue: the GPU gives no start time)
//   aborts the communicator (ncclCommAbort) and completes every pending Work with the
//   error. The host never blocks on a stream.
// - abort() aborts at once. After an abort the communicator is never destroyed (NCCL
//   forbids destroy after abort on any rank); every rank must abort when one did — peers
//   on NVLink/shared memory may never see an error — so the control plane broadcasts
//   "abort" and each rank calls abort(). Rebuild: a new communicator with a new epoch.
// - Destroying a healthy communicator waits for its pending Works (bounded by their
//   deadlines), then ncclCommFinalize (polled) and ncclCommDestroy.
//
// Numerics: reductions run in NCCL in the tensor's dtype (bf16 sums round at each ring
// step inside NCCL); fp8 reductions are rejected (use gathers of quantised data).
// all_to_all and all_to_all_v are grouped ncclSend/ncclRecv (zero counts skipped);
// barrier is a one-element all-reduce.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace troupe::comm {

struct NcclOptions {
  int device = 0;  // CUDA device ordinal this rank uses (cudaSetDevice before init)
};

// Collective over spec.size ranks. kUnavailable when no GPU/driver is usable.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommSpec& spec,
                                                             const NcclOptions& options = {});

}  // namespace troupe::comm
