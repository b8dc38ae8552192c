// tests/observe/observe_job_test.cc — a real train_moe job (2 workers, dp=2) under a
// troupe-scheduler with two agents, seen the way an operator sees it:
// - health reports: /proc readings turned into rates (a fake /proc with known counters),
//   step timings, no NVML on a host without the driver (said, not fatal), and every
//   worker's report reaching `troupe status <job> --health` and the status JSON;
// - Prometheus: Debian's real `prometheus` server scrapes the driver's /metrics
//   (observe.prometheus_listen) and the scheduler's (--metrics-listen), and its HTTP API
//   (/api/v1/query) answers a training metric (troupe_train_loss), a worker's health
//   (troupe_worker_proc_cpu) and the cluster's (troupe_agents); the server is stopped and
//   its files removed.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "observe/health.h"
#include "observe/nvml.h"
#include "tests/common/train_moe_harness.h"
#include "tests/scheduler/harness.h"

namespace troupe::observe {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using troupe::sched::test::Cluster;
using troupe::sched::test::wait_until;

// ---- readings without a job ------------------------------------------------------------

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

TEST(HealthReadings, ProcCountersBecomeRates) {
  const fs::path root = troupe::test::make_run_root("troupe-fakeproc");
  const long tick = sysconf(_SC_CLK_TCK);
  auto write_all = [&](int k) {  // k-th reading: every counter grows by a known amount
    put(root / "stat", fmt::format("cpu  {} 0 {} {} {} 0 0 {} 0 0\ncpu0 1 1 1 1\n", 100 + 30 * k, 50 + 10 * k,
                                   1000 + 50 * k, 10 + 5 * k, 5 + 5 * k));
    put(root / "meminfo", "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n");
    put(root / "7/net/dev",
        fmt::format("Inter-|   Receive\n face |bytes packets\n    lo: 999{} 0 0 0 0 0 0 0 999 0 0 0 0 0 0 0\n"
                    "  eth0: {} 0 0 0 0 0 0 0 {} 0 0 0 0 0 0 0\n",
                    k, 1000 + 2000 * k, 500 + 1000 * k));
    put(root / "7/net/snmp",
        fmt::format("Tcp: RtoAlgorithm OutSegs RetransSegs\nTcp: 1 {} {}\n", 100 + 50 * k, 3 * k));
    std::string stat = "7 (a b) S";
    for (int f = 4; f <= 52; ++f) {
      long v = 0;
      if (f == 14) v = tick * k;      // utime: one CPU-second per reading
      if (f == 15) v = tick * k / 2;  // stime
      if (f == 24) v = 10;            // rss pages
      stat += " " + std::to_string(v);
    }
    put(root / "7/stat", stat + "\n");
    put(root / "7/task/7/schedstat", fmt::format("1 {} 1\n", 200000000LL * k));
    put(root / "7/task/8/schedstat", fmt::format("1 {} 1\n", 100000000LL * k));
    put(root / "7/io", fmt::format("rchar: 0\nwrite_bytes: {}\n", 4096 * k));
    put(root / "7/cgroup", "0::/\n");
  };
  HostProbe p(7, root.string());
  write_all(0);
  const auto first = p.sample();  // primes the counters: gauges only
  for (const auto& m : first)
    EXPECT_TRUE(m.name == "host_mem_used_bytes" || m.name == "host_mem_available_bytes" ||
                m.name == "proc_rss_bytes")
        << m.name;
  std::this_thread::sleep_for(200ms);
  write_all(1);
  std::map<std::string, double> m;
  for (const auto& x : p.sample()) m[x.name] = x.value;
  EXPECT_DOUBLE_EQ(m.at("host_mem_used_bytes"), 600.0 * 1024);
  EXPECT_DOUBLE_EQ(m.at("proc_rss_bytes"), 10.0 * sysconf(_SC_PAGESIZE));
  // ticks: user +30, system +10, idle +50, iowait +5, steal +5 -> total 100
  EXPECT_NEAR(m.at("host_cpu_util"), 45.0 / 100, 1e-9);
  EXPECT_NEAR(m.at("host_cpu_steal"), 5.0 / 100, 1e-9);
  EXPECT_NEAR(m.at("host_cpu_iowait"), 5.0 / 100, 1e-9);
  // Rates are per second of the interval (about 0.2 s): compare their ratios.
  const double dt = 1.5 / m.at("proc_cpu");  // 1.5 CPU-seconds in the interval
  EXPECT_GT(dt, 0.15);
  EXPECT_LT(dt, 5.0);
  EXPECT_NEAR(m.at("proc_run_delay") * dt, 0.3, 1e-6);            // two threads: 0.2 + 0.1 s
  EXPECT_NEAR(m.at("host_net_rx_bytes_per_s") * dt, 2000, 1e-6);  // lo left out
  EXPECT_NEAR(m.at("host_net_tx_bytes_per_s") * dt, 1000, 1e-6);
  EXPECT_NEAR(m.at("host_tcp_retrans_per_s") * dt, 3, 1e-9);
  EXPECT_NEAR(m.at("proc_io_write_bytes_per_s") * dt, 4096, 1e-6);
  troupe::test::remove_run_root(root);
}

TEST(HealthReadings, StepProbeAveragesAndKeepsTheLastFigures) {
  StepProbe s;
  EXPECT_TRUE(s.take(1.0).empty());
  s.record_step(100, 60, 40);
  s.record_step(200, 140, 60);
  std::map<std::string, double> m;
  for (const auto& x : s.take(2.0)) m[x.name] = x.value;
  EXPECT_DOUBLE_EQ(m.at("step_ms"), 150);
  EXPECT_DOUBLE_EQ(m.at("step_compute_ms"), 100);
  EXPECT_DOUBLE_EQ(m.at("steps_per_s"), 1.0);
  m.clear();
  s.begin_io();
  std::this_thread::sleep_for(50ms);
  for (const auto& x : s.take(1.0)) m[x.name] = x.value;
  EXPECT_DOUBLE_EQ(m.at("step_compute_ms"), 100);  // no step ended: the last figures stand
  EXPECT_DOUBLE_EQ(m.at("steps_per_s"), 0);
  EXPECT_GE(m.at("step_io_ms"), 45);  // a write in progress counts
}

TEST(HealthReadings, NoNvmlLibraryIsAnErrorNotACrash) {
  if (access("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", F_OK) == 0 ||
      access("/usr/lib64/libnvidia-ml.so.1", F_OK) == 0)
    GTEST_SKIP() << "this host has NVML";
  auto n = Nvml::open("0");
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("libnvidia-ml.so.1"), std::string::npos) << n.status().to_string();
  HealthSampler s(HealthSamplerOptions{.gpu = true});
  EXPECT_NE(s.gpu_unavailable().find("libnvidia-ml"), std::string::npos);
  for (const auto& m : s.sample()) EXPECT_NE(m.name.rfind("gpu_", 0), 0u) << m.name;
}

