// tests/scheduler/cluster_test.cc — end-to-end tests with real processes on loopback: a
// troupe-scheduler, two troupe-agents (2 slots each) and 4-worker jobs with a driver,
// driven through the troupe CLI. Covers status, kill -9 of a worker (detection time),
// SIGSTOP (heartbeat timeout), a scheduler restart mid-job, a killed driver, CURVE with a
// wrong key, process starts that stall (the agent keeps beating; a kill meanwhile is
// applied once the start ends), and that no process is left behind (Cluster's destructor
// checks /proc).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "scheduler/client/transport.h"
#include "tests/scheduler/harness.h"

namespace troupe::sched::test {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

const std::vector<std::string> kAll = {"driver", "worker-0", "worker-1", "worker-2", "worker-3"};

// The first event of `type` for `proc` (and epoch, when >= 0) at or after `since_ms`.
std::optional<json> find_event(const std::vector<json>& events, const std::string& type, const std::string& proc,
                               int64_t since_ms = 0) {
  for (const auto& e : events) {
    if (e.value("type", "") == type && (proc.empty() || e.value("proc", "") == proc) &&
        e.value("ts_ms", int64_t{0}) >= since_ms) {
      return e;
    }
  }
  return std::nullopt;
}

bool exists(const std::string& p) { return std::filesystem::exists(p); }

TEST(Cluster, FourWorkerJobRunsShowsInStatusAndCompletes) {
  Cluster c({});
  // Each worker runs 4 s: long enough that status, status --json and top all find the job
  // running on a loaded 2-core machine.
  std::string job = c.submit(4, {"--layout", "pp=1,dp=2,n=2", "--name", "smoke"},
                             {{"TW_RUN_MS", "4000"}, {"TW_BEAT", "1"}, {"TW_RENDEZVOUS", "1"}});
  ASSERT_EQ(job, "job-1");
  ASSERT_TRUE(c.wait_running(job, kAll, 0, seconds(10))) << c.logs_of_daemons();

  // The human table and the JSON both show the job and its processes.
  auto table = run_cli([&] {
    std::vector<std::string> a = {"status"};
    auto conn = c.conn_args();
    a.insert(a.end(), conn.begin(), conn.end());
    return a;
  }());
  EXPECT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("job-1"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("smoke"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("running"), std::string::npos) << table.output;
  auto one = run_cli([&] {
    std::vector<std::string> a = {"status", job, "--json"};
    auto conn = c.conn_args();
    a.insert(a.end(), conn.begin(), conn.end());
    return a;
  }());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  json st = json::parse(one.output);
  ASSERT_EQ(st["jobs"].size(), 1u);
  EXPECT_EQ(st["jobs"][0]["procs"].size(), 5u);
  // Each MoE group (n=2: ranks {0,1} and {2,3}) sits on one agent, and both agents are used.
  std::map<int, std::string> agent_of;
  for (const auto& p : st["jobs"][0]["procs"]) {
    if (p["role"] == "worker") agent_of[p["rank"].get<int>()] = p["agent"].get<std::string>();
  }
  EXPECT_EQ(agent_of[0], agent_of[1]);
  EXPECT_EQ(agent_of[2], agent_of[3]);
  EXPECT_NE(agent_of[0], agent_of[2]);
  // `troupe top <job> --once`: the job's record, processes and events (no run directory:
  // the test worker is not train_moe).
  auto top = run_cli([&] {
    std::vector<std::string> a = {"top", job, "--once"};
    auto conn = c.conn_args();
    a.insert(a.end(), conn.begin(), conn.end());
    return a;
  }());
  EXPECT_EQ(top.exit_code, 0) << top.output;
  for (const char* s : {"troupe top", "job job-1  running", "layout pp=1,dp=2,n=2", "worker-2", "driver",
                        "run directory: unknown", "recent events", "proc_started"}) {
    EXPECT_NE(top.output.find(s), std::string::npos) << s << "\n" << top.output;
  }
  std::printf("[troupe top --once job-1]\n%s", top.output.c_str());

  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(20))) << c.logs_of_daemons();
  for (const auto& n : kAll) EXPECT_TRUE(exists(c.out_dir() + "/" + n + ".e0.r0.done")) << n;
  auto ev = c.events(job);
  for (const char* type : {"submitted", "placed", "proc_started", "proc_hello", "proc_exited", "job_finished"}) {
    EXPECT_TRUE(find_event(ev, type, "")) << "no " << type << " event";
  }
  for (const auto& e : ev) {
    EXPECT_TRUE(e.contains("ts") && e.contains("ts_ms")) << e.dump();
  }

