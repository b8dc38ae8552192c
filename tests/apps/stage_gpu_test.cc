// tests/apps/stage_gpu_test.cc — the framework's Stage on one GPU, through the Trainer
// (label gpu; exits 77 where the build has no CUDA or no GPU is visible). Two apps, each
// with layout 1x1x1 and one worker on the GPU (bf16 activations, NCCL communicators of one
// rank), against a reference:
//   - dense_lm --backend cuda against dense_lm on the CPU (the same Stage and program);
//   - `troupe run --nproc 1 -- train_moe --backend cuda` (the Trainer and one worker
//     process running the MoE stage program) against `train_moe --backend cuda` (the same
//     Trainer and Stage in one process), with the device timeline of the worker's steps.
// Losses agree within bf16 tolerance (2e-2 relative) at every step (the MoE pair runs the
// same kernels in the same order: measured bitwise equal), and dense_lm learns.
// Also train_moe's GPU runs with the gradient norm folded into the experts'
// dW products (bench.fold_grad_norm, the default) against the full pass, and
// its steps replayed from a CUDA graph (bench.cuda_graph, the default) against launches,
// and two runs with the attention's dQ in its own kernel (train.attention_fused_dq=false),
// and bf16 expert gradients (train.expert_grads) against f32 ones. And the Stage's own
// step captured as a CUDA graph against its op-by-op steps, bitwise, with no host read in
// any step.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"
#include "tests/common/visible_gpus.h"

namespace troupe::test {
namespace {

class StageGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(make_run_root("stage-gpu"));
    const RunResult r =
        prepare_data(*root_ / "data", PrepareSpec{}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    remove_run_root(*root_);
    delete root_;
    root_ = nullptr;
  }
  // `learns`: the loss must also fall over the run (dense_lm; the tiny MoE model's 10
  // steps of 32 tokens are too noisy for that).
  static void expect_close(const fs::path& ref_dir, const fs::path& got_dir, const std::string& what,
                           bool learns) {
    const auto ref = latest_step_records(ref_dir / "metrics.jsonl");
    const auto got = latest_step_records(got_dir / "metrics.jsonl");
    ASSERT_EQ(ref.size(), got.size()) << what;
    ASSERT_GE(ref.size(), 8u) << what;
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double d = rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>());
      EXPECT_LE(d, 2e-2) << what << " step " << ref[i]["step"] << ": " << ref[i]["loss"] << " vs "
                         << got[i]["loss"];
      worst = std::max(worst, d);
    }
    if (learns) {
      EXPECT_LT(got.back()["loss"].get<double>(), got.front()["loss"].get<double>())
          << what << ": no learning";
    }
    std::printf("[stage-gpu %s] %zu steps, worst relative loss difference %.3g (loss %.4f -> %.4f)\n",
                what.c_str(), got.size(), worst, got.front()["loss"].get<double>(),
                got.back()["loss"].get<double>());
  }
  static fs::path* root_;
};

fs::path* StageGpu::root_ = nullptr;

TEST_F(StageGpu, DenseLmOnTheGpuMatchesTheCpu) {
  auto cmd = [](const std::string& name, const std::string& backend) {
    return std::vector<std::string>{
        DENSE_LM_BIN,
        "--config",
        (fs::path(TROUPE_SOURCE_DIR) / "apps/examples/dense_lm/dense_lm.toml").string(),
        "--backend",
        backend,
        "--run-dir",
        (*root_ / name).string(),
        "--set",
        fmt::format("data.dir=\"{}\"", (*root_ / "data").string()),
        "--set",
        "model.vocab_size=320",
        "--set",
        "train.steps=10",
        "--set",
        "train.seq_len=64",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "train.eval_every=0"};
  };
  const RunResult cpu = run(cmd("dense-cpu", "cpu"), *root_ / "dense-cpu.log", std::chrono::seconds(300));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  const RunResult gpu = run(cmd("dense-gpu", "cuda"), *root_ / "dense-gpu.log", std::chrono::seconds(300));
  ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
  expect_close(*root_ / "dense-cpu", *root_ / "dense-gpu", "dense_lm cuda vs cpu", true);
}

