// tests/data/token_data_test.cc — shard files and the deterministic DataLoader.
#include "data/token_data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

namespace troupe::layers {
namespace {

std::vector<std::string>& created_dirs() {
  static std::vector<std::string> dirs;
  return dirs;
}

// Removes the directories the tests created once they have all run.
class RemoveCreatedDirs : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& d : created_dirs()) std::filesystem::remove_all(d);
  }
};
[[maybe_unused]] ::testing::Environment* const kCleanup = ::testing::AddGlobalTestEnvironment(new RemoveCreatedDirs);

std::string make_data(const std::string& name, int token_bytes, int64_t n, int64_t shard_tokens) {
  const std::string dir = ::testing::TempDir() + "/troupe_shards_" + std::to_string(getpid()) + "_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  created_dirs().push_back(dir);
  ShardWriter w(dir, "train", token_bytes, shard_tokens);
  std::vector<int32_t> toks;
  for (int64_t i = 0; i < n; ++i) toks.push_back(static_cast<int32_t>((i * 7) % 60000));
  EXPECT_TRUE(w.append(toks).ok());
  EXPECT_TRUE(w.finish().ok());
  return dir;
}

TEST(TokenShards, ReadsAcrossShardBoundaries) {
  for (int tb : {2, 4}) {
    const std::string dir = make_data("shards" + std::to_string(tb), tb, 1000, 300);
    auto ts = TokenShards::open(dir, "train");
    ASSERT_TRUE(ts.ok()) << ts.status().to_string();
    EXPECT_EQ(ts->size(), 1000);
    std::vector<int32_t> out(200);
    ts->read(250, 200, out.data());  // spans shards 0 and 1
    for (int64_t i = 0; i < 200; ++i) EXPECT_EQ(out[static_cast<size_t>(i)], ((250 + i) * 7) % 60000);
  }
}

TEST(TokenShards, ErrorsNameTheProblem) {
  auto missing = TokenShards::open(::testing::TempDir() + "/no_such_dir", "train");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("does not exist"), std::string::npos);
  const std::string dir = make_data("shards_val", 2, 100, 1000);
  EXPECT_EQ(TokenShards::open(dir, "val").status().code(), StatusCode::kNotFound);
  std::ofstream(dir + "/val-00000.bin") << "TRPTOKS1 but truncated";
  EXPECT_EQ(TokenShards::open(dir, "val").status().code(), StatusCode::kDataLoss);
}

TEST(DataLoader, SameInputsSameBatchesAndTargetsShifted) {
  const std::string dir = make_data("loader", 2, 5000, 100000);
  auto ts = TokenShards::open(dir, "train");
  ASSERT_TRUE(ts.ok());
  DataLoader a(*ts, 42, 16), b(*ts, 42, 16), other(*ts, 43, 16);
  Tensor i1, t1, i2, t2, i3, t3;
  a.train_batch(5, 0, 1, 2, 4, i1, t1);
  b.train_batch(5, 0, 1, 2, 4, i2, t2);
  other.train_batch(5, 0, 1, 2, 4, i3, t3);
  EXPECT_EQ(i1.to_floats(), i2.to_floats());
  EXPECT_EQ(t1.to_floats(), t2.to_floats());
  EXPECT_NE(i1.to_floats(), i3.to_floats());
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t s = 0; s + 1 < 16; ++s) EXPECT_EQ(t1.item({r, s}), i1.item({r, s + 1}));
  // Different steps draw different windows.
  std::set<int64_t> starts;
  for (int64_t s = 0; s < 50; ++s) starts.insert(a.sequence_start(s, 0));
  EXPECT_GT(starts.size(), 45u);
  for (int64_t st : starts) {
    EXPECT_GE(st, 0);
    EXPECT_LE(st + 17, 5000);
  }
}

TEST(DataLoader, RescaledLayoutSeesTheSameSamples) {
  const std::string dir = make_data("rescale", 2, 5000, 100000);
  auto ts = TokenShards::open(dir, "train");
  ASSERT_TRUE(ts.ok());
  DataLoader l(*ts, 9, 8);
  // Global batch 8: one rank x 4 micro-batches x 2 rows, or 2 ranks x 2 x 2, or 4 x 1 x 2.
  auto collect = [&](int64_t dp, int64_t ga, int64_t mb) {
    std::vector<std::vector<float>> rows;
    for (int64_t r = 0; r < dp; ++r)
      for (int64_t m = 0; m < ga; ++m) {
        Tensor ids, tg;
        l.train_batch(3, r, m, ga, mb, ids, tg);
        for (int64_t i = 0; i < mb; ++i) rows.push_back(ids.select(0, i).to_floats());
      }
    return rows;
  };
  const auto one = collect(1, 4, 2);
  EXPECT_EQ(collect(2, 2, 2), one);
  EXPECT_EQ(collect(4, 1, 2), one);
  EXPECT_EQ(collect(1, 1, 8), one);
}

TEST(DataLoader, EvalBatchesAreFixedAndSpread) {
  const std::string dir = make_data("eval", 2, 3000, 100000);
  auto ts = TokenShards::open(dir, "train");
  ASSERT_TRUE(ts.ok());
  DataLoader a(*ts, 1, 32), b(*ts, 2, 32);
  Tensor i1, t1, i2, t2;
  a.eval_batch(1, 3, 4, i1, t1);
  b.eval_batch(1, 3, 4, i2, t2);
  EXPECT_EQ(i1.to_floats(), i2.to_floats());  // independent of the seed
}

}  // namespace
}  // namespace troupe::layers
