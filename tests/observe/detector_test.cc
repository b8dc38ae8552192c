// tests/observe/detector_test.cc — the faulty-machine detector (observe/peer_detector.h):
// table-free unit cases under a manual clock (an outlier flagged only after it persists,
// noise and job-wide shifts never flagged, silence as heartbeat evidence, clearing, bad
// options refused), then the real thing: 8 health_job workers on 4 "hosts" (agents on
// 127.0.0.2-5) under a troupe-scheduler, one worker given a CPU hog in its own cgroup
// (sharing its CPU quota, so the contention is the victim's whatever else loads the
// machine), flagged within 10 s, and no healthy worker ever flagged.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "observe/peer_detector.h"
#include "tests/scheduler/harness.h"

namespace troupe::observe {
namespace {

using Clock = PeerDetector::Clock;
using namespace std::chrono_literals;

// Feeds `n` workers one report a second for `seconds`; `value(worker, t)` gives the metric.
std::vector<Verdict> drive(PeerDetector& d, int n, int seconds, const std::function<double(int, int)>& value,
                           Clock::time_point& t, const std::string& metric = "proc_run_delay",
                           const std::set<int>& silent = {}) {
  std::vector<Verdict> out;
  for (int s = 0; s < seconds; ++s) {
    for (int w = 0; w < n; ++w) {
      if (silent.count(w)) continue;
      d.report("worker-" + std::to_string(w), "h" + std::to_string(w / 2), {{metric, value(w, s)}}, t);
    }
    for (int half = 0; half < 2; ++half) {
      t += 500ms;
      for (auto& v :
           d.evaluate(t, std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count()))
        out.push_back(v);
    }
  }
  return out;
}

TEST(PeerDetector, PersistentOutlierIsFlaggedNoiseIsNot) {
  PeerDetector d(DetectorOptions{});
  Clock::time_point t{};
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0.05, 0.01);
  auto v = drive(
      d, 8, 30, [&](int, int) { return std::max(0.0, noise(rng)); }, t);
  EXPECT_TRUE(v.empty()) << v[0].worker << " " << v[0].metric;
  // worker-5 waits on a run queue 0.5 s/s from now on: flagged after `persist` reports.
  int at = -1, s = 0;
  for (; s < 10 && at < 0; ++s) {
    auto vs = drive(
        d, 8, 1, [&](int w, int) { return w == 5 ? 0.5 : std::max(0.0, noise(rng)); }, t);
    for (auto& x : vs) {
      EXPECT_EQ(x.worker, "worker-5");
      EXPECT_EQ(x.metric, "proc_run_delay");
      EXPECT_FALSE(x.cleared);
      at = s;
    }
  }
  EXPECT_EQ(at, DetectorOptions{}.persist - 1);
  // Back to normal: cleared after a window without deviation.
  auto c = drive(
      d, 8, 8, [&](int, int) { return std::max(0.0, noise(rng)); }, t);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_TRUE(c[0].cleared);
}

TEST(PeerDetector, ShortBlipsAndJobWideShiftsAreNotFlagged) {
  PeerDetector d(DetectorOptions{});
  Clock::time_point t{};
  // One worker deviates for 2 reports of every 5 (under persist = 3): never flagged.
  auto v = drive(
      d, 8, 40, [](int w, int s) { return w == 2 && s % 5 < 2 ? 1.0 : 0.05; }, t);
  EXPECT_TRUE(v.empty());
  // Half the job slows at once (a phase of training, the network): no one machine's fault.
  v = drive(
      d, 8, 20, [](int w, int) { return w < 4 ? 1.0 : 0.05; }, t);
  EXPECT_TRUE(v.empty());
  // Every value equal, then one a hair above: within the metric's floor, not an outlier.
  v = drive(
      d, 8, 20, [](int w, int) { return w == 1 ? 0.07 : 0.05; }, t);
  EXPECT_TRUE(v.empty());
}

TEST(PeerDetector, SilenceIsHeartbeatEvidence) {
  PeerDetector d(DetectorOptions{});
  Clock::time_point t{};
  drive(
      d, 6, 5, [](int, int) { return 0.05; }, t);
  auto v = drive(d, 6, 6, [](int, int) { return 0.05; }, t, "proc_run_delay", {3});
  ASSERT_FALSE(v.empty());
  EXPECT_EQ(v[0].worker, "worker-3");
  EXPECT_EQ(v[0].metric, "report_gap_s");
  // Every worker silent (the scheduler stalled): no verdict on anyone.
  PeerDetector d2(DetectorOptions{});
  Clock::time_point t2{};
  drive(
      d2, 6, 5, [](int, int) { return 0.05; }, t2);
  EXPECT_TRUE(
      drive(d2, 6, 8, [](int, int) { return 0.05; }, t2, "proc_run_delay", {0, 1, 2, 3, 4, 5}).empty());
}

TEST(DetectorOptions, KeysAreCheckedAndNamed) {
  DetectorOptions o;
  EXPECT_TRUE(o.set("z_threshold=5").ok());
  EXPECT_EQ(o.z_threshold, 5);
  EXPECT_TRUE(o.set("gpu_temp_c.abs_floor=3").ok());
  EXPECT_EQ(o.rules.at("gpu_temp_c").abs_floor, 3);
  EXPECT_TRUE(o.set("step_io_ms.off=1").ok());
  EXPECT_FALSE(o.rules.count("step_io_ms"));
  EXPECT_TRUE(o.set("host_net_rx_bytes_per_s.on=1").ok());
  EXPECT_TRUE(o.rules.count("host_net_rx_bytes_per_s"));
  EXPECT_NE(o.set("bogus=1").message().find("unknown key 'bogus'"), std::string::npos);
  EXPECT_NE(o.set("persist=9").message().find("persist"), std::string::npos);
  EXPECT_NE(o.set("window").message().find("not key=value"), std::string::npos);
  EXPECT_NE(o.set("silence_s=abc").message().find("needs a number"), std::string::npos);
  EXPECT_NE(o.set("nosuch_metric.abs_floor=1").message().find("unknown key"), std::string::npos);
}

// ---- the real job ----------------------------------------------------------------------

std::string health_job_bin() {
  return TROUPE_TEST_HEALTH_JOB_BIN;
}

// The victim's cgroup (v1 or v2 cpu controller) with a CPU quota of 0.2 CPU, or "" where
// none can be made (not root): then the victim and the hog share one pinned CPU instead.
std::string make_cgroup(const std::string& name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")) {
    const std::string d = "/sys/fs/cgroup/cpu/" + name;
    if (!fs::create_directory(d, ec) && !fs::exists(d)) return "";
    std::ofstream(d + "/cpu.cfs_period_us") << 100000;
    std::ofstream(d + "/cpu.cfs_quota_us") << 20000;
    return d;
  }
  if (fs::exists("/sys/fs/cgroup/cgroup.controllers")) {
    const std::string d = "/sys/fs/cgroup/" + name;
    if (!fs::create_directory(d, ec) && !fs::exists(d)) return "";
    std::ofstream(d + "/cpu.max") << "20000 100000";
    return fs::exists(d + "/cpu.max") ? d : "";
  }
  return "";
}

