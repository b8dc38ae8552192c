// tests/training/training_gpu_test.cc — distributed training on two GPUs against one
// (label gpu; exits 77 where the build has no CUDA or fewer than two GPUs are visible).
//
// The real binary runs, as in training_equivalence_test: `train_moe prepare` makes a small
// corpus from this repository's sources; a small MoE model (every layer's kernels on their
// CUDA paths: head dim 64, grouped-query attention, 8 experts top-2, dropless) trains for
// a few steps with --backend cuda on one GPU (the reference), then with the standalone
// launcher on two GPUs: --parallel n=2 (Ulysses attention and expert parallelism over
// NCCL, bf16 activations on the wire) and --parallel dp=2 (ZeRO-1 over NCCL, grad_accum
// 1 against the reference's 2). bf16 activations make the runs differ by rounding only:
// the first steps' loss within 2% and gradient norm within 5% of the reference, the loss
// falling, and mfu and peak_bytes in every step's metrics. Every child runs in its own
// process group, bounded by a timeout, and is killed and reaped on failure.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"

#if TROUPE_TEST_HAVE_CUDA
#include "core/cuda/stream.h"
#endif

namespace {

namespace fs = std::filesystem;
using troupe::test::rel_diff;
using troupe::test::RunResult;
using troupe::test::step_records;

int visible_gpus() {
#if TROUPE_TEST_HAVE_CUDA
  return troupe::cuda::device_count();
#else
  return 0;
#endif
}

constexpr int64_t kSteps = 8;

class TrainingGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-training-gpu"));
    const RunResult p = troupe::test::prepare_data(
        *root_ / "data", {{"layers", "kernels", "comm"}, {".cc", ".h", ".cu"}, 512, 2000000},
        *root_ / "prepare.log", std::chrono::seconds(180));
    ASSERT_EQ(p.exit_code, 0) << p.output;
  }
  static void TearDownTestSuite() {
    troupe::test::remove_run_root(*root_);
    delete root_;
  }

  // d 256, 2 blocks (dense, MoE), 4 heads / 2 kv heads (head dim 64), 8 experts top-2,
  // sequences of 256, micro-batches of 4.
  static std::vector<std::string> args(const std::string& name, int64_t grad_accum,
                                       const std::string& parallel) {
    troupe::test::TrainMoeCommand c;
    c.backend = "cuda";
    c.run_dir = *root_ / name;
    c.sets = {"model.vocab_size=512",
              "model.d_model=256",
              "model.n_layers=2",
              "model.n_heads=4",
              "model.n_kv_heads=2",
              "model.ffn_hidden=512",
              "model.moe.num_experts=8",
              "model.moe.expert_hidden=256",
              "train.seq_len=256",
              "train.micro_batch_size=4",
              fmt::format("train.grad_accum={}", grad_accum),
              fmt::format("train.steps={}", kSteps),
              "train.eval_batches=2",
              "train.eval_every=0",
              "train.log_every=1",
              "optim.warmup_steps=2",
              fmt::format("data.dir=\"{}\"", (*root_ / "data").string())};
    c.parallel = parallel;
    return c.argv();
  }

  static std::vector<nlohmann::json> train(const std::string& name, int64_t grad_accum,
                                           const std::string& parallel,
                                           const std::vector<std::string>& extra = {}) {
    std::vector<std::string> a = args(name, grad_accum, parallel);
    a.insert(a.end(), extra.begin(), extra.end());
    const RunResult r = troupe::test::run(a, *root_ / (name + ".log"), std::chrono::seconds(240));
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    std::printf("%s", r.output.c_str());
    return step_records(*root_ / name / "metrics.jsonl");
  }

  // Per step: loss and gradient norm against the one-GPU reference; every step reports mfu.
  static void compare(const std::vector<nlohmann::json>& got, const std::vector<nlohmann::json>& ref,
                      bool per_gpu_peak) {
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps));
    for (int64_t i = 0; i < 3; ++i) {
      const auto& g = got[static_cast<size_t>(i)];
      const auto& r = ref[static_cast<size_t>(i)];
      std::printf("step %lld: loss %.5f vs %.5f, grad norm %.4f vs %.4f\n", static_cast<long long>(i + 1),
                  g["loss"].get<double>(), r["loss"].get<double>(), g["grad_norm"].get<double>(),
                  r["grad_norm"].get<double>());
      EXPECT_LT(rel_diff(r["loss"].get<double>(), g["loss"].get<double>()), 2e-2) << "step " << i + 1;
      EXPECT_LT(rel_diff(r["grad_norm"].get<double>(), g["grad_norm"].get<double>()), 5e-2)
          << "step " << i + 1;
    }
    EXPECT_LT(got.back()["loss"].get<double>(), got.front()["loss"].get<double>())
        << "the loss does not fall";
    for (const auto& g : got) {
      ASSERT_TRUE(g.contains("mfu")) << g.dump();
      EXPECT_GT(g["mfu"].get<double>(), 0.0);
      if (per_gpu_peak) {
        ASSERT_TRUE(g.contains("peak_bytes")) << g.dump();
        EXPECT_GT(g["peak_bytes"].get<double>(), 0.0);
      }
    }
  }

  static const std::vector<nlohmann::json>& reference() {
    static std::vector<nlohmann::json> ref;
    if (ref.empty()) ref = train("one_gpu", 2, "");
    return ref;
  }

  static fs::path* root_;
};

fs::path* TrainingGpu::root_ = nullptr;

TEST_F(TrainingGpu, ExpertAndSequenceParallelOnTwoGpus) {
  // n=2 keeps the reference's micro-batches: the same tokens split over the sequence.
  const std::vector<nlohmann::json>& ref = reference();
  compare(train("n2", 2, "n=2"), ref, true);
}

TEST_F(TrainingGpu, DataParallelOnTwoGpus) {
  const std::vector<nlohmann::json>& ref = reference();
  compare(train("dp2", 1, "dp=2"), ref, true);
}

TEST_F(TrainingGpu, CheckpointOnTwoGpusResumesOnOne) {
  // n=2 saves after step 4 (device state copied to the host); one GPU resumes from it and
  // must continue the same run: steps 5..8 within bf16 tolerance of the saving run's.
  const std::vector<nlohmann::json> saved = train("n2_saving", 2, "n=2", {"--set", "checkpoint.every=4"});
  ASSERT_EQ(saved.size(), static_cast<size_t>(kSteps));
  const fs::path ckpt = *root_ / "n2_saving" / "checkpoints" / "step_4";
  ASSERT_TRUE(fs::exists(ckpt / "manifest.json")) << ckpt;
  const std::vector<nlohmann::json> resumed = train("resumed_one_gpu", 2, "", {"--resume", ckpt.string()});
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - 4));
  for (size_t i = 0; i < resumed.size(); ++i) {
    const auto& g = resumed[i];
    const auto& r = saved[i + 4];
    ASSERT_EQ(g["step"].get<int64_t>(), r["step"].get<int64_t>());
    std::printf("resumed step %lld: loss %.5f vs %.5f\n", static_cast<long long>(g["step"].get<int64_t>()),
                g["loss"].get<double>(), r["loss"].get<double>());
    EXPECT_LT(rel_diff(r["loss"].get<double>(), g["loss"].get<double>()), 2e-2) << "step " << g["step"];
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int gpus = visible_gpus();
  if (gpus < 2) {
    std::printf("skipping: %d CUDA device(s) visible, 2 needed\n", gpus);
    return 77;
  }
  return RUN_ALL_TESTS();
}
