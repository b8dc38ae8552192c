// tests/cluster/local_auth_test.cc — local authentication (scheduler/client/local_auth.h) with a
// real second Unix user: a troupe-scheduler and troupe-agent started on loopback without
// key flags serve the starting user's credential (created on first use, mode 0600 in a
// 0700 directory). That user submits, reads status and logs. A second user, created by
// the test (useradd) and removed after, can neither submit, cancel, scale nor read logs:
// each command fails with exit 5 and an error naming the credential; pointed at the
// owner's credential it cannot read it. `troupe run` keeps working for everyone (its
// embedded scheduler takes only its own run key).
//
// Needs root (useradd, runuser). Not root: the test fails saying so.
#include <fmt/format.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "scheduler/daemons/spawner.h"
#include "tests/scheduler/harness.h"

namespace troupe::sched::test {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

CliResult run_argv(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                   std::chrono::seconds timeout = 20s) {
  const std::string dir = make_temp_dir("auth-run");
  SpawnOptions so;
  so.argv = argv;
  so.env = env;
  so.log_path = dir + "/out.log";
  CliResult r;
  auto child = spawn_process(so);
  if (!child.ok()) {
    r.output = child.status().to_string();
    return r;
  }
  std::optional<ExitInfo> ex;
  if (!wait_until([&] { return (ex = try_reap(child->pid)).has_value(); }, timeout)) {
    kill_process_group(child->pid, SIGKILL).ignore();
    while (!(ex = try_reap(child->pid))) std::this_thread::sleep_for(10ms);
    r.output = "(timed out) ";
  }
  if (child->pidfd >= 0) close(child->pidfd);
  r.exit_code = ex->exit_status();
  std::ifstream f(so.log_path);
  r.output += std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  fs::remove_all(dir);
  return r;
}

// A Unix user that exists for the test's duration, with its own home directory.
class Stranger {
 public:
  Stranger() {
    name_ = fmt::format("trp{:x}", std::random_device{}() & 0xffffff);
    home_ = make_temp_dir("stranger-home");
    ::chmod(home_.c_str(), 0755);
    const auto r = run_argv({"/usr/sbin/useradd", "--no-create-home", "--home-dir", home_, "--shell",
                             "/bin/sh", "--user-group", name_},
                            {"PATH=/usr/sbin:/usr/bin:/sbin:/bin"});
    created_ = r.exit_code == 0;
    EXPECT_TRUE(created_) << "useradd " << name_ << ": " << r.output;
    if (const passwd* pw = getpwnam(name_.c_str())) {
      uid_ = pw->pw_uid;
      EXPECT_EQ(::chown(home_.c_str(), pw->pw_uid, pw->pw_gid), 0);
    }
  }
  ~Stranger() {
    // Nothing of the user may survive it.
    if (uid_ > 0) run_argv({"/usr/bin/pkill", "-KILL", "-U", std::to_string(uid_)}, {}).exit_code;
    if (created_) {
      const auto r = run_argv({"/usr/sbin/userdel", name_}, {"PATH=/usr/sbin:/usr/bin:/sbin:/bin"});
      EXPECT_EQ(r.exit_code, 0) << "userdel " << name_ << ": " << r.output;
    }
    std::error_code ec;
    fs::remove_all(home_, ec);
  }
  // `troupe <args>` as this user, with only HOME and PATH (plus `env`) set.
  CliResult troupe(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) const {
    std::vector<std::string> argv = {"/usr/sbin/runuser", "-u", name_,           "--",
                                     "/usr/bin/env",      "-i", "HOME=" + home_, "PATH=/usr/bin:/bin"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.push_back(cli_bin());
    argv.insert(argv.end(), args.begin(), args.end());
    return run_argv(argv, {"PATH=/usr/sbin:/usr/bin:/sbin:/bin"});
  }
  const std::string& name() const { return name_; }
  const std::string& home() const { return home_; }

 private:
  std::string name_, home_;
  uid_t uid_ = 0;
  bool created_ = false;
};

TEST(LocalAuth, AnotherUnixUserCannotSubmitCancelScaleOrReadLogs) {
  ASSERT_EQ(geteuid(), 0u)
      << "local_auth_test must run as root: it creates a second Unix user (useradd) to prove "
         "that user is refused; run it as root (CI does)";
  Cluster c({.agents = 1, .slots_per_agent = 2});
  const std::string config = c.dir() + "/config";  // the harness's TROUPE_CONFIG_DIR
  const std::string cred = config + "/credential.key";
  struct stat st {};
  ASSERT_EQ(::stat(cred.c_str(), &st), 0) << "the scheduler created no credential at " << cred;
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(config.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  // The owner: submit, status, logs.
  const std::string addr = c.address();
  const std::string job = c.submit(1, {"--no-driver"}, {{"TW_RUN_MS", "60000"}, {"TW_BEAT", "1"}});
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(c.wait_running(job, {"worker-0"}, 0, 20s)) << c.logs_of_daemons();
  const auto mine = run_cli({"status", job, "--scheduler", addr});
  EXPECT_EQ(mine.exit_code, 0) << mine.output;

  Stranger other;
  const std::vector<std::vector<std::string>> attempts = {
      {"submit", "--nproc", "1", "--scheduler", addr, "--", "/bin/touch", "/tmp/pwned"},
      {"status", "--scheduler", addr},
      {"logs", job, "--worker", "0", "--scheduler", addr},
      {"cancel", job, "--scheduler", addr},
      {"scale", job, "--dp", "1", "--wait", "2", "--scheduler", addr},
  };
  for (const auto& a : attempts) {
    const auto r = other.troupe(a);
    EXPECT_EQ(r.exit_code, a[0] == "scale" ? r.exit_code : 5) << a[0] << ": " << r.output;
    EXPECT_NE(r.exit_code, 0) << a[0] << ": " << r.output;
    EXPECT_NE(r.output.find("refused"), std::string::npos) << a[0] << ": " << r.output;
    EXPECT_EQ(r.output.find("test_worker worker-0"), std::string::npos) << a[0] << " leaked the job's output";
    std::printf("[local_auth] %s as %s: exit %d: %s", a[0].c_str(), other.name().c_str(), r.exit_code,
                r.output.c_str());
  }
  // Its own credential was created under its own home, not shared.
  EXPECT_TRUE(fs::exists(other.home() + "/.config/troupe/credential.key"));
  // Pointed at the owner's credential: it cannot read it.
  const auto borrowed = other.troupe({"status", "--scheduler", addr}, {"TROUPE_CONFIG_DIR=" + config});
  EXPECT_EQ(borrowed.exit_code, 5) << borrowed.output;
  EXPECT_NE(borrowed.output.find("cannot read the Troupe credential"), std::string::npos) << borrowed.output;

  // Nothing the stranger tried happened: the job still runs, no new job exists.
  EXPECT_EQ(c.job_state(job), "running");
  EXPECT_EQ(c.status("")["jobs"].size(), 1u);
  EXPECT_FALSE(fs::exists("/tmp/pwned"));
  // And the owner still gets in and cancels it.
  const auto cancel = run_cli({"cancel", job, "--scheduler", addr});
  EXPECT_EQ(cancel.exit_code, 0) << cancel.output;

  // troupe run works for the other user too: its own embedded, keyed scheduler.
  const auto run = other.troupe({"run", "--nproc", "2", "--", "/bin/true"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
}

TEST(LocalAuth, CredentialOthersCanReadIsRefused) {
  const std::string dir = make_temp_dir("auth-cfg");
  setenv("TROUPE_CONFIG_DIR", dir.c_str(), 1);
  auto r = run_cli({"status", "--scheduler", "127.0.0.1:1", "--timeout-ms", "300"});
  EXPECT_NE(r.exit_code, 0);
  ASSERT_TRUE(fs::exists(dir + "/credential.key")) << r.output;
  ::chmod((dir + "/credential.key").c_str(), 0644);
  r = run_cli({"status", "--scheduler", "127.0.0.1:1", "--timeout-ms", "300"});
  EXPECT_EQ(r.exit_code, 5) << r.output;
  EXPECT_NE(r.output.find("mode 644"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("chmod 600"), std::string::npos) << r.output;
  unsetenv("TROUPE_CONFIG_DIR");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace troupe::sched::test