TEST_F(StageGpu, TrainMoeTroupeRunMatchesOneProcess) {
  TrainMoeCommand c;
  c.backend = "cuda";
  c.sets = tiny_model_sets({.steps = 10, .data_dir = *root_ / "data"});
  c.run_dir = *root_ / "moe-one";
  const RunResult one = run(c.argv(), *root_ / "moe-one.log", std::chrono::seconds(300));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  c.run_dir = *root_ / "moe-trainer";
  std::vector<std::string> a = {TROUPE_CLI_BIN, "run", "--nproc", "1", "--backend", "cuda", "--"};
  for (const std::string& s : c.argv()) a.push_back(s);
  const RunResult tr = run(a, *root_ / "moe-trainer.log", std::chrono::seconds(300));
  ASSERT_EQ(tr.exit_code, 0) << tr.output;
  expect_close(*root_ / "moe-one", *root_ / "moe-trainer", "train_moe troupe run vs one process (cuda)",
               false);
  // Both forms report the device's own clock for each step (CUDA events on the Stage's
  // stream) and the worker's queue.
  for (const char* run_dir : {"moe-one", "moe-trainer"}) {
    const auto recs = latest_step_records(*root_ / run_dir / "metrics.jsonl");
    for (const auto& r : recs) {
      EXPECT_GT(r.value("device_ms", -1.0), 0.0) << run_dir << ": " << r.dump();
      if (r["step"].get<int64_t>() > 1) {
        EXPECT_GE(r.value("device_gap_ms", -1.0), 0.0) << run_dir << ": " << r.dump();
      }
      EXPECT_TRUE(r.contains("next_queued")) << run_dir << ": " << r.dump();
    }
  }
}

// The clip's gradient norm folded into the experts' dW epilogue (Hopper: the TMA kernel's)
// equals the norm read from every gradient: the same gradients (the fold leaves dW as it
// is), summed in another order.
TEST_F(StageGpu, TrainMoeFoldedGradNormMatchesTheFullPass) {
  auto train = [](const std::string& name, bool fold) {
    TrainMoeCommand c;
    c.backend = "cuda";
    c.sets = tiny_model_sets({.global_batch = 2, .steps = 6, .data_dir = *root_ / "data"});
    c.sets.push_back(fmt::format("bench.fold_grad_norm={}", fold));
    c.run_dir = *root_ / name;
    return run(c.argv(), *root_ / (name + ".log"), std::chrono::seconds(300));
  };
  const RunResult full = train("moe-full-norm", false);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_EQ(full.output.find("gradient norm folded"), std::string::npos) << full.output;
  const RunResult folded = train("moe-folded-norm", true);
  ASSERT_EQ(folded.exit_code, 0) << folded.output;
  EXPECT_NE(folded.output.find("gradient norm folded"), std::string::npos) << folded.output;
  const auto ref = latest_step_records(*root_ / "moe-full-norm" / "metrics.jsonl");
  const auto got = latest_step_records(*root_ / "moe-folded-norm" / "metrics.jsonl");
  ASSERT_EQ(ref.size(), got.size());
  ASSERT_GE(ref.size(), 6u);
  // Step 1 starts from the same weights: only the summation order differs.
  const double n0 = ref[0]["grad_norm"].get<double>(), g0 = got[0]["grad_norm"].get<double>();
  EXPECT_GT(n0, 0.0);
  EXPECT_LE(rel_diff(n0, g0), 1e-5) << n0 << " vs " << g0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LE(rel_diff(ref[i]["grad_norm"].get<double>(), got[i]["grad_norm"].get<double>()), 1e-3)
        << "step " << ref[i]["step"];
    EXPECT_LE(rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>()), 1e-3)
        << "step " << ref[i]["step"];
  }
  std::printf("[stage-gpu folded norm] %zu steps, step 1 grad norm %.6g vs %.6g\n", got.size(), n0, g0);
}

