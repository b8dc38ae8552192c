// kernels/cpu/quant.cc — CPU reference of scaled fp8 quantization (one scale per row, or
// per block of `block_size` elements along the row) and dequantization.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {
namespace {

float fp8_max(DType t) {
  return t == DType::kF8E4M3 ? kFp8E4M3Max : kFp8E5M2Max;
}

}  // namespace

void quantize_fp8(const Exec&, const Tensor& x, int64_t block_size, Tensor& q, Tensor& scales) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t block = block_size == 0 ? std::max<int64_t>(cols, 1) : block_size;
  const int64_t nb = scales.size(1);
  const float qmax = fp8_max(q.dtype());
  F32In px(x);
  F32Out ps(scales);
  std::vector<float> staged(static_cast<size_t>(block));
  auto* pq = static_cast<unsigned char*>(q.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * block, c1 = std::min(cols, c0 + block);
      const float* xr = px.get() + r * cols;
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(xr[c]));
      const float s = amax > 0.0f ? amax / qmax : 1.0f;
      ps[r * nb + b] = s;
      for (int64_t c = c0; c < c1; ++c) staged[c - c0] = xr[c] / s;
      // convert_dtype saturates to the fp8 range (and keeps NaN), per core/dtype.h.
      convert_dtype(staged.data(), DType::kF32, pq + r * cols + c0, q.dtype(), static_cast<size_t>(c1 - c0));
    }
  }
}

void dequantize_fp8(const Exec&, const Tensor& q, const Tensor& scales, int64_t block_size, Tensor& out) {
  const int64_t rows = q.size(0), cols = q.size(1);
  const int64_t block = block_size == 0 ? std::max<int64_t>(cols, 1) : block_size;
  const int64_t nb = scales.size(1);
  F32In pq(q), ps(scales);
  F32Out po(out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t b = std::min(c / block, nb - 1);
      po[r * cols + c] = pq[r * cols + c] * ps[r * nb + b];
    }
  }
}

}  // namespace troupe::kernels::cpu
