// tests/faults/secrets_test.cc — secrets at rest:
//   - a troupe-scheduler (CURVE) and two agents run a job submitted with
//     `--env MY_API_TOKEN=<random>`: its processes get the value, but no file of the
//     scheduler's state (scheduler.db, its -wal and -shm, the job's events) holds it in the
//     clear; the job's CURVE secret key reaches each process as a 0600 file
//     (TROUPE_JOB_SECRET_KEY_FILE, removed when the process ends), not in its environment;
//     and nothing in the scheduler's state or the agents' directories (logs, keys) is
//     readable by anyone but its owner;
//   - a finished `troupe run` training job: its run directory (metrics, events, config,
//     checkpoints) and the kept state directory (logs, events) are owner-only.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <random>

#include "tests/faults/faults_harness.h"
#include "tests/scheduler/harness.h"

namespace troupe::faults {
namespace {

using sched::test::Cluster;

TEST(SecretsAtRest, SchedulerStateHoldsNoPlaintextSecret) {
  Cluster::Options o;
  o.curve = true;
  Cluster c(o);
  std::random_device rd;
  const std::string token =
      fmt::format("tok-{:016x}{:016x}", (uint64_t{rd()} << 32) | rd(), (uint64_t{rd()} << 32) | rd());
  const std::string job = c.submit(2, {}, {{"MY_API_TOKEN", token}, {"TW_RUN_MS", "3000"}});
  std::vector<pid_t> procs;
  ASSERT_TRUE(sched::test::wait_until(
      [&] { return (procs = sched::test::procs_with_tag(c.tag())).size() == 3; }, std::chrono::seconds(30)))
      << c.logs_of_daemons();
  std::vector<std::string> key_files;
  for (pid_t p : procs) {
    EXPECT_EQ(environ_value(p, "MY_API_TOKEN"), token) << "pid " << p;  // delivered
    EXPECT_EQ(environ_value(p, "TROUPE_JOB_SECRET_KEY"), "") << "pid " << p;
    const std::string file = environ_value(p, "TROUPE_JOB_SECRET_KEY_FILE");
    ASSERT_FALSE(file.empty()) << "pid " << p;
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << file;
    std::string key;
    std::getline(std::ifstream(file), key);
    EXPECT_EQ(key.size(), 40u) << file;
    // The key itself is in no variable of the process's environment, under any name.
    std::ifstream env_in(fmt::format("/proc/{}/environ", p), std::ios::binary);
    const std::string whole_env((std::istreambuf_iterator<char>(env_in)), std::istreambuf_iterator<char>());
    EXPECT_FALSE(whole_env.empty()) << "pid " << p;
    EXPECT_EQ(whole_env.find(key), std::string::npos)
        << "pid " << p << ": the secret key is in its environment";
    key_files.push_back(file);
  }
  ASSERT_TRUE(c.wait_state(job, "succeeded", std::chrono::seconds(60))) << c.logs_of_daemons();
  ASSERT_TRUE(sched::test::wait_until([&] { return sched::test::procs_with_tag(c.tag()).empty(); },
                                      std::chrono::seconds(10)));
  // The agent's starter thread removes each key file once its process is reaped.
  EXPECT_TRUE(sched::test::wait_until(
      [&] {
        return std::none_of(key_files.begin(), key_files.end(), [](const auto& f) { return fs::exists(f); });
      },
      std::chrono::seconds(5)));
  for (const auto& f : key_files) EXPECT_FALSE(fs::exists(f)) << f << " outlived its process";

  const fs::path state = fs::path(c.dir()) / "state";
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(state)) {
    if (!e.is_regular_file()) continue;
    ++files;
    EXPECT_FALSE(file_contains(e.path(), token)) << "the secret is in the clear in " << e.path();
  }
  for (const char* db : {"scheduler.db", "scheduler.db-wal", "scheduler.db-shm"})
    EXPECT_TRUE(fs::exists(state / db)) << db;
  for (const fs::path& d : {state, fs::path(c.dir()) / "a1", fs::path(c.dir()) / "a2"}) {
    const auto open = not_owner_only(d);
    EXPECT_TRUE(open.empty()) << fmt::format("{}", fmt::join(open, "\n"));
  }
  std::printf(
      "[faults secrets] %d files of the scheduler's state searched for the submitted secret: none holds it; "
      "3 processes got it and a 0600 job key file each\n",
      files);
}

TEST(SecretsAtRest, RunAndStateDirectoriesAreOwnerOnly) {
  const fs::path root = test::make_run_root("troupe-faults-secrets");
  const fs::path data = prepared_data(root);
  const fs::path run_dir = root / "run", state = root / "state";
  fs::create_directories(state);  // as a user would, with their umask: troupe run makes it private
  const auto job = tiny_job(data, run_dir, 4, "dp=2,pp=2", {"checkpoint.every=2"});
  const std::string tag = fmt::format("faults-owner-{}", getpid());
  const RunResult r = test::run(troupe_run_argv(4, tag, {"--state-dir", state.string()}, job.argv()),
                                root / "run.log", std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(run_dir / "checkpoints" / "step_4" / "manifest.json"));
  for (const fs::path& d : {run_dir, state}) {
    const auto open = not_owner_only(d);
    EXPECT_TRUE(open.empty()) << fmt::format("{}", fmt::join(open, "\n"));
  }
  if (!::testing::Test::HasFailure()) test::remove_run_root(root);
}

}  // namespace
}  // namespace troupe::faults
