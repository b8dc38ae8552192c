// tests/faults/driver_fault_test.cc — the job's driver as a fault: a `troupe run --nproc 4`
// job of the tiny model (dp=2, pp=2, checkpoints every 4 steps) whose driver is
//   - SIGSTOPped and left stopped: the scheduler hears no heartbeat for the job's timeout,
//     kills it and starts a new driver (and, today, new workers: it resumes from the newest
//     checkpoint), and the job finishes with the losses of a fault-free run;
//   - SIGSTOPped for less than the timeout: nothing happens (a short stop is no failure);
//   - SIGKILLed: replaced the same way, and the run's record survives it: events.jsonl
//     holds both drivers' events (appended, never cut) and the scheduler's own event log
//     of the job is kept in the run directory (scheduler_events.jsonl).
// The fault-free reference is the same job under the standalone launcher (same Trainer,
// layout and data order).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "tests/faults/faults_harness.h"

namespace troupe::faults {
namespace {

constexpr int64_t kSteps = 12;
constexpr int kHeartbeatTimeoutMs = 1500;
const std::string kLayout = "dp=2,pp=2";

class DriverFaults : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(test::make_run_root("troupe-faults-driver"));
    data_ = new fs::path(prepared_data(*root_));
    const auto ref = tiny_job(*data_, *root_ / "reference", kSteps, kLayout, {"checkpoint.every=4"});
    const RunResult r = test::run(ref.argv(), *root_ / "reference.log", std::chrono::seconds(180));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    reference_ =
        new std::vector<nlohmann::json>(test::latest_step_records(*root_ / "reference" / "metrics.jsonl"));
    ASSERT_EQ(static_cast<int64_t>(reference_->size()), kSteps);
  }
  static void TearDownTestSuite() {
    if (!::testing::Test::HasFailure()) test::remove_run_root(*root_);
    delete root_;
    delete data_;
    delete reference_;
  }

