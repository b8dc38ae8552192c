// tests/training/checkpoint_resume_test.cc — checkpoints written by training and
// `train_moe --resume`, with the real binary and real processes:
//  - a pp=2 x n=2 run saves every 5 steps; resumed from its step 5 at n=4, at dp=2 and in
//    one process, the next 5 steps' losses equal the uninterrupted run's (1e-6) — a
//    permuted expert or a wrong optimizer shard would show here;
//  - kill -9 of a worker while a (rate-limited) save is being written: the previous
//    checkpoint stays valid, the half-written one never becomes a checkpoint, and a resume
//    loads the previous one;
//  - a flipped byte, a truncated shard, a deleted manifest in the newest checkpoint: the
//    resume names it with the reason and continues from the previous one; no valid
//    checkpoint at all is an error, never a silent partial load.
// Every child runs in its own process group, bounded by a timeout, killed and reaped.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/reader.h"
#include "tests/common/train_moe_harness.h"

namespace {

namespace fs = std::filesystem;
using troupe::test::Clock;
using troupe::test::finish;
using troupe::test::losses_by_step;
using troupe::test::run;
using troupe::test::RunResult;

class CheckpointResume : public ::testing::Test {
 protected:
  static constexpr int64_t kSteps = 10;

  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-ckpt-resume"));
    const RunResult p = troupe::test::prepare_data(*root_ / "data", {{"layers"}, {".cc", ".h"}, 320, 200000},
                                                   *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(p.exit_code, 0) << p.output;
    // The saved run: pp=2 x n=2, two micro-batches per step, a checkpoint every 5 steps.
    const RunResult a = run(args("saved", "pp=2,n=2", {"checkpoint.every=5"}), *root_ / "saved.log",
                            std::chrono::seconds(240));
    ASSERT_EQ(a.exit_code, 0) << a.output;
    std::printf("[saved run pp=2,n=2] %lld steps in %.1f s\n", static_cast<long long>(kSteps), a.seconds);
  }
  static void TearDownTestSuite() {
    troupe::test::remove_run_root(*root_);
    delete root_;
  }

  // The equivalence test's tiny model: 4 blocks (MoE 1 and 3), d 32, 8 heads / 4 kv
  // heads, 4 experts top-2, sequences of 16, micro-batches of 2.
  // One global batch (4 sequences) in every layout: the resumed run keeps the saved one's.
  static std::vector<std::string> args(const std::string& run_dir, const std::string& parallel,
                                       const std::vector<std::string>& extra = {},
                                       const std::string& resume = "") {
    troupe::test::TrainMoeCommand c;
    c.run_dir = *root_ / run_dir;
    c.sets = troupe::test::tiny_model_sets({.global_batch = 4,
                                            .steps = kSteps,
                                            .eval_batches = 1,
                                            .log_every = 10,
                                            .data_dir = *root_ / "data"});
    c.sets.insert(c.sets.end(), extra.begin(), extra.end());
    c.parallel = parallel;
    c.resume = resume;
    return c.argv();
  }

  // Resumes the saved run's step 5 into `name` with `parallel` and checks steps 6..10
  // against the uninterrupted run; returns the max absolute loss difference.
  static double check_resume(const std::string& name, const std::string& parallel, const std::string& from) {
    const RunResult r =
        run(args(name, parallel, {}, from), *root_ / (name + ".log"), std::chrono::seconds(180));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("step 5, saved with layout pp=2,dp=1,n=2"), std::string::npos) << r.output;
    const auto ref = losses_by_step(*root_ / "saved" / "metrics.jsonl");
    const auto got = losses_by_step(*root_ / name / "metrics.jsonl");
    EXPECT_EQ(got.size(), 5u) << r.output;
    double worst = 0;
    std::string line;
    for (const auto& [step, loss] : got) {
      EXPECT_GE(step, 6);
      const double d = std::fabs(loss - ref.at(step));
      EXPECT_LE(d, 1e-6) << name << " step " << step << ": " << loss << " vs " << ref.at(step);
      worst = std::max(worst, d);
      line += fmt::format(" {}:{:.9f}/{:.9f}", step, loss, ref.at(step));
    }
    std::printf("[resume %s from pp=2,n=2 step 5] resumed/uninterrupted loss:%s; max |diff| %.3g (%.1f s)\n",
                name.c_str(), line.c_str(), worst, r.seconds);
    return worst;
  }

