// kernels/cpu/matmul.cc — CPU reference of matmul (2-D and batched, with transposes) and
// grouped matmul over per-expert row segments, forward and backward.
//
// Every product goes through gemm_rows(): C[M,N] = alpha * A[M,K] @ op(B) + beta * C with A
// row-major. A transposed A is copied to row-major first (O(MK), small next to O(MNK)).
// Loop orders keep the innermost loop on contiguous memory: i-k-j for B [K,N] and i-j-k
// (dot products) for B stored [N,K]. Accumulation is f32.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {
namespace {

// C = alpha * A @ B + beta * C, A [M,K] row-major; B is [K,N] (b_nk false) or [N,K]
// (b_nk true), both row-major. beta == 0 ignores C's old contents (even NaN).
void gemm_rows(int64_t m, int64_t n, int64_t k, const float* a, const float* b, bool b_nk, float* c, float alpha,
               float beta, std::vector<float>& acc) {
  acc.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < m; ++i) {
    const float* arow = a + i * k;
    if (!b_nk) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t kk = 0; kk < k; ++kk) {
        const float aik = arow[kk];
        const float* brow = b + kk * n;
        for (int64_t j = 0; j < n; ++j) acc[j] += aik * brow[j];
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const float* brow = b + j * k;
        float s = 0.0f;
        for (int64_t kk = 0; kk < k; ++kk) s += arow[kk] * brow[kk];
        acc[j] = s;
      }
    }
    float* crow = c + i * n;
    if (beta == 0.0f) {
      for (int64_t j = 0; j < n; ++j) crow[j] = alpha * acc[j];
    } else {
      for (int64_t j = 0; j < n; ++j) crow[j] = alpha * acc[j] + beta * crow[j];
    }
  }
}

// Row-major copy of the transpose of src [rows, cols].
void transpose_into(const float* src, int64_t rows, int64_t cols, std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace

void matmul(const Exec&, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a, bool trans_b, float alpha,
            float beta) {
  const int64_t batches = out.dim() == 3 ? out.size(0) : 1;
  const int64_t m = out.size(-2), n = out.size(-1);
  const int64_t k = trans_a ? a.size(-2) : a.size(-1);
  const bool b_shared = b.dim() == 2;
  F32In pa(a), pb(b);
  F32Out po(out, beta != 0.0f);
  std::vector<float> acc, a_t;
  for (int64_t bi = 0; bi < batches; ++bi) {
    const float* ab = pa.get() + bi * m * k;
    const float* bb = pb.get() + (b_shared ? 0 : bi * k * n);
    if (trans_a) {
      transpose_into(ab, k, m, a_t);
      ab = a_t.data();
    }
    gemm_rows(m, n, k, ab, bb, trans_b, po.get() + bi * m * n, alpha, beta, acc);
  }
}

namespace {

struct Segments {
  const int32_t* offsets;
  int64_t experts;
  int64_t rows;
};

Segments check_segments(const Tensor& offsets, int64_t rows) {
  const int32_t* o = offsets.data<int32_t>();
  const int64_t experts = offsets.numel() - 1;
  TROUPE_CHECK(o[0] == 0 && o[experts] == rows, "grouped_matmul: offsets must run from 0 to {} (got {} .. {})",
               rows, o[0], o[experts]);
  for (int64_t e = 0; e < experts; ++e) {
    TROUPE_CHECK(o[e] <= o[e + 1], "grouped_matmul: offsets decrease at expert {} ({} > {})", e, o[e], o[e + 1]);
  }
  return {o, experts, rows};
}

}  // namespace

void grouped_matmul(const Exec&, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out,
                    bool trans_w) {
  const int64_t k = x.size(1), n = out.size(1);
  const Segments seg = check_segments(offsets, x.size(0));
  F32In px(x), pw(w);
  F32Out po(out);
  std::vector<float> acc;
  for (int64_t e = 0; e < seg.experts; ++e) {
    const int64_t r0 = seg.offsets[e], rows = seg.offsets[e + 1] - r0;
    if (rows == 0) continue;
    gemm_rows(rows, n, k, px.get() + r0 * k, pw.get() + e * k * n, trans_w, po.get() + r0 * n, 1.0f, 0.0f, acc);
  }
}

void grouped_matmul_backward(const Exec&, const Tensor& x, const Tensor& w, const Tensor& offsets,
                             const Tensor& dout, Tensor* dx, Tensor* dw, bool trans_w, bool accumulate_dw) {
  const int64_t k = x.size(1), n = dout.size(1);
  const Segments seg = check_segments(offsets, x.size(0));
  F32In px(x), pw(w), pd(dout);
  std::vector<float> acc, tmp_a;
  if (dx != nullptr) {
    // out = x @ B with B = W_e [K,N], or B = W_e^T when W_e is stored [N,K] (trans_w).
    // dx_seg = dout_seg @ B^T: B^T [N,K] is W_e itself when trans_w, and when not, W_e
    // [K,N] is B^T in the dot-product layout (b_nk).
    F32Out pdx(*dx);
    for (int64_t e = 0; e < seg.experts; ++e) {
      const int64_t r0 = seg.offsets[e], rows = seg.offsets[e + 1] - r0;
      if (rows == 0) continue;
      gemm_rows(rows, k, n, pd.get() + r0 * n, pw.get() + e * k * n, /*b_nk=*/!trans_w, pdx.get() + r0 * k,
                1.0f, 0.0f, acc);
    }
  }
  if (dw != nullptr) {
    F32Out pdw(*dw, accumulate_dw);
    const float beta = accumulate_dw ? 1.0f : 0.0f;
    for (int64_t e = 0; e < seg.experts; ++e) {
      const int64_t r0 = seg.offsets[e], rows = seg.offsets[e + 1] - r0;
      float* dwe = pdw.get() + e * k * n;
      if (rows == 0) {
        // An empty expert received no tokens: its gradient is zero.
        if (!accumulate_dw)
          for (int64_t i = 0; i < k * n; ++i) dwe[i] = 0.0f;
        continue;
      }
      if (!trans_w) {
        // dW_e [K,N] = x_seg^T [K,rows] @ dout_seg [rows,N].
        transpose_into(px.get() + r0 * k, rows, k, tmp_a);
        gemm_rows(k, n, rows, tmp_a.data(), pd.get() + r0 * n, false, dwe, 1.0f, beta, acc);
      } else {
        // dW_e [N,K] = dout_seg^T [N,rows] @ x_seg [rows,K].
        transpose_into(pd.get() + r0 * n, rows, n, tmp_a);
        gemm_rows(n, k, rows, tmp_a.data(), px.get() + r0 * k, false, dwe, 1.0f, beta, acc);
      }
    }
  }
}

}  // namespace troupe::kernels::cpu
