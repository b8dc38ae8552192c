// tests/apps/lm_examples_test.cc — the app API's examples end to end: dense_lm and
// parallel_lm (apps/examples/, each its block's forward on a tape and a main() on the
// transformer program base). For each, ONE config file with the same keys trains layout
// 1x1x1, pp=2,dp=2 and n=2 to the same losses and gradient norms within 1e-5 over 5 steps
// (the global batch is the config's: 8 sequences, 4 micro-batches of 2 in one process,
// 2 per replica at dp=2); dense_lm's pp=2,dp=2 runs under `troupe run`, parallel_lm's
// under the standalone launcher. `--gradcheck` passes for both. A worker killed mid-run is
// replaced, every rank going back to the newest in-memory snapshot (one per step: at most
// one step runs again), with the same losses; a config describing MoE blocks is refused
// with an error naming the key.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"

namespace troupe::test {
namespace {

struct Example {
  std::string name, bin;
  fs::path config;
};

const Example kDense{"dense_lm", DENSE_LM_BIN,
                     fs::path(TROUPE_SOURCE_DIR) / "apps/examples/dense_lm/dense_lm.toml"};
const Example kParallel{"parallel_lm", PARALLEL_LM_BIN,
                        fs::path(TROUPE_SOURCE_DIR) / "apps/examples/parallel_lm/parallel_lm.toml"};

class LmExamples : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(make_run_root("lm-examples"));
    const RunResult r =
        prepare_data(*root_ / "data", PrepareSpec{}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    remove_run_root(*root_);
    delete root_;
    root_ = nullptr;
  }
  // The example's command line: its config on the test corpus, 5 steps of a global batch
  // of 8 sequences of 64 tokens in micro-batches of 2 — the same keys for every layout.
  static std::vector<std::string> command(const Example& e, const std::string& run,
                                          const std::string& parallel) {
    std::vector<std::string> a = {e.bin, "--config", e.config.string(), "--run-dir", (*root_ / run).string()};
    for (const std::string& s :
         {fmt::format("data.dir=\"{}\"", (*root_ / "data").string()), std::string("model.vocab_size=320"),
          std::string("model.d_model=64"), std::string("model.ffn_hidden=128"), std::string("train.steps=5"),
          std::string("train.seq_len=64"), std::string("train.global_batch=8"),
          std::string("train.micro_batch_size=2"), std::string("train.eval_every=0"),
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
  // Runs the example at 1x1x1 once (the reference of its layouts).
  static const fs::path& reference(const Example& e) {
    static std::map<std::string, fs::path> done;
    if (!done.count(e.name)) {
      const std::string run = e.name + "-one";
      const RunResult one = run_cmd(command(e, run, ""), run);
      EXPECT_EQ(one.exit_code, 0) << one.output;
      done[e.name] = *root_ / run;
    }
    return done[e.name];
  }
  static RunResult run_cmd(const std::vector<std::string>& argv, const std::string& name) {
    return run(argv, *root_ / (name + ".log"), std::chrono::seconds(300));
  }
  // Relative differences of loss and grad norm per step against the reference run.
  static double worst_difference(const fs::path& ref_dir, const fs::path& run_dir,
                                 const std::string& output) {
    const auto ref = latest_step_records(ref_dir / "metrics.jsonl");
    const auto got = latest_step_records(run_dir / "metrics.jsonl");
    EXPECT_EQ(ref.size(), 5u);
    EXPECT_EQ(got.size(), 5u) << output;
    double worst = 0;
    for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i) {
      EXPECT_EQ(ref[i]["step"], got[i]["step"]);
      EXPECT_EQ(ref[i]["tokens"], got[i]["tokens"]) << "the global batch changed with the layout";
      for (const char* k : {"loss", "grad_norm"}) {
        const double e = rel_diff(ref[i][k].get<double>(), got[i][k].get<double>());
        EXPECT_LE(e, 1e-5) << run_dir << " step " << ref[i]["step"] << " " << k << ": " << ref[i][k] << " vs "
                           << got[i][k];
        worst = std::max(worst, e);
      }
    }
    return worst;
  }
  // `parallel` against 1x1x1, standalone or under `troupe run --nproc <world>`.
  static void check_layout(const Example& e, const std::string& parallel, int world, bool troupe_run) {
    const fs::path& ref = reference(e);
    std::string run = e.name + "-" + parallel;
    for (char& ch : run) ch = (ch == ',' || ch == '=') ? '_' : ch;
    std::vector<std::string> a = command(e, run, parallel);
    if (troupe_run) a.insert(a.begin(), {TROUPE_CLI_BIN, "run", "--nproc", std::to_string(world), "--"});
    const RunResult r = run_cmd(a, run);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double worst = worst_difference(ref, *root_ / run, r.output);
    const auto got = latest_step_records(*root_ / run / "metrics.jsonl");
    ASSERT_FALSE(got.empty());
    EXPECT_TRUE(got.back()["expert_load"].empty()) << got.back().dump();  // a dense model
    // The last record of each run holds the final validation loss.
    const auto rv = read_jsonl(ref / "metrics.jsonl").back();
    const auto gv = read_jsonl(*root_ / run / "metrics.jsonl").back();
    ASSERT_TRUE(rv.contains("val_loss") && gv.contains("val_loss")) << rv.dump() << gv.dump();
    EXPECT_LE(rel_diff(rv["val_loss"].get<double>(), gv["val_loss"].get<double>()), 1e-5);
    std::printf(
        "[%s] %s%s vs one process: 5 steps, worst relative difference %.3g (loss %.6f -> %.6f), %.1f s\n",
        e.name.c_str(), parallel.c_str(), troupe_run ? " under troupe run" : "", worst,
        got.front()["loss"].get<double>(), got.back()["loss"].get<double>(), r.seconds);
  }
  static void check_gradcheck(const Example& e) {
    std::vector<std::string> a =
        command(e, e.name + "-gradcheck", "pp=2,dp=2");  // --gradcheck: 1x1x1 whatever
    a.push_back("--gradcheck");
    const RunResult r = run_cmd(a, e.name + "-gradcheck");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(e.name + ": gradcheck of "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("tolerance 2e-02: ok"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(*root_ / (e.name + "-gradcheck") / "metrics.jsonl"))
        << "gradcheck does not train";
    const size_t at = r.output.find(": gradcheck of ");
    std::printf("[%s] gradcheck:%s", e.name.c_str(),
                at == std::string::npos ? " no summary\n" : r.output.substr(at + 1).c_str());
  }

  static fs::path* root_;
};

fs::path* LmExamples::root_ = nullptr;

TEST_F(LmExamples, DenseLmLayoutsTrainLikeOneProcess) {
  check_layout(kDense, "pp=2,dp=2", 4, /*troupe_run=*/true);
  check_layout(kDense, "n=2", 2, false);
}

TEST_F(LmExamples, ParallelLmLayoutsTrainLikeOneProcess) {
  check_layout(kParallel, "pp=2,dp=2", 4, false);
  check_layout(kParallel, "n=2", 2, false);
}

TEST_F(LmExamples, GradcheckPasses) {
  check_gradcheck(kDense);
  check_gradcheck(kParallel);
}

TEST_F(LmExamples, KilledWorkerIsReplacedFromTheSnapshot) {
  // The standalone launcher (no troupe run, it holds the snapshots): rank 1 SIGKILLs
  // itself in step 3; every rank restores the newest snapshot and the losses stay the
  // reference's.
  const fs::path& ref = reference(kDense);
  std::vector<std::string> a = command(kDense, "kill", "pp=2,dp=2");
  for (const char* s : {"test.inject=\"kill@3:any:1\"", "elastic.snapshot_every=1"}) {
    a.push_back("--set");
    a.push_back(s);
  }
  a.push_back("--allow-test-config");
  const RunResult r = run_cmd(a, "kill");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double worst = worst_difference(ref, *root_ / "kill", r.output);
  const auto rec = events_named(*root_ / "kill" / "events.jsonl", "recovered");
  ASSERT_EQ(rec.size(), 1u) << r.output;
  EXPECT_LE(rec[0]["steps_lost"].get<int64_t>(), 1) << rec[0].dump();
  std::printf(
      "[dense_lm] rank 1 killed in step 3: recovered in %.2f s, steps lost %lld, worst relative difference "
      "%.3g\n",
      rec[0]["recovery_s"].get<double>(), static_cast<long long>(rec[0]["steps_lost"].get<int64_t>()), worst);
}

TEST_F(LmExamples, RefusesAModelWithMoEBlocks) {
  std::vector<std::string> a = command(kDense, "moe", "");
  a.push_back("--set");
  a.push_back("model.moe_every=2");
  const RunResult r = run_cmd(a, "moe");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("set model.moe_every = 0"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(*root_ / "moe" / "metrics.jsonl"));
}

}  // namespace
}  // namespace troupe::test
