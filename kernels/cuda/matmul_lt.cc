// kernels/cuda/matmul_lt.cc — row-major matrix products on cuBLASLt (column-major): the
// row-major product out = op(a) @ op(b) is computed as the column-major product
// out^T = op(b)^T @ op(a)^T, so cuBLASLt's "A" is our b and its "B" is our a.
#include "kernels/cuda/matmul_lt.h"

#include "core/gpu_check.h"
#include "kernels/cuda/context.h"

namespace troupe::kernels {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    default: TROUPE_CHECK(false, "matmul on cuda: dtype {} is not supported", dtype_name(t));
  }
  return CUDA_R_32F;
}

// Owns the descriptors of one call.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtDescs() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

void set_batch(cublasLtMatrixLayout_t layout, int64_t batch, int64_t stride) {
  if (batch == 1) return;
  const int32_t count = static_cast<int32_t>(batch);
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
}

}  // namespace

void matmul_lt(CudaContext& ctx, const MatmulProblem& p0, const void* a, const void* b, void* out, float alpha,
               float beta) {
  MatmulProblem p = p0;
  if (p.m == 0 || p.n == 0) return;
  // One b for all batch entries and no transpose of a: fold the batch into the rows.
  if (p.batch > 1 && p.b_shared && !p.trans_a) {
    p.m *= p.batch;
    p.batch = 1;
    p.b_shared = false;
  }
  TROUPE_CHECK(p.ab_type == DType::kF32 ? p.out_type == DType::kF32
                                        : (p.out_type == p.ab_type || p.out_type == DType::kF32),
               "matmul on cuda: {} inputs with a {} output are not supported", dtype_name(p.ab_type),
               dtype_name(p.out_type));
  TROUPE_CHECK(p.m <= INT32_MAX && p.n <= INT32_MAX && p.k <= INT32_MAX, "matmul on cuda: dims too large");
  if (p.k == 0) {  // cuBLASLt rejects k = 0; the product is empty: out = beta * out
    TROUPE_CHECK(beta == 0.0f, "matmul on cuda with k = 0 needs beta = 0");
    CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(p.batch * p.m * p.n) * dtype_size(p.out_type), ctx.stream));
    return;
  }
  const cudaDataType_t ab = cuda_type(p.ab_type), ot = cuda_type(p.out_type);
  LtDescs d;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLASLt A = our b: op = T when b is stored [n,k] (trans_b); stored col-major [n,k]
  // with ld n when not transposed, [k,n] with ld k when transposed.
  const cublasOperation_t op_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const uint64_t m = p.m, n = p.n, k = p.k;
  if (p.trans_b) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, ab, k, n, k));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, ab, n, k, n));
  }
  if (p.trans_a) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, ab, m, k, m));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, ab, k, m, k));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, ot, n, m, n));
  set_batch(d.a, p.batch, p.b_shared ? 0 : p.k * p.n);
  set_batch(d.b, p.batch, p.a_shared ? 0 : p.m * p.k);
  set_batch(d.c, p.batch, p.m * p.n);

  auto& cache = ctx.matmul_plans->algos;
  auto it = cache.find(p.key());
  if (it == cache.end()) {
    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx.workspace_bytes;
    CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(ctx.lt, d.op, d.a, d.b, d.c, d.c, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    CUBLAS_CHECK(st);
    TROUPE_CHECK(found > 0, "cuBLASLt has no algorithm for matmul m={} n={} k={} batch={} {}->{}", p.m, p.n, p.k,
                 p.batch, dtype_name(p.ab_type), dtype_name(p.out_type));
    it = cache.emplace(p.key(), result.algo).first;
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt, d.op, &alpha, b, d.a, a, d.b, &beta, out, d.c, out, d.c, &it->second,
                              ctx.workspace, ctx.workspace_bytes, ctx.stream));
}

}  // namespace troupe::kernels
