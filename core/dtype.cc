// core/dtype.cc — DType metadata and CPU conversions between number formats.
#include "core/dtype.h"

#include <cfenv>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/fp8.h"

namespace troupe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kF8E5M2: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
    case DType::kI16:
      return 2;
  }
  TROUPE_UNREACHABLE("bad dtype {}", static_cast<int>(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF8E4M3: return "fp8e4m3";
    case DType::kF8E5M2: return "fp8e5m2";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
    case DType::kI16:
      return "i16";
  }
  return "invalid";
}

std::optional<DType> dtype_from_name(std::string_view n) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI32,
                  DType::kI64, DType::kU8, DType::kI16}) {
    if (dtype_name(t) == n) return t;
  }
  if (n == "float32" || n == "fp32") return DType::kF32;
  if (n == "bfloat16") return DType::kBF16;
  if (n == "float16" || n == "fp16") return DType::kF16;
  return std::nullopt;
}

bool dtype_is_float(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16 || t == DType::kF8E4M3 ||
         t == DType::kF8E5M2;
}

namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A small binary floating-point format: 1 sign bit, `exp_bits`, `man_bits`.
struct MiniFormat {
  int exp_bits;
  int man_bits;
  bool has_inf;        // top exponent reserved for inf/NaN (IEEE style)
  bool saturate;       // finite overflow -> max finite (else -> inf)
  uint32_t max_code;   // largest finite magnitude code
  uint32_t nan_code;   // canonical NaN magnitude code
  uint32_t inf_code;   // infinity magnitude code (if has_inf)
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
};

constexpr MiniFormat kF16{5, 10, true, false, 0x7BFF, 0x7E00, 0x7C00};
constexpr MiniFormat kE4M3{4, 3, false, true, 0x7E, 0x7F, 0};
constexpr MiniFormat kE5M2{5, 2, true, true, 0x7B, 0x7F, 0x7C};

// Decodes a magnitude code (without sign) of format `fmt`.
double mini_decode_magnitude(const MiniFormat& fmt, uint32_t code) {
  const uint32_t man_mask = (1u << fmt.man_bits) - 1;
  const uint32_t e = code >> fmt.man_bits;
  const uint32_t m = code & man_mask;
  const uint32_t e_max_field = (1u << fmt.exp_bits) - 1;
  if (fmt.has_inf && e == e_max_field) {
    return m == 0 ? INFINITY : NAN;
  }
  if (!fmt.has_inf && code == fmt.nan_code) return NAN;
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - fmt.bias() - fmt.man_bits);
  return std::ldexp(static_cast<double>(m | (1u << fmt.man_bits)),
                    static_cast<int>(e) - fmt.bias() - fmt.man_bits);
}

uint32_t mini_encode(const MiniFormat& fmt, float f) {
  const uint32_t sign = (float_bits(f) >> 31) << (fmt.exp_bits + fmt.man_bits);
  if (std::isnan(f)) return sign | fmt.nan_code;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return sign | (fmt.has_inf ? fmt.inf_code : fmt.max_code);
  if (a == 0.0) return sign;
  const int emin = 1 - fmt.bias();
  int e;
  std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  e -= 1;             // a in [2^e, 2^(e+1))
  uint32_t code;
  if (e < emin) {
    // Subnormal: quantum 2^(emin - man_bits). A result of 2^man_bits is exactly the
    // smallest normal, whose code has the same bit pattern.
    const double q = std::ldexp(a, fmt.man_bits - emin);
    code = static_cast<uint32_t>(std::nearbyint(q));
  } else {
    const double q = std::ldexp(a, fmt.man_bits - e);  // in [2^m, 2^(m+1))
    uint64_t n = static_cast<uint64_t>(std::nearbyint(q));
    if (n == (uint64_t{1} << (fmt.man_bits + 1))) {
      n >>= 1;
      e += 1;
    }
    const int64_t efield = e + fmt.bias();
    const int64_t max_field = (1 << fmt.exp_bits) - 1;
    if (efield > max_field) {
      code = UINT32_MAX;  // overflow, handled below
    } else {
      code = static_cast<uint32_t>((efield << fmt.man_bits) | (n - (uint64_t{1} << fmt.man_bits)));
    }
  }
  const bool overflow = code == UINT32_MAX || code > fmt.max_code;
  if (overflow) {
    if (fmt.saturate || !fmt.has_inf) return sign | fmt.max_code;
    return sign | fmt.inf_code;
  }
  return sign | code;
}

