// comm/communicator.h — defines the data-plane API: ReduceOp, OpOptions, Work (completion
// handle of an asynchronous operation), CommOptions, CommSpec (who meets whom, through
// which store, in which epoch) and Communicator (the interface Gloo and NCCL implement).
//
// Semantics shared by every backend:
// - Every operation is asynchronous: it validates its arguments, enqueues, and returns a
//   Work at once. Bad arguments give a Work already completed with kInvalidArgument (the
//   operation is not issued, so the caller must not expect peers to complete it either).
// - Every rank of the communicator issues the same collectives in the same order.
//   send/recv between two ranks match in the order they are issued.
// - Tensors are contiguous, on the communicator's device, and stay referenced by the Work
//   until it completes (NCCL, an operation captured into a CUDA graph: for as long as the
//   Work lives, see Work::hold); the caller must not touch an output (or modify an input)
//   before the Work completes.
// - Every operation has a deadline: OpOptions::timeout, or CommOptions::op_timeout, counted
//   from the moment the backend starts executing it. A dead or stuck peer makes the Work
//   complete with an error (kUnavailable, kDeadlineExceeded), never hang.
// - A failed operation poisons the communicator: every later operation fails with
//   kFailedPrecondition. Recovery is abort() on every rank, then a new communicator in a
//   new epoch (CommSpec::ns.epoch + 1), possibly with fewer ranks.
// - abort() completes every pending Work with kAborted at once and never blocks on peers.
//   After abort the communicator is only destroyed (NCCL: never ncclCommDestroy'd).
//   Buffers of operations pending at the abort may still be written until destruction.
//
// Dtypes: reductions (all_reduce, reduce_scatter) take f32, bf16, f16, i32, i64; 16-bit
// floats are reduced in fp32 (see each backend). Data movement (all_gather, all_to_all,
// all_to_all_v, send, recv, broadcast) takes every dtype, fp8 e4m3/e5m2 included.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "comm/rendezvous_store.h"
#include "core/device.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::comm {

enum class ReduceOp : uint8_t { kSum = 0, kMax };
std::string_view reduce_op_name(ReduceOp op);

struct OpOptions {
  std::chrono::milliseconds timeout{0};  // 0: the communicator's CommOptions::op_timeout
  // NCCL: the cudaStream_t to enqueue on (ordered after the caller's work there); null:
  // the communicator's own stream. Ignored by Gloo.
  void* stream = nullptr;
};

// Completion handle. Completed exactly once (the first complete() wins); thread-safe.
class Work {
 public:
  explicit Work(std::string what) : what_(std::move(what)) {}
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // A Work already completed with `status` (used for rejected arguments).
  static std::shared_ptr<Work> completed(std::string what, Status status);

  // Blocks until the operation completes (its own deadline bounds the wait) and returns
  // its status.
  Status wait();
  // Blocks until completion or `deadline`; kDeadlineExceeded if the deadline passes first
  // (the operation keeps running and may still complete).
  Status wait(Deadline deadline);
  // True once completed (successfully or not). Never blocks.
  bool test() const { return done_.load(std::memory_order_acquire); }
  // The final status; only meaningful after test() is true.
  Status status() const;
  const std::string& what() const { return what_; }

  // Backend side: returns false if already completed.
  bool complete(Status status);
  // Backend side: keeps `tensors` referenced for as long as this Work lives. An operation
  // enqueued into a CUDA graph being captured completes at once (it runs at each replay),
  // yet the capture's later nodes on other streams are ordered after it only once the
  // caller has waited for it (CommTime::await): until then its buffers must not return
  // to the allocator, which would hand them to such a node.
  void hold(std::vector<Tensor> tensors) { held_ = std::move(tensors); }

  // Timings for timelines (bench/overlap): when the backend began executing the operation
  // (mark_started; backends that do not mark it leave the creation time) and when it
  // completed (set by complete). Steady-clock nanoseconds since its epoch; 0 until then.
  void mark_started();
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t created_ns() const { return created_ns_; }
  int64_t started_ns() const { return started_ns_.load(std::memory_order_acquire); }
  int64_t completed_ns() const { return completed_ns_.load(std::memory_order_acquire); }

