// tests/scheduler/cli_hardening_test.cc — `troupe run` against the ways a new user broke
// it: --nproc beyond the slots (troupe run's, or all agents' for troupe submit) or the
// process limit fails at once naming the limit, and
// SIGTERM / SIGINT end the run and every process it started within 5 s in each phase
// (starting up, spawning many processes, running processes that ignore SIGTERM).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "scheduler/daemons/spawner.h"
#include "tests/scheduler/harness.h"

namespace troupe::sched::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string new_tag() {
  return fmt::format("hard-{}-{:x}", getpid(), std::random_device{}());
}

int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

TEST(CliHardening, NprocBeyondTheProcessLimitFailsAtOnce) {
  const auto t0 = Clock::now();
  auto r = run_cli({"run", "--nproc", "99999", "--", "/bin/true"}, 30s);
  const int64_t took = ms_since(t0);
  std::printf("[ measure ] troupe run --nproc 99999 refused in %lld ms\n", static_cast<long long>(took));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--nproc needs 100000 processes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("limit"), std::string::npos) << r.output;
  EXPECT_LT(took, 5000);
}

TEST(CliHardening, NprocBeyondRlimitNprocNamesIt) {
  // This user's processes now, plus 20: a run of 40 (+ driver) cannot fit.
  int64_t mine = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    struct stat st {};
    const std::string n = e.path().filename().string();
    if (!n.empty() && isdigit(static_cast<unsigned char>(n[0])) && ::stat(e.path().c_str(), &st) == 0 &&
        st.st_uid == getuid()) {
      ++mine;
    }
  }
  const std::string cmd =
      fmt::format("ulimit -u {} && exec '{}' run --nproc 40 -- /bin/true", mine + 20, cli_bin());
  const auto t0 = Clock::now();
  SpawnOptions so;
  so.argv = {"/bin/bash", "-c", cmd};
  for (char** e = environ; *e; ++e) so.env.emplace_back(*e);
  const std::string dir = make_temp_dir("rlimit");
  set_tmpdir(so.env, dir);
  so.log_path = dir + "/out.log";
  auto child = spawn_process(so);
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  std::optional<ExitInfo> ex;
  ASSERT_TRUE(wait_until([&] { return (ex = try_reap(child->pid)).has_value(); }, 20s));
  if (child->pidfd >= 0) close(child->pidfd);
  std::ifstream f(so.log_path);
  const std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(ex->exit_status(), 2) << out;
  EXPECT_NE(out.find("RLIMIT_NPROC"), std::string::npos) << out;
  EXPECT_NE(out.find(fmt::format("is {}", mine + 20)), std::string::npos) << out;
  EXPECT_LT(ms_since(t0), 5000);
  std::filesystem::remove_all(dir);
}

TEST(CliHardening, NprocBeyondTheSlotsFailsAtOnce) {
  auto r = run_cli({"run", "--slots", "2", "--nproc", "3", "--", "/bin/true"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("more than the 2 slots"), std::string::npos) << r.output;
}

TEST(CliHardening, SubmitBeyondTheClustersSlotsFailsAtOnce) {
  Cluster c({.agents = 2, .slots_per_agent = 2});
  std::vector<std::string> a = {"submit", "--nproc", "5"};
  for (const auto& x : c.conn_args()) a.push_back(x);
  a.insert(a.end(), {"--", "/bin/true"});
  const auto t0 = Clock::now();
  const auto r = run_cli(a);
  EXPECT_LT(ms_since(t0), 5000);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--nproc 5 is more than the 4 worker slots of all agents (a1: 2, a2: 2)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(c.status("")["jobs"].size(), 0u);
}

// Starts `troupe run` with `args`, sends `sig` once `ready` holds (or after `delay`),
// and checks the run and every process carrying `tag` are gone within 5 s.
void expect_signal_ends_run(const std::vector<std::string>& args, const std::string& tag, int sig,
                            const std::function<bool()>& ready, const char* phase) {
  SpawnOptions so;
  so.argv = {cli_bin()};
  so.argv.insert(so.argv.end(), args.begin(), args.end());
  for (char** e = environ; *e; ++e) so.env.emplace_back(*e);
  const std::string dir = make_temp_dir("sig");
  set_tmpdir(so.env, dir);
  so.log_path = dir + "/run.log";
  auto child = spawn_process(so);
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  if (ready) {
    EXPECT_TRUE(wait_until(ready, 30s)) << phase << ": never got ready";
  }
  const auto t0 = Clock::now();
  ::kill(child->pid, sig);
  std::optional<ExitInfo> ex;
  const bool ended = wait_until([&] { return (ex = try_reap(child->pid)).has_value(); }, 15s, 10ms);
  const int64_t took = ms_since(t0);
  std::vector<pid_t> left;
  wait_until([&] { return (left = procs_with_tag(tag)).empty(); }, 500ms);
  const int64_t all_gone = ms_since(t0);
  std::printf("[ measure ] %s: %s -> troupe run exited in %lld ms, its processes gone in %lld ms\n", phase,
              strsignal(sig), static_cast<long long>(took), static_cast<long long>(all_gone));
  ASSERT_TRUE(ended) << phase;
  EXPECT_LT(took, 5000) << phase;
  EXPECT_TRUE(ex->exit_status() == 130 || ex->exit_status() == 128 + sig)
      << phase << ": " << ex->exit_status();
  EXPECT_TRUE(left.empty()) << phase << ": " << left.size() << " processes left";
  for (pid_t p : left) ::kill(p, SIGKILL);
  if (child->pidfd >= 0) close(child->pidfd);
  std::filesystem::remove_all(dir);
}

TEST(CliHardening, SignalWhileStartingUp) {
  const std::string tag = new_tag();
  expect_signal_ends_run(
      {"run", "--nproc", "2", "--env", "TW_TAG=" + tag, "--", "sleep", "1000"}, tag, SIGTERM,
      [] {
        std::this_thread::sleep_for(30ms);
        return true;
      },
      "starting");
}

TEST(CliHardening, SigtermWhileSpawningManyProcessesThatIgnoreIt) {
  const std::string tag = new_tag();
  expect_signal_ends_run(
      {"run", "--nproc", "150", "--no-driver", "--env", "TW_TAG=" + tag, "--", "sh", "-c",
       "trap '' TERM INT; exec sleep 1000"},
      tag, SIGTERM, [&] { return procs_with_tag(tag).size() >= 10; }, "spawning");
}

TEST(CliHardening, SigintAndSigtermWhileRunningProcessesThatIgnoreThem) {
  for (int sig : {SIGINT, SIGTERM}) {
    const std::string tag = new_tag();
    expect_signal_ends_run(
        {"run", "--nproc", "3", "--env", "TW_TAG=" + tag, "--", "sh", "-c",
         "trap '' TERM INT; sleep 1000 & wait"},
        tag, sig, [&] { return procs_with_tag(tag).size() == 8; }, "running");
  }
}

}  // namespace
}  // namespace troupe::sched::test
