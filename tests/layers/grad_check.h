// tests/layers/grad_check.h — the finite-difference helpers the CPU gradient suites share
// (layers_grad_test: the hand-written backwards; autograd_test: the tape's): seeded random
// tensors, an inner product for the loss <y, R>, and check_grad, which compares an analytic
// gradient with central differences at up to `samples` entries.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace troupe::layers::testing {

inline Tensor random_tensor(const Shape& shape, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (auto& x : v) x = n(rng);
  return Tensor::from_floats(shape, v);
}

inline double dot(const Tensor& a, const Tensor& b) {
  const auto x = a.to_floats(), y = b.to_floats();
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += static_cast<double>(x[i]) * y[i];
  return s;
}

// Compares `analytic` (the gradient of loss() w.r.t. `x`) with central differences at up
// to `samples` entries. loss() must re-run the forward from the current values of x.
inline void check_grad(const std::string& what, Tensor& x, const Tensor& analytic,
                       const std::function<double()>& loss, int samples = 16, float h = 1e-2f) {
  ASSERT_EQ(x.numel(), analytic.numel()) << what;
  const std::vector<float> g = analytic.to_floats();
  double gmax = 0;
  for (float v : g) gmax = std::max(gmax, static_cast<double>(std::abs(v)));
  ASSERT_GT(gmax, 0.0) << what << ": analytic gradient is all zero";
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(what)));
  float* p = x.data<float>();
  const int64_t n = x.numel();
  for (int s = 0; s < samples && s < n; ++s) {
    const int64_t i = n <= samples ? s : static_cast<int64_t>(rng() % static_cast<uint32_t>(n));
    const float v = p[i];
    p[i] = v + h;
    const double lp = loss();
    p[i] = v - h;
    const double lm = loss();
    p[i] = v;
    const double num = (lp - lm) / (2.0 * h);
    EXPECT_NEAR(num, g[static_cast<size_t>(i)], 1e-2 * gmax + 3e-4) << what << "[" << i << "]";
  }
}

}  // namespace troupe::layers::testing
