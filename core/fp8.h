// core/fp8.h — defines fp8e4m3_encode, the one fp8 e4m3 ("fn") encoder of Troupe: float ->
// e4m3 bits, round to nearest with ties to even, finite overflow and infinities saturated to
// ±448 (code 0x7E, e4m3fn has no infinity), NaN kept as 0x7F with its sign. Integer
// arithmetic on the float's bits, inline for the host and for CUDA device code, so that the
// DType conversion (core/dtype.cc), the communication codec (comm/compression.cc) and the
// fp8 permute kernels (kernels/cpu/compress.cc, kernels/cuda/compress.cu) produce the same
// bytes from one definition. C++17 (CUDA sources include it).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define TROUPE_HOST_DEVICE __host__ __device__
#else
#define TROUPE_HOST_DEVICE
#endif

namespace troupe {

TROUPE_HOST_DEVICE inline uint8_t fp8e4m3_encode(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;  // NaN
  if (a >= 0x3C800000u) {                   // |x| >= 2^-6: normal in e4m3
    // Round the 23-bit mantissa to 3 bits, ties to even, then rebias the exponent 127 -> 7.
    const uint32_t rounded = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    const uint32_t code = rounded - ((127u - 7u) << 3);
    return sign | static_cast<uint8_t>(code < 0x7Eu ? code : 0x7Eu);  // saturate (inf too)
  }
  // Subnormal: multiples of 2^-9 (rintf rounds ties to even in the default rounding mode); a
  // result of 8 is the smallest normal's code.
  return sign | static_cast<uint8_t>(rintf(fabsf(x) * 512.0f));
}

}  // namespace troupe
