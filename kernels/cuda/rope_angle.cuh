// kernels/cuda/rope_angle.cuh — one RoPE angle's (cos, sin), the arithmetic every CUDA RoPE
// path shares (rows.cu's rotations and tables, the attention backward's preparation), so
// that all of them rotate by the same floats: frequency p of head_dim at position pos, in
// double precision, rounded once to float; (cos, -sin) with inverse (the backward's).
#pragma once

#include <cstdint>

namespace troupe::kernels::gpu {

__device__ __forceinline__ float2 rope_cos_sin(int32_t pos, int p, int head_dim, double log_theta,
                                               bool inverse) {
  const double inv_freq = exp(-(2.0 * static_cast<double>(p) / static_cast<double>(head_dim)) * log_theta);
  double sn, c;
  sincos(static_cast<double>(pos) * inv_freq, &sn, &c);
  return make_float2(static_cast<float>(c), inverse ? -static_cast<float>(sn) : static_cast<float>(sn));
}

}  // namespace troupe::kernels::gpu
