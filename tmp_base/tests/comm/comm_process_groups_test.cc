// tests/comm/comm_process_groups_test.cc — make_process_groups / make_group_communicator:
// argument checks and the group a factory is asked for (rank = index in the group). The
// layout arithmetic itself is tested in tests/core/parallel_layout_test.cc; groups over
// real Gloo communicators in comm_gloo_test (GlooGroups).
#include <gtest/gtest.h>

#include "comm/process_groups.h"

namespace troupe::comm {
namespace {

TEST(ProcessGroups, RejectsBadArguments) {
  auto l = ParallelLayout::make(1, 1, 2).value();
  CommSpec base;
  CommFactory never = [](const CommSpec&) -> Result<std::unique_ptr<Communicator>> {
    return internal_error("factory called");
  };
  EXPECT_EQ(make_process_groups(l, 0, base, nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_process_groups(l, 2, base, never).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_process_groups(l, -1, base, never).status().code(), StatusCode::kInvalidArgument);
}

TEST(ProcessGroups, GroupMembershipIsTheIndexInTheGroup) {
  CommSpec base;
  CommSpec seen;
  CommFactory record = [&](const CommSpec& s) -> Result<std::unique_ptr<Communicator>> {
    seen = s;
    return unimplemented("recording factory");
  };
  EXPECT_EQ(make_group_communicator(base, "g", {7, 3, 5}, 5, record).status().code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ(seen.name, "g");
  EXPECT_EQ(seen.rank, 2);
  EXPECT_EQ(seen.size, 3);
  EXPECT_EQ(make_group_communicator(base, "g", {7, 3}, 5, record).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(make_group_communicator(base, "g", {7, 7}, 7, record).status().code(),
            StatusCode::kInvalidArgument);
  // make_process_groups asks for the dp group first, named after the layout's group.
  auto l = ParallelLayout::make(2, 3, 4).value();
  EXPECT_EQ(make_process_groups(l, 5, base, record).status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(seen.name, l.dp_group_name(5));
  EXPECT_EQ(seen.rank, 1);  // rank 5 is dp 1 of the group {1, 5, 9}
  EXPECT_EQ(seen.size, 3);
}

}  // namespace
}  // namespace troupe::comm
