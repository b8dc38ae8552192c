// training/parallel/group_ops.h — defines CommTime (wall time spent waiting on the data
// plane during a step, the "communication" half of the step-time breakdown), the
// blocking helpers the training roles use on a Communicator (each waits and adds its wait
// to a CommTime), sum_doubles (an exact, deterministic fp64 sum over a group: Gloo has no
// f64 reductions, so the values travel as bytes through all_gather and are summed in rank
// order) and row helpers for host tensors.
//
// Failure contract: inside a step a data-plane error cannot be handed back through the
// layers' forward/backward (they return tensors), so these helpers abort the worker
// process with the error; the driver sees the worker exit and fails the job. That is the
// design's "last resort" path (docs/architecture.md). Elastic workers
// (training/worker/elastic.h) switch this to throwing CommFailure (elastic_comm.h) so the
// survivors recover in place.
//
// Device mode (CommTime::set_device with a CUDA Ctx): the communicators are NCCL ones on
// the Ctx's device, every collective is enqueued on the Ctx's compute stream
// (OpOptions::stream), so the ops after it on that stream see its result with no host
// wait; issue() keeps the Work (its tensors stay referenced until it completes) and
// drain() checks them all at the end of a step. Host waits remain only where values must
// reach the host (all_to_all_v counts, sum_doubles), through Ctx::to_host.
//
// Overlap: launch() starts an operation on the communication side and await()
// makes its result usable by the compute side, so the caller computes in between. Host:
// Gloo runs the operation on its communicator's own thread; await() is the (timed) wait.
// Device with a communication stream (set_comm_stream): the operation is enqueued on that
// stream after an event recorded on the compute stream (so it sees every input the compute
// stream wrote before launch), and await() makes the compute stream wait for an event
// recorded after it: no host wait. Without a communication stream launch/await behave as
// issue() on the compute stream.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "layers/context.h"

namespace troupe::training {

// One interval of a timeline (bench/overlap/timeline.py): lane "main" (the step thread:
// compute spans and exposed waits) or the communication side of a group ("comm n",
// "comm dp", "comm pp": when its backend executed an operation). Steady-clock ns.
struct TraceEvent {
  std::string lane, what;
  int64_t t0 = 0, t1 = 0;
};

// An operation launched on the communication side (CommTime::launch).
struct CommOp {
  comm::WorkPtr work;
  std::string what;
  void* event = nullptr;  // device: recorded on the communication stream after the op
  bool pending() const { return work != nullptr; }
};

// The device side of a timeline: CUDA timing events recorded on the streams as the step
// is enqueued, turned into spans once they have completed (group_ops.cc).
class DeviceTimeline;

class CommTime {
 public:
  CommTime();
  ~CommTime();
  CommTime(const CommTime&) = delete;
  CommTime& operator=(const CommTime&) = delete;
  // Waits for `w` (aborting the process on error, naming `what`) and counts the wait.
  void wait(const comm::WorkPtr& w, std::string_view what);
  void wait_all(const std::vector<comm::WorkPtr>& ws, std::string_view what);
  void add(double seconds, std::string_view what);  // a blocking call timed by the caller
  // Host mode (no device set, or a CPU Ctx): wait(w, what). Device mode: keeps w in
  // flight (ordered on the compute stream); a Work already failed aborts as wait() does.
  void issue(const comm::WorkPtr& w, std::string_view what);
  // Waits for every Work issue() kept (device mode; a no-op otherwise).
  void drain(std::string_view what);
  // Forgets every Work issue() kept, unchecked: an interrupted step's, on communicators
  // aborted since (an elastic recovery); waited on, they would raise the old failure.
  void drop_in_flight() { in_flight_.clear(); }
  // Starts fn(options) on the communication side (see the file comment).
  // `stream` (device mode): enqueue there instead of the communication stream.
  CommOp launch(const std::function<comm::WorkPtr(const comm::OpOptions&)>& fn, std::string_view what,
                void* stream = nullptr);
  // Makes op's result visible to the compute side; a no-op for an op not pending.
  void await(CommOp& op);
  // Device mode: the stream launch() enqueues on (not owned; null: the compute stream).
  void set_comm_stream(void* stream) { comm_stream_ = stream; }
  // Aborts (or throws CommFailure in elastic workers) with the failure of `w`.
  [[noreturn]] static void fail(const comm::Work& w, const Status& st, std::string_view what);
  // Timeline recording (off by default).
  void set_tracing(bool on) { tracing_ = on; }
  bool tracing() const { return tracing_; }
  void span(std::string_view lane, std::string_view what, int64_t t0, int64_t t1);
  std::vector<TraceEvent> take_trace() { return std::move(trace_); }
  // The device timeline (tracing in device mode, the stream not being captured into a
  // graph; else these do nothing and device_mark returns null): device_mark records a
  // timing event on `stream` (null: the compute stream); device_span puts the interval
  // between two marks on `lane` ("gpu", "gpu comm n", ...) of the step set by
  // set_trace_step. The first mark of a step is that step's origin.
  void* device_mark(void* stream = nullptr);
  void device_span(std::string_view lane, std::string_view what, void* ev0, void* ev1);
  void set_trace_step(int64_t step) { trace_step_ = step; }
  // The device spans whose events have completed, as (step, span) with t0/t1 in ns since
  // their step's origin; spans still in flight stay for a later call. No host wait.
  std::vector<std::pair<int64_t, TraceEvent>> take_device_trace();
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
  void trace_work(const comm::Work& w, std::string_view what);

