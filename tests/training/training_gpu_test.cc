// tests/training/training_gpu_test.cc — distributed training on two GPUs against one
// (label gpu; exits 77 where the build has no CUDA or fewer than two GPUs are visible).
//
// The real binary runs, as in training_equivalence_test: `train_moe prepare` makes a small
// corpus from this repository's sources; a small MoE model (every layer's kernels on their
// CUDA paths: head dim 64, grouped-query attention, 8 experts top-2, dropless) trains for
// a few steps with --backend cuda on one GPU (the reference), then with the standalone
// launcher on two GPUs: --parallel n=2 (Ulysses attention and expert parallelism over
// NCCL, bf16 activations on the wire) and --parallel dp=2 (ZeRO-1 over NCCL; the same
// global batch, one micro-batch per replica against the reference's 2). bf16 activations make the runs differ
// by rounding only: the first steps' loss within 2% and gradient norm within 5% of the reference, the loss
// falling, and mfu and peak_bytes in every step's metrics. Every child runs in its own
// process group, bounded by a timeout, and is killed and reaped on failure.
//
// Also on two GPUs: pp=2 (activations over NCCL send/recv on their own streams) and the
// all-gather expert dispatch against the same reference; and the GPU fault suite of a
// dp=2 job (each worker one GPU, an in-memory snapshot after every step): a worker
// SIGKILLed while its gradient reduce-scatter is issued is replaced (NCCL communicators
// aborted and rebuilt, every rank back to the newest snapshot, at most one step run
// again) with every loss equal to the fault-free dp=2 run's; a SIGSTOPped worker is found
// by its heartbeat, killed and replaced; dp 2 -> 1 -> 2 by scripted rescale requests (a
// snapshot of the step, restored into the new layout); the same kill under `troupe run`
// (the scheduler places the replacement on the freed GPU slot).
// Each prints its detection and recovery times and checks that no process of the job is
// left and no worker process still holds GPU memory.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"
#include "tests/common/visible_gpus.h"

namespace {

namespace fs = std::filesystem;
using troupe::test::events_named;
using troupe::test::latest_step_records;
using troupe::test::rel_diff;
using troupe::test::RunResult;
using troupe::test::step_records;

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
  // sequences of 256, micro-batches of 4, 8 sequences a step (2 micro-batches at 1x1x1,
  // one per replica at dp=2).
  static std::vector<std::string> args(const std::string& name, const std::string& parallel) {
    troupe::test::TrainMoeCommand c;
    c.backend = "cuda";
    c.run_dir = *root_ / name;
    c.sets = {"model.vocab_size=512", "model.d_model=256", "model.n_layers=2", "model.n_heads=4",
              "model.n_kv_heads=2", "model.ffn_hidden=512", "model.moe.num_experts=8",
              "model.moe.expert_hidden=256", "train.seq_len=256", "train.micro_batch_size=4",
              "train.global_batch=8", fmt::format("train.steps={}", kSteps), "train.eval_batches=2",
              "train.eval_every=0", "train.log_every=1", "optim.warmup_steps=2",
              // The recoveries are checked against the fault-free run's losses (1e-6): the
              // Hopper attention's dQ in its own, fixed-order kernel.
              "train.attention_fused_dq=false", fmt::format("data.dir=\"{}\"", (*root_ / "data").string())};
    c.parallel = parallel;
    return c.argv();
  }

  static std::vector<nlohmann::json> train(const std::string& name, const std::string& parallel,
                                           const std::vector<std::string>& extra = {}) {
    std::vector<std::string> a = args(name, parallel);
    a.insert(a.end(), extra.begin(), extra.end());
    const RunResult r = troupe::test::run(a, *root_ / (name + ".log"), std::chrono::seconds(240));
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    std::printf("%s", r.output.c_str());
    return step_records(*root_ / name / "metrics.jsonl");
  }

  // ---- the GPU fault suite: dp=2, one GPU per worker ----------------------------------
  static constexpr int64_t kHeartbeatTimeoutMs = 3000;

