// core/peak_flops.h — the one peak that Troupe's utilisation figures divide by: MFU in a
// run's metrics (training/driver/trainer.cc) and the kernel benchmarks' "% of peak"
// (bench/kernels). The model FLOPs they divide are layers::ModelConfig::
// train_flops_per_token (the one formula).
#pragma once

namespace troupe {

// Dense bf16 tensor-core peak of one H100 or H200 SXM (NVIDIA's datasheet figure without
// sparsity), in FLOP/s: the GPUs the figures in bench/RESULTS.md come from.
inline constexpr double kPeakBf16FlopsPerGpu = 989e12;

}  // namespace troupe
