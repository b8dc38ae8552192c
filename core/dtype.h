// core/dtype.h — defines DType (f32, f16, bf16, fp8 e4m3/e5m2, i32, i64, u8), the 16- and
// 8-bit storage types (bf16_t, f16_t, fp8e4m3_t, fp8e5m2_t) and their CPU conversions.
//
// Conversions from float round to nearest, ties to even. fp8 e4m3 ("fn": no infinities)
// saturates overflow and ±inf to ±448; fp8 e5m2 saturates finite overflow to ±57344 and
// keeps ±inf; NaN stays NaN in every format. f16 and bf16 overflow to ±inf (IEEE).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace troupe {

enum class DType : uint8_t { kF32 = 0, kF16, kBF16, kF8E4M3, kF8E5M2, kI32, kI64, kU8, kI16 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);                       // "f32", "bf16", "fp8e4m3", ...
std::optional<DType> dtype_from_name(std::string_view name);
bool dtype_is_float(DType t);

// Raw conversions (bit patterns).
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t b);
uint8_t float_to_fp8e4m3_bits(float f);
float fp8e4m3_bits_to_float(uint8_t b);
uint8_t float_to_fp8e5m2_bits(float f);
float fp8e5m2_bits_to_float(uint8_t b);

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

// Storage types: trivially copyable wrappers holding the bits.
struct bf16_t {
  uint16_t bits = 0;
  bf16_t() = default;
  explicit bf16_t(float f) : bits(float_to_bf16_bits(f)) {}
  explicit operator float() const { return bf16_bits_to_float(bits); }
  static bf16_t from_bits(uint16_t b) { bf16_t r; r.bits = b; return r; }
};
struct f16_t {
  uint16_t bits = 0;
  f16_t() = default;
  explicit f16_t(float f) : bits(float_to_f16_bits(f)) {}
  explicit operator float() const { return f16_bits_to_float(bits); }
  static f16_t from_bits(uint16_t b) { f16_t r; r.bits = b; return r; }
};
struct fp8e4m3_t {
  uint8_t bits = 0;
  fp8e4m3_t() = default;
  explicit fp8e4m3_t(float f) : bits(float_to_fp8e4m3_bits(f)) {}
  explicit operator float() const { return fp8e4m3_bits_to_float(bits); }
  static fp8e4m3_t from_bits(uint8_t b) { fp8e4m3_t r; r.bits = b; return r; }
};
struct fp8e5m2_t {
  uint8_t bits = 0;
  fp8e5m2_t() = default;
  explicit fp8e5m2_t(float f) : bits(float_to_fp8e5m2_bits(f)) {}
  explicit operator float() const { return fp8e5m2_bits_to_float(bits); }
  static fp8e5m2_t from_bits(uint8_t b) { fp8e5m2_t r; r.bits = b; return r; }
};

// C++ type -> DType.
template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::kF32; };
template <> struct dtype_of<f16_t> { static constexpr DType value = DType::kF16; };
template <> struct dtype_of<bf16_t> { static constexpr DType value = DType::kBF16; };
template <> struct dtype_of<fp8e4m3_t> { static constexpr DType value = DType::kF8E4M3; };
template <> struct dtype_of<fp8e5m2_t> { static constexpr DType value = DType::kF8E5M2; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::kI64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::kU8; };
template <>
struct dtype_of<int16_t> {
  static constexpr DType value = DType::kI16;
};
template <typename T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

// Converts `n` elements between any two dtypes on the CPU (float formats round as above;
// float -> integer truncates toward zero; integer -> float rounds to nearest).
void convert_dtype(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace troupe