 private:
  std::string what_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  Status status_;
  int64_t created_ns_ = now_ns();
  std::atomic<int64_t> started_ns_{0}, completed_ns_{0};
  std::vector<Tensor> held_;
};

using WorkPtr = std::shared_ptr<Work>;

// Waits for every Work in order; returns the first error.
Status wait_all(const std::vector<WorkPtr>& works);

struct CommOptions {
  std::chrono::milliseconds op_timeout{30000};    // per operation, from its start
  std::chrono::milliseconds init_timeout{60000};  // rendezvous + connection set-up
};

// What a backend needs to create one communicator. The store is used during creation
// only; keys live under "<ns.prefix()><name>/".
struct CommSpec {
  RendezvousStore* store = nullptr;  // not owned
  StoreNamespace ns;
  std::string name = "world";        // unique per communicator within the namespace
  int rank = 0;
  int size = 1;
  CommOptions options;

  std::string key_prefix() const { return ns.key(name) + "/"; }
  Status validate() const;  // rank/size/name/store checks
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "gloo", "nccl"
  virtual Device device() const = 0;             // where tensors must live
  virtual const CommSpec& spec() const = 0;

  // In place: every rank ends with op(tensor of rank 0, ..., tensor of rank size-1).
  virtual WorkPtr all_reduce(Tensor tensor, ReduceOp op, const OpOptions& opts = {}) = 0;
  // input.numel() == size * output.numel(); rank r receives op over ranks of chunk r.
  virtual WorkPtr reduce_scatter(Tensor input, Tensor output, ReduceOp op, const OpOptions& opts = {}) = 0;
  // output.numel() == size * input.numel(); chunk r of output is rank r's input.
  virtual WorkPtr all_gather(Tensor input, Tensor output, const OpOptions& opts = {}) = 0;
  // input and output: same numel, divisible by size; chunk p of input goes to rank p and
  // arrives as chunk r (the sender's rank) of p's output.
  virtual WorkPtr all_to_all(Tensor input, Tensor output, const OpOptions& opts = {}) = 0;
  // Per-peer element counts (zeros allowed): send_counts[p] consecutive elements of input
  // go to rank p; recv_counts[p] elements from rank p land consecutively in output, in
  // rank order. sum(send_counts) == input.numel(), sum(recv_counts) == output.numel();
  // send_counts[p] on this rank must equal recv_counts[this rank] on rank p.
  virtual WorkPtr all_to_all_v(Tensor input, std::vector<int64_t> send_counts, Tensor output,
                               std::vector<int64_t> recv_counts, const OpOptions& opts = {}) = 0;
  virtual WorkPtr send(Tensor tensor, int peer, const OpOptions& opts = {}) = 0;
  virtual WorkPtr recv(Tensor tensor, int peer, const OpOptions& opts = {}) = 0;
  // In place: every rank ends with root's tensor.
  virtual WorkPtr broadcast(Tensor tensor, int root, const OpOptions& opts = {}) = 0;
  virtual WorkPtr barrier(const OpOptions& opts = {}) = 0;
  // Completes once every operation this rank enqueued before it (on opts.stream, for a
  // device backend) has, under the same deadline and error checks as an operation: how
  // the collectives of a replayed CUDA graph, which were enqueued once at capture, are
  // tracked. Host backends complete each operation themselves: a completed Work.
  virtual WorkPtr fence(const OpOptions& opts = {});

  // Completes every pending Work with kAborted, tears the connections down (peers see
  // errors rather than silence) and poisons the communicator. Never blocks on peers;
  // idempotent; callable from any thread.
  virtual void abort(std::string_view reason) = 0;
  // OK while usable; else the first error (or the abort reason).
  virtual Status health() const = 0;
};

// Argument checks shared by the backends (return kInvalidArgument naming the problem).
namespace detail {
Status check_tensor(const Tensor& t, Device device, std::string_view what);
Status check_reduce_dtype(DType t, std::string_view what);
Status check_peer(int peer, int size, int self, std::string_view what);
Status check_counts(const std::vector<int64_t>& counts, int size, int64_t numel, std::string_view what);
std::chrono::milliseconds op_timeout(const OpOptions& opts, const CommOptions& comm);
}  // namespace detail

}  // namespace troupe::comm
