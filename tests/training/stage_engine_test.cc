// tests/training/stage_engine_test.cc — the Stage's step engine on the CPU (stage.h "Step
// engine"): ranks are threads of this process (Gloo on loopback, a FileStore rendezvous),
// a tiny MoE model trains a few steps, and every switch is compared with its plain way:
// - launch-ahead (step k+1 launched before step k is finished) gives bitwise the losses,
//   norms and loads of launching and finishing each step in turn, at 1x1x1 and dp=2;
// - statistics on the device (summed over the world as f32 in a tensor) against the fp64
//   host sums: the same losses and norms to f32 rounding, the same expert loads, at dp=2
//   and pp=2 x n=2;
// - the folded gradient norm against the read one (dp=1), to f32 rounding;
// - bf16 expert gradients reduced over dp=2 in bf16 with an f32 sum: close to the f32
//   run, not equal to it (the switch acts), the loss falling;
// - a state accessor with a step in flight, and finish_step out of order, fail loudly.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "apps/train_moe/moe_stage.h"
#include "comm/rendezvous_store.h"
#include "data/token_data.h"
#include "training/run_config.h"
#include "training/stage/stage.h"

namespace {

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::training;

constexpr int64_t kSteps = 4;

class StageEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::random_device rd;
    root_ =
        new fs::path(fs::temp_directory_path() / fmt::format("troupe-stage-engine-{}-{:x}", getpid(), rd()));
    fs::create_directories(*root_);
    const std::string src = TROUPE_SOURCE_DIR;
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string log = (*root_ / "prepare.log").string();
      FILE* f = std::fopen(log.c_str(), "w");
      if (f != nullptr) dup2(fileno(f), 1), dup2(fileno(f), 2);
      execl(TROUPE_TRAIN_MOE_BIN, TROUPE_TRAIN_MOE_BIN, "prepare", "--input", (src + "/layers").c_str(),
            "--out", (*root_ / "data").c_str(), "--vocab", "320", "--max-bytes", "200000", "--ext", ".cc",
            "--ext", ".h", static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(*root_, ec);
    delete root_;
  }

  static layers::TrainConfig config(const std::vector<std::string>& extra) {
    std::vector<std::string> o{"model.vocab_size=320",
                               "model.d_model=32",
                               "model.ffn_hidden=64",
                               "model.moe.num_experts=4",
                               "model.moe.expert_hidden=32",
                               "model.moe.z_loss_coef=0.0",
                               "train.seq_len=16",
                               "train.micro_batch_size=2",
                               fmt::format("train.steps={}", kSteps),
                               "optim.warmup_steps=2",
                               fmt::format("data.dir=\"{}\"", (*root_ / "data").string())};
    // One micro-batch of 2 sequences per replica unless a layout asks for more.
    int dp = 1;
    bool batch_given = false;
    for (const std::string& e : extra) {
      if (e.rfind("parallel.dp=", 0) == 0) dp = std::stoi(e.substr(12));
      if (e.rfind("train.global_batch=", 0) == 0) batch_given = true;
    }
    if (!batch_given) o.push_back(fmt::format("train.global_batch={}", 2 * dp));
    o.insert(o.end(), extra.begin(), extra.end());
    auto tc = layers::load_train_config(std::string(TROUPE_SOURCE_DIR) + "/apps/configs/tiny.toml", o,
                                        layers::TestSections::kAdmit);
    EXPECT_TRUE(tc.ok()) << tc.status().to_string();
    return *tc;
  }

  // Every rank's Stage (threads: creation and steps are collective).
  static std::vector<std::unique_ptr<Stage>> make(const layers::TrainConfig& tc, const std::string& job) {
    const int world = static_cast<int>(tc.parallel.world());
    std::vector<std::unique_ptr<Stage>> stages(static_cast<size_t>(world));
    std::vector<std::thread> th;
    for (int r = 0; r < world; ++r) {
      th.emplace_back([&, r] {
        auto store = comm::FileStore::open(*root_ / "store");
        ASSERT_TRUE(store.ok());
        auto train = layers::TokenShards::open(tc.data.dir, "train");
        auto val = layers::TokenShards::open(tc.data.dir, "val");
        ASSERT_TRUE(train.ok() && val.ok());
        auto s = Stage::create(tc, r, train_moe::moe_stage_program(), **store, comm::StoreNamespace{job, 0},
                               std::move(*train), std::move(*val));
        ASSERT_TRUE(s.ok()) << s.status().to_string();
        stages[static_cast<size_t>(r)] = std::move(*s);
      });
    }
    for (auto& t : th) t.join();
    return stages;
  }

