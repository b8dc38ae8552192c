// tests/faults/checkpoint_fault_test.cc — checkpoints as faults, on `troupe run --nproc 4`
// jobs of the tiny model (dp=2, pp=2, a checkpoint every 4 steps):
//   - a manifest edited by hand (adam_steps of the newest checkpoint, still valid JSON): the
//     resume names it ("edited or damaged": its checksum) and goes on from the previous
//     checkpoint, with the losses of a fault-free run, never training on the wrong state;
//   - a disk that is full at the final save (a tmpfs of 2.5 checkpoints in a mount
//     namespace of its own): the save is tried twice, its unfinished directory removed, and
//     the job fails at once with a permanent failure (exit 78: no driver restart, no step
//     run again) saying how much space the next checkpoint needs and, truly, which one is
//     the newest.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <random>

#include "core/exit_status.h"
#include "tests/faults/faults_harness.h"

namespace troupe::faults {
namespace {

const std::string kLayout = "dp=2,pp=2";

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string new_tag(const std::string& name) {
  return fmt::format("faults-{}-{}-{:x}", name, getpid(), std::random_device{}());
}

class CheckpointFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::make_run_root("troupe-faults-ckpt");
    data_ = prepared_data(root_);
  }
  void TearDown() override {
    if (!HasFailure()) test::remove_run_root(root_);
  }
  // The fault-free reference of `steps` steps (the standalone launcher, same layout).
  std::vector<nlohmann::json> reference(int64_t steps) {
    const auto ref = tiny_job(data_, root_ / "reference", steps, kLayout, {"checkpoint.every=4"});
    const RunResult r = test::run(ref.argv(), root_ / "reference.log", std::chrono::seconds(180));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return test::latest_step_records(root_ / "reference" / "metrics.jsonl");
  }
  fs::path root_, data_;
};

TEST_F(CheckpointFaults, TamperedManifestIsSkippedForThePreviousCheckpoint) {
  const auto ref = reference(14);
  ASSERT_EQ(ref.size(), 14u);
  const fs::path dir = root_ / "tampered";
  const RunResult first =
      test::run(troupe_run_argv(4, new_tag("tampered"), {},
                                tiny_job(data_, dir, 14, kLayout, {"checkpoint.every=4"}).argv()),
                root_ / "first.log", std::chrono::seconds(180));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // As if the run had stopped after step 12 (the same learning-rate schedule as the
  // reference), and then adam_steps of its newest checkpoint were edited: still valid JSON.
  fs::remove_all(dir / "checkpoints" / "step_14");
  const fs::path manifest = dir / "checkpoints" / "step_12" / "manifest.json";
  std::string text = read_all(manifest);
  const size_t at = text.find("\"adam_steps\": 12");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 2000);
  text.replace(at, 16, "\"adam_steps\": 1");
  std::ofstream(manifest, std::ios::trunc) << text;

  auto resumed_job = tiny_job(data_, dir, 14, kLayout, {"checkpoint.every=4"});
  resumed_job.resume = dir.string();
  const RunResult second = test::run(troupe_run_argv(4, new_tag("tampered2"), {}, resumed_job.argv()),
                                     root_ / "second.log", std::chrono::seconds(180));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("skipped checkpoint " + (dir / "checkpoints" / "step_12").string()),
            std::string::npos)
      << second.output;
  EXPECT_NE(second.output.find("edited or damaged"), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("resuming from " + (dir / "checkpoints" / "step_8").string()),
            std::string::npos)
      << second.output;
  // Steps 9.. ran again from step 8's state: every loss is the fault-free run's, and
  // metrics.jsonl holds every step.
  test::expect_losses_match(ref, dir / "metrics.jsonl", 1e-6, "faults tampered manifest", "fault-free");
  EXPECT_EQ(records(dir / "events.jsonl", "job_started").size(), 2u);
}

