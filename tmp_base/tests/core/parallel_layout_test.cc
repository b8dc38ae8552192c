// tests/core/parallel_layout_test.cc — ParallelLayout: validation, the layout-string
// parser (both forms, round trip, every kind of bad input), rank <-> coordinates, groups,
// pipeline neighbours and group names.
#include "core/parallel_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace troupe {
namespace {

// The status message of a parse that must fail with InvalidArgument.
std::string parse_error(std::string_view text) {
  Result<ParallelLayout> l = ParallelLayout::parse(text);
  EXPECT_FALSE(l.ok()) << text << " parsed as " << (l.ok() ? l->to_string() : "");
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << text;
  return l.status().message();
}

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

TEST(ParallelLayout, DefaultIsOneRank) {
  ParallelLayout l;
  EXPECT_EQ(l.pp(), 1);
  EXPECT_EQ(l.dp(), 1);
  EXPECT_EQ(l.n(), 1);
  EXPECT_EQ(l.world_size(), 1);
  EXPECT_EQ(l.to_string(), "pp=1,dp=1,n=1");
}

TEST(ParallelLayout, ParsesKeyValueInAnyOrderWithMissingPartsOne) {
  const ParallelLayout a = ParallelLayout::parse("pp=2,dp=3,n=4").value();
  EXPECT_EQ(a.pp(), 2);
  EXPECT_EQ(a.dp(), 3);
  EXPECT_EQ(a.n(), 4);
  EXPECT_EQ(a.world_size(), 24);
  EXPECT_EQ(ParallelLayout::parse("n=4,pp=2,dp=3").value(), a);
  const ParallelLayout b = ParallelLayout::parse("n=2").value();
  EXPECT_EQ(b, ParallelLayout::make(1, 1, 2).value());
  EXPECT_EQ(ParallelLayout::parse("dp=8,pp=2").value(), ParallelLayout::make(2, 8, 1).value());
}

TEST(ParallelLayout, ParsesShortForm) {
  EXPECT_EQ(ParallelLayout::parse("2x3x4").value(), ParallelLayout::make(2, 3, 4).value());
  EXPECT_EQ(ParallelLayout::parse("1x1x1").value(), ParallelLayout());
}

TEST(ParallelLayout, ToStringRoundTrips) {
  for (auto [pp, dp, n] : {std::tuple{1, 1, 1}, {2, 2, 4}, {3, 1, 8}, {1, 1000, 2}}) {
    const ParallelLayout l = ParallelLayout::make(pp, dp, n).value();
    EXPECT_EQ(l.to_string(), fmt::format("pp={},dp={},n={}", pp, dp, n));
    EXPECT_EQ(ParallelLayout::parse(l.to_string()).value(), l);
  }
}

TEST(ParallelLayout, ParseErrorsNameTheProblem) {
  EXPECT_TRUE(contains(parse_error(""), "empty"));
  EXPECT_TRUE(contains(parse_error("tp=2"), "unknown key 'tp'"));
  EXPECT_TRUE(contains(parse_error("pp=2,dispatch=alltoall"), "unknown key 'dispatch'"));
  EXPECT_TRUE(contains(parse_error("pp=0"), "pp must be >= 1, got 0"));
  EXPECT_TRUE(contains(parse_error("pp=1,dp=0"), "dp must be >= 1, got 0"));
  EXPECT_TRUE(contains(parse_error("2x1x0"), "n must be >= 1, got 0"));
  EXPECT_TRUE(contains(parse_error("n=-3"), "n must be >= 1, got -3"));
  EXPECT_TRUE(contains(parse_error("pp=two"), "pp = 'two' is not an integer"));
  EXPECT_TRUE(contains(parse_error("pp=2x"), "pp = '2x' is not an integer"));
  EXPECT_TRUE(contains(parse_error("dp=+2"), "not an integer"));
  EXPECT_TRUE(contains(parse_error("pp= 2"), "not an integer"));
  EXPECT_TRUE(contains(parse_error("2x2"), "expected pp=P,dp=D,n=N or PxDxN"));
  EXPECT_TRUE(contains(parse_error("2x2x2x2"), "expected"));
  EXPECT_TRUE(contains(parse_error("garbage"), "expected"));
  EXPECT_TRUE(contains(parse_error("2xx2"), "not an integer"));
  EXPECT_TRUE(contains(parse_error("pp=2,"), "'' is not key=value"));
  EXPECT_TRUE(contains(parse_error("pp=2,,n=2"), "is not key=value"));
  EXPECT_TRUE(contains(parse_error("pp=2,n"), "'n' is not key=value"));
  EXPECT_TRUE(contains(parse_error("=2"), "not key=value"));
  EXPECT_TRUE(contains(parse_error("pp="), "not key=value"));
  EXPECT_TRUE(contains(parse_error("pp=2,pp=3"), "key 'pp' given twice"));
  // Every message quotes the text it rejects.
  EXPECT_TRUE(contains(parse_error("pp=0"), "'pp=0'"));
}

TEST(ParallelLayout, ParseRejectsOverflow) {
  EXPECT_TRUE(contains(parse_error("pp=2147483648"), "too large"));
  EXPECT_TRUE(contains(parse_error("n=99999999999999999999999"), "too large"));
  EXPECT_TRUE(contains(parse_error("65536x65536x1"), "world size"));
  EXPECT_TRUE(contains(parse_error("pp=2147483647,n=2"), "world size"));
  EXPECT_EQ(ParallelLayout::parse("pp=2147483647").value().world_size(), 2147483647);
}

TEST(ParallelLayout, MakeValidatesEachPart) {
  EXPECT_TRUE(ParallelLayout::validate(1, 2, 3).ok());
  const Status s = ParallelLayout::validate(2, 0, 4);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "dp must be >= 1, got 0")) << s.message();
  EXPECT_TRUE(contains(s.message(), "pp=2,dp=0,n=4")) << s.message();
  EXPECT_TRUE(contains(ParallelLayout::make(-1, 1, 1).status().message(), "pp must be >= 1, got -1"));
  EXPECT_TRUE(contains(ParallelLayout::make(1, 1, int64_t{1} << 40).status().message(),
                       "n = 1099511627776 is too large"));
  EXPECT_TRUE(contains(ParallelLayout::make(1 << 16, 1 << 16, 1).status().message(), "world size"));
}

