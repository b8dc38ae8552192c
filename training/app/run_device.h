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
  // Waits for every op enqueued so far (no-op on the CPU).
  void synchronize() const;
  // train.attention_fused_dq (kernels::CudaContext::attention_fused_dq). No-op on the CPU.
  void set_attention_fused_dq(bool on);
  // bench.pdl: kernels launch with programmatic dependent launch where the GPU has it
  // (kernels::CudaContext::pdl); false turns it off, for comparison. No-op on the CPU.
  void set_pdl(bool on);

 private:
  RunDevice() = default;
  struct Cuda;  // stream, allocator, context (CUDA builds)
  std::unique_ptr<Cuda> cuda_;
  layers::Ctx ctx_;
  std::string name_ = "cpu";
};

}  // namespace troupe::training