// ---- the job ---------------------------------------------------------------------------

// GET http://127.0.0.1:<port><path>; the body, or "" when nothing answers.
std::string http_get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return "";
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

int port_of(const std::string& url) {  // http://127.0.0.1:PORT/metrics
  const size_t c = url.rfind(':');
  return c == std::string::npos ? 0 : std::atoi(url.c_str() + c + 1);
}

class ObserveJob : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-observe-job"));
    const auto p = troupe::test::prepare_data(*root_ / "data", {}, *root_ / "prepare.log", 120s);
    ASSERT_EQ(p.exit_code, 0) << p.output;
    Cluster::Options co;
    co.agents = 2;
    co.slots_per_agent = 1;
    co.scheduler_args = {"--metrics-listen", "127.0.0.1:0"};
    cluster_ = new Cluster(co);
    troupe::test::TrainMoeCommand c;
    c.run_dir = *root_ / "run";
    c.sets = troupe::test::tiny_model_sets({.steps = 100000, .data_dir = *root_ / "data"});
    c.sets.push_back("observe.prometheus_listen=\"127.0.0.1:0\"");
    c.parallel = "dp=2";
    job_ = new std::string(cluster_->submit_command({"--nproc", "2"}, c.argv()));
    ASSERT_TRUE(wait_until(
        [] { return troupe::test::latest_step_records(*root_ / "run" / "metrics.jsonl").size() >= 3; }, 120s,
        200ms))
        << cluster_->logs_of_daemons();
  }
  static void TearDownTestSuite() {
    if (cluster_ != nullptr && job_ != nullptr) cluster_->cli({"cancel", *job_});
    delete cluster_;  // stops the daemons; no process of the job is left
    if (!::testing::Test::HasFailure()) troupe::test::remove_run_root(*root_);
    delete root_;
    delete job_;
  }
  static fs::path* root_;
  static Cluster* cluster_;
  static std::string* job_;
};
fs::path* ObserveJob::root_ = nullptr;
Cluster* ObserveJob::cluster_ = nullptr;
std::string* ObserveJob::job_ = nullptr;