  // `troupe logs` reads a worker's output through the scheduler and its agent.
  auto logs = run_cli([&] {
    std::vector<std::string> a = {"logs", job, "--worker", "2"};
    auto conn = c.conn_args();
    a.insert(a.end(), conn.begin(), conn.end());
    return a;
  }());
  EXPECT_EQ(logs.exit_code, 0) << logs.output;
  EXPECT_NE(logs.output.find("test_worker worker-2: rendezvous done"), std::string::npos) << logs.output;
}

TEST(Cluster, KillDashNineOfAWorkerIsReportedWithinASecondAndTheJobRestarts) {
  Cluster c({});
  std::string job = c.submit(4, {"--max-restarts", "1"},
                             {{"TW_RUN_MS", "30000"}, {"TW_RUN_MS_E1", "800"}, {"TW_BEAT", "1"}, {"TW_CHILD", "1"},
                              {"TW_DRIVER_FOLLOW", "1"}});
  ASSERT_TRUE(c.wait_running(job, kAll, 0, seconds(10))) << c.logs_of_daemons();
  pid_t victim = c.proc(job, "worker-2")["pid"].get<int>();
  ASSERT_GT(victim, 0);
  int64_t t0 = wall_ms();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);

  std::optional<json> exit_ev;
  ASSERT_TRUE(wait_until([&] { return (exit_ev = find_event(c.events(job), "proc_exited", "worker-2")).has_value(); },
                         seconds(5)));
  int64_t detect_ms = exit_ev->value("ts_ms", int64_t{0}) - t0;
  std::printf("[ measure ] kill -9 of a worker -> proc_exited at the scheduler: %lld ms\n",
              static_cast<long long>(detect_ms));
  EXPECT_EQ(exit_ev->value("signal", 0), SIGKILL);
  EXPECT_LT(detect_ms, 1000);
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(20))) << c.logs_of_daemons();
  auto st = c.status(job)["jobs"][0];
  EXPECT_EQ(st["restarts"], 1);
  EXPECT_EQ(st["epoch"], 1);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(exists(fmt::format("{}/worker-{}.e1.r0.done", c.out_dir(), r)));
  EXPECT_TRUE(find_event(c.events(job), "job_restarting", ""));
}

TEST(Cluster, StoppedWorkerIsDetectedWithinTheHeartbeatTimeout) {
  Cluster c({});
  const int timeout_ms = 1000;
  std::string job = c.submit(4, {"--max-restarts", "1", "--heartbeat-timeout-ms", std::to_string(timeout_ms)},
                             {{"TW_RUN_MS", "30000"}, {"TW_RUN_MS_E1", "800"}, {"TW_BEAT", "1"}, {"TW_DRIVER_FOLLOW", "1"}});
  ASSERT_TRUE(c.wait_running(job, kAll, 0, seconds(10))) << c.logs_of_daemons();
  pid_t victim = c.proc(job, "worker-1")["pid"].get<int>();
  int64_t t0 = wall_ms();
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);
  std::optional<json> ev;
  ASSERT_TRUE(wait_until(
      [&] { return (ev = find_event(c.events(job), "proc_heartbeat_timeout", "worker-1")).has_value(); }, seconds(8)));
  int64_t detect_ms = ev->value("ts_ms", int64_t{0}) - t0;
  std::printf("[ measure ] SIGSTOP of a worker -> heartbeat timeout at the scheduler: %lld ms (timeout %d ms)\n",
              static_cast<long long>(detect_ms), timeout_ms);
  // Its last beat came at most one beat interval (timeout/6) before the stop.
  EXPECT_GE(detect_ms, timeout_ms - timeout_ms / 6 - 50);
  EXPECT_LT(detect_ms, timeout_ms + 1000);  // the target: <= heartbeat timeout + 1 s
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(20))) << c.logs_of_daemons();
  EXPECT_FALSE(pid_alive(victim)) << "the stopped worker was not killed";
}

