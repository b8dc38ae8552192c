// tests/checkpoint/inspect_tool_test.cc — runs the real troupe-ckpt binary on a real
// checkpoint: the manifest is printed, --verify passes, and after a flipped byte it fails
// naming the tensor and file.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <numeric>

#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string output;
};

RunResult run_tool(const std::string& args) {
  RunResult r;
  const std::string cmd = std::string(TROUPE_CKPT_TOOL) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

TEST(InspectTool, PrintsVerifiesAndReportsDamage) {
  testing::TempDir dir;
  const std::string run = dir.sub("run");
  std::vector<float> v(48);
  std::iota(v.begin(), v.end(), 0.0f);
  for (int rank = 0; rank < 2; ++rank) {
    auto w = CheckpointWriter::create(WriterOptions{run, ParallelLayout{1, 1, 2}, rank});
    ASSERT_TRUE(w.ok());
    const Tensor experts = Tensor::from_floats({2, 4, 3}, std::span<const float>(v).subspan(24 * rank, 24));
    auto h =
        (*w)->save(12, {SaveEntry{"layers.0.moe.w1", {4, 4, 3}, {2 * rank, 0, 0}, experts}}, {{"rng", rank}});
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(h->wait().ok());
  }
  FinalizeOptions fo;
  fo.world_size = 2;
  fo.info.data_position = {{"sample", 77}};
  ASSERT_TRUE(finalize_checkpoint(run, 12, fo).ok());

  RunResult ok = run_tool("inspect " + run + " --verify");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  for (const char* word : {"step 12", "pp=1,dp=1,n=2", "layers.0.moe.w1", "[4, 4, 3]", "[0:2, 0:4, 0:3]",
                           "[2:4, 0:4, 0:3]", "rank_00001.bin", "\"sample\":77", "all ok"}) {
    EXPECT_NE(ok.output.find(word), std::string::npos) << "'" << word << "' missing from:\n" << ok.output;
  }
  RunResult ls = run_tool("list " + run);
  EXPECT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_NE(ls.output.find("step_12"), std::string::npos) << ls.output;

  testing::flip_byte(run + "/step_12/rank_00001.bin", 10);
  RunResult bad = run_tool("inspect " + run + "/step_12 --verify");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("BAD: "), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("checksum mismatch in"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("rank_00001.bin for tensor 'layers.0.moe.w1'"), std::string::npos) << bad.output;

  RunResult none = run_tool("inspect " + dir.sub("empty"));
  EXPECT_EQ(none.exit_code, 1) << none.output;
}

}  // namespace
}  // namespace troupe::checkpoint
