// tests/apps/operating_test.cc — operating an app (dense_lm) under `troupe run`:
// - `troupe status <run dir>` lists every worker's real pid (a live dense_lm process) and
//   host, `--actors` has a PID column with them;
// - a worker killed with SIGKILL shows in `troupe status` within two seconds (not alive, the
//   recovery in progress), and the recovered job lists the replacement's pid;
// - the scheduler's `placed` event does not claim the pp=1,dp=4 it cannot know, and
//   `actors_placed` records the layout the driver runs (pp=2,dp=2,n=1);
// - `failure_detected` names the lost worker once; the survivors say they wait to be
//   re-formed, not that they failed;
// - `troupe run --state-dir` makes a missing directory, and names one it cannot make;
// - a default run directory (runs/<config stem>) holding an earlier run's metrics is
//   refused with --run-dir and --resume in the message, and the metrics are untouched.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"

namespace troupe::test {
namespace {

const fs::path kConfig = fs::path(TROUPE_SOURCE_DIR) / "apps/examples/dense_lm/dense_lm.toml";

class Operating : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(make_run_root("operating"));
    const RunResult r =
        prepare_data(*root_ / "data", PrepareSpec{}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    remove_run_root(*root_);
    delete root_;
    root_ = nullptr;
  }
  // dense_lm's small model on the test corpus; `steps` steps.
  static std::vector<std::string> sets(int64_t steps) {
    return {fmt::format("data.dir=\"{}\"", (*root_ / "data").string()),
            "model.vocab_size=320",
            "model.d_model=64",
            "model.ffn_hidden=128",
            fmt::format("train.steps={}", steps),
            "train.seq_len=64",
            "train.global_batch=8",
            "train.micro_batch_size=2",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.log_every=1"};
  }
  static std::vector<std::string> with_sets(std::vector<std::string> a, const std::vector<std::string>& s) {
    for (const auto& x : s) a.insert(a.end(), {"--set", x});
    return a;
  }
  static std::string read_file(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  static nlohmann::json read_status(const fs::path& run) {
    const nlohmann::json j = nlohmann::json::parse(read_file(run / "status.json"), nullptr, false);
    return j.is_object() ? j : nlohmann::json::object();
  }
  static std::string cmdline_of(pid_t pid) {
    std::string s = read_file(fs::path("/proc") / std::to_string(pid) / "cmdline");
    for (char& c : s) c = c == '\0' ? ' ' : c;
    return s;
  }
  static std::string hostname() {
    char buf[256] = {};
    gethostname(buf, sizeof(buf) - 1);
    return buf;
  }

  static fs::path* root_;
};

fs::path* Operating::root_ = nullptr;

TEST_F(Operating, StatusShowsRealPidsAndAKilledWorkerWithinTwoSeconds) {
  const fs::path run = *root_ / "run", state = *root_ / "state" / "nested", log = *root_ / "run.log";
  // Rank 3 sleeps 150 ms a step from step 1 on: the job runs long enough to look at.
  std::vector<std::string> a = {TROUPE_CLI_BIN, "run",        "--nproc",    "4",        "--state-dir",
                                state.string(), "--",         DENSE_LM_BIN, "--config", kConfig.string(),
                                "--run-dir",    run.string(), "--parallel", "pp=2,dp=2"};
  a = with_sets(a, sets(40));
  a.insert(a.end(), {"--set", "test.inject=\"slow@1:any:3\"", "--allow-test-config"});

  enum class Phase { kWaitStart, kWaitFailure, kWaitRecovery, kDone } phase = Phase::kWaitStart;
  pid_t victim = -1;
  int victim_slot = -1;
  std::set<pid_t> first_pids;
  Clock::time_point killed_at;
  double seen_after_s = -1;
  std::string actors_out, status_out;
  nlohmann::json recovered_status;
  const auto t0 = Clock::now();
  const pid_t launcher = spawn(a, log);
  RunOptions o;
  o.group_exit_wait = std::chrono::milliseconds(3000);
  o.tick = [&] {
    if (phase == Phase::kWaitStart) {
      const nlohmann::json st = read_status(run);
      if (st.value("step", int64_t{0}) < 2 || st.value("actors", nlohmann::json::array()).empty()) return;
      const RunResult s = troupe::test::run({TROUPE_CLI_BIN, "status", run.string()}, *root_ / "status.log",
                                            std::chrono::seconds(30));
      const RunResult sa = troupe::test::run({TROUPE_CLI_BIN, "status", run.string(), "--actors"},
                                             *root_ / "status-actors.log", std::chrono::seconds(30));
      status_out = s.output;
      actors_out = sa.output;
      for (const auto& w : st["workers"]) {
        const pid_t pid = w.value("pid", pid_t{0});
        first_pids.insert(pid);
        EXPECT_GT(pid, 0) << st.dump();
        EXPECT_EQ(kill(pid, 0), 0) << "pid " << pid << " is not a live process";
        EXPECT_NE(cmdline_of(pid).find("dense_lm"), std::string::npos) << pid << ": " << cmdline_of(pid);
        EXPECT_EQ(w.value("host", ""), hostname()) << w.dump();
        EXPECT_NE(status_out.find(" " + std::to_string(pid) + " "), std::string::npos) << status_out;
        EXPECT_NE(actors_out.find(" " + std::to_string(pid) + " "), std::string::npos) << actors_out;
        if (w.value("rank", -1) == 1) {
          victim = pid;
          victim_slot = w.value("slot", -1);
        }
      }
      ASSERT_GT(victim, 0);
      kill(victim, SIGKILL);
      killed_at = Clock::now();
      phase = Phase::kWaitFailure;
    } else if (phase == Phase::kWaitFailure) {
      const nlohmann::json st = read_status(run);
      bool shown = st.contains("recovering");
      for (const auto& w : st.value("workers", nlohmann::json::array()))
        shown |= w.value("slot", -1) == victim_slot && !w.value("alive", true);
      if (shown) {
        seen_after_s = std::chrono::duration<double>(Clock::now() - killed_at).count();
        const RunResult s = troupe::test::run({TROUPE_CLI_BIN, "status", run.string()},
                                              *root_ / "status2.log", std::chrono::seconds(30));
        EXPECT_NE(s.output.find("recovering: exit"), std::string::npos) << s.output;
        phase = Phase::kWaitRecovery;
      } else if (Clock::now() - killed_at > std::chrono::seconds(10)) {
        ADD_FAILURE() << "the killed worker never showed in status.json: " << st.dump();
        phase = Phase::kDone;
      }
    } else if (phase == Phase::kWaitRecovery) {
      const nlohmann::json st = read_status(run);
      if (st.value("recoveries", 0) >= 1 && !st.contains("recovering") && st.value("epoch", 0) >= 1) {
        recovered_status = st;
        phase = Phase::kDone;
      }
    }
  };
  const RunResult r = finish(launcher, log, t0, std::chrono::seconds(240), o);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_GE(seen_after_s, 0) << r.output;
  EXPECT_NE(status_out.find("HOST"), std::string::npos) << status_out;
  EXPECT_NE(actors_out.find("PID"), std::string::npos) << actors_out;
  // The design's promise (an agent reports an exit at once) with this test's margin: it
  // shows ~0.1 s after the kill on an idle machine, and took 1.06 s once with both cores
  // busy (two spin loops and another test beside the job).
  EXPECT_LE(seen_after_s, 2.0) << "a killed worker took " << seen_after_s << " s to show in troupe status";
  std::printf("[operating] worker pid %d (slot %d) killed: troupe status showed it %.3f s later\n", victim,
              victim_slot, seen_after_s);
  // The replacement's real pid.
  ASSERT_FALSE(recovered_status.empty()) << r.output;
  for (const auto& w : recovered_status["workers"]) {
    const pid_t pid = w.value("pid", pid_t{0});
    EXPECT_GT(pid, 0) << recovered_status.dump();
    if (w.value("rank", -1) == 1) {
      EXPECT_EQ(first_pids.count(pid), 0u) << "the replacement has a new pid";
    }
  }

  // events.jsonl: the lost worker once.
  const auto det = events_named(run / "events.jsonl", "failure_detected");
  ASSERT_FALSE(det.empty());
  EXPECT_EQ(det[0]["slots"], nlohmann::json::array({victim_slot})) << det[0].dump();
  // The survivors wait to be re-formed; nobody but the killed worker failed.
  EXPECT_NE(r.output.find("waiting for the trainer to re-form the job"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("failed in epoch"), std::string::npos) << r.output;

  // The scheduler's events: `placed` knows only 4 workers; the driver's actors_placed the
  // layout.
  std::vector<nlohmann::json> placed, actors_placed;
  for (const auto& job : fs::directory_iterator(state / "jobs")) {
    for (const auto& e : read_jsonl(job.path() / "events.jsonl")) {  // the scheduler's: {"type": ...}
      if (e.value("type", "") == "placed") placed.push_back(e);
      if (e.value("type", "") == "actors_placed") actors_placed.push_back(e);
    }
  }
  ASSERT_FALSE(placed.empty());
  ASSERT_FALSE(actors_placed.empty());
  EXPECT_NE(placed[0].dump().find("\"workers\":4"), std::string::npos) << placed[0].dump();
  EXPECT_EQ(placed[0].dump().find("dp=4"), std::string::npos) << placed[0].dump();
  EXPECT_NE(actors_placed[0].dump().find("\"layout\":\"pp=2,dp=2,n=1\""), std::string::npos)
      << actors_placed[0].dump();
  // A later epoch's placement (the replacement) knows the layout from the driver.
  if (placed.size() > 1) {
    EXPECT_NE(placed.back().dump().find("\"layout\":\"pp=2,dp=2,n=1\""), std::string::npos)
        << placed.back().dump();
  }
}

TEST_F(Operating, StateDirIsMadeOrNamed) {
  const fs::path fresh = *root_ / "fresh" / "state";
  const RunResult ok =
      run({TROUPE_CLI_BIN, "run", "--nproc", "1", "--state-dir", fresh.string(), "--", "/bin/true"},
          *root_ / "fresh.log", std::chrono::seconds(60));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(fs::is_directory(fresh / "jobs")) << ok.output;
  std::ofstream(*root_ / "a-file") << "x";
  const fs::path bad = *root_ / "a-file" / "state";
  const RunResult no =
      run({TROUPE_CLI_BIN, "run", "--nproc", "1", "--state-dir", bad.string(), "--", "/bin/true"},
          *root_ / "bad.log", std::chrono::seconds(60));
  EXPECT_NE(no.exit_code, 0) << no.output;
  EXPECT_NE(no.output.find("--state-dir " + bad.string() + ": cannot create the directory"),
            std::string::npos)
      << no.output;
  EXPECT_EQ(no.output.find("run-credential"), std::string::npos) << no.output;
}

TEST_F(Operating, DefaultRunDirIsNeverOverwritten) {
  // dense_lm started in `work` with a config named mini.toml and no --run-dir: runs/mini.
  const fs::path work = *root_ / "work";
  fs::create_directories(work);
  fs::copy_file(kConfig, work / "mini.toml");
  auto cmd = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"/usr/bin/env", "-C", work.string(), DENSE_LM_BIN, "--config", "mini.toml"};
    a = with_sets(a, sets(2));
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const RunResult first = run(cmd({}), *root_ / "first.log", std::chrono::seconds(120));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path metrics = work / "runs" / "mini" / "metrics.jsonl";
  const std::string before = read_file(metrics);
  ASSERT_FALSE(before.empty());
  const RunResult again = run(cmd({}), *root_ / "again.log", std::chrono::seconds(120));
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("runs/mini holds an earlier run"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--run-dir"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--resume runs/mini"), std::string::npos) << again.output;
  EXPECT_EQ(read_file(metrics), before) << "the earlier run's metrics changed";
  // Naming another directory trains.
  const RunResult other =
      run(cmd({"--run-dir", "runs/mini-2"}), *root_ / "other.log", std::chrono::seconds(120));
  EXPECT_EQ(other.exit_code, 0) << other.output;
  EXPECT_TRUE(fs::exists(work / "runs" / "mini-2" / "metrics.jsonl"));
}

}  // namespace
}  // namespace troupe::test