  // Rank 0's reports of kSteps steps; `ahead`: step k+1 launched before step k finishes
  // wherever the Stage allows it (as the worker loop does).
  static std::vector<StepReport> train(const std::vector<std::string>& extra, bool ahead) {
    const layers::TrainConfig tc = config(extra);
    static int jobs = 0;
    auto stages = make(tc, fmt::format("job{}", jobs++));
    std::vector<std::vector<StepReport>> reps(stages.size());
    std::vector<std::thread> th;
    for (size_t r = 0; r < stages.size(); ++r) {
      th.emplace_back([&, r] {
        Stage& s = *stages[r];
        if (!ahead) {
          for (int64_t k = 1; k <= kSteps; ++k) reps[r].push_back(s.run_step(k));
          return;
        }
        s.launch_step(1);
        for (int64_t k = 1; k <= kSteps; ++k) {
          if (k < kSteps && s.can_launch_ahead()) {
            s.launch_step(k + 1);
            reps[r].push_back(s.finish_step(k));
          } else {
            reps[r].push_back(s.finish_step(k));
            if (k < kSteps) s.launch_step(k + 1);
          }
        }
      });
    }
    for (auto& t : th) t.join();
    return reps[0];
  }

  static double rel(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

  static fs::path* root_;
};

fs::path* StageEngine::root_ = nullptr;

void expect_bitwise(const std::vector<StepReport>& a, const std::vector<StepReport>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].step, b[i].step) << what;
    EXPECT_EQ(a[i].loss, b[i].loss) << what << " step " << i + 1;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << what << " step " << i + 1;
    EXPECT_EQ(a[i].aux_loss, b[i].aux_loss) << what << " step " << i + 1;
    EXPECT_EQ(a[i].expert_load, b[i].expert_load) << what << " step " << i + 1;
    EXPECT_EQ(a[i].tokens, b[i].tokens) << what << " step " << i + 1;
  }
}

TEST_F(StageEngine, LaunchAheadGivesTheSameStepsBitwise) {
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{}, std::vector<std::string>{"parallel.dp=2"}}) {
    const std::string what = layout.empty() ? "1x1x1" : layout[0];
    const auto seq = train(layout, false);
    const auto ahead = train(layout, true);
    expect_bitwise(seq, ahead, what);
    for (const auto& r : seq) EXPECT_TRUE(std::isfinite(r.loss) && r.loss > 0) << what;
    EXPECT_GT(seq.front().tokens, 0) << what;
    for (const auto& r : seq) EXPECT_EQ(r.expert_load.size(), 2u) << what;  // tiny.toml: two MoE blocks
  }
}

TEST_F(StageEngine, DeviceStatisticsEqualTheHostSums) {
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"parallel.dp=2"},
        std::vector<std::string>{"parallel.pp=2", "parallel.n=2", "train.global_batch=4"}}) {
    std::vector<std::string> host = layout;
    host.push_back("bench.device_stats=false");
    const auto dev = train(layout, false);
    const auto ref = train(host, false);
    ASSERT_EQ(dev.size(), ref.size());
    for (size_t i = 0; i < dev.size(); ++i) {
      EXPECT_LE(rel(dev[i].loss, ref[i].loss), 1e-5) << layout[0] << " step " << i + 1;
      EXPECT_LE(rel(dev[i].grad_norm, ref[i].grad_norm), 1e-5) << layout[0] << " step " << i + 1;
      EXPECT_LE(rel(dev[i].aux_loss, ref[i].aux_loss), 1e-5) << layout[0] << " step " << i + 1;
      EXPECT_EQ(dev[i].expert_load, ref[i].expert_load) << layout[0] << " step " << i + 1;
      EXPECT_EQ(dev[i].tokens, ref[i].tokens) << layout[0] << " step " << i + 1;
    }
  }
}

TEST_F(StageEngine, FoldedNormEqualsTheReadNorm) {
  const auto fold = train({"parallel.n=2"}, false);
  const auto read = train({"parallel.n=2", "bench.fold_grad_norm=false"}, false);
  ASSERT_EQ(fold.size(), read.size());
  for (size_t i = 0; i < fold.size(); ++i) {
    EXPECT_LE(rel(fold[i].grad_norm, read[i].grad_norm), 1e-5) << "step " << i + 1;
    EXPECT_LE(rel(fold[i].loss, read[i].loss), 1e-5) << "step " << i + 1;
  }
}

TEST_F(StageEngine, Bf16ExpertGradientsReduceOverDataParallelRanks) {
  const auto bf16 = train({"parallel.dp=2", "train.expert_grads=\"bf16\""}, false);
  const auto f32 = train({"parallel.dp=2"}, false);
  ASSERT_EQ(bf16.size(), f32.size());
  bool differs = false;
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_LE(rel(bf16[i].loss, f32[i].loss), 1e-2) << "step " << i + 1;
    EXPECT_LE(rel(bf16[i].grad_norm, f32[i].grad_norm), 2e-2) << "step " << i + 1;
    differs = differs || bf16[i].grad_norm != f32[i].grad_norm;
  }
  EXPECT_TRUE(differs) << "the bf16 gradients left every norm bitwise f32's";
}

TEST_F(StageEngine, StateWithAStepInFlightFailsLoudly) {
  const layers::TrainConfig tc = config({});
  auto stages = make(tc, "inflight");
  Stage& s = *stages[0];
  s.launch_step(1);
  EXPECT_DEATH((void)s.evaluate(), "launched and not finished");
  EXPECT_DEATH((void)s.finish_step(2), "oldest unfinished step is 1");
  EXPECT_DEATH(s.launch_step(3), "after step 1");
  (void)s.finish_step(1);
  EXPECT_GT(s.evaluate(), 0.0);
}

}  // namespace