TEST(ParallelLayoutDeathTest, ConstructorChecksTheSizes) {
  EXPECT_EQ(ParallelLayout(2, 1, 4), ParallelLayout::make(2, 1, 4).value());
  EXPECT_DEATH(ParallelLayout(2, 0, 4), "dp must be >= 1, got 0");
}

TEST(ParallelLayout, LayoutItemsKeepOtherKeysAndWhichPartsWereGiven) {
  const LayoutItems a = parse_layout_items("pp=2,dispatch=allgather,n=4,compression=true").value();
  EXPECT_EQ(a.pp, 2);
  EXPECT_FALSE(a.dp.has_value());
  EXPECT_EQ(a.n, 4);
  ASSERT_EQ(a.other.size(), 2u);
  EXPECT_EQ(a.other[0], (std::pair<std::string, std::string>{"dispatch", "allgather"}));
  EXPECT_EQ(a.other[1], (std::pair<std::string, std::string>{"compression", "true"}));
  const LayoutItems b = parse_layout_items("1x2x3").value();
  EXPECT_EQ(b.pp, 1);
  EXPECT_EQ(b.dp, 2);
  EXPECT_EQ(b.n, 3);
  EXPECT_TRUE(b.other.empty());
  EXPECT_FALSE(parse_layout_items("pp=0,dispatch=alltoall").ok());
  EXPECT_FALSE(parse_layout_items("dispatch=a,dispatch=b").ok());
}

TEST(ParallelLayout, CoordinatesRoundTripWithNInnermost) {
  const ParallelLayout l = ParallelLayout::make(2, 3, 4).value();
  EXPECT_EQ(l.coord(0), (ParallelCoord{0, 0, 0}));
  EXPECT_EQ(l.coord(1), (ParallelCoord{0, 0, 1}));
  EXPECT_EQ(l.coord(4), (ParallelCoord{0, 1, 0}));
  EXPECT_EQ(l.coord(12), (ParallelCoord{1, 0, 0}));
  EXPECT_EQ(l.coord(23), (ParallelCoord{1, 2, 3}));
  for (int r = 0; r < l.world_size(); ++r) {
    const ParallelCoord c = l.coord(r);
    EXPECT_EQ((c.pp * l.dp() + c.dp) * l.n() + c.n, r);
    EXPECT_EQ(l.rank_of(c), r);
  }
  EXPECT_EQ(l.coord(23).to_string(), "pp 1, dp 2, n 3");
}

TEST(ParallelLayout, CheckedRanksAndCoordinates) {
  const ParallelLayout l = ParallelLayout::make(2, 1, 2).value();
  EXPECT_TRUE(l.check_rank(3).ok());
  EXPECT_EQ(l.check_rank(4).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(contains(l.check_rank(-1).message(), "rank -1 outside layout pp=2,dp=1,n=2"));
  EXPECT_TRUE(l.check_coord({1, 0, 1}).ok());
  EXPECT_EQ(l.check_coord({2, 0, 0}).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(l.check_coord({0, 1, 0}).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(contains(l.check_coord({0, 0, 2}).message(), "pp 0, dp 0, n 2"));
}

TEST(ParallelLayout, GroupsPartitionTheWorld) {
  const ParallelLayout l = ParallelLayout::make(2, 3, 4).value();
  EXPECT_EQ(l.n_group(5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(l.dp_group(5), (std::vector<int>{1, 5, 9}));
  EXPECT_EQ(l.pp_group(5), (std::vector<int>{5, 17}));
  for (auto group_of : {&ParallelLayout::dp_group, &ParallelLayout::n_group, &ParallelLayout::pp_group}) {
    std::set<std::vector<int>> groups;
    for (int r = 0; r < l.world_size(); ++r) {
      auto g = (l.*group_of)(r);
      // r's position in its group is its coordinate; every member names the same group.
      EXPECT_NE(std::find(g.begin(), g.end(), r), g.end());
      for (int m : g) EXPECT_EQ((l.*group_of)(m), g);
      groups.insert(g);
    }
    size_t members = 0;
    for (const auto& g : groups) members += g.size();
    EXPECT_EQ(members, 24u);  // disjoint groups that cover every rank
  }
  EXPECT_EQ(l.dp_group_name(5), l.dp_group_name(9));
  EXPECT_NE(l.dp_group_name(5), l.dp_group_name(6));
  EXPECT_EQ(l.n_group_name(4), l.n_group_name(7));
  EXPECT_NE(l.n_group_name(4), l.n_group_name(8));
  EXPECT_EQ(l.pp_group_name(5), l.pp_group_name(17));
  EXPECT_NE(l.pp_group_name(5), l.pp_group_name(4));
}

TEST(ParallelLayout, PipelineNeighbours) {
  const ParallelLayout l = ParallelLayout::make(3, 2, 2).value();
  EXPECT_FALSE(l.prev_stage(1).has_value());
  EXPECT_EQ(l.next_stage(1), 5);
  EXPECT_EQ(l.prev_stage(5), 1);
  EXPECT_EQ(l.next_stage(5), 9);
  EXPECT_FALSE(l.next_stage(9).has_value());
}

}  // namespace
}  // namespace troupe