void join_cgroup(const std::string& cg, pid_t pid) {
  const bool v2 = std::filesystem::exists(cg + "/cgroup.threads");
  for (const auto& t : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    std::ofstream(cg + (v2 ? "/cgroup.threads" : "/tasks")) << t.path().filename().string();
  }
  if (v2) std::ofstream(cg + "/cgroup.procs") << pid;
}

TEST(DetectorCluster, OneContendedWorkerAmongEightIsFlaggedWithinTenSeconds) {
  using namespace troupe::sched::test;
  Cluster::Options co;
  co.agents = 4;
  co.slots_per_agent = 2;
  co.agent_hosts = {"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"};
  Cluster c(co);
  const std::string stop = c.dir() + "/stop";
  const std::string job = c.submit_command(
      {"--nproc", "8", "--no-driver", "--heartbeat-timeout-ms", "60000", "--env", "HJ_STOP_FILE=" + stop},
      {health_job_bin()});
  // Every worker reports before anything is injected.
  ASSERT_TRUE(wait_until(
      [&] {
        const nlohmann::json j = c.status(job)["jobs"][0];
        return j.value("health", nlohmann::json::object()).value("workers", nlohmann::json::array()).size() ==
               8;
      },
      60s, 200ms))
      << c.logs_of_daemons();
  std::this_thread::sleep_for(4s);  // a few clean evaluations
  const pid_t victim = c.proc(job, "worker-5").value("pid", 0);
  ASSERT_GT(victim, 0);
  const std::string cg = make_cgroup("troupe-detector-test-" + std::to_string(getpid()));
  const pid_t hog = fork();
  if (hog == 0) {
    setpgid(0, 0);
    if (cg.empty()) {  // no cgroup: the hog and the victim share the last CPU
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) - 1, &one);
      sched_setaffinity(0, sizeof one, &one);
    }
    while (true) {
    }
  }
  if (cg.empty()) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) - 1, &one);
    for (const auto& t : std::filesystem::directory_iterator("/proc/" + std::to_string(victim) + "/task"))
      sched_setaffinity(std::stoi(t.path().filename().string()), sizeof one, &one);
  } else {
    join_cgroup(cg, victim);
    join_cgroup(cg, hog);
  }
  const auto injected = std::chrono::steady_clock::now();
  auto flags_of = [&](const std::string& proc) {
    int n = 0;
    for (const auto& e : c.events(job)) {
      if (e.value("type", "") == "health_flag" && (proc.empty() || e.value("proc", "") == proc)) ++n;
    }
    return n;
  };
  const bool flagged = wait_until([&] { return flags_of("worker-5") > 0; }, 10s, 100ms);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - injected).count();
  std::this_thread::sleep_for(5s);  // the healthy ones stay unflagged while the fault goes on
  kill(hog, SIGKILL);
  waitpid(hog, nullptr, 0);
  std::ofstream(stop) << "";
  EXPECT_TRUE(c.wait_state(job, "succeeded", 30s)) << c.logs_of_daemons();
  if (!cg.empty()) {
    const bool v2 = std::filesystem::exists(cg + "/cgroup.procs") && !std::filesystem::exists(cg + "/tasks");
    (void)v2;
    rmdir(cg.c_str());  // empty once the victim and the hog are gone
  }
  EXPECT_TRUE(flagged) << "worker-5 not flagged within 10 s";
  std::printf("worker-5 flagged %.1f s after the hog joined its cgroup%s\n", took,
              cg.empty() ? " (no cgroup: pinned to one CPU)" : "");
  for (const auto& e : c.events(job)) {
    if (e.value("type", "") != "health_flag") continue;
    EXPECT_EQ(e.value("proc", ""), "worker-5") << "a healthy worker was flagged: " << e.dump();
  }
}

}  // namespace
}  // namespace troupe::observe
