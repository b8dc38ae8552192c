// kernels/cpu/matmul.cc — CPU reference of matmul (2-D and batched, with transposes) and
// grouped matmul over per-expert row segments, forward and backward.
//
// Every product goes through gemm_nn(): C[M,N] = alpha * A[M,K] @ B[K,N] + beta * C, all
// row-major, i-k-j loops with f32 accumulation. A transposed operand is copied to that
// layout first (O(MK) or O(KN), small next to the O(MNK) product).
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {
namespace {

// C = alpha * A @ B + beta * C with A [M,K], B [K,N], C [M,N], all row-major. beta == 0
// ignores C's old contents (even NaN). Blocked as i-k-j over tiles of kRowTile rows and
// kColTile columns: the tile's accumulators stay in L1 and each B element loaded feeds
// kRowTile multiply-adds; the innermost loop runs over contiguous columns (vectorisable).
constexpr int64_t kRowTile = 4;
constexpr int64_t kColTile = 256;

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, float alpha,
             float beta) {
  float acc[kRowTile][kColTile];
  for (int64_t j0 = 0; j0 < n; j0 += kColTile) {
    const int64_t nj = std::min(kColTile, n - j0);
    for (int64_t i0 = 0; i0 < m; i0 += kRowTile) {
      const int64_t ni = std::min(kRowTile, m - i0);
      for (int64_t r = 0; r < ni; ++r)
        for (int64_t j = 0; j < nj; ++j) acc[r][j] = 0.0f;
      const float* arow = a + i0 * k;
      for (int64_t kk = 0; kk < k; ++kk) {
        const float* brow = b + kk * n + j0;
        if (ni == kRowTile) {
          const float a0 = arow[kk], a1 = arow[k + kk], a2 = arow[2 * k + kk], a3 = arow[3 * k + kk];
          for (int64_t j = 0; j < nj; ++j) {
            const float bv = brow[j];
            acc[0][j] += a0 * bv;
            acc[1][j] += a1 * bv;
            acc[2][j] += a2 * bv;
            acc[3][j] += a3 * bv;
          }
        } else {
          for (int64_t r = 0; r < ni; ++r) {
            const float ar = arow[r * k + kk];
            for (int64_t j = 0; j < nj; ++j) acc[r][j] += ar * brow[j];
          }
        }
      }
      for (int64_t r = 0; r < ni; ++r) {
        float* crow = c + (i0 + r) * n + j0;
        if (beta == 0.0f) {
          for (int64_t j = 0; j < nj; ++j) crow[j] = alpha * acc[r][j];
        } else {
          for (int64_t j = 0; j < nj; ++j) crow[j] = alpha * acc[r][j] + beta * crow[j];
        }
      }
    }
  }
}

// Row-major copy of the transpose of src [rows, cols].
void transpose_into(const float* src, int64_t rows, int64_t cols, std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// C = alpha * A @ B + beta * C, A [M,K] row-major; B is [K,N] (b_nk false) or [N,K]
// (b_nk true). A [N,K] B is transposed into `scratch` first (O(NK), small next to O(MNK)).
void gemm_rows(int64_t m, int64_t n, int64_t k, const float* a, const float* b, bool b_nk, float* c,
               float alpha, float beta, std::vector<float>& scratch) {
  if (b_nk) {
    transpose_into(b, n, k, scratch);
    b = scratch.data();
  }
  gemm_nn(m, n, k, a, b, c, alpha, beta);
}

}  // namespace

void matmul(const Exec&, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a, bool trans_b,
            float alpha, float beta) {
  const int64_t batches = out.dim() == 3 ? out.size(0) : 1;
  const int64_t m = out.size(-2), n = out.size(-1);
  const int64_t k = trans_a ? a.size(-2) : a.size(-1);
  const bool b_shared = b.dim() == 2, a_shared = a.dim() == 2;
  F32In pa(a), pb(b);
  F32Out po(out, beta != 0.0f);
  std::vector<float> a_t, b_t;
  for (int64_t bi = 0; bi < batches; ++bi) {
    const float* ab = pa.get() + (a_shared ? 0 : bi * m * k);
    const float* bb = pb.get() + (b_shared ? 0 : bi * k * n);
    if (trans_a) {
      if (bi == 0 || !a_shared) transpose_into(ab, k, m, a_t);  // a shared a is transposed once
      ab = a_t.data();
    }
    if (trans_b) {
      if (bi == 0 || !b_shared) transpose_into(bb, n, k, b_t);  // a shared b is transposed once
      bb = b_t.data();
    }
    gemm_nn(m, n, k, ab, bb, po.get() + bi * m * n, alpha, beta);
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
  TROUPE_CHECK(o[0] == 0 && o[experts] == rows,
               "grouped_matmul: offsets must run from 0 to {} (got {} .. {})", rows, o[0], o[experts]);
  for (int64_t e = 0; e < experts; ++e) {
    TROUPE_CHECK(o[e] <= o[e + 1], "grouped_matmul: offsets decrease at expert {} ({} > {})", e, o[e],
                 o[e + 1]);
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
    gemm_rows(rows, n, k, px.get() + r0 * k, pw.get() + e * k * n, trans_w, po.get() + r0 * n, 1.0f, 0.0f,
              acc);
  }
}

void grouped_matmul_backward(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets,
                             const Tensor& dout, Tensor* dx, Tensor* dw, bool trans_w, bool accumulate_dw,
                             Tensor* dw_sum_squares) {
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
  if (dw_sum_squares != nullptr) {
    // After pdw's scope: the values as stored (rounded, for a bf16 dW).
    float* slots = dw_sum_squares->data<float>();
    slots[0] = static_cast<float>(cpu::sum_squares(ex, *dw));
    for (int64_t i = 1; i < dw_sum_squares->numel(); ++i) slots[i] = 0.0f;
  }
}

}  // namespace troupe::kernels::cpu
