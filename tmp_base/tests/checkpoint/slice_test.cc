// tests/checkpoint/slice_test.cc — box arithmetic and copy_region against a plain
// element-by-element reference.
#include "checkpoint/slice.h"

#include <gtest/gtest.h>

#include <random>

#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

TEST(Slice, IntersectAndShape) {
  Slice a{{0, 4}, {2, 6}};
  Slice b{{2, 4}, {0, 3}};
  auto c = intersect(a, b);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, (Slice{{2, 2}, {2, 1}}));
  EXPECT_EQ(slice_shape(*c), (Shape{2, 1}));
  EXPECT_EQ(slice_to_string(a), "[0:4, 2:8]");
  EXPECT_FALSE(intersect(Slice{{0, 2}}, Slice{{2, 2}}).has_value());
  EXPECT_EQ(slice_numel(Slice{}), 1);  // a scalar has one element
}

TEST(Slice, CheckWithinNamesTheTensor) {
  Status st = check_slice_within(Slice{{0, 5}}, Shape{4}, "tensor 'w'");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tensor 'w'"), std::string::npos) << st.message();
  EXPECT_FALSE(check_slice_within(Slice{{0, 2}}, Shape{4, 4}, "x").ok());
  EXPECT_TRUE(check_slice_within(Slice{{1, 3}, {0, 4}}, Shape{4, 4}, "x").ok());
}

// Random boxes in a 3-D index space; the copied region is checked against a loop that
// computes every element's position from its global index.
TEST(Slice, CopyRegionMatchesReference) {
  std::mt19937 rng(7);
  const Shape global{5, 6, 7};
  auto random_box = [&]() {
    Slice s;
    for (int64_t d : global) {
      const int64_t a = std::uniform_int_distribution<int64_t>(0, d - 1)(rng);
      const int64_t b = std::uniform_int_distribution<int64_t>(a + 1, d)(rng);
      s.push_back(Range{a, b - a});
    }
    return s;
  };
  auto value = [&](int64_t i, int64_t j, int64_t k) { return static_cast<int32_t>(i * 10000 + j * 100 + k); };
  for (int trial = 0; trial < 300; ++trial) {
    const Slice src = random_box(), dst = random_box();
    auto region = intersect(src, dst);
    if (!region) continue;
    std::vector<int32_t> sbuf(static_cast<size_t>(slice_numel(src)));
    for (int64_t i = 0; i < src[0].length; ++i)
      for (int64_t j = 0; j < src[1].length; ++j)
        for (int64_t k = 0; k < src[2].length; ++k)
          sbuf[static_cast<size_t>((i * src[1].length + j) * src[2].length + k)] =
              value(src[0].start + i, src[1].start + j, src[2].start + k);
    std::vector<int32_t> dbuf(static_cast<size_t>(slice_numel(dst)), -1);
    copy_region(reinterpret_cast<const std::byte*>(sbuf.data()), src,
                reinterpret_cast<std::byte*>(dbuf.data()), dst, *region, sizeof(int32_t));
    for (int64_t i = 0; i < dst[0].length; ++i)
      for (int64_t j = 0; j < dst[1].length; ++j)
        for (int64_t k = 0; k < dst[2].length; ++k) {
          const int64_t gi = dst[0].start + i, gj = dst[1].start + j, gk = dst[2].start + k;
          const bool inside = gi >= (*region)[0].start && gi < (*region)[0].end() &&
                              gj >= (*region)[1].start && gj < (*region)[1].end() &&
                              gk >= (*region)[2].start && gk < (*region)[2].end();
          const int32_t got = dbuf[static_cast<size_t>((i * dst[1].length + j) * dst[2].length + k)];
          ASSERT_EQ(got, inside ? value(gi, gj, gk) : -1)
              << "trial " << trial << " src " << slice_to_string(src) << " dst " << slice_to_string(dst);
        }
  }
}

TEST(Slice, CopyRegionScalar) {
  const double src = 3.25;
  double dst = 0;
  copy_region(reinterpret_cast<const std::byte*>(&src), Slice{}, reinterpret_cast<std::byte*>(&dst), Slice{},
              Slice{}, sizeof(double));
  EXPECT_EQ(dst, 3.25);
}

}  // namespace
}  // namespace troupe::checkpoint