  // A copy of the saved run's checkpoints in `name`/checkpoints.
  static fs::path copy_checkpoints(const std::string& name) {
    const fs::path dst = *root_ / name;
    fs::create_directories(dst);
    fs::copy(*root_ / "saved" / "checkpoints", dst / "checkpoints", fs::copy_options::recursive);
    return dst;
  }

  static fs::path* root_;
};

fs::path* CheckpointResume::root_ = nullptr;

TEST_F(CheckpointResume, SavedRunCommittedItsCheckpoints) {
  const fs::path dir = *root_ / "saved" / "checkpoints";
  const auto list = troupe::checkpoint::list_checkpoints(dir.string());
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].first, 10);
  EXPECT_EQ(list[1].first, 5);
  auto r = troupe::checkpoint::CheckpointReader::open(list[1].second, troupe::checkpoint::VerifyMode::kChecksums);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& m = (*r)->manifest();
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.layout.pp(), 2);
  EXPECT_EQ(m.layout.n(), 2);
  EXPECT_EQ(m.data_position.value("next_step", 0), 6);
  ASSERT_TRUE(m.tokenizer.has_value());
  EXPECT_FALSE(m.config_text.empty());
  // Parameters, router biases and both moments, whole over the world.
  for (const char* t : {"embedding.weight", "blocks.1.moe.experts.w1", "blocks.3.moe.router.bias",
                        "opt.m.blocks.3.moe.experts.w2", "opt.v.embedding.weight", "opt.m.blocks.2.attn.wq"}) {
    EXPECT_TRUE((*r)->has_tensor(t)) << t;
  }
  ASSERT_EQ(m.ranks.size(), 4u);
  EXPECT_EQ(m.ranks[3].state.value("adam_steps", 0), 5);
  // The stall per checkpoint (the step thread's time for its snapshot) is in the metrics of
  // the saving steps only.
  int saves = 0;
  for (const auto& j : troupe::test::read_jsonl(*root_ / "saved" / "metrics.jsonl")) {
    if (j.contains("ckpt_stall_ms")) {
      ++saves;
      EXPECT_TRUE(j["step"] == 5 || j["step"] == 10) << j.dump();
      EXPECT_GE(j["ckpt_stall_ms"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(saves, 2);
}

TEST_F(CheckpointResume, ResumeAtN4) {
  check_resume("resume-n4", "n=4", (*root_ / "saved" / "checkpoints" / "step_5").string());
}

TEST_F(CheckpointResume, ResumeAtDp2) {
  // The config's global batch of 4 sequences: one micro-batch of 2 per replica here, two
  // in the saved run.
  check_resume("resume-dp2", "dp=2", (*root_ / "saved" / "checkpoints" / "step_5").string());
}

TEST_F(CheckpointResume, ResumeInOneProcess) {
  check_resume("resume-one", "", (*root_ / "saved" / "checkpoints" / "step_5").string());
}

TEST_F(CheckpointResume, SavedAtDp2N2ResumedAtPp2) {
  // The other direction: ZeRO-1 moment shards saved by two dp replicas (and experts by
  // two n ranks), loaded by a pipeline whose last stage holds a tied copy of the
  // embedding (its weights and moments come from the first stage's saved tensor).
  const RunResult a = run(args("saved-dp2n2", "dp=2,n=2", {"checkpoint.every=5"}), *root_ / "saved-dp2n2.log",
                          std::chrono::seconds(180));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const fs::path step5 = *root_ / "saved-dp2n2" / "checkpoints" / "step_5";
  const RunResult r = run(args("resume-pp2", "pp=2", {}, step5.string()), *root_ / "resume-pp2.log",
                          std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("saved with layout pp=1,dp=2,n=2"), std::string::npos) << r.output;
  const auto ref = losses_by_step(*root_ / "saved-dp2n2" / "metrics.jsonl");
  const auto got = losses_by_step(*root_ / "resume-pp2" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 5u) << r.output;
  double worst = 0;
  for (const auto& [step, loss] : got) {
    EXPECT_LE(std::fabs(loss - ref.at(step)), 1e-6) << "step " << step;
    worst = std::max(worst, std::fabs(loss - ref.at(step)));
  }
  std::printf("[resume pp=2 from dp=2,n=2 step 5] max |diff| %.3g\n", worst);
}

TEST_F(CheckpointResume, ResumeWithoutConfigUsesTheSavedOne) {
  // `train_moe train --resume <step dir>`: config text and overrides from the manifest,
  // then the command line's (here: one process instead of the saved pp=2 x n=2).
  const fs::path step5 = *root_ / "saved" / "checkpoints" / "step_5";
  const RunResult r = run({troupe::test::train_moe_bin(), "train", "--resume", step5.string(), "--run-dir",
                           (*root_ / "noconfig").string(), "--parallel", "pp=1,n=1"},
                          *root_ / "noconfig.log", std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("config from checkpoint"), std::string::npos) << r.output;
  const auto ref = losses_by_step(*root_ / "saved" / "metrics.jsonl");
  const auto got = losses_by_step(*root_ / "noconfig" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 5u) << r.output;
  for (const auto& [step, loss] : got) EXPECT_LE(std::fabs(loss - ref.at(step)), 1e-6) << "step " << step;
}

TEST_F(CheckpointResume, TroupeRunResumesIntoTheJobsCheckpointDir) {
  // Under the scheduler: driver and 4 workers from `troupe run`, the checkpoint to resume
  // passed through the scheduler's store, new checkpoints into --checkpoint-dir
  // (TROUPE_CHECKPOINT_DIR).
  const fs::path ck = *root_ / "troupe-ck";
  std::vector<std::string> a = args("troupe-resume", "pp=2,n=2", {"checkpoint.every=5"},
                                    (*root_ / "saved" / "checkpoints" / "step_5").string());
  a.insert(a.begin(), {TROUPE_CLI_BIN, "run", "--nproc", "4", "--checkpoint-dir", ck.string(), "--"});
  const RunResult r = run(a, *root_ / "troupe-resume.log", std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = losses_by_step(*root_ / "saved" / "metrics.jsonl");
  const auto got = losses_by_step(*root_ / "troupe-resume" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 5u) << r.output;
  for (const auto& [step, loss] : got) EXPECT_LE(std::fabs(loss - ref.at(step)), 1e-6) << "step " << step;
  const auto list = troupe::checkpoint::list_checkpoints(ck.string());
  ASSERT_EQ(list.size(), 1u) << r.output;
  EXPECT_EQ(list[0].first, 10);
  EXPECT_TRUE(troupe::checkpoint::CheckpointReader::open(list[0].second, troupe::checkpoint::VerifyMode::kChecksums).ok());
}

// The generated text of `train_moe sample` output: notes and log lines dropped, up to
// the weights' source in the summary line (which names the file or checkpoint).
std::string sample_text(const std::string& out) {
  std::string text, line;
  std::istringstream in(out);
  while (std::getline(in, line)) {
    // Notes and log lines ("[<time>] [ckpt] [warning] skipping checkpoint ...").
    if (line.rfind("train_moe:", 0) == 0 || (line.rfind("[", 0) == 0 && line.rfind("[sample:", 0) != 0)) continue;
    text += line + "\n";
  }
  const size_t w = text.find(", weights from ");
  return w == std::string::npos ? text : text.substr(0, w);
}

TEST_F(CheckpointResume, SampleFromTheDistributedRunsCheckpoints) {
  // `train_moe sample --run` takes the pp=2 x n=2 run's newest valid checkpoint (step 10),
  // resharded into one process. The reference is the final checkpoint of a one-process run
  // resumed from that checkpoint with nothing left to train (the same weights through
  // --resume's loader, which the resume tests above check against the uninterrupted run,
  // saved again by the one-process Stage): the sampled tokens must be identical.
  const fs::path saved = *root_ / "saved";
  const std::vector<std::string> opts{"--prompt", "int ", "--tokens", "40", "--seed", "11"};
  auto sample = [&](const std::vector<std::string>& where, const std::string& log) {
    std::vector<std::string> a{troupe::test::train_moe_bin(), "sample"};
    a.insert(a.end(), where.begin(), where.end());
    a.insert(a.end(), opts.begin(), opts.end());
    return run(a, *root_ / log, std::chrono::seconds(60));
  };
  const RunResult s1 = sample({"--run", saved.string()}, "sample-1.log");
  ASSERT_EQ(s1.exit_code, 0) << s1.output;
  EXPECT_NE(s1.output.find("weights from checkpoint " + (saved / "checkpoints" / "step_10").string() +
                           " (step 10, saved with layout pp=2,dp=1,n=2)"),
            std::string::npos)
      << s1.output;
  const std::string text = sample_text(s1.output);
  EXPECT_NE(text.find("int "), std::string::npos) << s1.output;
  EXPECT_NE(text.find("generated"), std::string::npos) << s1.output;
  // Deterministic for a fixed seed.
  const RunResult s2 = sample({"--run", saved.string()}, "sample-2.log");
  ASSERT_EQ(s2.exit_code, 0) << s2.output;
  EXPECT_EQ(sample_text(s2.output), text);

  // The one-process reference at step 10: its final checkpoint (layout 1x1x1), read by
  // `sample --run`.
  const RunResult ref = run({troupe::test::train_moe_bin(), "train", "--resume", (saved / "checkpoints" / "step_10").string(),
                             "--run-dir", (*root_ / "one-at-10").string(), "--parallel", "pp=1,n=1"},
                            *root_ / "one-at-10.log", std::chrono::seconds(120));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_TRUE(fs::exists(*root_ / "one-at-10" / "checkpoints" / "step_10" / "manifest.json")) << ref.output;
  const RunResult s3 = sample({"--run", (*root_ / "one-at-10").string()}, "sample-3.log");
  ASSERT_EQ(s3.exit_code, 0) << s3.output;
  EXPECT_NE(s3.output.find("(step 10, saved with layout pp=1,dp=1,n=1)"), std::string::npos) << s3.output;
  EXPECT_EQ(sample_text(s3.output), text) << "pp=2,n=2:\n" << s1.output << "\none process:\n" << s3.output;

  // --checkpoint picks one checkpoint explicitly; step 5's weights sample other text.
  const RunResult s5 = sample({"--checkpoint", (saved / "checkpoints" / "step_5").string()}, "sample-5.log");
  ASSERT_EQ(s5.exit_code, 0) << s5.output;
  EXPECT_NE(s5.output.find("(step 5, saved with layout pp=2,dp=1,n=2)"), std::string::npos) << s5.output;
  EXPECT_NE(sample_text(s5.output), text) << s5.output;

  // A damaged newest checkpoint is named and skipped; step 5 is sampled.
  const fs::path damaged = copy_checkpoints("sample-damaged");
  {
    std::fstream f(damaged / "checkpoints" / "step_10" / "rank_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  const RunResult sd = sample({"--run", damaged.string()}, "sample-damaged.log");
  ASSERT_EQ(sd.exit_code, 0) << sd.output;
  EXPECT_NE(sd.output.find("sample: skipped checkpoint " + (damaged / "checkpoints" / "step_10").string()),
            std::string::npos)
      << sd.output;
  EXPECT_NE(sd.output.find("checksum"), std::string::npos) << sd.output;
  EXPECT_EQ(sample_text(sd.output), sample_text(s5.output));

  // No checkpoint: a clear error naming what was looked for.
  const fs::path empty = *root_ / "sample-empty";
  fs::create_directories(empty);
  const RunResult se = sample({"--run", empty.string()}, "sample-empty.log");
  EXPECT_EQ(se.exit_code, 1) << se.output;
  EXPECT_NE(se.output.find("holds no checkpoint"), std::string::npos) << se.output;
  EXPECT_NE(se.output.find((empty / "checkpoints/step_<N>").string()), std::string::npos) << se.output;
  const RunResult sn = sample({"--checkpoint", (empty / "nowhere").string()}, "sample-nowhere.log");
  EXPECT_EQ(sn.exit_code, 1) << sn.output;
  EXPECT_NE(sn.output.find("does not exist"), std::string::npos) << sn.output;
  std::printf("[sample from pp=2,n=2 checkpoint step 10 == its one-process checkpoint]\n%s", text.c_str());

  // `troupe top <run dir> --once` on the same (finished) distributed run.
  const RunResult top = run({TROUPE_CLI_BIN, "top", saved.string(), "--once"}, *root_ / "top.log", std::chrono::seconds(30));
  ASSERT_EQ(top.exit_code, 0) << top.output;
  const auto loss = losses_by_step(saved / "metrics.jsonl");
  ASSERT_EQ(loss.rbegin()->first, 10);
  EXPECT_NE(top.output.find(fmt::format("step 10  loss {:.4f}", loss.rbegin()->second)), std::string::npos)
      << top.output;
  for (const char* s : {"tokens/s", "rank 0: compute", "comm mean over ranks", "val_loss", "last checkpoint save at step 10",
                        "recent events"}) {
    EXPECT_NE(top.output.find(s), std::string::npos) << s << "\n" << top.output;
  }
  EXPECT_EQ(top.output.find("\x1b["), std::string::npos);  // --once: no screen control codes
  const RunResult bad = run({TROUPE_CLI_BIN, "top", empty.string(), "--once"}, *root_ / "top-bad.log", std::chrono::seconds(30));
  EXPECT_EQ(bad.exit_code, 3) << bad.output;
  EXPECT_NE(bad.output.find("not a train_moe run directory"), std::string::npos) << bad.output;
  std::printf("[troupe top --once %s]\n%s", saved.string().c_str(), top.output.c_str());
}

TEST_F(CheckpointResume, CorruptNewestFallsBackToThePrevious) {
  struct Case {
    std::string name, expect;  // the reason the newest checkpoint is skipped
    std::function<void(const fs::path& step10)> damage;
  };
  const std::vector<Case> cases{
      {"flipped-byte", "checksum",
       [](const fs::path& d) {
         std::fstream f(d / "rank_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(100);
         char c = 0;
         f.read(&c, 1);
         c = static_cast<char>(c ^ 0x5a);
         f.seekp(100);
         f.write(&c, 1);
       }},
      {"truncated", "rank_00002.bin",
       [](const fs::path& d) { fs::resize_file(d / "rank_00002.bin", fs::file_size(d / "rank_00002.bin") / 2); }},
      {"no-manifest", "manifest", [](const fs::path& d) { fs::remove(d / "manifest.json"); }},
  };
  const auto ref = losses_by_step(*root_ / "saved" / "metrics.jsonl");
  for (const Case& c : cases) {
    const fs::path run_dir = copy_checkpoints("corrupt-" + c.name);
    c.damage(run_dir / "checkpoints" / "step_10");
    // Resume by run directory, in one process: step_10 is skipped by name, step_5 used.
    const RunResult r = run(args("corrupt-" + c.name, "", {"checkpoint.every=5"}, run_dir.string()),
                            *root_ / ("corrupt-" + c.name + ".log"), std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("skipped checkpoint " + (run_dir / "checkpoints" / "step_10").string()), std::string::npos)
        << c.name << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.name << "\n" << r.output;
    EXPECT_NE(r.output.find("step 5, saved with layout pp=2,dp=1,n=2"), std::string::npos) << r.output;
    // The continued run is the uninterrupted one.
    const auto got = losses_by_step(run_dir / "metrics.jsonl");
    ASSERT_EQ(got.size(), 5u) << r.output;
    for (const auto& [step, loss] : got) EXPECT_LE(std::fabs(loss - ref.at(step)), 1e-6) << c.name << " step " << step;
    // The damaged checkpoint was moved aside before the new step_10 was committed.
    const auto list = troupe::checkpoint::list_checkpoints((run_dir / "checkpoints").string());
    ASSERT_FALSE(list.empty());
    EXPECT_EQ(list[0].first, 10);
    EXPECT_TRUE(troupe::checkpoint::CheckpointReader::open(list[0].second, troupe::checkpoint::VerifyMode::kChecksums).ok());
  }
  // Nothing valid left: a clear error naming every candidate, no training.
  const fs::path run_dir = copy_checkpoints("corrupt-all");
  fs::remove(run_dir / "checkpoints" / "step_10" / "manifest.json");
  fs::resize_file(run_dir / "checkpoints" / "step_5" / "rank_00000.bin", 10);
  const RunResult r = run(args("corrupt-all", "", {}, run_dir.string()), *root_ / "corrupt-all.log",
                          std::chrono::seconds(120));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no valid checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step_5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step_10"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(run_dir / "metrics.jsonl"));
}

TEST_F(CheckpointResume, AFailedSaveIsReportedAndNeverCommitted) {
  // Step 2's temporary directory cannot be created (a file has its name): the workers'
  // background writes fail and say so; training is not interrupted, step 2 is never
  // committed, and the run's final checkpoint (step 4) is. What the failed save left is
  // removed at the end.
  const std::string name = "failed-save";
  const fs::path dir = *root_ / name / "checkpoints";
  fs::create_directories(dir);
  std::ofstream(dir / "step_2.tmp") << "in the way\n";
  const RunResult r = run(args(name, "pp=2", {"checkpoint.every=2", "train.steps=4"}),
                          *root_ / (name + ".log"), std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint step 2"), std::string::npos) << r.output;
  const auto list = troupe::checkpoint::list_checkpoints(dir.string());
  ASSERT_EQ(list.size(), 1u) << r.output;
  EXPECT_EQ(list[0].first, 4);
  EXPECT_TRUE(troupe::checkpoint::CheckpointReader::open(list[0].second, troupe::checkpoint::VerifyMode::kChecksums).ok());
  EXPECT_FALSE(fs::exists(dir / "step_2.tmp"));
}

TEST_F(CheckpointResume, KillWorkerInTheMiddleOfASave) {
  // Saves every 2 steps, written at 0.05 MB/s per rank (~4 s a save) from the committed
  // snapshot of the step: the test waits for step 2 to be committed and step 4's shards to
  // be half written, then kills a worker.
  const std::string name = "killed";
  const fs::path log = *root_ / (name + ".log");
  const auto t0 = Clock::now();
  const pid_t launcher = troupe::test::spawn(
      args(name, "pp=2,n=2",
           // The one failure is the kill: a generous heartbeat timeout, so that on a loaded
           // machine a worker starved of CPU during the final save is not a second one.
           {"checkpoint.every=2", "checkpoint.max_mb_per_s=0.05", "elastic.snapshot_every=0",
            "elastic.heartbeat_timeout_ms=10000"}),
      log);
  const fs::path dir = *root_ / name / "checkpoints";
  bool killed = false;
  pid_t victim = -1;
  int victim_rank = -1;
  while (Clock::now() - t0 < std::chrono::seconds(120)) {
    std::error_code ec;
    const bool have2 = fs::exists(dir / "step_2" / "manifest.json", ec);
    bool writing4 = false;
    for (const auto& de : fs::directory_iterator(dir / "step_4.tmp", ec)) {
      writing4 |= de.path().extension() == ".bin" && fs::file_size(de.path(), ec) > 0;
    }
    if (have2 && writing4 && !fs::exists(dir / "step_4", ec)) {
      // A worker whose part of step 4 is not written yet (a rank's "done" marker).
      for (pid_t kid : troupe::test::children_of(launcher)) {
        const int rank = troupe::test::worker_rank_of(kid);
        if (rank < 0 || fs::exists(dir / "step_4.tmp" / fmt::format("rank_{:05d}.part.json", rank), ec)) continue;
        victim = kid;
        victim_rank = rank;
        kill(victim, SIGKILL);
        killed = true;
        std::printf("[kill -9] worker rank %d (pid %d) during the save of step 4\n", rank, static_cast<int>(kid));
        break;
      }
      if (killed) break;
    }
    int st = 0;
    if (waitpid(launcher, &st, WNOHANG) == launcher) break;  // ended early: reported below
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const RunResult r = finish(launcher, log, t0, std::chrono::seconds(120));
  ASSERT_TRUE(killed) << r.output;
  // The Trainer replaces it and every rank goes back to the newest committed snapshot (the
  // checkpoint steps are snapshotted: step 4's, whose disk write the kill interrupted, or a
  // later one: training went on while step 4 was written), and the job ends normally with
  // the losses of the uninterrupted run. The interrupted checkpoint is written again from
  // the snapshot when that is the one restored; else it is abandoned (a newer one exists).
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path ev = *root_ / name / "events.jsonl";
  const auto restores = troupe::test::events_named(ev, "restore_from_snapshot");
  ASSERT_EQ(restores.size(), 1u) << r.output;
  const int64_t restored = restores[0]["step"].get<int64_t>();
  EXPECT_GE(restored, 4) << r.output;
  EXPECT_TRUE(troupe::test::events_named(ev, "restore_from_checkpoint").empty());
  const auto got = losses_by_step(*root_ / name / "metrics.jsonl");
  const auto ref = losses_by_step(*root_ / "saved" / "metrics.jsonl");
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << r.output;
  for (const auto& [step, loss] : got) EXPECT_LE(std::fabs(loss - ref.at(step)), 1e-6) << "step " << step;
  std::vector<int64_t> committed, abandoned;
  for (const auto& e : troupe::test::events_named(ev, "checkpoint_committed"))
    committed.push_back(e["step"].get<int64_t>());
  for (const auto& e : troupe::test::events_named(ev, "checkpoint_abandoned"))
    abandoned.push_back(e["step"].get<int64_t>());
  EXPECT_NE(std::find(committed.begin(), committed.end(), 2), committed.end()) << r.output;
  if (restored == 4) {
    EXPECT_NE(std::find(committed.begin(), committed.end(), 4), committed.end()) << r.output;
  } else {
    EXPECT_NE(std::find(abandoned.begin(), abandoned.end(), 4), abandoned.end()) << r.output;
  }
  const auto list = troupe::checkpoint::list_checkpoints(dir.string());
  ASSERT_FALSE(list.empty());
  EXPECT_EQ(list.front().first, 10);
  EXPECT_TRUE(troupe::checkpoint::CheckpointReader::open(list.front().second,
                                                         troupe::checkpoint::VerifyMode::kChecksums)
                  .ok());
  std::printf(
      "[kill -9 mid-save] rank %d killed while step 4 was written; restored the snapshot of step %lld (step "
      "4's "
      "checkpoint %s), %zu steps equal the uninterrupted run, newest checkpoint step %lld\n",
      victim_rank, static_cast<long long>(restored), restored == 4 ? "written again from it" : "abandoned",
      got.size(), static_cast<long long>(list.front().first));
}

}  // namespace
