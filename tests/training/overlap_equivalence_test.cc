// tests/training/overlap_equivalence_test.cc — the correctness checks of the
// overlapped schedule and the compressed exchanges, on the real binary (train_moe's
// standalone launcher, Gloo on loopback):
// - For every layout of tests/training, the overlapped schedule (bench.overlap_a2a,
//   overlap_grad_sync, overlap_param_gather on: the defaults) gives bitwise the same
//   losses, gradient norms, aux losses, expert loads and final validation loss over 5
//   steps as the sequential one (all three off), compression off. Same parallel.chunks on
//   both sides (chunking is part of the arithmetic; the switches only move the waits).
// - bf16 gradient exchange plus fp8 token dispatch: the loss after 50 steps is within 1%
//   of the uncompressed run; the per-step relative gradient error (bench.measure_compression)
//   is printed and bounded.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"

namespace {

namespace fs = std::filesystem;
using troupe::test::run;
using troupe::test::RunResult;
using troupe::test::step_records;

const std::vector<std::string> kSequential{"bench.overlap_a2a=false", "bench.overlap_grad_sync=false",
                                           "bench.overlap_param_gather=false"};

class OverlapEquivalence : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-overlap"));
    const RunResult p =
        troupe::test::prepare_data(*root_ / "data", {}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(p.exit_code, 0) << p.output;
  }
  static void TearDownTestSuite() {
    troupe::test::remove_run_root(*root_);
    delete root_;
  }

  static std::vector<std::string> args(const std::string& name, int64_t steps, int64_t global_batch,
                                       const std::string& parallel, const std::vector<std::string>& extra) {
    troupe::test::TrainMoeCommand c;
    c.run_dir = *root_ / name;
    c.sets = troupe::test::tiny_model_sets({.global_batch = global_batch,
                                            .steps = steps,
                                            .log_every = 10,
                                            .warmup_steps = 5,
                                            .data_dir = *root_ / "data"});
    c.sets.insert(c.sets.end(), extra.begin(), extra.end());
    c.parallel = parallel;
    return c.argv();
  }

  static std::string slug(std::string s) {
    for (char& ch : s) ch = (ch == ',' || ch == '=' || ch == '.') ? '_' : ch;
    return s;
  }

  static std::vector<nlohmann::json> train(const std::string& name, int64_t steps, int64_t global_batch,
                                           const std::string& parallel, const std::vector<std::string>& extra,
                                           const std::vector<std::string>& env = {},
                                           std::string* output = nullptr) {
    std::vector<std::string> a = args(name, steps, global_batch, parallel, extra);
    if (!env.empty()) {
      std::vector<std::string> pre{"/usr/bin/env"};
      pre.insert(pre.end(), env.begin(), env.end());
      a.insert(a.begin(), pre.begin(), pre.end());
    }
    const RunResult r = run(a, *root_ / (name + ".log"), std::chrono::seconds(300));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (output != nullptr) *output = r.output;
    return troupe::test::read_jsonl(*root_ / name / "metrics.jsonl");
  }

  static fs::path* root_;
};

fs::path* OverlapEquivalence::root_ = nullptr;

TEST_F(OverlapEquivalence, OverlappedScheduleIsBitwiseTheSequentialOne) {
  // Every layout of training_equivalence_test, plus dp x pp and dp = 4 (a rank-order sum
  // of four), with 2 token chunks per expert dispatch; each with its global batch
  // (sequences).
  const std::vector<std::pair<std::string, int64_t>> layouts{
      {"dp=2", 4}, {"n=2", 4},      {"n=4", 4},      {"n=2,dispatch=allgather", 4},
      {"pp=2", 4}, {"pp=2,n=2", 4}, {"dp=2,n=2", 4}, {"pp=2,dp=2", 4},
      {"dp=4", 8}};
  for (const auto& [parallel, global_batch] : layouts) {
    const std::vector<std::string> chunks{"parallel.chunks=2"};
    std::vector<std::string> off = chunks;
    off.insert(off.end(), kSequential.begin(), kSequential.end());
    const auto on_recs = train("on-" + slug(parallel), 5, global_batch, parallel, chunks);
    const auto off_recs = train("off-" + slug(parallel), 5, global_batch, parallel, off);
    ASSERT_EQ(on_recs.size(), off_recs.size()) << parallel;
    size_t steps = 0, evals = 0;
    for (size_t i = 0; i < on_recs.size(); ++i) {
      const auto& a = on_recs[i];
      const auto& b = off_recs[i];
      for (const char* key : {"loss", "lm_loss", "aux_loss", "grad_norm", "val_loss"}) {
        ASSERT_EQ(a.contains(key), b.contains(key)) << parallel << " record " << i << " " << key;
        if (!a.contains(key)) continue;
        // Bitwise: the JSON writer prints doubles so that they read back exactly.
        EXPECT_EQ(a[key].get<double>(), b[key].get<double>()) << parallel << " record " << i << " " << key;
        if (std::string(key) == "grad_norm") ++steps;
        if (std::string(key) == "val_loss") ++evals;
      }
      if (a.contains("expert_load")) {
        EXPECT_EQ(a["expert_load"], b["expert_load"]) << parallel << " record " << i;
      }
    }
    EXPECT_EQ(steps, 5u) << parallel;
    EXPECT_GE(evals, 1u) << parallel;
    std::printf("[overlap %s] %zu steps and %zu validations bitwise equal with and without overlap\n",
                parallel.c_str(), steps, evals);
  }
}

TEST_F(OverlapEquivalence, Bf16GradientsAndFp8DispatchTrainWithinOnePercent) {
  const std::string layout = "dp=2,n=2";
  const auto exact = train("exact50", 50, 4, layout, {});
  std::string out;
  const auto comp = train("compressed50", 50, 4, layout + ",compression=true",
                          {"parallel.fp8_dispatch=true", "bench.measure_compression=true"}, {}, &out);
  const auto a = step_records(*root_ / "exact50" / "metrics.jsonl");
  const auto b = step_records(*root_ / "compressed50" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 50u);
  ASSERT_EQ(b.size(), 50u);
  const double la = a.back()["loss"].get<double>(), lb = b.back()["loss"].get<double>();
  const double rel = std::fabs(lb - la) / std::fabs(la);
  EXPECT_LE(rel, 0.01) << "loss after 50 steps: compressed " << lb << " vs " << la;
  EXPECT_LT(lb, a.front()["loss"].get<double>() - 0.1) << "the compressed run should learn";
  // One error line per step from rank 0: bf16 has 8 mantissa bits (2^-9 relative rounding).
  const std::regex line(R"(compression: step (\d+) relative gradient error ([0-9.e+-]+))");
  int lines = 0;
  double worst = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it) {
    const double err = std::stod((*it)[2].str());
    std::printf("[compression] step %s relative gradient error %.3e\n", (*it)[1].str().c_str(), err);
    EXPECT_GT(err, 0.0) << "bf16 rounding must show";
    EXPECT_LT(err, 1e-2);
    worst = std::max(worst, err);
    ++lines;
  }
  EXPECT_EQ(lines, 50) << out;
  std::printf(
      "[compression] loss after 50 steps %.6f vs %.6f uncompressed (rel %.2e); worst per-step relative "
      "gradient error %.3e\n",
      lb, la, rel, worst);
}

}  // namespace
