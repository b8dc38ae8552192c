// tests/scheduler/checkpoints_cli_test.cc — `troupe checkpoints`: a real troupe-scheduler
// on loopback (no agents, so submitted jobs stay pending), jobs whose checkpoint
// directory comes from --checkpoint-dir or from train_moe's --run-dir, and real
// checkpoints written by the checkpoint writer (one committed, one unfinished save).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/writer.h"
#include "tests/scheduler/harness.h"

namespace {

namespace fs = std::filesystem;
using troupe::ParallelLayout;
using troupe::Tensor;
using namespace troupe::checkpoint;

// One rank of layout 1x1x1 writes step `step` into `dir`; committed unless `finalize` is false.
void write_checkpoint(const std::string& dir, int64_t step, bool finalize) {
  auto w = CheckpointWriter::create({dir, ParallelLayout{}, 0});
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  Tensor t = Tensor::from_floats({10, 100}, v);
  auto h = (*w)->save(step, {SaveEntry{"w", {10, 100}, {}, t}});
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE(h->wait().ok());
  if (finalize) {
    FinalizeOptions fo;
    fo.world_size = 1;
    ASSERT_TRUE(finalize_checkpoint(dir, step, fo).ok());
  }
}

// True when one line of `text` starts with `first` and holds every one of `words`.
bool has_line(const std::string& text, const std::string& first, const std::vector<std::string>& words) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    bool all = line.rfind(first + " ", 0) == 0;
    for (const auto& w : words) all = all && line.find(w) != std::string::npos;
    if (all) return true;
    pos = end + 1;
  }
  return false;
}

std::string submit(troupe::sched::test::Cluster& c, const std::vector<std::string>& flags,
                   const std::vector<std::string>& command) {
  std::vector<std::string> args = {"submit", "--nproc", "1"};
  auto conn = c.conn_args();
  args.insert(args.end(), conn.begin(), conn.end());
  args.insert(args.end(), flags.begin(), flags.end());
  args.push_back("--");
  args.insert(args.end(), command.begin(), command.end());
  auto r = troupe::sched::test::run_cli(args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::string id = r.output;
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

TEST(TroupeCheckpoints, ListsTheCheckpointsOfAJob) {
  troupe::sched::test::Cluster c({.agents = 0});
  const std::string ck = c.dir() + "/ck";
  write_checkpoint(ck, 10, true);
  write_checkpoint(ck, 20, true);
  write_checkpoint(ck, 30, false);  // a save that never committed

  const std::string job = submit(c, {"--checkpoint-dir", ck}, {"/bin/true"});
  auto conn = c.conn_args();
  std::vector<std::string> args = {"checkpoints", job};
  args.insert(args.end(), conn.begin(), conn.end());
  auto r = troupe::sched::test::run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints in " + ck), std::string::npos) << r.output;
  EXPECT_TRUE(has_line(r.output, "30", {"unfinished", "1 parts", "step_30.tmp"})) << r.output;
  EXPECT_TRUE(has_line(r.output, "20", {"committed", "pp=1,dp=1,n=1", "0.00 MB", "step_20"})) << r.output;
  EXPECT_TRUE(has_line(r.output, "10", {"committed", "step_10"})) << r.output;
  EXPECT_NE(r.output.find("latest: step_20"), std::string::npos) << r.output;

  // `troupe status <job>` shows them too.
  std::vector<std::string> st = {"status", job};
  st.insert(st.end(), conn.begin(), conn.end());
  r = troupe::sched::test::run_cli(st);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints in " + ck), std::string::npos) << r.output;
  EXPECT_TRUE(has_line(r.output, "20", {"committed", "step_20"})) << r.output;

  // JSON, and a damaged checkpoint shows as invalid with its reason.
  fs::remove(ck + "/step_20/manifest.json");
  args.push_back("--json");
  r = troupe::sched::test::run_cli(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  ASSERT_EQ(j["checkpoints"].size(), 2u);
  EXPECT_EQ(j["checkpoints"][0]["step"], 20);
  EXPECT_EQ(j["checkpoints"][0]["valid"], false);
  EXPECT_NE(j["checkpoints"][0]["error"].get<std::string>().find("manifest"), std::string::npos);
  EXPECT_EQ(j["checkpoints"][1]["valid"], true);
  EXPECT_EQ(j["checkpoints"][1]["bytes"], 4000);

  // A train_moe job without --checkpoint-dir: <--run-dir>/checkpoints.
  const std::string run = c.dir() + "/run";
  write_checkpoint(run + "/checkpoints", 5, true);
  const std::string job2 = submit(c, {}, {"train_moe", "--config", "x.toml", "--run-dir", run});
  std::vector<std::string> a2 = {"checkpoints", job2};
  a2.insert(a2.end(), conn.begin(), conn.end());
  r = troupe::sched::test::run_cli(a2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "5", {"committed", run + "/checkpoints/step_5"})) << r.output;

  // A job that names no directory, and an unknown job: clear errors.
  const std::string job3 = submit(c, {}, {"/bin/true"});
  std::vector<std::string> a3 = {"checkpoints", job3};
  a3.insert(a3.end(), conn.begin(), conn.end());
  r = troupe::sched::test::run_cli(a3);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("names no checkpoint directory"), std::string::npos) << r.output;
  std::vector<std::string> a4 = {"checkpoints", "no-such-job"};
  a4.insert(a4.end(), conn.begin(), conn.end());
  r = troupe::sched::test::run_cli(a4);
  EXPECT_NE(r.exit_code, 0) << r.output;
}

}  // namespace
