// tests/training/training_equivalence_test.cc — the central correctness test of
// The design's promise: every parallel layout trains exactly like one process.
//
// The real binary runs: `train_moe prepare` makes a small corpus (this repository's own
// sources), the single-process run is the reference, and each layout runs as
// `train_moe --parallel ...` (the standalone launcher: a driver plus pp*dp*n worker
// processes over Gloo on loopback). Compared per step from metrics.jsonl: loss and
// gradient norm (relative difference <= 1e-5 over the first 5 steps), aux loss and the
// per-expert loads (equal). Every run has the same keys (a global batch of 4 sequences):
// the reference takes it in 2 micro-batches of 2, each dp replica in one (replica d takes
// the reference's micro-batch d).
// Every child runs in its own process group, is bounded by a timeout and is killed and
// reaped on failure.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/common/train_moe_harness.h"

namespace {

namespace fs = std::filesystem;
using troupe::test::Clock;
using troupe::test::rel_diff;
using troupe::test::run;
using troupe::test::RunResult;
using troupe::test::step_records;

class TrainingEquivalence : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-training"));
    const RunResult p =
        troupe::test::prepare_data(*root_ / "data", {}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(p.exit_code, 0) << p.output;
  }
  static void TearDownTestSuite() {
    troupe::test::remove_run_root(*root_);
    delete root_;
  }

  // The test model: 4 blocks (dense, MoE, dense, MoE), d 32, 8 heads / 4 kv heads,
  // 4 experts top-2 (dropless, aux and z losses on), sequences of 16, micro-batches of 2.
  static std::vector<std::string> args(const std::string& name, int64_t steps, const std::string& parallel,
                                       const std::vector<std::string>& extra = {}) {
    troupe::test::TrainMoeCommand c;
    c.run_dir = *root_ / name;
    c.sets = troupe::test::tiny_model_sets(
        {.global_batch = 4, .steps = steps, .log_every = 10, .warmup_steps = 5, .data_dir = *root_ / "data"});
    c.sets.insert(c.sets.end(), extra.begin(), extra.end());
    c.parallel = parallel;
    return c.argv();
  }

  static const std::vector<nlohmann::json>& reference(int64_t steps) {
    static std::vector<nlohmann::json> ref5, ref50;
    auto& ref = steps == 5 ? ref5 : ref50;
    if (ref.empty()) {
      const std::string name = fmt::format("ref{}", steps);
      const RunResult r = run(args(name, steps, ""), *root_ / (name + ".log"), std::chrono::seconds(120));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      ref = step_records(*root_ / name / "metrics.jsonl");
    }
    return ref;
  }

  // Runs `parallel` for 5 steps and checks it against the reference; returns the max
  // relative difference of loss and grad norm.
  static double check_layout(const std::string& parallel, const std::vector<std::string>& extra = {}) {
    const auto& ref = reference(5);
    std::string name = "run-" + parallel;
    for (char& ch : name) ch = (ch == ',' || ch == '=') ? '_' : ch;
    const RunResult r =
        run(args(name, 5, parallel, extra), *root_ / (name + ".log"), std::chrono::seconds(180));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const auto got = step_records(*root_ / name / "metrics.jsonl");
    EXPECT_EQ(got.size(), ref.size()) << r.output;
    double worst = 0;
    for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
      const double dl = rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>());
      const double dg = rel_diff(ref[i]["grad_norm"].get<double>(), got[i]["grad_norm"].get<double>());
      const double da = rel_diff(ref[i]["aux_loss"].get<double>(), got[i]["aux_loss"].get<double>());
      EXPECT_LE(dl, 1e-5) << parallel << " step " << i + 1;
      EXPECT_LE(dg, 1e-5) << parallel << " step " << i + 1;
      EXPECT_LE(da, 1e-5) << parallel << " step " << i + 1;
      EXPECT_EQ(ref[i]["expert_load"], got[i]["expert_load"]) << parallel << " step " << i + 1;
      EXPECT_TRUE(got[i].contains("comm_ms") && got[i].contains("compute_ms"));
      worst = std::max({worst, dl, dg});
    }
    std::printf("[layout %s] max relative difference over %zu steps: %.3g (%.1f s)\n", parallel.c_str(), got.size(),
                worst, r.seconds);
    return worst;
  }

  // `parallel` and one process, both with the same `extra` settings (their own reference,
  // "ref-<tag>" and "pp-<tag>"), for `steps` steps: loss and gradient norm within 1e-5 at
  // every step. Returns the parallel run.
  static RunResult same_as_one_process(const std::string& tag, int64_t steps, const std::string& parallel,
                                       const std::vector<std::string>& extra) {
    const RunResult ref = run(args("ref-" + tag, steps, "", extra), *root_ / ("ref-" + tag + ".log"),
                              std::chrono::seconds(120));
    EXPECT_EQ(ref.exit_code, 0) << ref.output;
    const RunResult r = run(args("pp-" + tag, steps, parallel, extra), *root_ / ("pp-" + tag + ".log"),
                            std::chrono::seconds(180));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const auto a = step_records(*root_ / ("ref-" + tag) / "metrics.jsonl");
    const auto b = step_records(*root_ / ("pp-" + tag) / "metrics.jsonl");
    EXPECT_EQ(a.size(), static_cast<size_t>(steps)) << ref.output;
    EXPECT_EQ(b.size(), static_cast<size_t>(steps)) << r.output;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      EXPECT_LE(rel_diff(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()), 1e-5)
          << tag << " step " << i + 1;
      EXPECT_LE(rel_diff(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()), 1e-5)
          << tag << " step " << i + 1;
    }
    return r;
  }

  static fs::path* root_;
};

