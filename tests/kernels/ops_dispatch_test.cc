// tests/kernels/ops_dispatch_test.cc — the dispatcher of kernels/ops.h: bad shapes, dtypes
// or devices abort with a message naming the op and its tensors, and an op a backend
// lacks aborts saying so.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace troupe::kernels
