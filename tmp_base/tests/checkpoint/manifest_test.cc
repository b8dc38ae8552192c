// tests/checkpoint/manifest_test.cc — manifest JSON round trip, and the merge refusing
// parts that disagree, leave holes or partly overlap.
#include "checkpoint/manifest.h"

#include <gtest/gtest.h>

#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

ManifestPart make_part(int rank, int world, Slice box, DType dt = DType::kF32) {
  ManifestPart p;
  p.step = 5;
  p.rank = rank;
  p.world_size = world;
  p.layout = ParallelLayout{1, 1, world};
  p.coords = ParallelCoord{0, 0, rank};
  p.state = {{"rng", "abc"}};
  StoredSlice s{shard_file_name(rank), 64,  static_cast<uint64_t>(slice_numel(box)) * dtype_size(dt), box,
                0x0123456789abcdefull, rank};
  p.tensors.push_back(TensorRecord{"w", dt, Shape{4, 3}, {s}});
  return p;
}

TEST(Manifest, MergeAndJsonRoundTrip) {
  CheckpointInfo info;
  info.config_text = "[model]\nd = 8\n";
  info.data_position = {{"sample", 1024}};
  info.metadata = {{"note", "unit test"}};
  auto m = merge_parts({make_part(0, 2, {{0, 2}, {0, 3}}), make_part(1, 2, {{2, 2}, {0, 3}})}, info);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->tensors.at("w").slices.size(), 2u);
  EXPECT_EQ(m->total_bytes(), 48u);
  auto back = manifest_from_json(nlohmann::json::parse(manifest_to_json(*m).dump()), "test");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 5);
  EXPECT_EQ(back->layout, (ParallelLayout{1, 1, 2}));
  EXPECT_EQ(back->config_text, info.config_text);
  EXPECT_EQ(back->data_position["sample"], 1024);
  EXPECT_EQ(back->ranks.at(1).coords, (ParallelCoord{0, 0, 1}));
  EXPECT_EQ(back->ranks.at(1).state["rng"], "abc");
  const StoredSlice& s = back->tensors.at("w").slices.at(1);
  EXPECT_EQ(s.xxh64, 0x0123456789abcdefull);
  EXPECT_EQ(s.box, (Slice{{2, 2}, {0, 3}}));
  EXPECT_EQ(s.file, "rank_00001.bin");
}

TEST(Manifest, MergeRefusesHolesOverlapsAndDisagreement) {
  auto hole = merge_parts({make_part(0, 2, {{0, 2}, {0, 3}}), make_part(1, 2, {{3, 1}, {0, 3}})}, {});
  EXPECT_EQ(hole.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(hole.status().message().find("cover 9 of 12"), std::string::npos) << hole.status();
  auto overlap = merge_parts({make_part(0, 2, {{0, 3}, {0, 3}}), make_part(1, 2, {{2, 2}, {0, 3}})}, {});
  EXPECT_EQ(overlap.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(overlap.status().message().find("overlap"), std::string::npos) << overlap.status();
  auto dtype =
      merge_parts({make_part(0, 2, {{0, 2}, {0, 3}}), make_part(1, 2, {{2, 2}, {0, 3}}, DType::kBF16)}, {});
  EXPECT_EQ(dtype.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(dtype.status().message().find("'w'"), std::string::npos) << dtype.status();
  // Exact duplicates (a replica saved twice) are accepted.
  auto dup = merge_parts({make_part(0, 2, {{0, 4}, {0, 3}}), make_part(1, 2, {{0, 4}, {0, 3}})}, {});
  EXPECT_TRUE(dup.ok()) << dup.status();
  auto missing = merge_parts({make_part(0, 2, {{0, 4}, {0, 3}})}, {});
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
}

// The on-disk spelling of layouts and coordinates ({"pp","dp","n"} and {"stage","dp","n"})
// is the format every checkpoint so far was written in: it must read, and be written, as is.
TEST(Manifest, LayoutAndCoordinatesKeepTheirOnDiskSpelling) {
  const nlohmann::json old = nlohmann::json::parse(R"({
    "format": "troupe-checkpoint", "format_version": 1, "step": 7,
    "layout": {"pp": 2, "dp": 1, "n": 2}, "world_size": 4, "created_unix_ms": 1,
    "data_position": {}, "config_text": "", "tokenizer": null, "metadata": {},
    "ranks": [{"rank": 3, "coords": {"stage": 1, "dp": 0, "n": 1}, "state": {}}],
    "tensors": {}})");
  auto m = manifest_from_json(old, "old/manifest.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->layout, (ParallelLayout{2, 1, 2}));
  EXPECT_EQ(m->ranks.at(0).coords, (ParallelCoord{1, 0, 1}));
  const nlohmann::json again = manifest_to_json(*m);
  EXPECT_EQ(again["layout"], old["layout"]);
  EXPECT_EQ(again["ranks"][0]["coords"], old["ranks"][0]["coords"]);

  nlohmann::json bad = old;
  bad["layout"]["dp"] = 0;
  auto b = manifest_from_json(bad, "bad/manifest.json");
  EXPECT_EQ(b.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(b.status().message().find("bad/manifest.json: parallel layout pp=2,dp=0,n=2: dp must be >= 1"),
            std::string::npos)
      << b.status();
}

TEST(Manifest, MalformedJsonIsDataLossNamingTheSource) {
  auto m = manifest_from_json(nlohmann::json{{"format", "troupe-checkpoint"}, {"format_version", 1}},
                              "/x/manifest.json");
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("/x/manifest.json"), std::string::npos);
  auto v = manifest_from_json(nlohmann::json{{"format", "troupe-checkpoint"}, {"format_version", 99}}, "f");
  EXPECT_NE(v.status().message().find("format version 99"), std::string::npos) << v.status();
  auto other = manifest_from_json(nlohmann::json::array(), "f");
  EXPECT_EQ(other.status().code(), StatusCode::kDataLoss);
}

TEST(Manifest, StepDirNames) {
  EXPECT_EQ(parse_step_dir_name("step_120"), 120);
  EXPECT_FALSE(parse_step_dir_name("step_120.tmp").has_value());
  EXPECT_FALSE(parse_step_dir_name("step_").has_value());
  EXPECT_FALSE(parse_step_dir_name("latest").has_value());
  EXPECT_FALSE(parse_step_dir_name("step_3.deleting").has_value());
}

}  // namespace
}  // namespace troupe::checkpoint
