// kernels/cpu/elementwise.cc — CPU reference of fill, cast, add, axpby, scale, the sum
// reductions and SwiGLU.
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {

void fill(const Exec&, Tensor& out, float value) {
  const int64_t n = out.numel();
  if (n == 0) return;
  if (out.dtype() == DType::kF32) {
    float* p = out.data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = value;
    return;
  }
  // Any other dtype: convert the value once, then replicate its bytes.
  unsigned char one[8];
  convert_dtype(&value, DType::kF32, one, out.dtype(), 1);
  const size_t es = out.element_size();
  auto* p = static_cast<unsigned char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(p + static_cast<size_t>(i) * es, one, es);
}

void cast(const Exec&, const Tensor& src, Tensor& dst) {
  if (src.numel() == 0) return;
  convert_dtype(src.data_ptr(), src.dtype(), dst.data_ptr(), dst.dtype(), static_cast<size_t>(src.numel()));
}

void add(const Exec&, const Tensor& a, const Tensor& b, Tensor& out) {
  F32In pa(a), pb(b);
  F32Out po(out);
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}

void axpby(const Exec&, float alpha, const Tensor& x, float beta, Tensor& y) {
  F32In px(x);
  // beta == 0 overwrites y (BLAS convention), so garbage or NaN in y is ignored.
  F32Out py(y, beta != 0.0f);
  const int64_t n = y.numel();
  if (beta == 0.0f) {
    for (int64_t i = 0; i < n; ++i) py[i] = alpha * px[i];
  } else {
    for (int64_t i = 0; i < n; ++i) py[i] = alpha * px[i] + beta * py[i];
  }
}

void scale(const Exec&, Tensor& x, float alpha) {
  F32Out px(x, /*load=*/true);
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) px[i] *= alpha;
}

double sum(const Exec&, const Tensor& x) {
  F32In px(x);
  double acc = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) acc += px[i];
  return acc;
}

double sum_squares(const Exec&, const Tensor& x) {
  F32In px(x);
  double acc = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) acc += static_cast<double>(px[i]) * px[i];
  return acc;
}

void sum_rows(const Exec&, const Tensor& x, Tensor& out, bool accumulate) {
  const int64_t rows = x.size(0), cols = x.size(1);
  F32In px(x);
  F32Out po(out, accumulate);
  std::vector<double> acc(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = px.get() + r * cols;
    for (int64_t c = 0; c < cols; ++c) acc[c] += row[c];
  }
  for (int64_t c = 0; c < cols; ++c) {
    po[c] = accumulate ? static_cast<float>(po[c] + acc[c]) : static_cast<float>(acc[c]);
  }
}

namespace {
float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
}  // namespace

void swiglu_forward(const Exec&, const Tensor& h, Tensor& out) {
  const int64_t rows = out.size(0), f = out.size(1);
  F32In ph(h);
  F32Out po(out);
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = ph.get() + t * 2 * f;
    const float* up = gate + f;
    float* o = po.get() + t * f;
    for (int64_t i = 0; i < f; ++i) o[i] = gate[i] * sigmoid(gate[i]) * up[i];
  }
}

void swiglu_backward(const Exec&, const Tensor& h, const Tensor& dout, Tensor& dh) {
  const int64_t rows = dout.size(0), f = dout.size(1);
  F32In ph(h), pd(dout);
  F32Out pdh(dh);
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = ph.get() + t * 2 * f;
    const float* up = gate + f;
    const float* d = pd.get() + t * f;
    float* dgate = pdh.get() + t * 2 * f;
    float* dup = dgate + f;
    for (int64_t i = 0; i < f; ++i) {
      const float s = sigmoid(gate[i]);
      // d silu(g)/dg = s * (1 + g * (1 - s)).
      dgate[i] = d[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
      dup[i] = d[i] * gate[i] * s;
    }
  }
}

}  // namespace troupe::kernels::cpu
