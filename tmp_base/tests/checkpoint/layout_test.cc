// tests/checkpoint/layout_test.cc — the owned/saved slices of every placement (the rank
// numbering itself: tests/core/parallel_layout_test.cc): saved slices tile each tensor exactly once, owned
// slices give every rank what its layout says it holds.
#include "checkpoint/layout.h"

#include <gtest/gtest.h>

#include <map>

#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

std::vector<ParallelCoord> all_coords(const ParallelLayout& l) {
  std::vector<ParallelCoord> out;
  for (int r = 0; r < l.world_size(); ++r) out.push_back(l.coord(r));
  return out;
}

TEST(Layout, CoordinatesOutsideTheLayoutAreRefused) {
  auto s = owned_slice("x", Shape{4}, TensorPlacement::replicated(), ParallelLayout{1, 2, 1},
                       ParallelCoord{0, 2, 0});
  EXPECT_EQ(s.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.status().message().find("pp 0, dp 2, n 0"), std::string::npos) << s.status();
}

TEST(Layout, ExpertShardedOwnsAContiguousExpertBlock) {
  const ParallelLayout l{1, 2, 4};
  auto s = owned_slice("w1", Shape{8, 3, 5}, TensorPlacement::experts(0), l, ParallelCoord{0, 1, 2});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(s->has_value());
  EXPECT_EQ(**s, (Slice{{4, 2}, {0, 3}, {0, 5}}));
  // dp rank 1 holds it but does not save it.
  auto saved = save_slice("w1", Shape{8, 3, 5}, TensorPlacement::experts(0), l, ParallelCoord{0, 1, 2});
  ASSERT_TRUE(saved.ok());
  EXPECT_FALSE(saved->has_value());
}

TEST(Layout, BadPlacementsAreRefusedByName) {
  auto e = owned_slice("layers.0.experts.w1", Shape{6, 4}, TensorPlacement::experts(0),
                       ParallelLayout{1, 1, 4}, ParallelCoord{});
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("layers.0.experts.w1"), std::string::npos) << e.status();
  EXPECT_NE(e.status().message().find("6 experts"), std::string::npos) << e.status();
  auto st =
      owned_slice("x", Shape{4}, TensorPlacement::replicated(2), ParallelLayout{2, 1, 1}, ParallelCoord{});
  EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument);
  auto z = owned_slice("opt", Shape{4, 4}, TensorPlacement::zero(0, false, 0, 16), ParallelLayout{},
                       ParallelCoord{});
  EXPECT_EQ(z.status().code(), StatusCode::kInvalidArgument);
  auto zo = owned_slice("opt", Shape{16}, TensorPlacement::zero(0, false, 8, 16), ParallelLayout{},
                        ParallelCoord{});
  EXPECT_EQ(zo.status().code(), StatusCode::kInvalidArgument);
}

TEST(Layout, DpFlatShardsTile) {
  for (int64_t total : {0, 1, 7, 64, 101}) {
    for (int dp : {1, 2, 3, 8}) {
      int64_t next = 0;
      for (int r = 0; r < dp; ++r) {
        Range s = dp_flat_shard(total, dp, r);
        EXPECT_EQ(s.start, next);
        next = s.end();
      }
      EXPECT_EQ(next, total);
    }
  }
}

// Across all ranks of each layout, save_slice() writes every element of every placement
// exactly once, and owned_slice() gives each (stage, n) its replica.
TEST(Layout, SavedSlicesTileEveryTensorExactlyOnce) {
  struct Case {
    std::string name;
    Shape shape;
    TensorPlacement p;
  };
  for (ParallelLayout l : {ParallelLayout{1, 1, 1}, ParallelLayout{2, 1, 2}, ParallelLayout{1, 2, 4},
                           ParallelLayout{2, 2, 2}, ParallelLayout{1, 3, 1}}) {
    const int64_t experts_local = 8 / l.n();
    // The ZeRO buffer of a (stage 0, n rank): 10 replicated elements, then the local experts.
    const int64_t total = 10 + experts_local * 6;
    std::vector<Case> cases = {
        {"attn", {4, 6}, TensorPlacement::replicated(0)},
        {"last", {3}, TensorPlacement::replicated(l.pp() - 1)},
        {"everywhere", {}, TensorPlacement::replicated()},
        {"experts", {8, 2, 3}, TensorPlacement::experts(0)},
        {"opt.attn", {10}, TensorPlacement::zero(0, false, 0, total)},
        {"opt.experts", {48}, TensorPlacement::zero(0, true, 10, total)},
    };
    for (const Case& c : cases) {
      std::vector<int> count(static_cast<size_t>(shape_numel(c.shape)), 0);
      const Shape strides = contiguous_strides(c.shape);
      for (const ParallelCoord& rc : all_coords(l)) {
        auto s = save_slice(c.name, c.shape, c.p, l, rc);
        ASSERT_TRUE(s.ok()) << s.status();
        if (!s->has_value()) continue;
        const Slice& box = **s;
        // Walk the box.
        std::vector<int64_t> idx(box.size(), 0);
        for (int64_t e = 0; e < slice_numel(box); ++e) {
          int64_t rem = e, flat = 0;
          for (size_t d = box.size(); d-- > 0;) {
            flat += (box[d].start + rem % box[d].length) * strides[d];
            rem /= box[d].length;
          }
          ++count[static_cast<size_t>(flat)];
        }
      }
      for (size_t i = 0; i < count.size(); ++i) {
        ASSERT_EQ(count[i], 1) << c.name << " element " << i << " at layout " << l.to_string();
      }
    }
  }
}

}  // namespace
}  // namespace troupe::checkpoint
