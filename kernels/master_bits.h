// kernels/master_bits.h — the split f32 master weight (train.master_weights = "split"): an
// f32 value kept as two 16-bit halves, the upper one rounded so that it is also the bf16
// working copy the matrix products read, the lower one the f32's own low 16 bits read as
// a signed offset. The pair is exact: join(split(x)) has x's bits for every bit pattern,
// so the optimizer updates the same f32 master as before while reading and writing 4 bytes
// a parameter for master and working copy together instead of 4 + 2.
//
// The upper half rounds to nearest with ties away from zero (the bf16 cast rounds ties to
// even; the two differ only where the low 16 bits are exactly 0x8000). A NaN splits into a
// quiet bf16 NaN and a zero low half (joined: a quiet f32 NaN of the same sign).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TROUPE_MASTER_HD __host__ __device__ __forceinline__
#else
#define TROUPE_MASTER_HD inline
#endif

namespace troupe::kernels {

// The f32 bits `b` as (hi, lo): hi the bf16 bits, lo the low 16 bits.
TROUPE_MASTER_HD void master_split_bits(uint32_t b, uint16_t& hi, uint16_t& lo) {
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN
    hi = static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7FC0u);
    lo = 0;
    return;
  }
  // Adding half of the low half's range carries into the upper half exactly when the low
  // half is 0x8000 or more, and the low half read as signed is then negative: the sum
  // below gives back b (mod 2^32, which also covers the carry out of the sign bit).
  hi = static_cast<uint16_t>((b + 0x8000u) >> 16);
  lo = static_cast<uint16_t>(b & 0xFFFFu);
}

// The f32 bits of the pair (hi, lo) from master_split_bits.
TROUPE_MASTER_HD uint32_t master_join_bits(uint16_t hi, uint16_t lo) {
  return (static_cast<uint32_t>(hi) << 16) +
         static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(lo)));
}

}  // namespace troupe::kernels
