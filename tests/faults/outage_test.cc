// tests/faults/outage_test.cc — an outage of the scheduler as a fault: a train_moe job
// (dp=2, n=2, tiny model) submitted to a troupe-scheduler with two troupe-agents, the
// scheduler SIGKILLed mid-job and started again later:
//   - down for 60 s (the default outage limit is 300 s): training goes on meanwhile (no
//     step needs the scheduler), the driver and every worker log every few seconds that
//     they are waiting for it and for how long, and when it returns no worker is declared
//     silent or killed for its absence (liveness starts again from fresh evidence): the job
//     succeeds without any recovery and with the fault-free losses;
//   - down past the job's limit (elastic.scheduler_outage_limit_ms = 6000 here): every
//     process says so and ends with a permanent failure; when the scheduler returns the job
//     is failed (not restarted), and the run directory says why.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <iterator>
#include <regex>
#include <thread>

#include "tests/faults/faults_harness.h"
#include "tests/scheduler/harness.h"

namespace troupe::faults {
namespace {

using sched::test::Cluster;

// Slot 0 sleeps 150 ms at each of four points of every step (600 ms a step), so that the
// job outlives the outage; the arithmetic is the same as without.
const std::string kSlow = "test.inject=\"slow@1:forward:0,slow@1:alltoall:0,slow@1:sync:0,slow@1:any:0\"";

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The job's process logs (both agents' work directories), by process name.
std::map<std::string, std::string> job_logs(const Cluster& c, const std::string& job) {
  std::map<std::string, std::string> out;
  for (const char* agent : {"a1", "a2"}) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fs::path(c.dir()) / agent / "jobs" / job / "logs", ec))
      out[e.path().stem().string()] += read_all(e.path());
  }
  return out;
}

// The "waiting for the scheduler ... for N s" lines of a log: their N, in order.
std::vector<int> waits(const std::string& log) {
  std::vector<int> out;
  static const std::regex re("waiting for the scheduler[^\\n]* for ([0-9]+) s");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator(); ++it)
    out.push_back(std::stoi((*it)[1]));
  return out;
}

class SchedulerOutage : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::make_run_root("troupe-faults-outage");
    data_ = prepared_data(root_);
  }
  void TearDown() override {
    if (!HasFailure()) test::remove_run_root(root_);
  }
  fs::path root_, data_;
};

TEST_F(SchedulerOutage, SchedulerDownForSixtySecondsKillsNoHealthyWorker) {
  constexpr int64_t kSteps = 140;
  constexpr int kDownS = 60;
  const auto ref = tiny_job(data_, root_ / "reference", kSteps, "dp=2,n=2");
  const RunResult rr = test::run(ref.argv(), root_ / "reference.log", std::chrono::seconds(240));
  ASSERT_EQ(rr.exit_code, 0) << rr.output;
  const auto reference = test::latest_step_records(root_ / "reference" / "metrics.jsonl");

  Cluster c({});
  const fs::path dir = root_ / "outage";
  const std::string job = c.submit_command({"--nproc", "4", "--heartbeat-timeout-ms", "2000"},
                                           tiny_job(data_, dir, kSteps, "dp=2,n=2", {kSlow}).argv());
  ASSERT_TRUE(wait_for_steps(dir, 3, std::chrono::seconds(90))) << c.logs_of_daemons();
  const size_t steps_at_kill = test::step_records(dir / "metrics.jsonl").size();
  c.stop_scheduler(SIGKILL);
  std::this_thread::sleep_for(std::chrono::seconds(kDownS));
  c.start_scheduler();
  const size_t steps_at_return = test::step_records(dir / "metrics.jsonl").size();
  ASSERT_TRUE(c.wait_state(job, "succeeded", std::chrono::seconds(240))) << c.logs_of_daemons();

  // The job went on through the outage, and nobody was declared silent or replaced.
  EXPECT_GT(steps_at_return, steps_at_kill) << "training stopped while the scheduler was down";
  for (const char* e : {"failure_detected", "worker_killed", "job_failed", "recovered"})
    EXPECT_TRUE(records(dir / "events.jsonl", e).empty()) << e << " in " << dir / "events.jsonl";
  const fs::path sched_events = fs::path(c.dir()) / "state/jobs" / job / "events.jsonl";
  for (const char* e : {"proc_lost", "proc_heartbeat_timeout", "job_restarting", "driver_restarting"})
    EXPECT_TRUE(records(sched_events, e).empty()) << e << " in " << sched_events;
  // Every process said it was waiting, every few seconds, and that the scheduler came back.
  const auto logs = job_logs(c, job);
  EXPECT_EQ(logs.size(), 5u);
  for (const auto& [proc, log] : logs) {
    const std::vector<int> w = waits(log);
    EXPECT_GE(w.size(), static_cast<size_t>(kDownS / 5 - 4)) << proc << ":\n" << log.substr(0, 4000);
    EXPECT_GE(w.empty() ? 0 : w.back(), kDownS - 15) << proc;
    for (size_t i = 1; i < w.size(); ++i)
      EXPECT_LE(w[i] - w[i - 1], 10) << proc << ": a gap in the waiting lines";
    EXPECT_NE(log.find("answers again after"), std::string::npos) << proc;
  }
  test::expect_losses_match(reference, dir / "metrics.jsonl", 1e-5, "faults scheduler down 60 s",
                            "fault-free");
  std::printf(
      "[faults scheduler down %d s] steps %zu -> %zu during the outage; %zu processes logged their wait "
      "(driver: %zu lines); no failure declared; job succeeded\n",
      kDownS, steps_at_kill, steps_at_return, logs.size(),
      logs.count("driver") ? waits(logs.at("driver")).size() : 0);
}