TEST_F(CheckpointFaults, DiskFullOnTheFinalSaveFailsAtOnce) {
  // A file system of its own for the checkpoints: a tmpfs in a private mount namespace
  // (root, or an unprivileged user namespace).
  const fs::path mnt = root_ / "ckpt";
  fs::create_directories(mnt);
  std::vector<std::string> unshare;
  for (std::vector<std::string> u : {std::vector<std::string>{"/usr/bin/unshare", "-m"},
                                     std::vector<std::string>{"/usr/bin/unshare", "-rm"}}) {
    std::vector<std::string> probe = u;
    probe.insert(probe.end(),
                 {"/bin/sh", "-c", fmt::format("mount -t tmpfs -o size=1m tmpfs '{}'", mnt.string())});
    if (test::run(probe, root_ / "probe.log", std::chrono::seconds(20)).exit_code == 0) {
      unshare = u;
      break;
    }
  }
  if (unshare.empty())
    GTEST_SKIP() << "cannot mount a tmpfs in a private mount namespace here (unshare -m / -rm)";

  // The size of one checkpoint of this job, from a fault-free run.
  const auto ref = reference(10);
  uint64_t ckpt_bytes = 0;
  for (const auto& e : fs::directory_iterator(root_ / "reference" / "checkpoints" / "step_4"))
    ckpt_bytes += (fs::file_size(e.path()) + 4095) / 4096 * 4096;
  ASSERT_GT(ckpt_bytes, 0u);
  const uint64_t fs_bytes = (ckpt_bytes * 5 / 2 + 4095) / 4096 * 4096;  // steps 4 and 8 fit, 10 does not

  const fs::path dir = root_ / "full";
  const auto job = tiny_job(data_, dir, 10, kLayout,
                            {"checkpoint.every=4", fmt::format("checkpoint.dir=\"{}\"", mnt.string())});
  std::string cmd =
      fmt::format("mount -t tmpfs -o size={} tmpfs '{}' || exit 99; '{}'", fs_bytes, mnt.string(),
                  fmt::join(troupe_run_argv(4, new_tag("full"), {}, job.argv()), "' '"));
  cmd += fmt::format("; rc=$?; ls -A '{}' > '{}'; exit $rc", mnt.string(), (root_ / "listing.txt").string());
  std::vector<std::string> argv = unshare;
  argv.insert(argv.end(), {"/bin/sh", "-c", cmd});
  const auto t0 = Clock::now();
  const RunResult r = test::run(argv, root_ / "full.log", std::chrono::seconds(180));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_NE(r.exit_code, 99) << r.output;
  EXPECT_EQ(r.exit_code, kExitPermanentFailure) << r.output;
  EXPECT_NE(r.output.find("the final checkpoint (step 10) could not be written twice"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("a checkpoint of this job needs"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the newest committed checkpoint is step 8"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("is none"), std::string::npos) << r.output;
  // Not restarted, no step run again, the unfinished save gone.
  const std::string state = kept_state_dir(r.output);
  ASSERT_FALSE(state.empty()) << r.output;
  for (const auto& e : fs::directory_iterator(fs::path(state) / "jobs")) {
    EXPECT_TRUE(records(e.path() / "events.jsonl", "driver_restarting").empty());
    EXPECT_TRUE(records(e.path() / "events.jsonl", "job_restarting").empty());
  }
  const auto failed = records(dir / "events.jsonl", "final_checkpoint_failed");
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_TRUE(failed[1].value("disk_full", false)) << failed[1].dump();
  for (const auto& rec : test::step_records(dir / "metrics.jsonl")) EXPECT_FALSE(rec.contains("replayed"));
  test::expect_losses_match(ref, dir / "metrics.jsonl", 1e-6, "faults disk full", "fault-free");
  const std::string listing = read_all(root_ / "listing.txt");
  EXPECT_EQ(listing.find("step_10"), std::string::npos) << listing;
  EXPECT_NE(listing.find("step_8"), std::string::npos) << listing;
  std::printf(
      "[faults disk full] tmpfs of %llu bytes (checkpoint %llu): failed after %.1f s with exit %d, no "
      "restart; left: %s",
      static_cast<unsigned long long>(fs_bytes), static_cast<unsigned long long>(ckpt_bytes), seconds,
      r.exit_code, listing.c_str());
  fs::remove_all(fs::path(state));
}

}  // namespace
}  // namespace troupe::faults
