// training/app/run_device.h — defines RunDevice, the execution resources of one training
// process, made by main() from --backend and passed down: for "cuda" a stream, the
// CudaCachingAllocator every device tensor (parameters, optimizer state, activations,
// op scratch) comes from, and the CudaContext; for "cpu" the CPU Ctx. Its Ctx is what
// every layer call receives.
#pragma once

#include <memory>
#include <string>

#include "core/allocator.h"
#include "core/status.h"
#include "layers/context.h"

namespace troupe::training {

class RunDevice {
 public:
  // backend: "cpu" or "cuda" (device 0; a distributed worker: its local rank mod the
  // visible GPUs). Errors name the problem: an unknown backend, a build without CUDA, or
  // no visible GPU.
  static Result<std::unique_ptr<RunDevice>> create(const std::string& backend);
  ~RunDevice();
  RunDevice(const RunDevice&) = delete;
  RunDevice& operator=(const RunDevice&) = delete;

  const layers::Ctx& ctx() const { return ctx_; }
  bool is_cuda() const { return ctx_.on_device(); }
  std::string name() const { return name_; }  // e.g. "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"
  int num_gpus() const { return is_cuda() ? 1 : 0; }
  // The allocator's live bytes, and its high-water mark since reset_peak().
  size_t bytes_in_use() const { return ctx_.alloc->bytes_in_use(); }
  size_t peak_bytes() const { return ctx_.alloc->peak_bytes_in_use(); }
  void reset_peak() { ctx_.alloc->reset_peak(); }
  // Waits for every op enqueued so far (no-op on the CPU).
  void synchronize() const;
  // Host waits so far (core/cuda/host_wait.h; 0 on the CPU; synchronize() not counted):
  // device->host read-backs, and host->device uploads that waited for their copy.
  int64_t host_syncs() const;
  int64_t upload_waits() const;
  // An NVTX range around a training step ("step"), so profilers can select the kernels of
  // steps (e.g. ncu --nvtx --nvtx-include step/). No-ops on the CPU.
  void range_push(const char* name) const;
  void range_pop() const;
  // The device's time for a stretch of enqueued work: mark_begin() and mark_end() record
  // events on the stream; after the end event has completed (e.g. after synchronize()),
  // device_ms() is the GPU time between them, in ms. A step's wall time less this is what
  // the device sat idle waiting for the host. 0 on the CPU (and before any pair).
  // slot (0 or 1): two pairs, so that a step's pair can be read after the next step's
  // work was enqueued (train_moe's steps launched ahead).
  void mark_begin(int slot = 0) const;
  void mark_end(int slot = 0) const;
  double device_ms(int slot = 0) const;
  // A read-back that does not stop the stream: read_async() enqueues a copy of the device
  // tensor src (f32) into a pinned host buffer; read_wait() waits for that copy alone and
  // returns the buffer (valid until the next read_async). Work enqueued between them runs
  // on. On the CPU read_async copies at once.
  void read_async(const Tensor& src);
  const float* read_wait();
  // train.attention_fused_dq (kernels::CudaContext::attention_fused_dq). No-op on the CPU.
  void set_attention_fused_dq(bool on);
  // bench.pdl: kernels launch with programmatic dependent launch where the GPU has it
  // (kernels::CudaContext::pdl); false turns it off, for comparison. No-op on the CPU.
  void set_pdl(bool on);

  // A CUDA graph of a training step (train_moe's bench.cuda_graph): begin_capture() starts
  // recording this device's stream (the work enqueued until end_capture() is recorded,
  // not run) with the allocator's graph pool (core/cuda/caching_allocator.h), so the
  // addresses the graph replays stay its own; end_capture() instantiates it and
  // launch_graph() enqueues one replay. The captured work must not wait on the host
  // (no read-backs, no uploads); errors name the CUDA call that refused. CUDA only.
  Status begin_capture();
  Status end_capture();
  void launch_graph() const;
  bool has_graph() const;
  // Bytes the graph owns (its activations and temporaries): reserved while it lives.
  size_t graph_pool_bytes() const;

 private:
  RunDevice() = default;
  struct Cuda;  // stream, allocator, context (CUDA builds)
  std::unique_ptr<Cuda> cuda_;
  Tensor host_read_;  // read_async on the CPU
  layers::Ctx ctx_;
  std::string name_ = "cpu";
};

}  // namespace troupe::training
