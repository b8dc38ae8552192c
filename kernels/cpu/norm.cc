// kernels/cpu/norm.cc — CPU reference of RMSNorm and row softmax, forward and backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {

void rmsnorm_forward(const Exec& ex, const Tensor& x, const Tensor* r, const Tensor& w, float eps, Tensor* h,
                     Tensor& y, Tensor& rstd) {
  if (r != nullptr) {
    // The sum is stored (rounded to h's dtype) first and normalised from there: exactly
    // add then rmsnorm.
    cpu::add(ex, x, *r, *h);
    rmsnorm_forward(ex, *h, nullptr, w, eps, nullptr, y, rstd);
    return;
  }
  const int64_t rows = x.size(0), dim = x.size(1);
  F32In px(x), pw(w);
  F32Out py(y), pr(rstd);
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = px.get() + t * dim;
    double ss = 0.0;
    for (int64_t d = 0; d < dim; ++d) ss += static_cast<double>(xr[d]) * xr[d];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
    pr[t] = r;
    float* yr = py.get() + t * dim;
    for (int64_t d = 0; d < dim; ++d) yr[d] = xr[d] * r * pw[d];
  }
}

// With g = dy * w:  dx = rstd * g - x * rstd^3 * mean(g * x);  dw = sum_t dy * x * rstd.
void rmsnorm_backward(const Exec&, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool accumulate_dw, const Tensor* dres) {
  const int64_t rows = x.size(0), dim = x.size(1);
  F32In pdy(dy), px(x), pw(w), pr(rstd);
  // dres is read whole before dx's view is written back (dx may alias it).
  std::optional<F32In> pres;
  if (dres != nullptr) pres.emplace(*dres);
  F32Out pdx(dx), pdw(dw, accumulate_dw);
  std::vector<double> dw_acc(static_cast<size_t>(dim), 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = px.get() + t * dim;
    const float* dyr = pdy.get() + t * dim;
    const float r = pr[t];
    double gx = 0.0;
    for (int64_t d = 0; d < dim; ++d) gx += static_cast<double>(dyr[d]) * pw[d] * xr[d];
    const float c = static_cast<float>(gx / static_cast<double>(dim)) * r * r * r;
    float* dxr = pdx.get() + t * dim;
    for (int64_t d = 0; d < dim; ++d) {
      float v = r * dyr[d] * pw[d] - xr[d] * c;
      if (pres) v += (*pres)[t * dim + d];
      dxr[d] = v;
      dw_acc[d] += static_cast<double>(dyr[d]) * xr[d] * r;
    }
  }
  for (int64_t d = 0; d < dim; ++d) {
    pdw[d] = accumulate_dw ? static_cast<float>(pdw[d] + dw_acc[d]) : static_cast<float>(dw_acc[d]);
  }
}

void softmax_forward(const Exec&, const Tensor& x, Tensor& y) {
  const int64_t rows = x.size(0), cols = x.size(1);
  F32In px(x);
  F32Out py(y);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px.get() + r * cols;
    float* yr = py.get() + r * cols;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, xr[c]);
    double z = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      yr[c] = std::exp(xr[c] - mx);
      z += yr[c];
    }
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t c = 0; c < cols; ++c) yr[c] *= inv;
  }
}

// dx = y * (dy - sum(dy * y)) per row.
void softmax_backward(const Exec&, const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t rows = y.size(0), cols = y.size(1);
  F32In py(y), pdy(dy);
  F32Out pdx(dx);
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = py.get() + r * cols;
    const float* dyr = pdy.get() + r * cols;
    double dot = 0.0;
    for (int64_t c = 0; c < cols; ++c) dot += static_cast<double>(dyr[c]) * yr[c];
    float* dxr = pdx.get() + r * cols;
    for (int64_t c = 0; c < cols; ++c) dxr[c] = yr[c] * (dyr[c] - static_cast<float>(dot));
  }
}

}  // namespace troupe::kernels::cpu
