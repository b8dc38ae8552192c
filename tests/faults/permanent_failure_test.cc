// tests/faults/permanent_failure_test.cc — failures that will always recur, on `troupe run
// --nproc N` jobs of the tiny model (dp=2, pp=2): each fails at once with its reason and
// the permanent-failure exit status (78, core/exit_status.h), and the scheduler restarts
// neither the driver nor the workers:
//   - a token id >= model.vocab_size in a shard (checked when the data is opened, before
//     the run directory is written or a worker is started);
//   - an explicitly named corrupt checkpoint (--resume <run>/checkpoints/step_4 with a
//     flipped byte);
//   - a layout that cannot run: --nproc 3 for dp=2, pp=2.
// (A disk full at the final save: checkpoint_fault_test.cc.)
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include "core/exit_status.h"
#include "tests/faults/faults_harness.h"

namespace troupe::faults {
namespace {

const std::string kLayout = "dp=2,pp=2";

class PermanentFailures : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::make_run_root("troupe-faults-permanent");
    data_ = prepared_data(root_);
  }
  void TearDown() override {
    if (!HasFailure()) test::remove_run_root(root_);
  }
  // Runs `job` under `troupe run --nproc nproc`; expects the permanent failure within 60 s,
  // no restart of any process, and `why` in the output.
  RunResult expect_permanent(const std::string& name, int nproc, const test::TrainMoeCommand& job,
                             const std::string& why) {
    const std::string tag = fmt::format("faults-{}-{}-{:x}", name, getpid(), std::random_device{}());
    const auto t0 = Clock::now();
    const RunResult r = test::run(troupe_run_argv(nproc, tag, {}, job.argv()), root_ / (name + ".log"),
                                  std::chrono::seconds(120));
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_EQ(r.exit_code, kExitPermanentFailure) << r.output;
    EXPECT_LT(s, 60.0) << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << why << "\n" << r.output;
    EXPECT_NE(r.output.find("a permanent failure, not restarted"), std::string::npos) << r.output;
    const std::string state = kept_state_dir(r.output);
    EXPECT_FALSE(state.empty()) << r.output;
    if (!state.empty()) {
      for (const auto& e : fs::directory_iterator(fs::path(state) / "jobs")) {
        for (const char* ev : {"driver_restarting", "job_restarting"})
          EXPECT_TRUE(records(e.path() / "events.jsonl", ev).empty()) << ev << " in " << e.path();
      }
      fs::remove_all(fs::path(state));
    }
    std::printf("[faults permanent %s] exit %d after %.1f s, not restarted: %s\n", name.c_str(), r.exit_code,
                s, why.c_str());
    return r;
  }
  fs::path root_, data_;
};

TEST_F(PermanentFailures, BadTokenDataIsNotRetried) {
  const fs::path bad = root_ / "bad-data";
  fs::copy(data_, bad, fs::copy_options::recursive);
  {
    // Token 1000 of the train shard (2-byte ids after a 24-byte header) becomes 65000.
    std::fstream f(bad / "train-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(24 + 2 * 1000);
    const unsigned char id[2] = {0xe8, 0xfd};  // 65000, little-endian
    f.write(reinterpret_cast<const char*>(id), 2);
  }
  const fs::path dir = root_ / "bad-token";
  expect_permanent("bad-token", 4, tiny_job(bad, dir, 8, kLayout),
                   fmt::format("shard {}: token 1000 (of", (bad / "train-00000.bin").string()));
  EXPECT_FALSE(fs::exists(dir)) << "the run directory was written before the data was checked";
}

TEST_F(PermanentFailures, NamedCorruptCheckpointIsNotRetried) {
  const fs::path dir = root_ / "saved";
  const RunResult first = test::run(tiny_job(data_, dir, 4, kLayout, {"checkpoint.every=4"}).argv(),
                                    root_ / "saved.log", std::chrono::seconds(180));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path step = dir / "checkpoints" / "step_4";
  {
    std::fstream f(step / "rank_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  auto job = tiny_job(data_, root_ / "resumed", 8, kLayout, {"checkpoint.every=4"});
  job.resume = step.string();
  expect_permanent("named-corrupt", 4, job, "checksum mismatch in " + (step / "rank_00001.bin").string());
}

TEST_F(PermanentFailures, LayoutThatCannotRunIsNotRetried) {
  const fs::path dir = root_ / "nproc3";
  expect_permanent("nproc3", 3, tiny_job(data_, dir, 8, kLayout), "needs 4 workers but the job has 3");
  EXPECT_FALSE(fs::exists(dir)) << "the run directory was written before the layout was checked";
}

}  // namespace
}  // namespace troupe::faults
