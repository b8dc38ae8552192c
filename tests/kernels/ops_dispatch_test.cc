// tests/kernels/ops_dispatch_test.cc — the dispatcher of kernels/ops.h: bad shapes, dtypes
// or devices abort with a message naming the op and its tensors, and an op a backend
// lacks aborts saying so. Also the CPU contract of the folded gradient norm:
// grouped_matmul_backward's dw_sum_squares slots and sum_squares_into's plain sums.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/ops.h"

namespace troupe::kernels {
namespace {

TEST(OpsDispatchDeathTest, MatmulInnerDimensionMismatchNamesOpAndShapes) {
  Tensor a = Tensor::zeros({2, 4}, DType::kF32), b = Tensor::zeros({5, 3}, DType::kF32);
  Tensor out = Tensor::zeros({2, 3}, DType::kF32);
  EXPECT_DEATH(matmul(Exec::cpu(), a, b, out),
               R"(op matmul: inner dimensions differ \(4 vs 5\).*a f32\[2, 4\] cpu, b f32\[5, 3\] cpu)");
}

TEST(OpsDispatchDeathTest, WrongOutputShapeAndDtype) {
  Tensor x = Tensor::zeros({3, 8}, DType::kF32), w = Tensor::zeros({8}, DType::kF32);
  Tensor y = Tensor::zeros({3, 7}, DType::kF32), rstd = Tensor::zeros({3}, DType::kF32);
  EXPECT_DEATH(rmsnorm_forward(Exec::cpu(), x, w, 1e-5f, y, rstd),
               R"(op rmsnorm_forward: y has shape \[3, 7\], expected \[3, 8\])");
  Tensor ids = Tensor::zeros({3}, DType::kF32), table = Tensor::zeros({5, 4}, DType::kF32);
  Tensor emb = Tensor::zeros({3, 4}, DType::kF32);
  EXPECT_DEATH(embedding_forward(Exec::cpu(), ids, table, emb),
               "op embedding_forward: ids must be i32, not f32");
}

TEST(OpsDispatchDeathTest, DataDependentChecksInTheCpuBackend) {
  Tensor offsets = Tensor::from_ints({3}, std::vector<int32_t>{0, 4, 3});
  Tensor x = Tensor::zeros({3, 2}, DType::kF32), w = Tensor::zeros({2, 2, 2}, DType::kF32);
  Tensor out = Tensor::zeros({3, 2}, DType::kF32);
  EXPECT_DEATH(grouped_matmul(Exec::cpu(), x, w, offsets, out),
               "grouped_matmul: offsets decrease at expert 1");
}

TEST(OpsDispatchDeathTest, MissingBackendOrWrongDevice) {
  Tensor t = Tensor::zeros({4}, DType::kF32);
  Exec cuda_ex{Device::cuda(0), nullptr};
  if (cuda_backend() == nullptr) {
    EXPECT_DEATH(fill(cuda_ex, t, 1.0f), "op fill is not available on cuda:0");
  } else {
    // A host tensor given to a CUDA op is the caller's bug.
    EXPECT_DEATH(fill(cuda_ex, t, 1.0f), "op fill: out is on cpu but the op runs on cuda:0");
  }
}

TEST(OpsDispatch, ValidCallsRunOnTheCpuBackend) {
  EXPECT_STREQ(cpu_backend().name, "cpu");
  Tensor a = Tensor::from_floats({2, 2}, std::vector<float>{1, 2, 3, 4});
  Tensor b = Tensor::from_floats({2, 2}, std::vector<float>{5, 6, 7, 8});
  Tensor out = Tensor::empty({2, 2}, DType::kF32);
  matmul(Exec::cpu(), a, b, out);
  EXPECT_EQ(out.to_floats(), (std::vector<float>{19, 22, 43, 50}));
  EXPECT_DOUBLE_EQ(sum(Exec::cpu(), out), 134.0);
  // bf16 storage is accepted and converted (the CUDA backend's activation format).
  Tensor a16 = a.to_dtype(DType::kBF16), out16 = Tensor::empty({2, 2}, DType::kBF16);
  matmul(Exec::cpu(), a16, b, out16, /*trans_a=*/true);
  EXPECT_EQ(out16.to_floats(), (std::vector<float>{26, 30, 38, 44}));
}

Tensor random_f32(const Shape& shape, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = u(gen);
  return Tensor::from_floats(shape, v);
}

TEST(OpsDispatch, GroupedMatmulDwSumSquaresSlotsCount) {
  // 8 slots per 128 x 256 tile of the larger of the two tilings, whatever the orientation.
  EXPECT_EQ(grouped_matmul_dw_sum_squares_slots(16, 1024, 4096), 8 * 16 * 128);  // bench_1b w1
  EXPECT_EQ(grouped_matmul_dw_sum_squares_slots(16, 2048, 1024), 8 * 16 * 64);   // bench_1b w2
  EXPECT_EQ(grouped_matmul_dw_sum_squares_slots(5, 72, 136), 8 * 5 * 2);         // [1 x 1] or [2 x 1] tiles
  for (auto [k, n] : {std::pair<int64_t, int64_t>{200, 264}, {8, 1000}, {129, 257}})
    EXPECT_EQ(grouped_matmul_dw_sum_squares_slots(3, k, n), grouped_matmul_dw_sum_squares_slots(3, n, k));
  EXPECT_EQ(grouped_matmul_dw_sum_squares_slots(0, 64, 64), 1);  // always a slot 0
}

// The written dW's sum of squares lands in the slots (slot 0 on the CPU, the rest zero),
// and the dW itself is what the call without slots writes, empty experts included.
TEST(OpsDispatch, GroupedMatmulDwSumSquaresOnCpu) {
  const Exec cpu = Exec::cpu();
  const std::vector<int32_t> off = {0, 5, 5, 12, 20};  // expert 1 gets no rows
  const int64_t experts = 4, rows = 20, k = 6, n = 9;
  Tensor offsets = Tensor::from_ints({experts + 1}, off);
  for (bool trans : {false, true}) {
    const Shape ws = trans ? Shape{experts, n, k} : Shape{experts, k, n};
    Tensor x = random_f32({rows, k}, 1), w = random_f32(ws, 2), dout = random_f32({rows, n}, 3);
    Tensor dw_plain = Tensor::empty(ws, DType::kF32), dw = Tensor::empty(ws, DType::kF32);
    dw.fill(std::nanf(""));  // every element written
    grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, &dw_plain, trans, false);
    Tensor slots = Tensor::empty({grouped_matmul_dw_sum_squares_slots(experts, k, n)}, DType::kF32);
    slots.fill(std::nanf(""));
    grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, &dw, trans, false, &slots);
    EXPECT_EQ(dw.to_floats(), dw_plain.to_floats());
    double want = 0;
    for (float v : dw.to_floats()) want += static_cast<double>(v) * v;
    const std::vector<float> got = slots.to_floats();
    double total = 0;
    for (float v : got) total += v;
    EXPECT_GT(want, 1.0);
    EXPECT_NEAR(total, want, 1e-6 * want) << (trans ? "trans_w" : "w");
    for (size_t i = 1; i < got.size(); ++i) EXPECT_EQ(got[i], 0.0f) << i;
  }
}