  // A dp=2 job's command line with the fault to inject and further settings; `troupe_run`:
  // under `troupe run --nproc 2` (the embedded scheduler places the workers).
  static std::vector<std::string> dp2_args(const std::string& name, const std::string& fault,
                                           std::vector<std::string> extra = {}, bool troupe_run = false) {
    std::vector<std::string> a = args(name, "dp=2");
    a.insert(a.end(), {"--set", fmt::format("elastic.heartbeat_timeout_ms={}", kHeartbeatTimeoutMs)});
    a.insert(a.end(), {"--set", "elastic.snapshot_every=1"});
    if (!fault.empty()) a.insert(a.end(), {"--set", fmt::format("test.inject=\"{}\"", fault)});
    for (auto& e : extra) a.insert(a.end(), {"--set", std::move(e)});
    a.push_back("--allow-test-config");
    if (troupe_run) {
      a.insert(a.begin(), {TROUPE_CLI_BIN, "run", "--nproc", "2", "--backend", "cuda",
                           "--heartbeat-timeout-ms", std::to_string(kHeartbeatTimeoutMs), "--"});
    }
    return a;
  }

  static RunResult run_job(const std::string& name, const std::vector<std::string>& argv) {
    const RunResult r = troupe::test::run(argv, *root_ / (name + ".log"), std::chrono::seconds(300),
                                          {.group_exit_wait = std::chrono::milliseconds(3000)});
    std::printf("[gpu fault %s] ran in %.1f s\n", name.c_str(), r.seconds);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    EXPECT_TRUE(r.group_empty_after_exit) << name << ": a process of the job outlived it";
    return r;
  }

  // The fault-free dp=2 job (computed once).
  static const std::vector<nlohmann::json>& dp2_baseline() {
    static std::vector<nlohmann::json> ref;
    if (ref.empty()) {
      run_job("dp2_baseline", dp2_args("dp2_baseline", ""));
      ref = latest_step_records(*root_ / "dp2_baseline" / "metrics.jsonl");
      EXPECT_EQ(static_cast<int64_t>(ref.size()), kSteps);
    }
    return ref;
  }

