// training/moe/peer_rows.h — defines PeerRows: row buffers of every GPU of an n-group on
// one host, mapped into every member (CUDA IPC), for the device-driven expert dispatch
// (parallel.device_dispatch; kernels in kernels/cuda/peer_rows.h).
//
// Each member owns three buffers: `recv` (dispatched rows land here, written by the
// sources), `scales` (their f32 per-row scales when the rows are fp8) and `out` (the
// expert outputs, read back by the sources). One PeerRows serves every MoE block of a
// stage: the blocks run one after the other, and the barrier after each transfer orders
// reuse (ExpertGroup's device-dispatch comment says why that suffices).
//
// reserve() is collective whenever it (re)maps: every member calls it at the same points
// with the same arguments (every member runs the same blocks on the same token count), so
// all of them (re)map together: the first time, when the rows grow, and after the
// group's ElasticComm was rebuilt in a new epoch (a replacement maps for the first time
// exactly when the survivors renew theirs). A mapping exchanges small tables over the
// group's own communicator and reads them on the host: set-up, not per step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "layers/context.h"
#include "training/parallel/group_ops.h"

namespace troupe::training {

class PeerRows {
 public:
  // required: parallel.device_dispatch was set true in the config (a group whose GPUs
  // cannot map each other then fails; by default it falls back to the host counts).
  PeerRows(comm::Communicator& group, bool required) : group_(group), required_(required) {}
  ~PeerRows();
  PeerRows(const PeerRows&) = delete;
  PeerRows& operator=(const PeerRows&) = delete;

  // Every member's buffers hold at least `rows` rows of `row_bytes` bytes (recv and out)
  // and `rows` scales: true. False on every member when the group spans hosts, when its
  // GPUs cannot map each other's memory and the switch was not required (or in a build
  // without CUDA): the caller moves the rows another way. Fails the process, naming
  // parallel.device_dispatch, when the mapping fails and the switch was required.
  // Waits (and failures) of its collectives are counted in `t`.
  bool reserve(const layers::Ctx& c, CommTime& t, int64_t rows, int64_t row_bytes);

  // Device arrays of the members' buffers, indexed by group rank (this rank's own too).
  void* const* recv_peers() const { return static_cast<void* const*>(tables_[0]); }
  float* const* scale_peers() const { return static_cast<float* const*>(tables_[1]); }
  const void* const* out_peers() const { return static_cast<const void* const*>(tables_[2]); }
  void* recv() const { return own_[0]; }
  float* scales() const { return static_cast<float*>(own_[1]); }
  void* out() const { return own_[2]; }

  // Enqueues the group's barrier (an all-reduce of one value) with `o`: whatever each
  // member enqueued before it on that stream is complete on every member once it is.
  comm::WorkPtr barrier(const comm::OpOptions& o);

  // Whether reserve() decided, in the group's current generation, that the rows go
  // through the host counts (false before its first call: not decided yet).
  bool host_counts() const { return host_counts_ && generation() == hosts_generation_; }

 private:
  bool map(const layers::Ctx& c, CommTime& t, int64_t rows, int64_t row_bytes);
  bool same_host(const layers::Ctx& c, CommTime& t);
  void release();
  uint64_t generation() const;

  comm::Communicator& group_;
  uint64_t mapped_generation_ = 0;
  int64_t rows_ = 0, row_bytes_ = 0;
  void* own_[3] = {nullptr, nullptr, nullptr};  // recv, scales, out (cudaMalloc)
  std::vector<void*> opened_;                   // peers' buffers opened here (cudaIpcOpenMemHandle)
  void* tables_[3] = {nullptr, nullptr, nullptr};
  Tensor flag_;  // the barrier's one value
  bool required_ = false;
  bool warned_ = false;
  // The rows go through the host counts in this ElasticComm generation: the group spans
  // hosts, or (not required) its GPUs could not map each other.
  bool host_counts_ = false;
  uint64_t hosts_generation_ = 0;  // the generation host_counts_ was decided in
};

}  // namespace troupe::training