  const layers::Ctx* ctx_ = nullptr;
  void* comm_stream_ = nullptr;
  bool tracing_ = false;
  std::vector<TraceEvent> trace_;
  int64_t trace_step_ = 0;
  std::unique_ptr<DeviceTimeline> device_trace_;
  std::vector<std::pair<comm::WorkPtr, std::string>> in_flight_;
};

// Data-parallel gradient reduce-scatter and parameter all-gather over arbitrary ranges of
// a flat buffer whose dp shards are contiguous and in rank order ([p*L, (p+1)*L) is rank
// p's shard): the building blocks of the bucketed ZeRO-1 synchronisation. Both are one
// all_to_all_v, so a bucket may straddle shards.
//  - grad_bucket_launch: `grads` holds the gradient elements [a, b) = [b.lo, b.hi) (f32,
//    or bf16 gradients); every rank p receives the part of [a, b) in its shard from every
//    rank (in `wire` dtype: f32, or bf16 for compression and for bf16 gradients, which
//    then travel without a cast);
//    grad_bucket_finish adds them into shard[(a', b') - p*L] in rank order, in fp32 (the
//    same order on every schedule, so the result does not depend on bucketing).
//  - param_bucket_launch: every rank sends its part of [a, b) of `flat` to every rank,
//    which receives flat[a, b) in place.
struct Bucket {
  int64_t lo = 0, hi = 0;  // flat range
  CommOp op;
  Tensor send, recv;                 // wire buffers
  int64_t mine_lo = 0, mine_hi = 0;  // the part of [lo, hi) in this rank's shard
};
void grad_bucket_launch(comm::Communicator& dp, const layers::Ctx& c, const Tensor& grads, int64_t shard_len,
                        DType wire, Bucket& b, CommTime& t, std::string_view what);
void grad_bucket_finish(const layers::Ctx& c, Bucket& b, const Tensor& shard, int64_t shard_len, CommTime& t);
void param_bucket_launch(comm::Communicator& dp, const layers::Ctx& c, const Tensor& flat, int64_t shard_len,
                         Bucket& b, CommTime& t, std::string_view what);

// Collectives, timed into `t`: blocking on host tensors; in device mode enqueued on the
// compute stream (see the file comment).
void all_reduce_sum(comm::Communicator& c, const Tensor& x, CommTime& t, std::string_view what);
void all_gather(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t,
                std::string_view what);
void reduce_scatter_sum(comm::Communicator& c, const Tensor& in, const Tensor& out, CommTime& t,
                        std::string_view what);
void all_to_all_v_rows(comm::Communicator& c, const Tensor& in, const std::vector<int64_t>& send_rows,
                       const Tensor& out, const std::vector<int64_t>& recv_rows, CommTime& t,
                       std::string_view what);
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