  // Every step's loss against the fault-free dp=2 run's (relative, within `tol`).
  static void expect_baseline_losses(const std::string& name, double tol) {
    const auto& ref = dp2_baseline();
    const auto got = latest_step_records(*root_ / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), ref.size()) << name;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i]["step"], ref[i]["step"]);
      const double d = rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>());
      EXPECT_LE(d, tol) << name << " step " << i + 1;
      worst = std::max(worst, d);
    }
    std::printf("[gpu fault %s] %zu steps, max relative loss difference vs the fault-free dp=2 run %.3g\n",
                name.c_str(), got.size(), worst);
  }

  // One failure of `cause`, detected within `detect_limit_ms` of the fault, recovered
  // within 30 s (kill to the next completed step, NCCL re-initialisation included) with at
  // most one step lost (a snapshot after every step).
  static void expect_recovery(const std::string& name, const std::string& cause, int64_t detect_limit_ms) {
    const fs::path ev = *root_ / name / "events.jsonl";
    const auto det = events_named(ev, "failure_detected");
    const auto rec = events_named(ev, "recovered");
    ASSERT_EQ(det.size(), 1u) << name;
    ASSERT_EQ(rec.size(), 1u) << name;
    EXPECT_EQ(det[0]["cause"], cause) << det[0].dump();
    ASSERT_TRUE(det[0].contains("detection_ms")) << det[0].dump();
    const int64_t d = det[0]["detection_ms"].get<int64_t>();
    const double rs = rec[0]["recovery_s"].get<double>();
    EXPECT_GE(d, 0);
    EXPECT_LE(d, detect_limit_ms) << name;
    EXPECT_LE(rs, 30.0) << name;
    EXPECT_LE(rec[0]["steps_lost"].get<int64_t>(), 1) << rec[0].dump();
    std::printf(
        "[gpu fault %s] %s in step %lld: detected %lld ms after the fault (target <= %lld), next step "
        "completed %.2f s after detection (target <= 30), steps lost %lld\n",
        name.c_str(), cause.c_str(), static_cast<long long>(det[0]["step"].get<int64_t>()),
        static_cast<long long>(d), static_cast<long long>(detect_limit_ms), rs,
        static_cast<long long>(rec[0]["steps_lost"].get<int64_t>()));
  }

  // The pids of the job's workers (events.jsonl) hold no GPU memory any more.
  static void expect_gpu_memory_freed(const std::string& name) {
    std::set<long> pids;
    for (const auto& e : events_named(*root_ / name / "events.jsonl", "worker_started")) {
      if (e.contains("pid")) pids.insert(e["pid"].get<long>());
    }
    ASSERT_FALSE(pids.empty()) << name << ": no worker_started event with a pid";
    FILE* p = popen("nvidia-smi --query-compute-apps=pid --format=csv,noheader", "r");
    ASSERT_TRUE(p != nullptr);
    char line[128];
    int left = 0;
    while (std::fgets(line, sizeof line, p) != nullptr) {
      if (pids.count(std::strtol(line, nullptr, 10)) != 0) ++left;
    }
    const int rc = pclose(p);
    ASSERT_EQ(rc, 0) << "nvidia-smi --query-compute-apps failed: GPU memory not checked";
    EXPECT_EQ(left, 0) << name << ": a worker process of the job still holds GPU memory";
    std::printf("[gpu fault %s] %zu worker processes, none holds GPU memory after the job\n", name.c_str(),
                pids.size());
  }

  // Per step: loss and gradient norm against the one-GPU reference; every step reports mfu.
  // `no_host_reads`: every step of the layout reads nothing back to the host before its
  // metrics (host_syncs 0), as every layout whose step is a graph must.
  static void compare(const std::string& name, const std::vector<nlohmann::json>& got,
                      const std::vector<nlohmann::json>& ref, bool per_gpu_peak, bool no_host_reads) {
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
    int64_t most_reads = 0;
    for (const auto& g : got) {
      ASSERT_TRUE(g.contains("mfu")) << g.dump();
      EXPECT_GT(g["mfu"].get<double>(), 0.0);
      if (per_gpu_peak) {
        ASSERT_TRUE(g.contains("peak_bytes")) << g.dump();
        EXPECT_GT(g["peak_bytes"].get<double>(), 0.0);
      }
      ASSERT_TRUE(g.contains("host_syncs")) << g.dump();
      most_reads = std::max(most_reads, g["host_syncs"].get<int64_t>());
      if (no_host_reads) {
        EXPECT_EQ(g["host_syncs"].get<int64_t>(), 0) << name << " step " << g["step"];
      }
    }
    std::printf("[%s] host reads per step: at most %lld\n", name.c_str(), static_cast<long long>(most_reads));
  }

  static const std::vector<nlohmann::json>& reference() {
    static std::vector<nlohmann::json> ref;
    if (ref.empty()) ref = train("one_gpu", "");
    return ref;
  }

  static fs::path* root_;
};

fs::path* TrainingGpu::root_ = nullptr;

TEST_F(TrainingGpu, ExpertAndSequenceParallelOnTwoGpus) {
  // n=2 keeps the reference's micro-batches: the same tokens split over the sequence.
  const std::vector<nlohmann::json>& ref = reference();
  compare("n=2", train("n2", "n=2"), ref, true, true);
}

TEST_F(TrainingGpu, DataParallelOnTwoGpus) {
  const std::vector<nlohmann::json>& ref = reference();
  compare("dp=2", train("dp2", "dp=2"), ref, true, true);
}