// train.expert_grads = "bf16": the experts' dW products write bf16 gradients (on Hopper the
// TMA kernel, folding their sums of squares of the rounded values). The folded norm equals
// the norm read from those bf16 gradients (same values, another order), and the run
// follows the f32-gradient run within bf16 tolerance: a gradient rounded once changes each
// element by at most 2^-9 of itself.
TEST_F(StageGpu, TrainMoeBf16ExpertGradsMatchF32) {
  auto train = [](const std::string& name, const char* grads, bool fold) {
    TrainMoeCommand c;
    c.backend = "cuda";
    c.sets = tiny_model_sets({.global_batch = 2, .steps = 6, .data_dir = *root_ / "data"});
    c.sets.push_back("model.moe.z_loss_coef=0.0");
    c.sets.push_back(fmt::format("train.expert_grads={}", grads));
    c.sets.push_back(fmt::format("bench.fold_grad_norm={}", fold));
    c.run_dir = *root_ / name;
    return run(c.argv(), *root_ / (name + ".log"), std::chrono::seconds(300));
  };
  const RunResult f32 = train("moe-grads-f32", "f32", true);
  ASSERT_EQ(f32.exit_code, 0) << f32.output;
  EXPECT_EQ(f32.output.find("weight gradients are bf16"), std::string::npos) << f32.output;
  const RunResult bf16 = train("moe-grads-bf16", "bf16", true);
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  EXPECT_NE(bf16.output.find("the experts' weight gradients are bf16"), std::string::npos) << bf16.output;
  EXPECT_NE(bf16.output.find("gradient norm folded"), std::string::npos) << bf16.output;
  const RunResult full = train("moe-grads-bf16-full", "bf16", false);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const auto ref = latest_step_records(*root_ / "moe-grads-f32" / "metrics.jsonl");
  const auto got = latest_step_records(*root_ / "moe-grads-bf16" / "metrics.jsonl");
  const auto read = latest_step_records(*root_ / "moe-grads-bf16-full" / "metrics.jsonl");
  ASSERT_EQ(ref.size(), 6u);
  ASSERT_EQ(got.size(), ref.size());
  ASSERT_EQ(read.size(), ref.size());
  // Step 1: the same bf16 gradients, their squares summed in the epilogue or read back.
  const double g0 = got[0]["grad_norm"].get<double>(), r0 = read[0]["grad_norm"].get<double>();
  EXPECT_GT(g0, 0.0);
  EXPECT_LE(rel_diff(g0, r0), 1e-5) << g0 << " vs " << r0;
  // Against f32 gradients: the same forward at step 1, a norm within rounding.
  EXPECT_EQ(ref[0]["loss"].get<double>(), got[0]["loss"].get<double>());
  const double f0 = ref[0]["grad_norm"].get<double>();
  EXPECT_LE(rel_diff(f0, g0), 1e-2) << f0 << " vs " << g0;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>());
    EXPECT_LE(d, 2e-2) << "step " << ref[i]["step"] << ": " << ref[i]["loss"] << " vs " << got[i]["loss"];
    worst = std::max(worst, d);
  }
  std::printf(
      "[stage-gpu bf16 expert grads] step 1 grad norm f32 %.6g, bf16 folded %.6g, bf16 read %.6g; "
      "worst relative loss difference %.3g over %zu steps\n",
      f0, g0, r0, worst, got.size());
}

