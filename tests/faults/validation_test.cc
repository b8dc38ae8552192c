// tests/faults/validation_test.cc — input checked before work, on `troupe run --nproc 4`
// jobs of the tiny model (dp=2, pp=2):
//   - model.d_model = 1000000: refused at once with the memory a rank needs and what the
//     device has (both numbers), a permanent failure, nothing written;
//   - train.seq_len longer than the data: refused before the run directory is written
//     (bad token ids: permanent_failure_test.cc, which checks the same);
//   - config errors name their origin: an unknown key given with --set is the override's,
//     one in the file is the file's;
//   - refused credentials: `troupe status`, `cancel`, `scale` and `replace` all exit 5.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "core/exit_status.h"
#include "tests/faults/faults_harness.h"
#include "tests/scheduler/harness.h"

namespace troupe::faults {
namespace {

const std::string kLayout = "dp=2,pp=2";

class Validation : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::make_run_root("troupe-faults-validation");
    data_ = prepared_data(root_);
  }
  void TearDown() override {
    if (!HasFailure()) test::remove_run_root(root_);
  }
  RunResult run_job(const std::string& name, const test::TrainMoeCommand& job,
                    std::chrono::seconds deadline) {
    return test::run(troupe_run_argv(4, fmt::format("faults-{}-{}", name, getpid()), {}, job.argv()),
                     root_ / (name + ".log"), deadline);
  }
  fs::path root_, data_;
};

TEST_F(Validation, ModelLargerThanTheDeviceIsRefusedBeforeWork) {
  const fs::path dir = root_ / "huge";
  const auto t0 = Clock::now();
  // On a build without the estimate the job allocates for minutes: 30 s is its bound here.
  const RunResult r =
      run_job("huge", tiny_job(data_, dir, 8, kLayout, {"model.d_model=1000000"}), std::chrono::seconds(30));
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_FALSE(r.timed_out) << "not refused within 30 s";
  EXPECT_EQ(r.exit_code, kExitPermanentFailure) << r.output;
  EXPECT_NE(r.output.find("this model does not fit: each rank needs at least"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("TiB ("), std::string::npos) << r.output;           // what it needs
  EXPECT_NE(r.output.find("(MemTotal) has"), std::string::npos) << r.output;  // what the host has
  EXPECT_FALSE(fs::exists(dir));
  const std::string state = kept_state_dir(r.output);
  if (!state.empty()) fs::remove_all(fs::path(state));
  std::printf("[faults validation] d_model 1000000 refused after %.1f s (exit %d)\n", s, r.exit_code);
}

TEST_F(Validation, SequenceLongerThanTheDataIsRefusedBeforeWork) {
  const fs::path dir = root_ / "long-seq";
  const RunResult r = run_job("long-seq", tiny_job(data_, dir, 8, kLayout, {"train.seq_len=1000000000"}),
                              std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, kExitPermanentFailure) << r.output;
  EXPECT_NE(r.output.find("train.seq_len = 1000000000 but the train split of"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir))
      << "config.toml, overrides.txt or tokenizer.json written before the data was checked";
  const std::string state = kept_state_dir(r.output);
  if (!state.empty()) fs::remove_all(fs::path(state));
}

TEST_F(Validation, ConfigErrorsNameTheirOrigin) {
  const std::string config = (fs::path(test::source_dir()) / "apps/configs/tiny.toml").string();
  const RunResult set = test::run({test::train_moe_bin(), "--config", config, "--set", "train.no_such_key=1",
                                   "--run-dir", (root_ / "origin").string()},
                                  root_ / "set.log", std::chrono::seconds(30));
  EXPECT_EQ(set.exit_code, kExitPermanentFailure) << set.output;
  EXPECT_NE(set.output.find("override 'train.no_such_key=1': unknown key 'train.no_such_key'"),
            std::string::npos)
      << set.output;
  EXPECT_EQ(set.output.find(config + ": unknown key"), std::string::npos) << set.output;
  const fs::path bad = root_ / "bad.toml";
  {
    std::ofstream out(bad);
    out << std::ifstream(config).rdbuf() << "\n[extra]\nno_such_key = 1\n";
  }
  const RunResult file =
      test::run({test::train_moe_bin(), "--config", bad.string(), "--run-dir", (root_ / "origin").string()},
                root_ / "file.log", std::chrono::seconds(30));
  EXPECT_EQ(file.exit_code, kExitPermanentFailure) << file.output;
  EXPECT_NE(file.output.find(bad.string() + ": unknown key 'extra.no_such_key'"), std::string::npos)
      << file.output;
  // A wrong type given with --set is the override's too.
  const RunResult type = test::run({test::train_moe_bin(), "--config", config, "--set",
                                    "train.steps=\"many\"", "--run-dir", (root_ / "origin").string()},
                                   root_ / "type.log", std::chrono::seconds(30));
  EXPECT_NE(type.output.find("override 'train.steps=\"many\"': key 'train.steps' must be an integer"),
            std::string::npos)
      << type.output;
  EXPECT_FALSE(fs::exists(root_ / "origin"));
}

TEST_F(Validation, RefusedCredentialsExitTheSameForEveryCommand) {
  sched::test::Cluster c({});
  // Another user's credential (local authentication): every command is refused, exit 5.
  const std::string other = "TROUPE_CONFIG_DIR=" + (root_ / "other-user").string();
  for (const std::vector<std::string>& cmd : {std::vector<std::string>{"status"},
                                              {"cancel", "job-1"},
                                              {"scale", "job-1", "--dp", "1"},
                                              {"replace", "job-1", "0"}}) {
    std::vector<std::string> argv{troupe_bin(), cmd[0], "--scheduler", c.address()};
    argv.insert(argv.end(), cmd.begin() + 1, cmd.end());
    const RunResult r = test::run(argv, root_ / "cli.log", std::chrono::seconds(60), {.env = {other}});
    EXPECT_EQ(r.exit_code, 5) << fmt::format("troupe {}", fmt::join(cmd, " ")) << "\n" << r.output;
    EXPECT_NE(r.output.find("refused this client's credentials"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace troupe::faults