TEST_F(TrainingGpu, CheckpointOnTwoGpusResumesOnOne) {
  // n=2 saves after step 4 (device state copied to the host); one GPU resumes from it and
  // must continue the same run: steps 5..8 within bf16 tolerance of the saving run's.
  const std::vector<nlohmann::json> saved = train("n2_saving", "n=2", {"--set", "checkpoint.every=4"});
  ASSERT_EQ(saved.size(), static_cast<size_t>(kSteps));
  const fs::path ckpt = *root_ / "n2_saving" / "checkpoints" / "step_4";
  ASSERT_TRUE(fs::exists(ckpt / "manifest.json")) << ckpt;
  const std::vector<nlohmann::json> resumed = train("resumed_one_gpu", "", {"--resume", ckpt.string()});
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

TEST_F(TrainingGpu, PipelineOnTwoGpus) {
  // pp=2: one block per GPU, the reference's micro-batches through the 1F1B schedule, its
  // step captured as a CUDA graph (the sends' buffers held by their Works until awaited).
  const std::vector<nlohmann::json>& ref = reference();
  compare("pp=2", train("pp2", "pp=2"), ref, true, true);
  std::ifstream log(*root_ / "pp2.log");
  const std::string out((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("captured as a CUDA graph"), std::string::npos) << "pp=2 ran op by op:\n" << out;
}

TEST_F(TrainingGpu, AllGatherDispatchOnTwoGpus) {
  const std::vector<nlohmann::json>& ref = reference();
  compare("n=2 allgather", train("n2_allgather", "n=2", {"--set", "parallel.dispatch=\"allgather\""}), ref,
          true,
          false);  // op by op: the counts go through the host
}

// parallel.device_dispatch (the default on one host): the expert rows move through the
// n-group's mapped buffers with every index computed on the device. The same rows meet the
// same GEMMs in the same order as on the host-count path (device_dispatch = false), so the
// losses agree (printed bitwise or not), and each step reads nothing per MoE block on the
// host: the host-count path reads two tables per MoE block forward (the plan's counts,
// then the received counts), 4 per step here (1 MoE block, grad_accum 2); the device path
// none of them, and with the routers' statistics on the device too (bench.device_stats
// without a z-loss, summed over the n-group by an all-reduce on the device) the default
// n=2 step reads nothing at all (host_syncs 0), with one MoE block or two.
TEST_F(TrainingGpu, DeviceDrivenExpertDispatchOnTwoGpus) {
  struct Case {
    const char* name;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {
      {"overlapped", {"parallel.chunks=2"}},  // the chunked dispatch (the default is 1 chunk)
      {"sequential", {"bench.overlap_a2a=false", "parallel.chunks=1"}},
      {"fp8", {"parallel.fp8_dispatch=true"}},
  };
  int64_t dev_reads = -1;  // the overlapped device path's host reads per step
  for (const Case& k : cases) {
    // No z-loss (tiny.toml has one), as in the one-GPU run the aux losses are compared with.
    std::vector<std::string> host_sets = {"--set", "model.moe.z_loss_coef=0", "--allow-test-config"},
                             dev_sets = host_sets;
    for (const auto& v : k.sets) {
      host_sets.insert(host_sets.end(), {"--set", v});
      dev_sets.insert(dev_sets.end(), {"--set", v});
    }
    // The device path is the default on one host; the host-count path is asked for.
    host_sets.insert(host_sets.end(), {"--set", "parallel.device_dispatch=false"});
    const std::string base = fmt::format("n2_dispatch_{}", k.name);
    const std::vector<nlohmann::json> host = train(base + "_host", "n=2", host_sets);
    const std::vector<nlohmann::json> dev = train(base + "_device", "n=2", dev_sets);
    ASSERT_EQ(host.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(dev.size(), static_cast<size_t>(kSteps));
    int bitwise = 0;
    for (size_t i = 0; i < dev.size(); ++i) {
      const double a = host[i]["loss"].get<double>(), b = dev[i]["loss"].get<double>();
      bitwise += a == b;
      EXPECT_LT(rel_diff(a, b), 1e-6)
          << k.name << " step " << i + 1 << ": host counts " << a << ", device " << b;
      ASSERT_TRUE(dev[i].contains("host_syncs")) << dev[i].dump();
      ASSERT_TRUE(host[i].contains("host_syncs")) << host[i].dump();
      EXPECT_EQ(host[i]["host_syncs"].get<int64_t>() - dev[i]["host_syncs"].get<int64_t>(), 4)
          << k.name << " step " << i + 1
          << ": two reads per MoE block forward saved (1 block x grad_accum 2)";
    }
    std::printf(
        "[device dispatch %s] %d of %lld steps' losses bitwise equal to the host-count path; host reads "
        "per step: %lld (host counts) vs %lld (device)\n",
        k.name, bitwise, static_cast<long long>(kSteps),
        static_cast<long long>(host.back()["host_syncs"].get<int64_t>()),
        static_cast<long long>(dev.back()["host_syncs"].get<int64_t>()));
    if (std::string(k.name) == "overlapped") {
      // One GPU without the z-loss, the same tokens: the n-group's aux loss is the whole
      // micro-batch's, counted once (not once per member).
      const std::vector<nlohmann::json> one =
          train("one_gpu_no_zloss", "", {"--set", "model.moe.z_loss_coef=0"});
      compare("n=2 device dispatch", dev, one, true, true);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_LT(rel_diff(one[i]["aux_loss"].get<double>(), dev[i]["aux_loss"].get<double>()), 1e-2)
            << "step " << i + 1 << ": aux loss " << dev[i]["aux_loss"] << " against one GPU's "
            << one[i]["aux_loss"];
      }
      dev_reads = dev.back()["host_syncs"].get<int64_t>();
      for (size_t i = 0; i < dev.size(); ++i) {
        EXPECT_EQ(dev[i]["host_syncs"].get<int64_t>(), 0)
            << "step " << i + 1 << ": the default n=2 step reads "
            << "nothing on the host";
      }
    }
  }
  // Four blocks (two MoE) against two (one MoE): no host read scales with the MoE blocks.
  const std::vector<nlohmann::json> deeper =
      train("n2_dispatch_4blocks", "n=2", {"--set", "model.moe.z_loss_coef=0", "--set", "model.n_layers=4"});
  ASSERT_EQ(deeper.size(), static_cast<size_t>(kSteps));
  for (size_t i = 0; i < deeper.size(); ++i) {
    EXPECT_EQ(deeper[i]["host_syncs"].get<int64_t>(), dev_reads) << "step " << i + 1 << ": 4 blocks";
  }
  std::printf("[device dispatch] host reads per step: %lld with 1 MoE block, %lld with 2\n",
              static_cast<long long>(dev_reads),
              static_cast<long long>(deeper.back()["host_syncs"].get<int64_t>()));
}

TEST_F(TrainingGpu, KilledGpuWorkerIsReplacedFromItsDataParallelPeer) {
  dp2_baseline();
  const std::string name = "gpu_kill";
  run_job(name, dp2_args(name, "kill@4:sync:1"));
  expect_baseline_losses(name, 1e-6);
  expect_recovery(name, "exit", 1000);
  expect_gpu_memory_freed(name);
}

TEST_F(TrainingGpu, HungGpuWorkerIsDetectedAndReplaced) {
  dp2_baseline();
  const std::string name = "gpu_sigstop";
  run_job(name, dp2_args(name, "stop@3:sync:0"));
  expect_baseline_losses(name, 1e-6);
  expect_recovery(name, "heartbeat", kHeartbeatTimeoutMs + 2000);
  EXPECT_EQ(events_named(*root_ / name / "events.jsonl", "worker_killed").size(), 1u);
  expect_gpu_memory_freed(name);
}

TEST_F(TrainingGpu, RescaleDp2To1To2OnGpus) {
  // dp 2 -> 1 after step 2 (grad_accum doubles: the same global batch), back to 2 after
  // step 5 (each time every rank restores the snapshot of the step into the new layout).
  const std::vector<nlohmann::json>& ref = dp2_baseline();
  const std::string name = "gpu_scale";
  run_job(name, dp2_args(name, "", {"test.scale_at=\"2:1,5:2\""}));
  const auto scaled = events_named(*root_ / name / "events.jsonl", "scaled");
  ASSERT_EQ(scaled.size(), 2u);
  EXPECT_EQ(scaled[0]["to_dp"], 1);
  EXPECT_EQ(scaled[1]["to_dp"], 2);
  const auto got = latest_step_records(*root_ / name / "metrics.jsonl");
  ASSERT_EQ(got.size(), ref.size());
  std::vector<int64_t> dps;
  for (const auto& g : got) dps.push_back(g["dp"].get<int64_t>());
  EXPECT_NE(std::find(dps.begin(), dps.end(), 1), dps.end());
  EXPECT_EQ(dps.back(), 2);
  // dp=1 sums the same micro-batches' gradients in another order: rounding only.
  expect_baseline_losses(name, 1e-3);
  expect_gpu_memory_freed(name);
}

TEST_F(TrainingGpu, TroupeRunReplacesAKilledGpuWorker) {
  dp2_baseline();
  const std::string name = "gpu_troupe_run";
  run_job(name, dp2_args(name, "kill@4:sync:0", {}, /*troupe_run=*/true));
  expect_baseline_losses(name, 1e-6);
  expect_recovery(name, "exit", 1000);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int gpus = troupe::test::visible_gpus();
  if (gpus < 2) {
    std::printf("skipping: %d CUDA device(s) visible, 2 needed\n", gpus);
    return 77;
  }
  return RUN_ALL_TESTS();
}