// A CUDA graph of the step (bench.cuda_graph, the default): step 1 runs launch by launch,
// step 2 is captured, the rest replay it, with evaluations (eager work and allocations)
// between replays. The same kernels run in the same order on the same inputs, so every
// step's loss and gradient norm equal the launch-by-launch run's. Replays are launched
// ahead (bench.launch_ahead): steps 3, 5, 6 and 8 are enqueued before the statistics of
// the step before them are read (not 4 and 7, which follow the evaluations at 3 and 6).
TEST_F(StageGpu, TrainMoeCudaGraphStepsMatchLaunchByLaunch) {
  auto train = [](const std::string& name, bool graph) {
    TrainMoeCommand c;
    c.backend = "cuda";
    c.sets = tiny_model_sets({.steps = 8, .data_dir = *root_ / "data"});
    c.sets.push_back("model.moe.z_loss_coef=0.0");
    c.sets.push_back("train.eval_every=3");
    c.sets.push_back(fmt::format("bench.cuda_graph={}", graph));
    c.run_dir = *root_ / name;
    return run(c.argv(), *root_ / (name + ".log"), std::chrono::seconds(300));
  };
  const RunResult eager = train("moe-launches", false);
  ASSERT_EQ(eager.exit_code, 0) << eager.output;
  EXPECT_EQ(eager.output.find("CUDA graph"), std::string::npos) << eager.output;
  const RunResult graph = train("moe-graph", true);
  ASSERT_EQ(graph.exit_code, 0) << graph.output;
  EXPECT_NE(graph.output.find("step 2 captured as a CUDA graph"), std::string::npos) << graph.output;
  // bench.launch_ahead (the default): a replayed step between two evaluations was enqueued
  // before the one before it was finished (the worker's launched_ahead).
  bool ahead = false;
  for (const auto& r : latest_step_records(*root_ / "moe-graph" / "metrics.jsonl"))
    ahead |= r.value("launched_ahead", false);
  EXPECT_TRUE(ahead) << graph.output;
  const auto ref = latest_step_records(*root_ / "moe-launches" / "metrics.jsonl");
  const auto got = latest_step_records(*root_ / "moe-graph" / "metrics.jsonl");
  ASSERT_EQ(ref.size(), got.size());
  ASSERT_EQ(ref.size(), 8u);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    for (const char* key : {"loss", "grad_norm", "aux_loss"}) {
      const double d = rel_diff(ref[i][key].get<double>(), got[i][key].get<double>());
      EXPECT_LE(d, 1e-6) << key << " at step " << ref[i]["step"] << ": " << ref[i][key] << " vs "
                         << got[i][key];
      worst = std::max(worst, d);
    }
    EXPECT_EQ(ref[i]["expert_load"], got[i]["expert_load"]) << "step " << ref[i]["step"];
    EXPECT_EQ(got[i]["host_syncs"].get<int64_t>(), 0) << "step " << got[i]["step"];
    if (ref[i].contains("val_loss")) {
      ASSERT_TRUE(got[i].contains("val_loss")) << "step " << got[i]["step"];
      EXPECT_LE(rel_diff(ref[i]["val_loss"].get<double>(), got[i]["val_loss"].get<double>()), 1e-6);
    }
  }
  EXPECT_GT(got.back()["peak_bytes"].get<int64_t>(), 0);
  std::printf("[stage-gpu cuda graph] %zu steps, worst relative difference %.3g (loss %.4f -> %.4f)\n",
              got.size(), worst, got.front()["loss"].get<double>(), got.back()["loss"].get<double>());
}

// The Stage's step engine on one GPU through the Trainer (`troupe run --nproc 1`): the
// step captured as a CUDA graph at step 2 and replayed after (evaluations between
// replays) gives bitwise the losses of the op-by-op Stage (the attention's dQ in a fixed
// order, train.attention_fused_dq = false, so that two runs can be bitwise equal), no
// step of either reads the device from the host (host_syncs 0: the statistics leave the
// device by one asynchronous copy per step; tiny.toml's routers have a z-loss, kept on
// the device too), and every step reports its peak memory.
TEST_F(StageGpu, StageCudaGraphStepsMatchOpByOpBitwise) {
  auto train = [](const std::string& name, bool graph) {
    TrainMoeCommand c;
    c.backend = "cuda";
    c.sets = tiny_model_sets({.global_batch = 2, .steps = 8, .data_dir = *root_ / "data"});
    c.sets.push_back("train.eval_every=3");
    c.sets.push_back("train.attention_fused_dq=false");
    c.sets.push_back("train.expert_grads=\"bf16\"");
    c.sets.push_back("train.master_weights=\"split\"");
    c.sets.push_back(fmt::format("bench.cuda_graph={}", graph));
    c.run_dir = *root_ / name;
    std::vector<std::string> a = {TROUPE_CLI_BIN, "run", "--nproc", "1", "--backend", "cuda", "--"};
    for (const std::string& s : c.argv()) a.push_back(s);
    return run(a, *root_ / (name + ".log"), std::chrono::seconds(300));
  };
  const RunResult eager = train("stage-launches", false);
  ASSERT_EQ(eager.exit_code, 0) << eager.output;
  EXPECT_EQ(eager.output.find("captured as a CUDA graph"), std::string::npos) << eager.output;
  const RunResult graph = train("stage-graph", true);
  ASSERT_EQ(graph.exit_code, 0) << graph.output;
  EXPECT_NE(graph.output.find("step 2 captured as a CUDA graph"), std::string::npos) << graph.output;
  const auto ref = latest_step_records(*root_ / "stage-launches" / "metrics.jsonl");
  const auto got = latest_step_records(*root_ / "stage-graph" / "metrics.jsonl");
  ASSERT_EQ(ref.size(), 8u);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_EQ(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>()) << "step " << ref[i]["step"];
    EXPECT_EQ(ref[i]["aux_loss"].get<double>(), got[i]["aux_loss"].get<double>())
        << "step " << ref[i]["step"];
    EXPECT_EQ(ref[i]["expert_load"], got[i]["expert_load"]) << "step " << ref[i]["step"];
    for (const auto* r : {&ref[i], &got[i]}) {
      ASSERT_TRUE(r->contains("host_syncs")) << r->dump();
      EXPECT_EQ((*r)["host_syncs"].get<int64_t>(), 0) << r->dump();
      EXPECT_GT((*r)["peak_bytes"].get<int64_t>(), 0) << r->dump();
    }
  }
  std::printf("[stage-gpu stage graph] %zu steps bitwise equal (loss %.6f -> %.6f)\n", got.size(),
              got.front()["loss"].get<double>(), got.back()["loss"].get<double>());
}

