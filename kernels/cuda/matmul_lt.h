// kernels/cuda/matmul_lt.h — defines matmul_lt: dense (optionally batched) matrix products
// through cuBLASLt for row-major tensors, and MatmulPlanCache, the per-context cache of
// cuBLASLt's algorithm choice per problem shape.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "core/dtype.h"

namespace troupe::kernels {

struct CudaContext;

struct MatmulProblem {
  int64_t m = 0, n = 0, k = 0;  // out [batch, m, n] = op(a) [m,k] @ op(b) [k,n]
  int64_t batch = 1;
  bool trans_a = false, trans_b = false;
  bool b_shared = false;  // one b for every batch entry
  bool a_shared = false;  // one a for every batch entry
  DType ab_type = DType::kF32, out_type = DType::kF32;
  auto key() const {
    return std::make_tuple(m, n, k, batch, trans_a, trans_b, b_shared, a_shared, ab_type, out_type);
  }
};

class MatmulPlanCache {
 public:
  std::map<decltype(MatmulProblem{}.key()), cublasLtMatmulAlgo_t> algos;
};

// out = alpha * op(a) @ op(b) + beta * out on ctx's stream; every tensor contiguous
// row-major. a/b f32 with out f32 (exact fp32 arithmetic), or a/b bf16 with out bf16 or
// f32 (fp32 accumulation).
void matmul_lt(CudaContext& ctx, const MatmulProblem& p, const void* a, const void* b, void* out, float alpha,
               float beta);

}  // namespace troupe::kernels
