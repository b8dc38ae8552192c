// tests/apps/dense_lm_test.cc — the app API's example end to end: dense_lm (a dense
// transformer whose only code is its stage program and main) trained by `troupe run
// --nproc 4 ... --parallel pp=2,dp=2` gives the losses of its one-process run (layout
// 1x1x1, the same global batch as one rank's 4 micro-batches) within 1e-5; a worker
// killed mid-run is replaced, every rank going back to the newest in-memory snapshot (one
// per step: at most one step runs again), with the same losses; a config describing
// MoE blocks is refused with an error naming the key.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"

namespace troupe::test {
namespace {

const fs::path kConfig = fs::path(TROUPE_SOURCE_DIR) / "apps/examples/dense_lm/config.toml";

class DenseLm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(make_run_root("dense-lm"));
    const RunResult r =
        prepare_data(*root_ / "data", PrepareSpec{}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // The reference: layout 1x1x1, 4 micro-batches per step (= dp 2 x 2).
    const RunResult one = run(command(*root_ / "one", 4, ""), *root_ / "one.log", std::chrono::seconds(240));
    ASSERT_EQ(one.exit_code, 0) << one.output;
  }
  static void TearDownTestSuite() {
    remove_run_root(*root_);
    delete root_;
    root_ = nullptr;
  }
  // dense_lm's command line: the example's config on the test corpus, 5 steps of
  // micro-batches of 4 sequences of 64 tokens.
  static std::vector<std::string> command(const fs::path& run_dir, int64_t grad_accum,
                                          const std::string& parallel) {
    std::vector<std::string> a = {DENSE_LM_BIN, "--config", kConfig.string(), "--run-dir", run_dir.string()};
    for (const std::string& s :
         {fmt::format("data.dir=\"{}\"", (*root_ / "data").string()), std::string("model.vocab_size=320"),
          std::string("model.d_model=64"), std::string("model.ffn_hidden=128"), std::string("train.steps=5"),
          std::string("train.seq_len=64"), std::string("train.micro_batch_size=4"),
          fmt::format("train.grad_accum={}", grad_accum), std::string("train.eval_every=0"),
          std::string("train.eval_batches=2"), std::string("train.log_every=1")}) {
      a.push_back("--set");
      a.push_back(s);
    }
    if (!parallel.empty()) {
      a.push_back("--parallel");
      a.push_back(parallel);
    }
    return a;
  }
  // Relative differences of loss and grad norm per step against the reference run.
  static double worst_difference(const fs::path& run_dir, const std::string& output) {
    const auto ref = latest_step_records(*root_ / "one" / "metrics.jsonl");
    const auto got = latest_step_records(run_dir / "metrics.jsonl");
    EXPECT_EQ(ref.size(), 5u);
    EXPECT_EQ(got.size(), 5u) << output;
    double worst = 0;
    for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i) {
      EXPECT_EQ(ref[i]["step"], got[i]["step"]);
      for (const char* k : {"loss", "grad_norm"}) {
        const double e = rel_diff(ref[i][k].get<double>(), got[i][k].get<double>());
        EXPECT_LE(e, 1e-5) << "step " << ref[i]["step"] << " " << k << ": " << ref[i][k] << " vs "
                           << got[i][k];
        worst = std::max(worst, e);
      }
    }
    return worst;
  }

  static fs::path* root_;
};

fs::path* DenseLm::root_ = nullptr;

TEST_F(DenseLm, TroupeRunPipelineTimesDataParallelEqualsOneProcess) {
  std::vector<std::string> dist = {TROUPE_CLI_BIN, "run", "--nproc", "4", "--"};
  for (const std::string& s : command(*root_ / "dist", 2, "pp=2,dp=2")) dist.push_back(s);
  const RunResult d = run(dist, *root_ / "dist.log", std::chrono::seconds(300));
  ASSERT_EQ(d.exit_code, 0) << d.output;
  const double worst = worst_difference(*root_ / "dist", d.output);
  const auto got = latest_step_records(*root_ / "dist" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 5u);
  for (const auto& g : got) EXPECT_EQ(g["dp"], 2) << g.dump();
  // The last record of each run holds the final validation loss.
  const auto rv = read_jsonl(*root_ / "one" / "metrics.jsonl").back();
  const auto gv = read_jsonl(*root_ / "dist" / "metrics.jsonl").back();
  ASSERT_TRUE(rv.contains("val_loss") && gv.contains("val_loss")) << rv.dump() << gv.dump();
  EXPECT_LE(rel_diff(rv["val_loss"].get<double>(), gv["val_loss"].get<double>()), 1e-5);
  // No dense-model job has expert loads.
  EXPECT_TRUE(got.back()["expert_load"].empty()) << got.back().dump();
  std::printf(
      "[dense_lm] pp=2,dp=2 under troupe run vs one process: 5 steps, worst relative difference %.3g "
      "(loss %.6f -> %.6f); val_loss %.6f vs %.6f\n",
      worst, got.front()["loss"].get<double>(), got.back()["loss"].get<double>(),
      rv["val_loss"].get<double>(), gv["val_loss"].get<double>());
}

TEST_F(DenseLm, KilledWorkerIsReplacedFromTheSnapshot) {
  // The standalone launcher (no troupe run, it holds the snapshots): rank 1 SIGKILLs
  // itself in step 3; every rank restores the newest snapshot and the losses stay the
  // reference's.
  std::vector<std::string> a = command(*root_ / "kill", 2, "pp=2,dp=2");
  for (const char* s : {"elastic.inject=\"kill@3:any:1\"", "elastic.snapshot_every=1"}) {
    a.push_back("--set");
    a.push_back(s);
  }
  const RunResult r = run(a, *root_ / "kill.log", std::chrono::seconds(300));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double worst = worst_difference(*root_ / "kill", r.output);
  const auto rec = events_named(*root_ / "kill" / "events.jsonl", "recovered");
  ASSERT_EQ(rec.size(), 1u) << r.output;
  EXPECT_LE(rec[0]["steps_lost"].get<int64_t>(), 1) << rec[0].dump();
  std::printf(
      "[dense_lm] rank 1 killed in step 3: recovered in %.2f s, steps lost %lld, worst relative difference "
      "%.3g\n",
      rec[0]["recovery_s"].get<double>(), static_cast<long long>(rec[0]["steps_lost"].get<int64_t>()), worst);
}

TEST_F(DenseLm, RefusesAModelWithMoEBlocks) {
  std::vector<std::string> a = command(*root_ / "moe", 1, "");
  a.push_back("--set");
  a.push_back("model.moe_every=2");
  const RunResult r = run(a, *root_ / "moe.log", std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("set model.moe_every = 0"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(*root_ / "moe" / "metrics.jsonl"));
}

}  // namespace
}  // namespace troupe::test