TEST_F(ObserveJob, EveryWorkersHealthReportReachesStatus) {
  ASSERT_NE(cluster_, nullptr);
  nlohmann::json workers;
  ASSERT_TRUE(wait_until(
      [&] {
        workers = cluster_->status(*job_)["jobs"][0]["health"]["workers"];
        int with_steps = 0;
        for (const auto& w : workers) with_steps += w["metrics"].contains("step_compute_ms") ? 1 : 0;
        return with_steps == 2;
      },
      30s, 200ms))
      << workers.dump(1);
  for (const auto& w : workers) {
    const auto& m = w["metrics"];
    EXPECT_EQ(w.value("name", "").rfind("worker-", 0), 0u) << w.dump();
    EXPECT_LT(w.value("age_s", 99.0), 5.0) << w.dump();
    EXPECT_GE(m.value("host_cpu_util", -1.0), 0.0);
    EXPECT_LE(m.value("host_cpu_util", 2.0), 1.0);
    EXPECT_GT(m.value("proc_cpu", 0.0), 0.0);  // it trains
    EXPECT_GT(m.value("proc_rss_bytes", 0.0), 1e6);
    EXPECT_GE(m.value("proc_run_delay", -1.0), 0.0);
    EXPECT_GT(m.value("step_compute_ms", 0.0), 0.0);
    EXPECT_GT(m.value("steps_per_s", 0.0), 0.0);
    EXPECT_FALSE(m.contains("gpu_sm_clock_mhz"));  // CPU workers
  }
  const auto r = cluster_->cli({"status", *job_, "--health"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* s :
       {"health (each worker's last report", "PROC CPU", "RUNQ", "COMPUTE ms", "worker-0", "worker-1"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  const auto bad = cluster_->cli({"status", "--health"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
}

TEST_F(ObserveJob, PrometheusServerScrapesTheDriverAndTheScheduler) {
  ASSERT_NE(cluster_, nullptr);
  const fs::path url_file = *root_ / "run" / "metrics_url";
  ASSERT_TRUE(wait_until([&] { return fs::exists(url_file); }, 30s));
  std::string driver_url;
  std::ifstream(url_file) >> driver_url;
  const std::string sched_url = cluster_->status("")["scheduler"].value("metrics_url", "");
  ASSERT_FALSE(sched_url.empty());
  // Our own endpoints first: the text format, with the training metric in it.
  EXPECT_NE(http_get(port_of(driver_url), "/metrics").find("troupe_train_loss{troupe_job=\""),
            std::string::npos);
  std::string sched_text;  // refreshed once a second
  EXPECT_TRUE(wait_until(
      [&] {
        sched_text = http_get(port_of(sched_url), "/metrics");
        return sched_text.find("troupe_agents{state=\"alive\"} 2") != std::string::npos;
      },
      10s, 200ms))
      << sched_url << "\n"
      << sched_text.substr(0, 3000);
  // The real server.
  const fs::path dir = *root_ / "prometheus";
  fs::create_directories(dir / "data");
  const int port = troupe::sched::test::free_port();
  std::ofstream(dir / "prometheus.yml") << fmt::format(
      "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
      "  - job_name: troupe-driver\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n"
      "  - job_name: troupe-scheduler\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
      port_of(driver_url), port_of(sched_url));
  const std::string bin = "/usr/bin/prometheus";
  ASSERT_EQ(access(bin.c_str(), X_OK), 0) << "Debian's prometheus is not installed (scripts/install-deps.sh)";
  const pid_t pid =
      troupe::test::spawn({bin, "--config.file=" + (dir / "prometheus.yml").string(),
                           "--storage.tsdb.path=" + (dir / "data").string(),
                           fmt::format("--web.listen-address=127.0.0.1:{}", port), "--log.level=warn"},
                          dir / "prometheus.log");
  auto query = [&](const std::string& q) {
    const nlohmann::json j =
        nlohmann::json::parse(http_get(port, "/api/v1/query?query=" + q), nullptr, false);
    if (!j.is_object() || j.value("status", "") != "success") return nlohmann::json::array();
    return j["data"].value("result", nlohmann::json::array());
  };
  nlohmann::json loss, cpu, agents;
  const bool got = wait_until(
      [&] {
        loss = query("troupe_train_loss");
        cpu = query("troupe_worker_proc_cpu");
        agents = query("troupe_agents");
        return !loss.empty() && cpu.size() == 2 && !agents.empty();
      },
      60s, 500ms);
  kill(pid, SIGTERM);
  const auto r = troupe::test::finish(pid, dir / "prometheus.log", troupe::test::Clock::now(), 20s);
  EXPECT_TRUE(got) << "loss " << loss.dump() << " cpu " << cpu.dump() << " agents " << agents.dump() << "\n"
                   << r.output;
  ASSERT_FALSE(loss.empty());
  EXPECT_EQ(loss[0]["metric"].value("troupe_job", ""), *job_);
  const double v = std::stod(loss[0]["value"][1].get<std::string>());
  EXPECT_GT(v, 0.0);
  EXPECT_LT(v, 20.0);  // a cross-entropy over 320 tokens starts near ln 320 = 5.8
  EXPECT_FALSE(r.timed_out) << "prometheus did not stop on SIGTERM";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace troupe::observe
