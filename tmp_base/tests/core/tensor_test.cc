// tests/core/tensor_test.cc — Tensor creation, views, copies and allocator accounting.
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <numeric>

namespace troupe {
namespace {

Tensor iota(const Shape& s) {
  std::vector<float> v(static_cast<size_t>(shape_numel(s)));
  std::iota(v.begin(), v.end(), 0.0f);
  return Tensor::from_floats(s, v);
}

TEST(Tensor, ShapeAndStrides) {
  Tensor t = iota({2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "f32[2, 3, 4] cpu");
  EXPECT_EQ(t.item({1, 2, 3}), 23.0f);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = iota({4, 6});
  Tensor row = t.select(0, 2);
  EXPECT_EQ(row.shape(), (Shape{6}));
  EXPECT_EQ(row.item({0}), 12.0f);
  Tensor cols = t.narrow(1, 2, 3);
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.item({3, 0}), 20.0f);
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.item({5, 1}), 11.0f);
  row.data<float>()[0] = -1.0f;
  EXPECT_EQ(t.item({2, 0}), -1.0f);
  Tensor v = t.view({2, -1});
  EXPECT_EQ(v.shape(), (Shape{2, 12}));
}

TEST(Tensor, ContiguousCopyOfTranspose) {
  Tensor t = iota({2, 3});
  Tensor c = t.transpose(0, 1).contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_floats(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(Tensor, DTypeConversionAndFill) {
  Tensor t = iota({5});
  Tensor b = t.to_dtype(DType::kBF16);
  EXPECT_EQ(b.element_size(), 2u);
  EXPECT_EQ(b.to_floats(), t.to_floats());
  b.fill(2.5f);
  EXPECT_EQ(b.to_floats(), std::vector<float>(5, 2.5f));
}

TEST(Allocator, CountsBytes) {
  CpuAllocator a;
  {
    Tensor t = Tensor::empty({1000}, DType::kF32, a);
    EXPECT_EQ(a.bytes_in_use(), 4000u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
  }
  EXPECT_EQ(a.bytes_in_use(), 0u);
  EXPECT_EQ(a.peak_bytes_in_use(), 4000u);
}

TEST(Device, Parse) {
  EXPECT_EQ(*Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(*Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_FALSE(Device::parse("gpu").ok());
  EXPECT_FALSE(Device::parse("cuda:x").ok());
}

}  // namespace
}  // namespace troupe
