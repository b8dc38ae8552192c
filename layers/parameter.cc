// layers/parameter.cc — Parameter allocation and deterministic initialisers.
#include "layers/parameter.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

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

void init_normal(Tensor& t, uint64_t seed, const std::string& name, float std, int64_t first_element) {
  TROUPE_CHECK(t.dtype() == DType::kF32 && t.is_contiguous() && t.device().is_cpu(), "init_normal: {}",
               t.describe());
  TROUPE_CHECK_GE(first_element, 0);
  float* p = t.data<float>();
  const int64_t n = t.numel();
  const uint64_t base = mix64(seed ^ hash_string(name));
  // 53 random bits of counter c -> (0, 1].
  auto uniform = [base](uint64_t c) {
    return (static_cast<double>(mix64(base + c) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  };
  auto fill = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      // Box-Muller over the pair (2q, 2q+1) of global element g: cos for even g, sin for odd.
      const uint64_t g = static_cast<uint64_t>(first_element + i), q = g / 2;
      const double r = std::sqrt(-2.0 * std::log(uniform(2 * q)));
      const double a = 2.0 * M_PI * uniform(2 * q + 1);
      p[i] = static_cast<float>(std * r * (g % 2 == 0 ? std::cos(a) : std::sin(a)));
    }
  };
  // Every element is a function of (seed, name, index) alone, so large tensors are split
  // over threads (bench_1b's 1.3 B elements: ~40 s on one core) with identical results.
  constexpr int64_t kPerThread = int64_t{1} << 22;
  const int64_t threads = std::min<int64_t>(std::max<unsigned>(1, std::thread::hardware_concurrency()),
                                            (n + kPerThread - 1) / kPerThread);
  if (threads <= 1) {
    fill(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t lo = t * chunk, hi = std::min(n, lo + chunk);
    if (lo < hi) pool.emplace_back(fill, lo, hi);
  }
  for (std::thread& th : pool) th.join();
}

void init_normal_rows(Tensor& t, uint64_t seed, const std::string& name, float std, int64_t first_row) {
  TROUPE_CHECK(t.dim() >= 1, "init_normal_rows: '{}' needs a tensor with rows, got {}", name, t.describe());
  TROUPE_CHECK_GE(first_row, 0);
  const int64_t row = t.size(0) > 0 ? t.numel() / t.size(0) : 0;
  init_normal(t, seed, name, std, first_row * row);
}

void init_constant(Tensor& t, float value) { t.fill(value); }

}  // namespace troupe::layers
