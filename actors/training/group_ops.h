// actors/training/group_ops.h — defines CommTime (wall time spent waiting on the data
// plane during a step, the "communication" half of the step-time breakdown), the
// blocking helpers the training roles use on a Communicator (each waits and adds its wait
// to a CommTime), sum_doubles (an exact, deterministic fp64 sum over a group: Gloo has no
// f64 reductions, so the values travel as bytes through all_gather and are summed in rank
// order) and row helpers for host tensors.
//
// Failure contract: inside a step a data-plane error cannot be handed back through the
// layers' forward/backward (they return tensors), so these helpers abort the worker
// process with the error; the driver sees the worker exit and fails the job. That is the
// DESIGN.md "last resort" path. Elastic workers (actors/training/elastic.h) switch this to
// throwing CommFailure (elastic_comm.h) so the survivors recover in place.
//
// Device mode (CommTime::set_device with a CUDA Ctx): the communicators are NCCL ones on
// the Ctx's device, every collective is enqueued on the Ctx's compute stream
// (OpOptions::stream), so the ops after it on that stream see its result with no host
// wait; issue() keeps the Work (its tensors stay referenced until it completes) and
// drain() checks them all at the end of a step. Host waits remain only where values must
// reach the host (all_to_all_v counts, sum_doubles), through Ctx::to_host.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "layers/context.h"

namespace troupe::training {

class CommTime {
 public:
  // Waits for `w` (aborting the process on error, naming `what`) and counts the wait.
  void wait(const comm::WorkPtr& w, std::string_view what);
  void wait_all(const std::vector<comm::WorkPtr>& ws, std::string_view what);
  void add(double seconds, std::string_view what);  // a blocking call timed by the caller
  // Host mode (no device set, or a CPU Ctx): wait(w, what). Device mode: keeps w in
  // flight (ordered on the compute stream); a Work already failed aborts as wait() does.
  void issue(const comm::WorkPtr& w, std::string_view what);
  // Waits for every Work issue() kept (device mode; a no-op otherwise).
  void drain(std::string_view what);
  // Device mode from now on when `c` is a device Ctx (not owned; must outlive its use).
  void set_device(const layers::Ctx* c) { ctx_ = c != nullptr && c->on_device() ? c : nullptr; }
  bool device_mode() const { return ctx_ != nullptr; }
  const layers::Ctx* device_ctx() const { return ctx_; }
  // The options collectives are issued with: the compute stream in device mode.
  comm::OpOptions op_options() const;
  double seconds() const { return seconds_; }
  // Seconds per kind of communication: the first word of `what` ("ulysses", "expert",
  // "pipeline", "router", ...; gradient and parameter synchronisation is "sync").
  const std::map<std::string, double>& by_kind() const { return by_kind_; }
  void reset() {
    seconds_ = 0;
    by_kind_.clear();
  }

 private:
  double seconds_ = 0;
  std::map<std::string, double> by_kind_;
  const layers::Ctx* ctx_ = nullptr;
  std::vector<std::pair<comm::WorkPtr, std::string>> in_flight_;
};

// Collectives, timed into `t`: blocking on host tensors; in device mode enqueued on the
// compute stream (see the file comment).
void all_reduce_sum(comm::Communicator& c, const Tensor& x, CommTime& t, std::string_view what);
void all_gather(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t, std::string_view what);
void reduce_scatter_sum(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t,
                        std::string_view what);
void all_to_all_v_rows(comm::Communicator& c, const Tensor& in, const std::vector<int64_t>& send_rows,
                       const Tensor& out, const std::vector<int64_t>& recv_rows, CommTime& t, std::string_view what);
// In place: every rank ends with the sum over the group, added in rank order (so every
// rank holds bit-identical values). Device mode: the bytes go through a small device copy
// (one host sync).
void sum_doubles(comm::Communicator& c, std::vector<double>& values, CommTime& t, std::string_view what);

// dst[i] = src[idx[i]] over rows of two 2-D f32 host tensors (dst pre-allocated).
// (Device code gathers rows with kernels::embedding_forward on an i32 index tensor.)
void gather_rows(const Tensor& src, const std::vector<int64_t>& idx, Tensor& dst);
// dst[idx[i]] = src[i].
void scatter_rows(const Tensor& src, const std::vector<int64_t>& idx, Tensor& dst);

}  // namespace troupe::training