float mini_decode(const MiniFormat& fmt, uint32_t code) {
  const uint32_t sign_bit = 1u << (fmt.exp_bits + fmt.man_bits);
  const double mag = mini_decode_magnitude(fmt, code & (sign_bit - 1));
  return static_cast<float>((code & sign_bit) ? -mag : mag);
}

// Round-to-nearest-even needs the default rounding mode; we never change it, but make
// the assumption visible.
struct RoundingModeCheck {
  RoundingModeCheck() { TROUPE_CHECK(std::fegetround() == FE_TONEAREST); }
};

}  // namespace

uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040);  // quiet NaN, keep sign
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_f16_bits(float f) { return static_cast<uint16_t>(mini_encode(kF16, f)); }
float f16_bits_to_float(uint16_t b) { return mini_decode(kF16, b); }
uint8_t float_to_fp8e4m3_bits(float f) {
  static const RoundingModeCheck check;
  return fp8e4m3_encode(f);
}
float fp8e4m3_bits_to_float(uint8_t b) { return mini_decode(kE4M3, b); }
uint8_t float_to_fp8e5m2_bits(float f) { return static_cast<uint8_t>(mini_encode(kE5M2, f)); }
float fp8e5m2_bits_to_float(uint8_t b) { return mini_decode(kE5M2, b); }

namespace {

template <typename T>
float load_as_float(const void* p, size_t i) {
  const T* t = static_cast<const T*>(p);
  if constexpr (std::is_same_v<T, float>) {
    return t[i];
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<float>(t[i]);
  } else {
    return static_cast<float>(t[i]);
  }
}

template <typename T>
void store_from_float(void* p, size_t i, float v) {
  T* t = static_cast<T*>(p);
  if constexpr (std::is_integral_v<T>) {
    t[i] = static_cast<T>(v);
  } else {
    t[i] = T(v);
  }
}

template <typename F>
void visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kF32: f(float{}); return;
    case DType::kF16: f(f16_t{}); return;
    case DType::kBF16: f(bf16_t{}); return;
    case DType::kF8E4M3: f(fp8e4m3_t{}); return;
    case DType::kF8E5M2: f(fp8e5m2_t{}); return;
    case DType::kI32: f(int32_t{}); return;
    case DType::kI64: f(int64_t{}); return;
    case DType::kU8: f(uint8_t{}); return;
    case DType::kI16:
      f(int16_t{});
      return;
  }
  TROUPE_UNREACHABLE("bad dtype");
}

}  // namespace

void convert_dtype(const void* src, DType st, void* dst, DType dt, size_t n) {
  if (n == 0) return;  // src/dst may be null for empty tensors
  if (st == dt) {
    std::memcpy(dst, src, n * dtype_size(st));
    return;
  }
  // Integer <-> integer keeps full precision.
  if (!dtype_is_float(st) && !dtype_is_float(dt)) {
    visit_dtype(st, [&](auto s) {
      using S = decltype(s);
      visit_dtype(dt, [&](auto d) {
        using D = decltype(d);
        if constexpr (std::is_integral_v<S> && std::is_integral_v<D>) {
          for (size_t i = 0; i < n; ++i) static_cast<D*>(dst)[i] = static_cast<D>(static_cast<const S*>(src)[i]);
        }
      });
    });
    return;
  }
  visit_dtype(st, [&](auto s) {
    using S = decltype(s);
    visit_dtype(dt, [&](auto d) {
      using D = decltype(d);
      for (size_t i = 0; i < n; ++i) store_from_float<D>(dst, i, load_as_float<S>(src, i));
    });
  });
}

}  // namespace troupe
