// layers/parameter.cc — Parameter allocation and deterministic initialisers.
#include "layers/parameter.h"

#include <cmath>

namespace troupe::layers {

void Parameter::allocate(const Shape& shape, bool with_decay) {
  value = Tensor::zeros(shape, DType::kF32);
  grad = Tensor::zeros(shape, DType::kF32);
  decay = with_decay;
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t hash_string(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, then mixed
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return mix64(h);
}

void init_normal(Tensor& t, uint64_t seed, const std::string& name, float std) {
  TROUPE_CHECK(t.dtype() == DType::kF32 && t.is_contiguous() && t.device().is_cpu(), "init_normal: {}",
               t.describe());
  float* p = t.data<float>();
  const int64_t n = t.numel();
  uint64_t state = mix64(seed ^ hash_string(name));
  auto uniform = [&state]() {
    state = mix64(state);
    // 53 random bits -> (0, 1]
    return (static_cast<double>(state >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  };
  for (int64_t i = 0; i < n; i += 2) {
    // Box-Muller: two normals from two uniforms.
    const double u1 = uniform(), u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    p[i] = static_cast<float>(std * r * std::cos(2.0 * M_PI * u2));
    if (i + 1 < n) p[i + 1] = static_cast<float>(std * r * std::sin(2.0 * M_PI * u2));
  }
}

void init_constant(Tensor& t, float value) { t.fill(value); }

}  // namespace troupe::layers