  // Starts the job under `troupe run` (slot 0 is 150 ms slower a step, so that a fault
  // lands mid-job; the numbers are the same); returns the troupe run process.
  static pid_t start(const std::string& name, const std::string& tag) {
    const auto job = tiny_job(*data_, *root_ / name, kSteps, kLayout,
                              {"checkpoint.every=4", "test.inject=\"slow@1:any:0\""});
    return test::spawn(
        troupe_run_argv(4, tag, {"--heartbeat-timeout-ms", std::to_string(kHeartbeatTimeoutMs)}, job.argv()),
        *root_ / (name + ".log"));
  }
  static pid_t driver_of(const std::string& tag) {
    std::vector<pid_t> d;
    const auto until = Clock::now() + std::chrono::seconds(30);
    while ((d = job_pids(tag, "driver")).size() != 1 && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return d.size() == 1 ? d[0] : -1;
  }
  static std::string new_tag(const std::string& name) {
    return fmt::format("faults-{}-{}-{:x}", name, getpid(), std::random_device{}());
  }

  static fs::path* root_;
  static fs::path* data_;
  static std::vector<nlohmann::json>* reference_;
};

fs::path* DriverFaults::root_ = nullptr;
fs::path* DriverFaults::data_ = nullptr;
std::vector<nlohmann::json>* DriverFaults::reference_ = nullptr;

TEST_F(DriverFaults, HungDriverIsReplaced) {
  const std::string name = "hung", tag = new_tag(name);
  const auto t0 = Clock::now();
  const pid_t run = start(name, tag);
  ASSERT_TRUE(wait_for_steps(*root_ / name, 6, std::chrono::seconds(90)));
  const pid_t driver = driver_of(tag);
  ASSERT_GT(driver, 0);
  const int64_t stopped_ms = wall_ms();
  ASSERT_EQ(::kill(driver, SIGSTOP), 0);
  // Left stopped: the job must finish without it (on a build that never detects it, the
  // job waits for its driver until this deadline).
  const RunResult r = test::finish(run, *root_ / (name + ".log"), t0, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << "the stopped driver was never replaced\n" << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(::kill(driver, 0), 0) << "the stopped driver " << driver << " is still there";

  const fs::path dir = *root_ / name;
  const auto timeouts = records(dir / "scheduler_events.jsonl", "proc_heartbeat_timeout");
  ASSERT_EQ(timeouts.size(), 1u) << "the scheduler's log: " << dir / "scheduler_events.jsonl";
  EXPECT_EQ(timeouts[0].value("proc", ""), "driver");
  const int64_t detection_ms = timeouts[0]["ts_ms"].get<int64_t>() - stopped_ms;
  // Silence counts from the driver's last beat, up to one beat interval (500 ms) before
  // the SIGSTOP: detection can come that much sooner than the timeout after the stop.
  EXPECT_GE(detection_ms, kHeartbeatTimeoutMs - 500 - 200);
  EXPECT_LE(detection_ms, kHeartbeatTimeoutMs + 2000);
  EXPECT_EQ(records(dir / "scheduler_events.jsonl", "driver_restarting").size(), 1u);
  const auto restarted = records(dir / "events.jsonl", "driver_restarted");
  ASSERT_EQ(restarted.size(), 1u);
  test::expect_losses_match(*reference_, dir / "metrics.jsonl", 1e-6, "faults hung driver", "fault-free");
  std::printf(
      "[faults hung driver] SIGSTOP after step 6: detected %lld ms later (heartbeat timeout %d ms), the new "
      "driver started %lld ms after the detection and resumed from step %lld\n",
      static_cast<long long>(detection_ms), kHeartbeatTimeoutMs,
      static_cast<long long>(restarted[0]["ts_ms"].get<int64_t>() - timeouts[0]["ts_ms"].get<int64_t>()),
      static_cast<long long>(restarted[0].value("step", int64_t{-1})));
}

TEST_F(DriverFaults, ShortDriverStopIsNotAFailure) {
  const std::string name = "short-stop", tag = new_tag(name);
  const auto t0 = Clock::now();
  const pid_t run = start(name, tag);
  ASSERT_TRUE(wait_for_steps(*root_ / name, 4, std::chrono::seconds(90)));
  const pid_t driver = driver_of(tag);
  ASSERT_GT(driver, 0);
  ASSERT_EQ(::kill(driver, SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(kHeartbeatTimeoutMs / 3));
  ASSERT_EQ(::kill(driver, SIGCONT), 0);
  const RunResult r = test::finish(run, *root_ / (name + ".log"), t0, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const fs::path dir = *root_ / name;
  EXPECT_TRUE(records(dir / "scheduler_events.jsonl", "proc_heartbeat_timeout").empty());
  EXPECT_TRUE(records(dir / "scheduler_events.jsonl", "driver_restarting").empty());
  EXPECT_TRUE(records(dir / "events.jsonl", "failure_detected").empty());
  test::expect_losses_match(*reference_, dir / "metrics.jsonl", 1e-6, "faults short driver stop",
                            "fault-free");
}

TEST_F(DriverFaults, RestartedDriverKeepsTheRecord) {
  const std::string name = "killed", tag = new_tag(name);
  const auto t0 = Clock::now();
  const pid_t run = start(name, tag);
  ASSERT_TRUE(wait_for_steps(*root_ / name, 6, std::chrono::seconds(90)));
  const fs::path dir = *root_ / name;
  // The first driver commits the checkpoint of step 4 off the steps: on a loaded machine (a
  // busy disk) that may land after step 6. The kill waits for it, until step 9 of 12 at most.
  auto ready_to_kill = [&] {
    try {
      return !records(dir / "events.jsonl", "checkpoint_committed").empty() ||
             test::step_records(dir / "metrics.jsonl").size() >= 9;
    } catch (const std::exception&) {
      return false;  // a line being written
    }
  };
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (!ready_to_kill() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const size_t events_before = test::read_jsonl(dir / "events.jsonl").size();
  const pid_t driver = driver_of(tag);
  ASSERT_GT(driver, 0);
  ASSERT_EQ(::kill(driver, SIGKILL), 0);
  const RunResult r = test::finish(run, *root_ / (name + ".log"), t0, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;

  // The first driver's record is still there, the second's follows it.
  const auto events = test::read_jsonl(dir / "events.jsonl");
  EXPECT_GE(events.size(), events_before + 3);
  EXPECT_EQ(records(dir / "events.jsonl", "job_started").size(), 2u);
  const auto restarted = records(dir / "events.jsonl", "driver_restarted");
  ASSERT_EQ(restarted.size(), 1u);
  EXPECT_EQ(restarted[0].value("driver_restarts", 0), 1);
  EXPECT_EQ(events.empty() ? "" : events.back().value("event", ""), "job_finished");
  bool committed_before_restart = false;
  for (const auto& e : events) {
    if (e.value("event", "") == "driver_restarted") break;
    committed_before_restart |= e.value("event", "") == "checkpoint_committed" && e.value("step", 0) == 4;
  }
  EXPECT_TRUE(committed_before_restart) << "the first driver's checkpoint_committed (step 4) was lost";
  // The scheduler's log of the job, in the run directory although its state was temporary.
  const fs::path sched = dir / "scheduler_events.jsonl";
  ASSERT_TRUE(fs::exists(sched));
  EXPECT_EQ(records(sched, "driver_restarting").size(), 1u);
  EXPECT_EQ(records(sched, "job_finished").size(), 1u);
  test::expect_losses_match(*reference_, dir / "metrics.jsonl", 1e-6, "faults killed driver", "fault-free");
  std::printf(
      "[faults killed driver] events.jsonl: %zu records before the kill, %zu after the job (2 job_started, "
      "1 driver_restarted); scheduler_events.jsonl kept: %zu records\n",
      events_before, events.size(), test::read_jsonl(sched).size());
}

}  // namespace
}  // namespace troupe::faults
