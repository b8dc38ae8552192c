// tests/core/dtype_test.cc — bf16, f16 and fp8 round trips on edge values: rounding to
// nearest even, subnormals, max, overflow/saturation, infinities and NaN.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/fp8.h"

namespace troupe {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_from_name("bf16"), DType::kBF16);
  EXPECT_EQ(dtype_from_name("fp8e5m2"), DType::kF8E5M2);
  EXPECT_FALSE(dtype_from_name("f128").has_value());
}

TEST(BF16, RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  // Just above halfway rounds up.
  EXPECT_EQ(float_to_bf16_bits(bits_to_float(0x3F808001)), 0x3F81);
}

TEST(BF16, EdgeValues) {
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(INFINITY)), INFINITY);
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(-INFINITY)), -INFINITY);
  // Largest float overflows to inf after rounding.
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(std::numeric_limits<float>::max())), INFINITY);
  // Largest bf16 is exact.
  EXPECT_EQ(float_to_bf16_bits(bf16_bits_to_float(0x7F7F)), 0x7F7F);
  // A float subnormal survives (bf16 shares float's exponent range).
  const float sub = bits_to_float(0x00010000);
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(sub)), sub);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
}

TEST(F16, EdgeValues) {
  EXPECT_EQ(float_to_f16_bits(1.0f), 0x3C00);
  EXPECT_EQ(f16_bits_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7C00);  // halfway to 2^16 rounds to even -> inf
  EXPECT_EQ(float_to_f16_bits(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(1e6f), 0x7C00);
  EXPECT_EQ(f16_bits_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(float_to_f16_bits(std::ldexp(3.0f, -26)), 0x0001);  // 0.75 ulp rounds up
  EXPECT_EQ(f16_bits_to_float(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_TRUE(std::isnan(f16_bits_to_float(float_to_f16_bits(NAN))));
  EXPECT_EQ(float_to_f16_bits(-INFINITY), 0xFC00);
}

TEST(FP8E4M3, EdgeValues) {
  EXPECT_EQ(fp8e4m3_bits_to_float(0x7E), 448.0f);
  EXPECT_EQ(float_to_fp8e4m3_bits(448.0f), 0x7E);
  EXPECT_EQ(float_to_fp8e4m3_bits(500.0f), 0x7E);        // saturates
  EXPECT_EQ(float_to_fp8e4m3_bits(1e9f), 0x7E);
  EXPECT_EQ(float_to_fp8e4m3_bits(INFINITY), 0x7E);      // no inf in e4m3fn: saturate
  EXPECT_EQ(float_to_fp8e4m3_bits(-INFINITY), 0xFE);
  EXPECT_TRUE(std::isnan(fp8e4m3_bits_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8e4m3_bits_to_float(float_to_fp8e4m3_bits(NAN))));
  EXPECT_EQ(fp8e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(float_to_fp8e4m3_bits(std::ldexp(1.0f, -10)), 0x00);   // tie -> even
  EXPECT_EQ(float_to_fp8e4m3_bits(std::ldexp(3.0f, -10)), 0x02);   // 1.5 ulp tie -> even (2)
  EXPECT_EQ(fp8e4m3_bits_to_float(0x08), std::ldexp(1.0f, -6));    // smallest normal
  EXPECT_EQ(float_to_fp8e4m3_bits(1.0f), 0x38);
  // 1.0625 is halfway between 1.0 (mantissa 000) and 1.125 (001): ties to even.
  EXPECT_EQ(float_to_fp8e4m3_bits(1.0625f), 0x38);
  EXPECT_EQ(float_to_fp8e4m3_bits(1.1875f), 0x3A);  // halfway 1.125/1.25 -> 1.25 (even)
}

TEST(FP8E5M2, EdgeValues) {
  EXPECT_EQ(fp8e5m2_bits_to_float(0x7B), 57344.0f);
  EXPECT_EQ(float_to_fp8e5m2_bits(57344.0f), 0x7B);
  EXPECT_EQ(float_to_fp8e5m2_bits(1e6f), 0x7B);  // finite overflow saturates
  EXPECT_EQ(fp8e5m2_bits_to_float(0x7C), INFINITY);
  EXPECT_EQ(float_to_fp8e5m2_bits(INFINITY), 0x7C);
  EXPECT_EQ(float_to_fp8e5m2_bits(-INFINITY), 0xFC);
  EXPECT_TRUE(std::isnan(fp8e5m2_bits_to_float(float_to_fp8e5m2_bits(NAN))));
  EXPECT_EQ(fp8e5m2_bits_to_float(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(float_to_fp8e5m2_bits(1.0f), 0x3C);
}

// Every finite code decodes and re-encodes to itself, and encoding a random float
// gives the nearest representable value.
template <typename Enc, typename Dec>
void check_all_codes(Enc enc, Dec dec, int ncodes) {
  std::vector<float> finite;
  for (int c = 0; c < ncodes; ++c) {
    float v = dec(static_cast<uint32_t>(c));
    if (std::isnan(v) || std::isinf(v)) continue;
    if (v == 0.0f && c != 0 && std::signbit(v)) continue;  // -0 maps to -0 but skip dup
    EXPECT_EQ(dec(enc(v)), v) << "code " << c;
    finite.push_back(v);
  }
  std::sort(finite.begin(), finite.end());
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(finite.front(), finite.back());
  for (int i = 0; i < 20000; ++i) {
    float x = u(rng) * (i % 3 == 0 ? 0.01f : 1.0f);
    float r = dec(enc(x));
    auto it = std::lower_bound(finite.begin(), finite.end(), x);
    float best = *it;
    if (it != finite.begin() && std::fabs(*(it - 1) - x) < std::fabs(best - x)) best = *(it - 1);
    EXPECT_EQ(std::fabs(r - x), std::fabs(best - x)) << "x=" << x;
  }
}

// The e4m3 encoder (core/fp8.h, behind float_to_fp8e4m3_bits) against a brute-force
// oracle: the nearest of the 127 finite magnitudes, ties to the even code, saturating at
// 448, NaN kept — over a stride through every float bit pattern and every tie.
uint8_t e4m3_nearest_reference(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(static_cast<double>(fp8e4m3_bits_to_float(static_cast<uint8_t>(c))) - a);
    if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
  }
  return sign | static_cast<uint8_t>(best);
}

TEST(FP8E4M3, EncoderMatchesNearestEvenReference) {
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 65537) {
    float x;
    const uint32_t b = static_cast<uint32_t>(u);
    std::memcpy(&x, &b, sizeof(x));
    ASSERT_EQ(fp8e4m3_encode(x), e4m3_nearest_reference(x)) << "x = " << x;
  }
  for (int c = 0; c < 0x7E; ++c) {
    const float v = fp8e4m3_bits_to_float(static_cast<uint8_t>(c));
    const float w = fp8e4m3_bits_to_float(static_cast<uint8_t>(c + 1));
    for (float x : {v, (v + w) / 2, std::nextafter((v + w) / 2, 0.0f), std::nextafter((v + w) / 2, 1e9f)}) {
      ASSERT_EQ(fp8e4m3_encode(x), e4m3_nearest_reference(x)) << "x = " << x;
      ASSERT_EQ(fp8e4m3_encode(-x), e4m3_nearest_reference(-x)) << "x = " << -x;
    }
  }
}

TEST(FP8, AllCodesRoundTripAndNearest) {
  check_all_codes([](float f) { return float_to_fp8e4m3_bits(f); },
                  [](uint32_t c) { return fp8e4m3_bits_to_float(static_cast<uint8_t>(c)); }, 256);
  check_all_codes([](float f) { return float_to_fp8e5m2_bits(f); },
                  [](uint32_t c) { return fp8e5m2_bits_to_float(static_cast<uint8_t>(c)); }, 256);
}

TEST(F16, AllCodesRoundTripAndNearest) {
  check_all_codes([](float f) { return float_to_f16_bits(f); },
                  [](uint32_t c) { return f16_bits_to_float(static_cast<uint16_t>(c)); }, 65536);
}

TEST(ConvertDType, Buffers) {
  std::vector<float> src{1.5f, -2.25f, 3.0f, 1000.0f};
  std::vector<uint16_t> bf(4);
  convert_dtype(src.data(), DType::kF32, bf.data(), DType::kBF16, 4);
  std::vector<float> back(4);
  convert_dtype(bf.data(), DType::kBF16, back.data(), DType::kF32, 4);
  EXPECT_EQ(back, src);
  std::vector<int32_t> ints(4);
  convert_dtype(src.data(), DType::kF32, ints.data(), DType::kI32, 4);
  EXPECT_EQ(ints, (std::vector<int32_t>{1, -2, 3, 1000}));
}

}  // namespace
}  // namespace troupe
