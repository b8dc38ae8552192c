// kernels/cpu/compress.cc — CPU versions of the communication codec ops:
// moe_permute_fp8 (the expert permute fused with fp8 e4m3 per-row quantisation, core/fp8.h; bytes
// identical to comm::quantize_rows_fp8 of moe_permute's output, checked in
// tests/comm/comm_compression_test.cc) and sum_chunks (fp32 sum of chunks in order).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/fp8.h"
#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {
void moe_permute_fp8(const Exec&, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& q,
                     Tensor& scales) {
  const int64_t tokens = x.size(0), d = x.size(1), rows = q.size(0);
  const int32_t* pm = row_map.data<int32_t>();
  F32In px(x);
  auto* pq = static_cast<uint8_t*>(q.data_ptr());
  float* ps = scales.data<float>();
  std::fill(pq, pq + rows * d, uint8_t{0});
  std::fill(ps, ps + rows, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* src = px.get() + t * d;
    float amax = 0.0f;
    for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(src[c]));
    const float scale = (amax > 0.0f && std::isfinite(amax)) ? amax / kFp8E4M3Max : 1.0f;
    const float inv = 1.0f / scale;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t r = pm[t * top_k + j];
      TROUPE_CHECK(r < rows, "moe_permute_fp8: copy {} maps to row {} of {}", t * top_k + j, r, rows);
      if (r < 0) continue;
      for (int64_t c = 0; c < d; ++c) pq[r * d + c] = fp8e4m3_encode(src[c] * inv);
      ps[r] = scale;
    }
  }
}

void sum_chunks(const Exec&, const Tensor& in, Tensor& out) {
  const int64_t n = in.size(0), m = in.size(1);
  F32In pi(in);
  float* po = out.data<float>();
  for (int64_t i = 0; i < m; ++i) po[i] = pi[i];
  for (int64_t k = 1; k < n; ++k)
    for (int64_t i = 0; i < m; ++i) po[i] += pi[k * m + i];
}

}  // namespace troupe::kernels::cpu
