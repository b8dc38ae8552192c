// training/parallel/elastic_comm.h — defines ElasticComm, a Communicator whose backend
// communicator can be replaced in place (new membership epoch) while the objects that
// hold a reference to it (AttentionShard, ExpertGroup, Bf16ReduceScatter, the Stage's
// groups) keep that reference, and CommFailure, the exception a training role throws when
// a data-plane operation fails in elastic mode.
//
// Why: after a failure every survivor aborts its communicators, the job opens epoch e+1
// and every rank creates the same communicators again (same names, same order) under the
// new namespace. The Stage's roles were built once over references; swapping the inner
// communicator keeps them valid without rebuilding the model part.
//
// Contract: abort() and health() may be called from any thread (the elastic watcher
// aborts while the step thread waits on an operation). rebuild() is collective over the
// communicator's ranks in the new epoch, called by the owning (step) thread only after
// abort() or a failure; operations issued concurrently with rebuild() are not allowed.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/process_groups.h"

namespace troupe::training {

// Thrown by the group helpers (group_ops.h) instead of aborting the process when
// set_throw_on_comm_error(true) (elastic workers): the step unwinds to the worker loop,
// which then recovers in a new epoch.
class CommFailure : public std::runtime_error {
 public:
  explicit CommFailure(const std::string& what) : std::runtime_error(what) {}
};
void set_throw_on_comm_error(bool on);
bool throw_on_comm_error();

// Fault injection (tests/elastic): a hook called with the description of every data-plane
// wait of the group helpers ("ulysses seq->head", "expert dispatch all_to_all_v", ...)
// before it waits. Unset (the default) it does nothing.
using FaultHook = void (*)(std::string_view what);
void set_fault_hook(FaultHook hook);
void fault_point(std::string_view what);

// Fault injection (tests/elastic, the demo): test.inject = "<action>@<step>:<phase>:<slot>[,...]" with
// action kill (SIGKILL), stop (SIGSTOP), slow (sleeps 150 ms there at that step and
// every later one: a straggler), cut (aborts the worker's own communicators: its data-plane
// connections close, the process lives on) or hang (the step thread blocks forever while
// the process keeps its heartbeat: only the step watchdog sees it) or cutctl (the worker's
// connection to the control plane is closed: under troupe-scheduler its store session;
// it keeps computing but can neither beat nor take commands) or corrupt (flips a byte of
// the newest intact snapshot part this rank holds in its keeper's memory: the slice
// checksums catch it at a restore), phase forward (the first attention all-to-all
// of the step), alltoall (the first MoE dispatch all-to-all), sync (gradient
// reduce-scatter), snapshot (right after the step's snapshot copy started), checkpoint
// (while the checkpoint of the step is being written from its snapshot, by the writer
// thread, during a later step) or any (the first data-plane wait of the step); slow@0:start:<slot>
// instead delays the worker's start by twice the heartbeat timeout before its first beat
// (a slow start is not a silent worker). Only processes started in epoch 0 inject (a
// replacement never repeats its predecessor's fault).
struct FaultSpec {
  enum class Action { kKill, kStop, kSlow, kCut, kHang, kCutControl, kCorrupt } action = Action::kKill;
  int64_t step = 0;
  std::string phase;
  int slot = 0;
  // Whether the phase is a point the step's own host code passes (forward, alltoall,
  // sync, any): a step replayed as a CUDA graph passes none of them.
  bool inside_step() const {
    return phase == "forward" || phase == "alltoall" || phase == "sync" || phase == "any";
  }
};
Result<std::vector<FaultSpec>> parse_faults(const std::string& spec);

class ElasticComm final : public comm::Communicator {
 public:
  // Creates the first inner communicator from `spec` with `factory`.
  static Result<std::unique_ptr<ElasticComm>> create(const comm::CommSpec& spec, comm::CommFactory factory);

  int rank() const override { return spec_.rank; }
  int size() const override { return spec_.size; }
  std::string_view backend() const override;
  Device device() const override;
  const comm::CommSpec& spec() const override { return spec_; }

  comm::WorkPtr all_reduce(Tensor tensor, comm::ReduceOp op, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr reduce_scatter(Tensor input, Tensor output, comm::ReduceOp op, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr all_gather(Tensor input, Tensor output, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr all_to_all(Tensor input, Tensor output, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr all_to_all_v(Tensor input, std::vector<int64_t> send_counts, Tensor output,
                             std::vector<int64_t> recv_counts, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr send(Tensor tensor, int peer, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr recv(Tensor tensor, int peer, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr broadcast(Tensor tensor, int root, const comm::OpOptions& opts = {}) override;
  comm::WorkPtr barrier(const comm::OpOptions& opts = {}) override;
  comm::WorkPtr fence(const comm::OpOptions& opts = {}) override;
  void abort(std::string_view reason) override;
  Status health() const override;

  // Aborts the current inner communicator (if not yet) and creates a new one with the same
  // name, rank and size in namespace `ns` (collective with the other ranks).
  Status rebuild(const comm::StoreNamespace& ns);
  // How many times rebuild() replaced the inner communicator (state tied to the old
  // epoch's ranks, e.g. peer memory mappings, compares it to know when to renew).
  uint64_t generation() const { return generation_.load(); }

 private:
  ElasticComm(comm::CommSpec spec, comm::CommFactory factory) : spec_(std::move(spec)), factory_(std::move(factory)) {}
  std::shared_ptr<comm::Communicator> inner() const;
  comm::CommSpec spec_;
  comm::CommFactory factory_;
  mutable std::mutex mu_;
  std::shared_ptr<comm::Communicator> inner_;
  std::atomic<uint64_t> generation_{0};
};

}  // namespace troupe::training