TEST(Cluster, SchedulerRestartMidJobLosesNoJobRecordAndReattaches) {
  Cluster c({});
  std::string first = c.submit(1, {"--no-driver"}, {{"TW_RUN_MS", "0"}});
  ASSERT_TRUE(c.wait_state(first, "succeeded", seconds(10)));
  std::string job = c.submit(4, {}, {{"TW_RUN_MS", "5000"}, {"TW_BEAT", "1"}});
  ASSERT_TRUE(c.wait_running(job, kAll, 0, seconds(10))) << c.logs_of_daemons();
  auto before = c.status(job)["jobs"][0];

  c.restart_scheduler(SIGKILL);
  json st;
  ASSERT_TRUE(wait_until([&] {
    try {
      st = c.status("");
      int alive = 0;
      for (const auto& a : st["agents"]) alive += a.value("alive", false) ? 1 : 0;
      return alive == 2;
    } catch (const std::exception&) {
      return false;
    }
  }, seconds(10))) << c.logs_of_daemons();
  ASSERT_EQ(st["jobs"].size(), 2u);
  EXPECT_EQ(st["jobs"][0]["id"], first);
  EXPECT_EQ(st["jobs"][0]["state"], "succeeded");
  EXPECT_EQ(st["jobs"][1]["id"], job);
  EXPECT_EQ(st["jobs"][1]["state"], "running");
  // Same processes, same epoch: re-attached, not restarted.
  for (const auto& p : st["jobs"][1]["procs"]) {
    for (const auto& q : before["procs"]) {
      if (p["name"] == q["name"]) {
        EXPECT_EQ(p["pid"], q["pid"]) << p["name"];
      }
    }
  }
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(15))) << c.logs_of_daemons();
  auto after = c.status(job)["jobs"][0];
  EXPECT_EQ(after["restarts"], 0);
  EXPECT_EQ(after["epoch"], 0);
  EXPECT_TRUE(find_event(c.events(job), "scheduler_recovered", ""));
  EXPECT_TRUE(find_event(c.events(job), "proc_reattached", ""));
}

TEST(Cluster, KilledDriverIsRestartedAndReattachesToItsWorkers) {
  Cluster c({});
  std::string job = c.submit(4, {}, {{"TW_RUN_MS", "3000"}, {"TW_BEAT", "1"}});
  ASSERT_TRUE(c.wait_running(job, kAll, 0, seconds(10))) << c.logs_of_daemons();
  std::vector<int> worker_pids;
  for (int r = 0; r < 4; ++r) worker_pids.push_back(c.proc(job, fmt::format("worker-{}", r))["pid"].get<int>());
  pid_t driver = c.proc(job, "driver")["pid"].get<int>();
  ASSERT_EQ(::kill(driver, SIGKILL), 0);
  ASSERT_TRUE(wait_until([&] { return exists(c.out_dir() + "/driver.e0.r1.start"); }, seconds(5))) << c.logs_of_daemons();
  std::ifstream f(c.out_dir() + "/driver.e0.r1.start");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("running_workers=4"), std::string::npos) << text;
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(15))) << c.logs_of_daemons();
  auto st = c.status(job)["jobs"][0];
  EXPECT_EQ(st["driver_restarts"], 1);
  EXPECT_EQ(st["restarts"], 0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(c.proc(job, fmt::format("worker-{}", r))["pid"].get<int>(), worker_pids[static_cast<size_t>(r)]);
  }
}

TEST(Cluster, DriverPlacesActorsOnWorkersAndReachesThemThroughTheirActorSystems) {
  Cluster c({});
  std::string job = c.submit(4, {"--layout", "dp=2,n=2"},
                             {{"TW_RUN_MS", "1500"}, {"TW_BEAT", "1"}, {"TW_ACTORS", "1"}, {"TW_PLACE", "1"},
                              {"TW_DRIVER_FOLLOW", "1"}});
  ASSERT_TRUE(wait_until([&] { return exists(c.out_dir() + "/driver.placed"); }, seconds(20))) << c.logs_of_daemons();
  std::ifstream f(c.out_dir() + "/driver.placed");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "ok 4\n");
  auto st = c.status(job)["jobs"][0];
  ASSERT_EQ(st["actors"].size(), 4u);
  for (const auto& a : st["actors"]) {
    EXPECT_EQ(a["actor"].get<std::string>(), "expert-" + a["proc"].get<std::string>().substr(7));
  }
  EXPECT_TRUE(find_event(c.events(job), "actors_placed", ""));
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(15))) << c.logs_of_daemons();
}

