// tests/training/stage_state_test.cc — Stage::export_state / import_state, the API a
// lost rank is rebuilt with and checkpoints are written from: two data-parallel
// Stages (threads of this process, Gloo on loopback, a FileStore rendezvous) train two
// steps and export what they hold; a fresh pair imports it from those exports and the
// next step's loss and gradient norm equal the original pair's exactly. Also: what each
// scope holds, and a clear error when the given states do not hold a rank's slices.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

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

class StageState : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::random_device rd;
    root_ = new fs::path(fs::temp_directory_path() / fmt::format("troupe-stage-state-{}-{:x}", getpid(), rd()));
    fs::create_directories(*root_);
    const std::string src = TROUPE_SOURCE_DIR;
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string log = (*root_ / "prepare.log").string();
      FILE* f = std::fopen(log.c_str(), "w");
      if (f != nullptr) dup2(fileno(f), 1), dup2(fileno(f), 2);
      execl(TROUPE_TRAIN_MOE_BIN, TROUPE_TRAIN_MOE_BIN, "prepare", "--input", (src + "/layers").c_str(), "--out",
            (*root_ / "data").c_str(), "--vocab", "320", "--max-bytes", "200000", "--ext", ".cc", "--ext", ".h", static_cast<char*>(nullptr));
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

  static layers::TrainConfig config() {
    auto tc = layers::load_train_config(
        std::string(TROUPE_SOURCE_DIR) + "/apps/configs/tiny.toml",
        {"model.vocab_size=320", "model.d_model=32", "model.ffn_hidden=64", "model.moe.num_experts=4",
         "model.moe.expert_hidden=32", "train.seq_len=16", "train.micro_batch_size=2", "train.steps=10",
         "optim.warmup_steps=2", "parallel.dp=2", fmt::format("data.dir=\"{}\"", (*root_ / "data").string())});
    EXPECT_TRUE(tc.ok()) << tc.status().to_string();
    return *tc;
  }

  // Creates the dp=2 pair under `job` (threads: creation is collective).
  static std::vector<std::unique_ptr<Stage>> make_pair(const std::string& job) {
    const layers::TrainConfig tc = config();
    std::vector<std::unique_ptr<Stage>> stages(2);
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r) {
      th.emplace_back([&, r] {
        auto store = comm::FileStore::open(*root_ / "store");
        ASSERT_TRUE(store.ok());
        comm::StoreNamespace ns{job, 0};
        auto train = layers::TokenShards::open(tc.data.dir, "train");
        auto val = layers::TokenShards::open(tc.data.dir, "val");
        ASSERT_TRUE(train.ok()) << train.status().to_string();
        ASSERT_TRUE(val.ok()) << val.status().to_string();
        auto s = Stage::create(tc, r, train_moe::moe_stage_program(), **store, ns, std::move(*train),
                               std::move(*val));
        ASSERT_TRUE(s.ok()) << s.status().to_string();
        stages[static_cast<size_t>(r)] = std::move(*s);
      });
    }
    for (auto& t : th) t.join();
    return stages;
  }

  // Runs `f` on both stages at once (collectives need both).
  static void both(std::vector<std::unique_ptr<Stage>>& s, const std::function<void(Stage&, int)>& f) {
    std::thread t1([&] { f(*s[1], 1); });
    f(*s[0], 0);
    t1.join();
  }

  static fs::path* root_;
};

fs::path* StageState::root_ = nullptr;

TEST_F(StageState, ImportFromExportedStatesContinuesTheRunExactly) {
  auto a = make_pair("a");
  ASSERT_TRUE(a[0] && a[1]);
  both(a, [](Stage& s, int) {
    s.run_step(1);
    s.run_step(2);
  });
  troupe::training::StageState held[2], saved[2];
  for (int r = 0; r < 2; ++r) {
    auto h = a[static_cast<size_t>(r)]->export_state(StateScope::kHeld, /*copy=*/true);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    held[r] = std::move(*h);
    auto v = a[static_cast<size_t>(r)]->export_state(StateScope::kSave, /*copy=*/false);
    ASSERT_TRUE(v.ok());
    saved[r] = std::move(*v);
  }
  EXPECT_EQ(held[0].step, 2);
  EXPECT_EQ(held[1].rank_state["data"]["next_step"], 3);
  // Held: both ranks hold every parameter, each its own half of the moments. Saved: the
  // parameters once (dp rank 0), the moments by their owners.
  auto count = [](const troupe::training::StageState& s, const std::string& prefix) {
    int n = 0;
    for (const auto& e : s.slices) n += e.name.rfind(prefix, 0) == 0 ? 1 : 0;
    return n;
  };
  EXPECT_GT(count(held[1], "blocks."), 0);
  EXPECT_EQ(count(saved[1], "blocks."), 0);
  EXPECT_EQ(count(saved[0], "blocks."), count(held[0], "blocks."));
  EXPECT_GT(count(saved[1], "opt.m."), 0);
  EXPECT_EQ(count(saved[1], "opt.v."), count(held[1], "opt.v."));

  // A fresh pair (step 0, initial weights) takes the exported state.
  auto b = make_pair("b");
  ASSERT_TRUE(b[0] && b[1]);
  // Rank 0 alone does not hold rank 1's optimizer shard: a clear error naming a moment.
  {
    const Status st = b[1]->import_state(slice_source(std::vector<const troupe::training::StageState*>{&held[0]}), 2);
    EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
    EXPECT_NE(st.to_string().find("opt."), std::string::npos) << st.to_string();
  }
  const SliceSource src = slice_source(std::vector<const troupe::training::StageState*>{&held[0], &held[1]});
  both(b, [&](Stage& s, int) { ASSERT_TRUE(s.import_state(src, 2).ok()); });
  EXPECT_EQ(b[0]->steps_done(), 2);
  StepReport ra[2], rb[2];
  both(a, [&](Stage& s, int r) { ra[r] = s.run_step(3); });
  both(b, [&](Stage& s, int r) { rb[r] = s.run_step(3); });
  EXPECT_EQ(ra[0].loss, rb[0].loss);
  EXPECT_EQ(ra[0].grad_norm, rb[0].grad_norm);
  EXPECT_EQ(ra[0].expert_load, rb[0].expert_load);
  std::printf("[dp peer restore] step 3 loss %.9f (original) vs %.9f (restored)\n", ra[0].loss, rb[0].loss);
  // The step after: the optimizer moments and step count were restored too.
  both(a, [&](Stage& s, int r) { ra[r] = s.run_step(4); });
  both(b, [&](Stage& s, int r) { rb[r] = s.run_step(4); });
  EXPECT_EQ(ra[0].loss, rb[0].loss);
  EXPECT_EQ(ra[1].grad_norm, rb[1].grad_norm);
}

}  // namespace