// train.attention_fused_dq = false: two runs of a model with head dim 64 and sequences of
// two key blocks (on Hopper the default then adds dQ from both blocks in no fixed order)
// give the same losses to rounding of the last bits: the attention is reproducible, but
// the embedding backward's atomic adds of repeated ids are not, and a last-bit change in
// an embedding row reaches the next steps' losses (measured on H200s: 6 steps bitwise
// equal in most runs, step 3 differing in its last bits in one; relative 1e-6 bounds it).
TEST_F(StageGpu, TrainMoeSplitAttentionDqRunsGiveTheSameLosses) {
  auto train = [](const std::string& name) {
    TrainMoeCommand c;
    c.backend = "cuda";
    c.sets = tiny_model_sets({.steps = 6, .data_dir = *root_ / "data"});
    for (std::string& s : c.sets) {
      if (s == "model.d_model=32") s = "model.d_model=256";
      if (s == "train.seq_len=16") s = "train.seq_len=256";
    }
    for (const char* s : {"model.n_heads=4", "model.n_kv_heads=2", "train.attention_fused_dq=false"}) {
      c.sets.emplace_back(s);
    }
    c.run_dir = *root_ / name;
    return run(c.argv(), *root_ / (name + ".log"), std::chrono::seconds(300));
  };
  const RunResult first = train("moe-split-dq-1");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const RunResult second = train("moe-split-dq-2");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const auto ref = latest_step_records(*root_ / "moe-split-dq-1" / "metrics.jsonl");
  const auto got = latest_step_records(*root_ / "moe-split-dq-2" / "metrics.jsonl");
  ASSERT_EQ(ref.size(), 6u);
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0;
  int bitwise = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    for (const char* key : {"loss", "aux_loss"}) {
      const double d = rel_diff(ref[i][key].get<double>(), got[i][key].get<double>());
      EXPECT_LE(d, 1e-6) << key << " at step " << ref[i]["step"];
      worst = std::max(worst, d);
      bitwise += ref[i][key].get<double>() == got[i][key].get<double>();
    }
    EXPECT_LE(rel_diff(ref[i]["grad_norm"].get<double>(), got[i]["grad_norm"].get<double>()), 1e-6)
        << "step " << ref[i]["step"];
  }
  std::printf(
      "[stage-gpu split dQ] %zu steps: %d of %zu losses and aux losses bitwise equal, worst relative "
      "difference "
      "%.3g (target <= 1e-6; loss %.6f -> %.6f)\n",
      got.size(), bitwise, 2 * got.size(), worst, got.front()["loss"].get<double>(),
      got.back()["loss"].get<double>());
}

}  // namespace
}  // namespace troupe::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int gpus = troupe::test::visible_gpus();
  if (gpus < 1) {
    std::printf("skipping: no CUDA device visible\n");
    return 77;
  }
  return RUN_ALL_TESTS();
}