TEST(Cluster, CurveClientWithWrongKeyIsRefused) {
  Cluster c({.agents = 1, .slots_per_agent = 2, .curve = true});
  // Agents and job processes got in with allowed keys: a job runs end to end.
  std::string job = c.submit(2, {}, {{"TW_RUN_MS", "200"}, {"TW_BEAT", "1"}, {"TW_RENDEZVOUS", "1"}});
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(15))) << c.logs_of_daemons();

  auto rogue = run_cli({"status", "--scheduler", c.address(), "--curve-key", c.dir() + "/keys/rogue.key",
                        "--scheduler-key", c.scheduler_pub()});
  EXPECT_EQ(rogue.exit_code, 5) << rogue.output;
  EXPECT_NE(rogue.output.find("refused"), std::string::npos) << rogue.output;
  auto plain = run_cli({"status", "--scheduler", c.address(), "--timeout-ms", "1000"});
  EXPECT_NE(plain.exit_code, 0) << plain.output;
  // The scheduler kept serving the allowed client.
  auto good = run_cli({"status", "--scheduler", c.address(), "--curve-key", c.client_key(), "--scheduler-key",
                       c.scheduler_pub()});
  EXPECT_EQ(good.exit_code, 0) << good.output;
  EXPECT_NE(good.output.find(job), std::string::npos) << good.output;
}

TEST(Cluster, ClearErrorsForUnknownJobWrongAddressAndBadArguments) {
  Cluster c({.agents = 1, .slots_per_agent = 1});
  auto conn = c.conn_args();
  auto unknown = run_cli({"status", "job-99", "--scheduler", c.address()});
  EXPECT_EQ(unknown.exit_code, 3) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown job 'job-99'"), std::string::npos) << unknown.output;
  auto top = run_cli({"top", "job-99", "--once", "--scheduler", c.address()});
  EXPECT_EQ(top.exit_code, 3) << top.output;
  EXPECT_NE(top.output.find("unknown job 'job-99'"), std::string::npos) << top.output;
  EXPECT_NE(top.output.find("or a run directory"), std::string::npos) << top.output;
  auto top_nowhere = run_cli({"top", "job-1", "--once", "--scheduler", fmt::format("127.0.0.1:{}", free_port()),
                              "--timeout-ms", "500"});
  EXPECT_EQ(top_nowhere.exit_code, 4) << top_nowhere.output;
  auto cancel = run_cli({"cancel", "job-99", "--scheduler", c.address()});
  EXPECT_EQ(cancel.exit_code, 3) << cancel.output;
  auto nowhere = run_cli({"status", "--scheduler", fmt::format("127.0.0.1:{}", free_port()), "--timeout-ms", "500"});
  EXPECT_EQ(nowhere.exit_code, 4) << nowhere.output;
  EXPECT_NE(nowhere.output.find("cannot reach a scheduler"), std::string::npos) << nowhere.output;
  auto bad_addr = run_cli({"status", "--scheduler", "no-port-here"});
  EXPECT_EQ(bad_addr.exit_code, 2) << bad_addr.output;
  auto bad_nproc = run_cli({"submit", "--nproc", "0", "--scheduler", c.address(), "--", "/bin/true"});
  EXPECT_NE(bad_nproc.exit_code, 0) << bad_nproc.output;
  auto bad_layout = run_cli({"submit", "--nproc", "4", "--layout", "pp=3,dp=1,n=1", "--scheduler", c.address(), "--",
                             "/bin/true"});
  EXPECT_EQ(bad_layout.exit_code, 2) << bad_layout.output;
  EXPECT_NE(bad_layout.output.find("layout"), std::string::npos) << bad_layout.output;
  auto no_cmd = run_cli({"submit", "--nproc", "1", "--scheduler", c.address()});
  EXPECT_EQ(no_cmd.exit_code, 2) << no_cmd.output;
  // Cancel of a running job stops every process of it.
  std::string job = c.submit(1, {}, {{"TW_RUN_MS", "60000"}, {"TW_CHILD", "1"}});
  ASSERT_TRUE(wait_until([&] { return procs_with_tag(c.tag()).size() >= 3; }, seconds(10)));
  auto cancelled = run_cli({"cancel", job, "--scheduler", c.address()});
  EXPECT_EQ(cancelled.exit_code, 0) << cancelled.output;
  EXPECT_TRUE(wait_until([&] { return procs_with_tag(c.tag()).empty(); }, seconds(5)));
  EXPECT_EQ(c.job_state(job), "cancelled");
}

