// kernels/backend.h — defines Backend, a table of function pointers with one entry per
// op of kernels/ops.h (same signatures), as ggml does. kernels/ops.cc checks shapes and
// calls the entry of the backend for `ex.device`: cpu_backend() (kernels/cpu/, always
// complete) or cuda_backend() (kernels/cuda/, CUDA builds). An entry left null means the
// backend lacks that op: the dispatcher aborts with "op X is not available on cuda".
#pragma once

#include "kernels/ops.h"

namespace troupe::kernels {

struct Backend {
  const char* name;
  void (*fill)(const Exec&, Tensor&, float);
  void (*cast)(const Exec&, const Tensor&, Tensor&);
  void (*add)(const Exec&, const Tensor&, const Tensor&, Tensor&);
  void (*axpby)(const Exec&, float, const Tensor&, float, Tensor&);
  void (*scale)(const Exec&, Tensor&, float);
  double (*sum)(const Exec&, const Tensor&);
  double (*sum_squares)(const Exec&, const Tensor&);
  void (*sum_rows)(const Exec&, const Tensor&, Tensor&, bool);
  void (*matmul)(const Exec&, const Tensor&, const Tensor&, Tensor&, bool, bool, float, float);
  void (*grouped_matmul)(const Exec&, const Tensor&, const Tensor&, const Tensor&, Tensor&, bool);
  // ..., dx, dw, trans_w, accumulate_dw, dw_sum_squares (null: none).
  void (*grouped_matmul_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  Tensor*, Tensor*, bool, bool, Tensor*);
  void (*embedding_forward)(const Exec&, const Tensor&, const Tensor&, Tensor&);
  void (*embedding_backward)(const Exec&, const Tensor&, const Tensor&, Tensor&);
  // x, residual (null: plain rmsnorm), w, eps, h (the sum, with residual), y, rstd.
  void (*rmsnorm_forward)(const Exec&, const Tensor&, const Tensor*, const Tensor&, float, Tensor*, Tensor&,
                          Tensor&);
  void (*rmsnorm_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
                           Tensor&, bool, const Tensor*);
  void (*rope_forward)(const Exec&, const Tensor&, const Tensor&, float, Tensor&);
  void (*rope_backward)(const Exec&, const Tensor&, const Tensor&, float, Tensor&);
  void (*attention_forward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, float, Tensor&,
                            Tensor&);
  // ..., dq, dk, dv, rope (null: none).
  void (*attention_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, float, Tensor&, Tensor&, Tensor&, const RopeArgs*);
  void (*softmax_forward)(const Exec&, const Tensor&, Tensor&);
  void (*softmax_backward)(const Exec&, const Tensor&, const Tensor&, Tensor&);
  void (*router_forward)(const Exec&, const Tensor&, const Tensor*, const RouterConfig&, Tensor&, Tensor&,
                         Tensor&, const RouterStats*);
  void (*router_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, const Tensor*,
                          const RouterConfig&, Tensor&, float);
  void (*logsumexp_forward)(const Exec&, const Tensor&, Tensor&);
  void (*logsumexp_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, float, Tensor&);
  void (*moe_dispatch_plan)(const Exec&, const Tensor&, int64_t, int64_t, Tensor&, Tensor&, Tensor&);
  void (*moe_permute)(const Exec&, const Tensor&, const Tensor&, int64_t, Tensor&);
  void (*moe_permute_backward)(const Exec&, const Tensor&, const Tensor&, int64_t, Tensor&);
  void (*moe_unpermute)(const Exec&, const Tensor&, const Tensor&, const Tensor&, Tensor&, const Tensor*);
  void (*moe_unpermute_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 Tensor&, Tensor&);
  void (*swiglu_forward)(const Exec&, const Tensor&, Tensor&);
  void (*swiglu_backward)(const Exec&, const Tensor&, const Tensor&, Tensor&);
  void (*cross_entropy_forward)(const Exec&, const Tensor&, const Tensor&, Tensor&, Tensor&);
  void (*cross_entropy_backward)(const Exec&, const Tensor&, const Tensor&, const Tensor&, float, Tensor&);
  void (*cross_entropy_forward_backward)(const Exec&, const Tensor&, const Tensor&, float, Tensor&, Tensor&,
                                         Tensor&);
  void (*adamw_step)(const Exec&, Tensor&, const Tensor&, Tensor&, Tensor&, const AdamWConfig&);
  void (*quantize_fp8)(const Exec&, const Tensor&, int64_t, Tensor&, Tensor&);
  void (*dequantize_fp8)(const Exec&, const Tensor&, const Tensor&, int64_t, Tensor&);
  void (*adamw_step_multi)(const Exec&, std::span<const AdamWTensor>, const AdamWConfig&);
  double (*sum_squares_multi)(const Exec&, std::span<const Tensor* const>);
  void (*master_split)(const Exec&, const Tensor&, Tensor&, Tensor&);
  void (*master_join)(const Exec&, const Tensor&, const Tensor&, Tensor&);
  // ---- device-resident step statistics
  // tensors (squared), sums (summed plainly), out, accumulate.
  void (*sum_squares_into)(const Exec&, std::span<const Tensor* const>, std::span<const Tensor* const>,
                           Tensor&, bool);
  // ---- communication codecs ----
  void (*moe_permute_fp8)(const Exec&, const Tensor&, const Tensor&, int64_t, Tensor&, Tensor&);
  void (*sum_chunks)(const Exec&, const Tensor&, Tensor&);
};

// The CPU reference backend (kernels/cpu/backend_cpu.cc): every entry is set.
const Backend& cpu_backend();
// The CUDA backend (kernels/cuda/backend_cuda.cu) in CUDA builds; nullptr otherwise.
const Backend* cuda_backend();

}  // namespace troupe::kernels