TEST_F(SchedulerOutage, OutagePastTheLimitEndsTheJobWithAClearState) {
  Cluster c({});
  const fs::path dir = root_ / "past-limit";
  const std::string job = c.submit_command(
      {"--nproc", "4"},
      tiny_job(data_, dir, 400, "dp=2,n=2", {kSlow, "elastic.scheduler_outage_limit_ms=6000"}).argv());
  ASSERT_TRUE(wait_for_steps(dir, 3, std::chrono::seconds(90))) << c.logs_of_daemons();
  const auto t0 = Clock::now();
  c.stop_scheduler(SIGKILL);
  // Every process of the job ends by itself once the limit has passed.
  const bool all_gone = sched::test::wait_until([&] { return sched::test::procs_with_tag(c.tag()).empty(); },
                                                std::chrono::seconds(60));
  const double gone_s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(all_gone) << sched::test::procs_with_tag(c.tag()).size() << " process(es) still waiting";
  c.start_scheduler();
  ASSERT_TRUE(c.wait_state(job, "failed", std::chrono::seconds(60))) << c.logs_of_daemons();
  const nlohmann::json st = c.status(job)["jobs"][0];
  EXPECT_NE(st.value("message", "").find("permanent failure"), std::string::npos) << st.dump();
  EXPECT_EQ(st.value("restarts", -1), 0) << st.dump();
  EXPECT_EQ(st.value("driver_restarts", -1), 0) << st.dump();
  // The run directory says why.
  const auto failed = records(dir / "events.jsonl", "job_failed");
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_NE(failed[0].value("error", "").find("unreachable"), std::string::npos) << failed[0].dump();
  const nlohmann::json status = nlohmann::json::parse(read_all(dir / "status.json"), nullptr, false);
  EXPECT_TRUE(status.is_object() && status.value("failed", false)) << status.dump();
  for (const auto& [proc, log] : job_logs(c, job)) {
    EXPECT_FALSE(waits(log).empty()) << proc;
    EXPECT_NE(log.find("past the job's limit of 6 s"), std::string::npos) << proc << ":\n"
                                                                          << log.substr(0, 4000);
  }
  std::printf(
      "[faults scheduler past the limit] limit 6 s: every process gone %.1f s after the scheduler's kill; "
      "job %s: %s\n",
      gone_s, st.value("state", "").c_str(), st.value("message", "").c_str());
}

}  // namespace
}  // namespace troupe::faults
