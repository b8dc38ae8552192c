// tests/comm/comm_layout_test.cc — ParallelLayout: coordinates, groups, pipeline
// neighbours and group names for pp x dp x n layouts.
#include <gtest/gtest.h>

#include <set>

#include "comm/parallel_layout.h"

namespace troupe::comm {
namespace {

TEST(ParallelLayout, CoordinatesRoundTripWithNInnermost) {
  auto l = ParallelLayout::make(2, 3, 4).value();
  EXPECT_EQ(l.world_size(), 24);
  EXPECT_EQ(l.coord(0), (ParallelCoord{0, 0, 0}));
  EXPECT_EQ(l.coord(1), (ParallelCoord{0, 0, 1}));
  EXPECT_EQ(l.coord(4), (ParallelCoord{0, 1, 0}));
  EXPECT_EQ(l.coord(12), (ParallelCoord{1, 0, 0}));
  EXPECT_EQ(l.coord(23), (ParallelCoord{1, 2, 3}));
  for (int r = 0; r < l.world_size(); ++r) EXPECT_EQ(l.rank_of(l.coord(r)), r);
  EXPECT_EQ(l.to_string(), "pp2 x dp3 x n4");
}

TEST(ParallelLayout, GroupsPartitionTheWorld) {
  auto l = ParallelLayout::make(2, 3, 4).value();
  EXPECT_EQ(l.n_group(5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(l.dp_group(5), (std::vector<int>{1, 5, 9}));
  EXPECT_EQ(l.pp_group(5), (std::vector<int>{5, 17}));
  for (auto group_of : {&ParallelLayout::dp_group, &ParallelLayout::n_group, &ParallelLayout::pp_group}) {
    std::set<int> seen;
    for (int r = 0; r < l.world_size(); ++r) {
      auto g = (l.*group_of)(r);
      // r's position in its group is its coordinate; every member names the same group.
      EXPECT_NE(std::find(g.begin(), g.end(), r), g.end());
      for (int m : g) EXPECT_EQ((l.*group_of)(m), g);
      seen.insert(r);
    }
    EXPECT_EQ(seen.size(), 24u);
  }
  EXPECT_EQ(l.dp_group_name(5), l.dp_group_name(9));
  EXPECT_NE(l.dp_group_name(5), l.dp_group_name(6));
  EXPECT_EQ(l.n_group_name(4), l.n_group_name(7));
  EXPECT_NE(l.n_group_name(4), l.n_group_name(8));
}

TEST(ParallelLayout, PipelineNeighbours) {
  auto l = ParallelLayout::make(3, 2, 2).value();
  EXPECT_FALSE(l.prev_stage(1).has_value());
  EXPECT_EQ(l.next_stage(1), 5);
  EXPECT_EQ(l.prev_stage(5), 1);
  EXPECT_EQ(l.next_stage(5), 9);
  EXPECT_FALSE(l.next_stage(9).has_value());
}

TEST(ParallelLayout, RejectsBadSizes) {
  EXPECT_EQ(ParallelLayout::make(0, 1, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParallelLayout::make(1, -2, 1).status().code(), StatusCode::kInvalidArgument);
  auto l = ParallelLayout::make(1, 1, 2).value();
  CommSpec base;
  EXPECT_EQ(make_process_groups(l, 2, base, nullptr).status().code(), StatusCode::kInvalidArgument);
  // Group membership: the factory sees rank = index in the group, size = group size.
  CommSpec seen;
  CommFactory record = [&](const CommSpec& s) -> Result<std::unique_ptr<Communicator>> {
    seen = s;
    return unimplemented("recording factory");
  };
  EXPECT_EQ(make_group_communicator(base, "g", {7, 3, 5}, 5, record).status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(seen.name, "g");
  EXPECT_EQ(seen.rank, 2);
  EXPECT_EQ(seen.size, 3);
  EXPECT_EQ(make_group_communicator(base, "g", {7, 3}, 5, record).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_group_communicator(base, "g", {7, 7}, 7, record).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace troupe::comm