// A start that stalls, as an open of its log file on a stalled disk would: the log file is
// a FIFO that nothing reads yet, so the agent's open of it blocks until the test opens the
// other end. Opens the FIFO `path` for reading and drains it to its end on a thread.
class FifoReader {
 public:
  explicit FifoReader(std::string path) : path_(std::move(path)) {}
  ~FifoReader() { join(); }
  void start() {
    thread_ = std::thread([this] {
      const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return;
      char buf[4096];
      while (::read(fd, buf, sizeof(buf)) > 0) {
      }
      ::close(fd);
    });
  }
  void join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::string path_;
  std::thread thread_;
};

// The FIFO in place of job-1's worker-0 log on the cluster's only agent.
std::string stall_worker0_log(const Cluster& c) {
  const std::string logs = c.dir() + "/a1/jobs/job-1/logs";
  std::filesystem::create_directories(logs);
  const std::string fifo = logs + "/worker-0.log";
  EXPECT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  return fifo;
}

TEST(Cluster, AStalledProcessStartDoesNotSilenceTheAgent) {
  Cluster::Options o;
  o.agents = 1;
  Cluster c(o);
  FifoReader reader(stall_worker0_log(c));
  std::string job = c.submit(2, {}, {{"TW_RUN_MS", "300"}});
  ASSERT_EQ(job, "job-1");
  // Past the scheduler's agent timeout (3 s) with worker-0's start blocked in the agent.
  std::this_thread::sleep_for(milliseconds(4500));
  const json st = c.status("");
  ASSERT_EQ(st["agents"].size(), 1u);
  EXPECT_TRUE(st["agents"][0].value("alive", false)) << st.dump();
  EXPECT_FALSE(find_event(c.events(job), "agent_lost", "")) << c.logs_of_daemons();
  EXPECT_EQ(c.logs_of_daemons().find("declared dead"), std::string::npos) << c.logs_of_daemons();
  // The open returns: the start goes on and the job runs to its end.
  reader.start();
  ASSERT_TRUE(c.wait_state(job, "succeeded", seconds(20))) << c.logs_of_daemons();
  EXPECT_TRUE(exists(c.out_dir() + "/worker-0.e0.r0.done"));
  EXPECT_TRUE(exists(c.out_dir() + "/worker-1.e0.r0.done"));
}

TEST(Cluster, ACancelDuringAStalledStartKillsTheProcessOnceStarted) {
  Cluster::Options o;
  o.agents = 1;
  Cluster c(o);
  FifoReader reader(stall_worker0_log(c));
  std::string job = c.submit(2, {}, {{"TW_RUN_MS", "60000"}});
  ASSERT_EQ(job, "job-1");
  // The driver starts; worker-0's start blocks (and worker-1's waits behind it).
  ASSERT_TRUE(wait_until([&] { return !procs_with_tag(c.tag()).empty(); }, seconds(10)))
      << c.logs_of_daemons();
  auto cancelled = c.cli({"cancel", job});
  EXPECT_EQ(cancelled.exit_code, 0) << cancelled.output;
  reader.start();
  // worker-0 and worker-1 start after the cancel and are killed as they are adopted.
  EXPECT_TRUE(wait_until([&] { return procs_with_tag(c.tag()).empty(); }, seconds(10)))
      << c.logs_of_daemons();
  EXPECT_TRUE(wait_until([&] { return c.job_state(job) == "cancelled"; }, seconds(5))) << c.job_state(job);
  EXPECT_FALSE(exists(c.out_dir() + "/worker-0.e0.r0.done"));
  const std::string agent_log = c.agent(0).log_text();
  EXPECT_NE(agent_log.find("job-1/worker-0 epoch 0 was to be killed while it was being started"),
            std::string::npos)
      << agent_log;
}

}  // namespace
}  // namespace troupe::sched::test