TEST(OpsDispatchDeathTest, GroupedMatmulDwSumSquaresNeedsAWrittenDw) {
  const Exec cpu = Exec::cpu();
  Tensor offsets = Tensor::from_ints({3}, std::vector<int32_t>{0, 2, 3});
  Tensor x = Tensor::zeros({3, 4}, DType::kF32), w = Tensor::zeros({2, 4, 8}, DType::kF32);
  Tensor dout = Tensor::zeros({3, 8}, DType::kF32), dw = Tensor::zeros({2, 4, 8}, DType::kF32);
  Tensor slots = Tensor::zeros({grouped_matmul_dw_sum_squares_slots(2, 4, 8)}, DType::kF32);
  EXPECT_DEATH(grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, &dw, false, true, &slots),
               "op grouped_matmul_backward: dw_sum_squares needs a written dW \\(accumulate_dw = false\\)");
  EXPECT_DEATH(grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, nullptr, false, false, &slots),
               "op grouped_matmul_backward: dw_sum_squares needs dw");
  Tensor short_slots = Tensor::zeros({3}, DType::kF32);
  EXPECT_DEATH(grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, &dw, false, false, &short_slots),
               "op grouped_matmul_backward: dw_sum_squares has shape \\[3\\], expected \\[16\\]");
}

TEST(OpsDispatch, SumSquaresIntoAddsPlainSums) {
  const Exec cpu = Exec::cpu();
  Tensor a = Tensor::from_floats({3}, std::vector<float>{1, -2, 3});
  Tensor b = Tensor::from_floats({2}, std::vector<float>{0.5f, -4});
  Tensor s = Tensor::from_floats({2}, std::vector<float>{10, 0.25f});
  Tensor out = Tensor::from_floats({1}, std::vector<float>{100});
  const std::vector<const Tensor*> squares = {&a, &b}, sums = {&s};
  sum_squares_into(cpu, squares, out, /*accumulate=*/false, sums);
  EXPECT_FLOAT_EQ(out.to_floats()[0], 14.0f + 16.25f + 10.25f);
  sum_squares_into(cpu, squares, out, /*accumulate=*/true, sums);
  EXPECT_FLOAT_EQ(out.to_floats()[0], 2 * (14.0f + 16.25f + 10.25f));
  sum_squares_into(cpu, {}, out, /*accumulate=*/false, sums);
  EXPECT_FLOAT_EQ(out.to_floats()[0], 10.25f);
}

}  // namespace
}  // namespace troupe::kernels