fs::path* TrainingEquivalence::root_ = nullptr;

TEST_F(TrainingEquivalence, DataParallel) {
  check_layout("dp=2");
}
TEST_F(TrainingEquivalence, ExpertAndSequenceParallelN2) {
  check_layout("n=2");
}
TEST_F(TrainingEquivalence, ExpertAndSequenceParallelN4) {
  check_layout("n=4");
}
TEST_F(TrainingEquivalence, AllGatherDispatch) {
  check_layout("n=2,dispatch=allgather");
}
TEST_F(TrainingEquivalence, Pipeline) {
  check_layout("pp=2");
}
TEST_F(TrainingEquivalence, PipelineTimesN) {
  check_layout("pp=2,n=2");
}
TEST_F(TrainingEquivalence, DataParallelTimesN) {
  check_layout("dp=2,n=2");
}
TEST_F(TrainingEquivalence, TroupeRunLaunchesTheSameRun) {
  // troupe run starts the driver and 4 workers (TROUPE_* variables, the scheduler's
  // rendezvous store); the result equals the standalone launcher's and one process's.
  const auto& ref = reference(5);
  std::vector<std::string> a = args("troupe-run", 5, "pp=2,n=2");
  a.insert(a.begin(), {TROUPE_CLI_BIN, "run", "--nproc", "4", "--"});
  const RunResult r = run(a, *root_ / "troupe-run.log", std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto got = step_records(*root_ / "troupe-run" / "metrics.jsonl");
  ASSERT_EQ(got.size(), ref.size()) << r.output;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LE(rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>()), 1e-5);
    EXPECT_LE(rel_diff(ref[i]["grad_norm"].get<double>(), got[i]["grad_norm"].get<double>()), 1e-5);
  }
  // A job whose worker count does not match the layout is refused by every process.
  std::vector<std::string> bad = args("troupe-run-bad", 5, "pp=2,n=2");
  bad.insert(bad.begin(), {TROUPE_CLI_BIN, "run", "--nproc", "3", "--"});
  const RunResult rb = run(bad, *root_ / "troupe-run-bad.log", std::chrono::seconds(120));
  EXPECT_NE(rb.exit_code, 0);
  EXPECT_NE(rb.output.find("needs 4 workers but the job has 3"), std::string::npos) << rb.output;
}

TEST_F(TrainingEquivalence, UntiedHeadOverPipeline) {
  // The tied-embedding path is the default; an untied head exercises the other one. Both
  // sides of the comparison use the same override, so it gets its own reference.
  same_as_one_process("untied", 5, "pp=2,n=2", {"model.tie_embeddings=false"});
}

// Two blocks over two stages: the first stage holds only the dense block (its statistics
// could stay on the device), the second the MoE block with the z-loss (its router keeps
// them on the host). The step's statistics are one collective over the world, so every
// stage must keep them in the same place: once they did not, and the first step waited
// for its all-reduce until the deadline in every epoch.
TEST_F(TrainingEquivalence, PipelineWhoseStagesHoldDifferentRouters) {
  const RunResult r = same_as_one_process("2blocks", 3, "pp=2", {"model.n_layers=2"});
  EXPECT_EQ(r.output.find("lost a peer"), std::string::npos) << r.output;
}

TEST_F(TrainingEquivalence, FiftyStepsSameFinalLoss) {
  const auto& ref = reference(50);
  ASSERT_EQ(ref.size(), 50u);
  // Every layout, from the same keys (dp and dp x n take the global batch of 4 sequences in
  // one micro-batch of 2 per replica, the others in two).
  for (const std::string parallel : {"dp=2", "n=2", "n=4", "pp=2", "pp=2,n=2", "dp=2,n=2"}) {
    std::string name = "fifty-" + parallel;
    for (char& ch : name) ch = (ch == ',' || ch == '=') ? '_' : ch;
    const RunResult r = run(args(name, 50, parallel), *root_ / (name + ".log"), std::chrono::seconds(300));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto got = step_records(*root_ / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), 50u);
    const double a = ref.back()["loss"].get<double>(), b = got.back()["loss"].get<double>();
    EXPECT_LE(std::fabs(a - b), 1e-3) << parallel;
    EXPECT_LT(b, ref.front()["loss"].get<double>() - 0.1) << "the loss should fall over 50 steps";
    std::printf("[50 steps %s] final loss %.6f vs one process %.6f (|diff| %.2g, %.1f s)\n", parallel.c_str(), b, a,
                std::fabs(a - b), r.seconds);
  }
}

TEST_F(TrainingEquivalence, CompressionTrainsClose) {
  // bf16 gradient exchange is not exact; it must stay close to fp32.
  const auto& ref = reference(5);
  const RunResult r =
      run(args("bf16", 5, "dp=2,compression=true"), *root_ / "bf16.log", std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto got = step_records(*root_ / "bf16" / "metrics.jsonl");
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LE(rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>()), 1e-3);
    EXPECT_LE(rel_diff(ref[i]["grad_norm"].get<double>(), got[i]["grad_norm"].get<double>()), 1e-2);
  }
}

TEST_F(TrainingEquivalence, LayoutThatDoesNotFitIsRefusedBeforeAnyWorker) {
  struct Case {
    std::string parallel;
    std::vector<std::string> extra;
    std::string message;
  };
  const std::vector<Case> cases{
      {"pp=3", {}, "parallel.pp=3 does not divide model.n_layers=4"},
      {"n=8", {}, "parallel.n=8 must divide model.n_heads=8 and model.n_kv_heads=4"},
      {"n=4", {"model.moe.num_experts=6"}, "parallel.n=4 does not divide model.moe.num_experts=6"},
      {"n=4", {"train.seq_len=18"}, "parallel.n=4 does not divide train.seq_len=18"},
      {"n=2,dispatch=ring", {}, "parallel.dispatch must be"},
      {"pp=2,tp=2", {}, "unknown key 'tp'"},
      {"dp=3", {}, "train.global_batch = 4 sequences cannot be split over dp = 3 replicas"},
  };
  for (const auto& c : cases) {
    const fs::path dir = *root_ / "refused";
    fs::remove_all(dir);
    const RunResult r =
        run(args("refused", 5, c.parallel, c.extra), *root_ / "refused.log", std::chrono::seconds(30));
    EXPECT_NE(r.exit_code, 0) << c.parallel;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.parallel << ": " << r.output;
    // Nothing started: no rendezvous, no metrics, no launcher banner.
    EXPECT_FALSE(fs::exists(dir / "rendezvous")) << c.parallel;
    EXPECT_FALSE(fs::exists(dir / "metrics.jsonl")) << c.parallel;
    EXPECT_EQ(r.output.find("workers"), std::string::npos) << c.parallel << ": " << r.output;
  }
}

TEST_F(TrainingEquivalence, DeadWorkerWithNothingToRestoreFailsTheJobWithoutOrphans) {
  // A worker killed mid-run with no snapshot (elastic.snapshot_every=0) and no checkpoint:
  // nothing holds the state, so the Trainer fails the job naming the lost worker, and
  // leaves no process behind.
  const fs::path log = *root_ / "killed.log";
  const pid_t pid = troupe::test::spawn(args("killed", 400, "n=2", {"elastic.snapshot_every=0"}), log);
  // Wait for training to start (step 1 in metrics), then kill one worker of the group.
  const fs::path metrics = *root_ / "killed" / "metrics.jsonl";
  const auto t0 = Clock::now();
  bool started = false;
  while (Clock::now() - t0 < std::chrono::seconds(60) && !started) {
    started = step_records(metrics).size() >= 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!started)
    troupe::test::finish(pid, log, Clock::now(), std::chrono::seconds(0));  // kill and reap the job
  ASSERT_TRUE(started);
  // Workers are the launcher's children.
  const std::vector<pid_t> workers = troupe::test::children_of(pid);
  if (workers.empty()) troupe::test::finish(pid, log, Clock::now(), std::chrono::seconds(0));
  ASSERT_FALSE(workers.empty());
  kill(workers.front(), SIGKILL);
  const RunResult r = troupe::test::finish(pid, log, Clock::now(), std::chrono::seconds(30));
  ASSERT_FALSE(r.timed_out) << "the driver did not notice the dead worker within 30 s";
  EXPECT_GT(r.exit_code, 0);
  EXPECT_NE(r.output.find("no checkpoint is kept"), std::string::npos) << r.output;
  // The lost worker is named (by its exit, or by its actors' Down, whichever came first).
  EXPECT_NE(r.output.find("slot "), std::string::npos) << r.output;
  // No survivor of the job's process group.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_NE(kill(-pid, 0), 0) << "processes of the job are still alive";
}

}  // namespace
