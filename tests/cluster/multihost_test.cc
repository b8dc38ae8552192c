// tests/cluster/multihost_test.cc — a Troupe cluster of three "hosts" on one machine:
// distinct loopback addresses stand for hosts (127.0.0.2 runs troupe-scheduler, 127.0.0.3
// and 127.0.0.4 run one troupe-agent each, started with --host-addr), every connection
// CURVE-encrypted (scheduler and agents with key files; the job's processes with the
// job's key pair the scheduler hands them). A dp=2,n=2 train_moe job is placed one
// n-group per host:
//   - every listening socket of every job process (actor control plane, Gloo) is bound
//     to its own agent's address, never 127.0.0.1 or 0.0.0.0; its sessions with the
//     scheduler go through its agent's relay (TROUPE_AGENT_RELAY; no TCP connection of
//     its own to the scheduler), and the agent's session leaves from the host's address;
//     its losses equal one process's (1e-5);
//   - job processes with their own actor systems bind their host's address and accept
//     only the job's key (a client without it is refused);
//   - an elastic job whose agent on 127.0.0.4 is SIGKILLed mid-job gets that host's
//     workers replaced on 127.0.0.3, which restore their parts of the newest snapshot
//     from the copies 127.0.0.4's keeper had made on 127.0.0.3's, and finishes with the
//     one-process losses;
//   - a driver SIGKILLed mid-job is restarted and resumes from the newest snapshot the
//     agents still hold.
// Prints the time from `troupe submit` to the first step and the recovery time.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cluster/net_probe.h"
#include "tests/common/train_moe_harness.h"
#include "tests/scheduler/harness.h"

namespace {

namespace fs = std::filesystem;
using troupe::sched::test::Cluster;
using troupe::sched::test::wait_until;
using troupe::test::Clock;
using troupe::test::events_named;
using troupe::test::latest_step_records;
using troupe::test::RunResult;
using troupe::test::tcp_sockets_of;

constexpr int64_t kSteps = 12;
constexpr int64_t kSnapshotEvery = 2;  // elastic.snapshot_every
const std::map<std::string, std::string> kHostOf = {{"a1", "127.0.0.3"}, {"a2", "127.0.0.4"}};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A job's processes, by value (a range-for over a member of the temporary status
// document would dangle).
nlohmann::json procs_of(Cluster& c, const std::string& job) {
  return c.status(job)["jobs"][0]["procs"];
}

bool step_records_after(const fs::path& dir, size_t steps) {
  return latest_step_records(dir / "metrics.jsonl").size() > steps;
}

std::string environ_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::string environ_value(pid_t pid, const std::string& name) {
  const std::string env = environ_of(pid);
  const std::string key = name + "=";
  for (size_t at = 0; at < env.size();) {
    const size_t end = env.find('\0', at);
    const std::string kv = env.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (kv.rfind(key, 0) == 0) return kv.substr(key.size());
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "";
}

class Multihost : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-multihost"));
    const RunResult p =
        troupe::test::prepare_data(*root_ / "data", {}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(p.exit_code, 0) << p.output;
    // One process, the same global batch (2 micro-batches accumulated).
    const RunResult ref = troupe::test::run(train_args("one-process", ""), *root_ / "one-process.log",
                                            std::chrono::seconds(180));
    ASSERT_EQ(ref.exit_code, 0) << ref.output;
    reference_ =
        new std::vector<nlohmann::json>(latest_step_records(*root_ / "one-process" / "metrics.jsonl"));
    ASSERT_EQ(static_cast<int64_t>(reference_->size()), kSteps);
  }
  static void TearDownTestSuite() {
    if (!::testing::Test::HasFailure()) troupe::test::remove_run_root(*root_);
    delete root_;
    delete reference_;
  }

  // `inject`: test.inject (training/worker/elastic.h), empty for none.
  static std::vector<std::string> train_args(const std::string& name, const std::string& parallel,
                                             const std::string& inject = "") {
    troupe::test::TrainMoeCommand c;
    c.run_dir = *root_ / name;
    c.sets = troupe::test::tiny_model_sets({.steps = kSteps, .data_dir = *root_ / "data"});
    if (!inject.empty()) c.sets.push_back(fmt::format("test.inject=\"{}\"", inject));
    c.sets.push_back("checkpoint.every=4");
    c.sets.push_back(fmt::format("elastic.snapshot_every={}", kSnapshotEvery));
    c.parallel = parallel;
    return c.argv();
  }

  static Cluster::Options hosts(int slots) {
    Cluster::Options o;
    o.agents = 2;
    o.slots_per_agent = slots;
    o.curve = true;
    o.agent_timeout_ms = 1500;
    o.scheduler_host = "127.0.0.2";
    o.agent_hosts = {"127.0.0.3", "127.0.0.4"};
    return o;
  }

  static void expect_one_process_losses(const std::string& name) {
    troupe::test::expect_losses_match(*reference_, *root_ / name / "metrics.jsonl", 1e-5, "multihost " + name,
                                      "one process");
  }

  // Every live process of `job`: its listening sockets are on its agent's address, its
  // sessions with the scheduler go through its agent's relay (none of its own: the
  // agent's leaves from the host's address, checked by the caller), and every other
  // connection it holds
  // either is on its own address or goes to a host's address: nothing of the job
  // listens on, or is reached at, 127.0.0.1 or 0.0.0.0. (An outgoing Gloo connection
  // leaves from the address the kernel picks: 127.0.0.1 towards 127.0.0.x.) Returns
  // how many processes were checked.
  static int expect_bound_to_their_hosts(Cluster& c, const std::string& job, bool workers_listen) {
    const std::string sched_ip = "127.0.0.2";
    auto is_host = [&](const std::string& ip) {
      return ip == sched_ip ||
             std::any_of(kHostOf.begin(), kHostOf.end(), [&](const auto& h) { return h.second == ip; });
    };
    int checked = 0;
    for (const auto& p : procs_of(c, job)) {
      if (p.value("state", "") != "running") continue;
      const pid_t pid = p.value("pid", 0);
      const std::string name = p.value("name", "");
      const std::string host = kHostOf.at(p.value("agent", ""));
      EXPECT_EQ(environ_value(pid, "TROUPE_HOST_ADDR"), host) << p.dump();
      EXPECT_FALSE(environ_value(pid, "TROUPE_JOB_PUBLIC_KEY").empty()) << p.dump();
      // The job's secret key comes as a 0600 file, never in the environment.
      EXPECT_TRUE(environ_value(pid, "TROUPE_JOB_SECRET_KEY").empty()) << p.dump();
      EXPECT_FALSE(environ_value(pid, "TROUPE_JOB_SECRET_KEY_FILE").empty()) << p.dump();
      EXPECT_EQ(environ_value(pid, "TROUPE_AGENT_RELAY").rfind("ipc://", 0), 0u) << p.dump();
      int listening = 0, to_scheduler = 0, peers = 0;
      for (const auto& s : tcp_sockets_of(pid)) {
        if (s.listening) {
          ++listening;
          EXPECT_EQ(s.local_ip, host) << name << " listens on " << s.local_ip << ":" << s.local_port;
        } else if (s.remote_ip == sched_ip) {
          ++to_scheduler;
          EXPECT_EQ(s.local_ip, host) << name << " reaches the scheduler from " << s.local_ip;
        } else {
          ++peers;
          EXPECT_TRUE(s.local_ip == host || is_host(s.remote_ip))
              << name << ": connection " << s.local_ip << ":" << s.local_port << " -> " << s.remote_ip << ":"
              << s.remote_port << " is neither on its host's address nor to another host's";
        }
      }
      EXPECT_EQ(to_scheduler, 0) << name << " has a session with the scheduler besides its agent's relay";
      if (p.value("role", "") == "worker") {
        if (workers_listen) {
          EXPECT_GE(listening, 1) << name << " listens nowhere";
        }
        EXPECT_GE(listening + peers, 1) << name << " has no connection with its peers";
      }
      ++checked;
    }
    return checked;
  }

  static fs::path* root_;
  static std::vector<nlohmann::json>* reference_;
};

fs::path* Multihost::root_ = nullptr;
std::vector<nlohmann::json>* Multihost::reference_ = nullptr;

TEST_F(Multihost, JobOnTwoHostsBindsEachHostsAddressAndTrainsLikeOneProcess) {
  Cluster c(hosts(2));
  const fs::path dir = *root_ / "two-hosts";
  const auto t0 = Clock::now();
  const std::string job =
      c.submit_command({"--nproc", "4", "--layout", "dp=2,n=2"}, train_args("two-hosts", "dp=2,n=2"));
  ASSERT_TRUE(wait_until([&] { return !latest_step_records(dir / "metrics.jsonl").empty(); },
                         std::chrono::seconds(90), std::chrono::milliseconds(10)))
      << c.logs_of_daemons();
  const double first_step_s = seconds_since(t0);
  // One n-group per host.
  std::map<std::string, std::vector<int>> ranks_on;
  for (const auto& p : procs_of(c, job)) {
    if (p.value("role", "") == "worker") ranks_on[p.value("agent", "")].push_back(p.value("rank", -1));
  }
  for (auto& [agent, ranks] : ranks_on) std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks_on["a1"], (std::vector<int>{0, 1}));
  EXPECT_EQ(ranks_on["a2"], (std::vector<int>{2, 3}));
  EXPECT_EQ(expect_bound_to_their_hosts(c, job, false), 5);  // driver + 4 workers, while they train
  // The agents' own sessions with the scheduler leave from their hosts' addresses too.
  for (size_t i = 0; i < 2; ++i) {
    int sessions = 0;
    for (const auto& sock : tcp_sockets_of(c.agent(i).pid())) {
      if (sock.listening || sock.remote_ip != "127.0.0.2") continue;
      ++sessions;
      EXPECT_EQ(sock.local_ip, i == 0 ? "127.0.0.3" : "127.0.0.4") << "agent a" << i + 1;
    }
    EXPECT_GE(sessions, 1) << "agent a" << i + 1 << " has no session with the scheduler";
  }
  ASSERT_TRUE(c.wait_state(job, "succeeded", std::chrono::seconds(120))) << c.logs_of_daemons();
  expect_one_process_losses("two-hosts");
  std::printf(
      "[multihost two-hosts] submit -> first step %.2f s (scheduler 127.0.0.2, agents 127.0.0.3/.4, CURVE)\n",
      first_step_s);
}

TEST_F(Multihost, AgentKilledMidJobGetsItsWorkersReplacedOnTheOtherHost) {
  Cluster c(hosts(4));
  // Another tenant's 2-process job fills half of a1 (127.0.0.3), so the elastic job's
  // two n-groups land one per host; it ends before the kill, leaving a1 room for the
  // replacements.
  const std::string filler = c.submit_command({"--nproc", "2", "--layout", "dp=1,n=2", "--no-driver"},
                                              {"sh", "-c", "exec sleep 1000"});
  ASSERT_TRUE(wait_until([&] { return c.status(filler)["jobs"][0].value("running_procs", 0) == 2; },
                         std::chrono::seconds(30)))
      << c.logs_of_daemons();
  const fs::path dir = *root_ / "agent-kill";
  const auto t0 = Clock::now();
  // Slot 0 (on a1) runs 150 ms slower per step so that the kill lands mid-job.
  const std::string job = c.submit_command({"--nproc", "4", "--layout", "dp=2,n=2"},
                                           train_args("agent-kill", "dp=2,n=2", "slow@1:any:0"));
  ASSERT_TRUE(wait_until([&] { return !latest_step_records(dir / "metrics.jsonl").empty(); },
                         std::chrono::seconds(90), std::chrono::milliseconds(10)))
      << c.logs_of_daemons();
  const double first_step_s = seconds_since(t0);
  std::map<std::string, int> workers_on;
  for (const auto& p : procs_of(c, job)) {
    if (p.value("role", "") == "worker") workers_on[p.value("agent", "")]++;
    if (p.value("role", "") == "driver") {
      EXPECT_EQ(p.value("agent", ""), "a1");
    }
  }
  EXPECT_EQ(workers_on["a1"], 2);
  EXPECT_EQ(workers_on["a2"], 2);
  // (An elastic worker holds its Gloo pairs' connections; its listener is closed by now.)
  EXPECT_EQ(expect_bound_to_their_hosts(c, job, false), 5);
  EXPECT_EQ(c.cli({"cancel", filler}).exit_code, 0);
  ASSERT_TRUE(wait_until([&] { return latest_step_records(dir / "metrics.jsonl").size() >= 3; },
                         std::chrono::seconds(60)))
      << c.logs_of_daemons();
  const size_t steps_before = latest_step_records(dir / "metrics.jsonl").size();
  ASSERT_LT(steps_before, static_cast<size_t>(kSteps)) << "the job ended before the kill";
  const auto kill_at = Clock::now();
  c.agent(1).stop(SIGKILL);  // the host 127.0.0.4 is gone, with its two workers
  // Training goes on past the step it was at, with workers on a1 only.
  ASSERT_TRUE(wait_until([&] { return step_records_after(dir, steps_before); }, std::chrono::seconds(90),
                         std::chrono::milliseconds(10)))
      << c.logs_of_daemons();
  const double resumed_s = seconds_since(kill_at);
  ASSERT_TRUE(c.wait_state(job, "succeeded", std::chrono::seconds(120))) << c.logs_of_daemons();
  expect_one_process_losses("agent-kill");
  int replaced_on_a1 = 0;
  for (const auto& p : procs_of(c, job)) {
    if (p.value("role", "") == "worker" && p.value("state", "") == "exited" &&
        p.value("exit_status", -1) == 0) {
      EXPECT_EQ(p.value("agent", ""), "a1") << p.dump();
      ++replaced_on_a1;
    }
  }
  EXPECT_EQ(replaced_on_a1, 4) << c.status(job).dump(2);
  const auto det = events_named(dir / "events.jsonl", "failure_detected");
  const auto rec = events_named(dir / "events.jsonl", "recovered");
  ASSERT_GE(rec.size(), 1u);
  // A newest snapshot whose copy had not reached a1 yet is skipped for the one before.
  for (const auto& r : rec) EXPECT_LE(r["steps_lost"].get<int64_t>(), 2 * kSnapshotEvery) << r.dump();
  // The parts of the two ranks that were on 127.0.0.4 came from the copies a2's keeper had
  // made on a1's; the others from a1's own memory.
  const auto ready = events_named(dir / "events.jsonl", "epoch_ready");
  ASSERT_GE(ready.size(), 1u);
  const nlohmann::json parts = ready.back().value("restored_parts", nlohmann::json::object());
  int from_copies = 0, local = 0;
  std::string where;
  for (const auto& [slot, lines] : parts.items()) {
    for (const auto& l : lines) {
      const std::string s = l.get<std::string>();
      where += fmt::format("\n  slot {}: {}", slot, s);
      if (s.find("a copy on node a1 of node a2's") != std::string::npos) ++from_copies;
      if (s.find("on node a1") != std::string::npos && s.find("copy") == std::string::npos) ++local;
    }
  }
  EXPECT_EQ(from_copies, 2) << parts.dump(1);
  EXPECT_EQ(local, 2) << parts.dump(1);
  std::printf(
      "[multihost agent-kill] submit -> first step %.2f s; agent on 127.0.0.4 SIGKILLed after step %zu: "
      "detection %s ms (%s), recovery %.2f s (train_moe's recovered event), steps lost %lld, next step %.2f "
      "s "
      "after the kill; %d workers finished on 127.0.0.3; parts restored from:%s\n",
      first_step_s, steps_before,
      det.empty() ? "?" : det[0].value("detection_ms", nlohmann::json("-")).dump().c_str(),
      det.empty() ? "?" : det[0].value("cause", "?").c_str(), rec[0]["recovery_s"].get<double>(),
      static_cast<long long>(rec.back()["steps_lost"].get<int64_t>()), resumed_s, replaced_on_a1,
      where.c_str());
}

// Job processes with their own actor systems (the scheduler's actor placement,
// tests/scheduler/test_worker.cc TW_ACTORS/TW_PLACE): each worker's endpoint is on its
// host's address and speaks CURVE with the job's key pair; the driver on 127.0.0.3
// reaches all four actors, and a client without the job's key is refused.
TEST_F(Multihost, JobActorSystemsBindTheirHostsAndAcceptOnlyTheJob) {
  Cluster c(hosts(2));
  const std::string job =
      c.submit(4, {}, {{"TW_ACTORS", "1"}, {"TW_PLACE", "1"}, {"TW_BEAT", "1"}, {"TW_RUN_MS", "60000"}});
  const std::string placed = c.out_dir() + "/driver.placed";
  ASSERT_TRUE(wait_until([&] { return fs::exists(placed); }, std::chrono::seconds(30)))
      << c.logs_of_daemons();
  std::ifstream f(placed);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("ok 4"), std::string::npos) << text;
  EXPECT_EQ(expect_bound_to_their_hosts(c, job, true), 5);
  int workers = 0;
  for (const auto& p : procs_of(c, job)) {
    if (p.value("role", "") != "worker" || p.value("state", "") != "running") continue;
    const std::string host = kHostOf.at(p.value("agent", ""));
    const std::string ep = p.value("endpoint", "");
    EXPECT_EQ(ep.rfind("tcp://" + host + ":", 0), 0u) << p.dump();
    // The job's own key pair gets through; no key, or a key pair of our own, does not.
    const pid_t pid = p.value("pid", 0);
    troupe::sched::ClientSecurity job_keys;
    job_keys.server_public_key = environ_value(pid, "TROUPE_JOB_PUBLIC_KEY");
    std::string job_secret;
    std::getline(std::ifstream(environ_value(pid, "TROUPE_JOB_SECRET_KEY_FILE")), job_secret);
    job_keys.client_keys = troupe::sched::CurveKeyPair{job_keys.server_public_key, job_secret.substr(0, 40)};
    EXPECT_TRUE(troupe::sched::probe_connection(ep, job_keys, std::chrono::milliseconds(3000)).ok()) << ep;
    EXPECT_FALSE(troupe::sched::probe_connection(ep, {}, std::chrono::milliseconds(1500)).ok()) << ep;
    troupe::sched::ClientSecurity stranger;
    stranger.server_public_key = job_keys.server_public_key;
    stranger.client_keys = *troupe::sched::read_key_file(c.client_key());
    EXPECT_FALSE(troupe::sched::probe_connection(ep, stranger, std::chrono::milliseconds(1500)).ok()) << ep;
    ++workers;
  }
  EXPECT_EQ(workers, 4);
  EXPECT_EQ(c.cli({"cancel", job}).exit_code, 0);
  std::printf("[multihost actors] driver on 127.0.0.3 reached 4 CURVE actor endpoints on 127.0.0.3/.4: %s",
              text.c_str());
}

// The driver dies (SIGKILL) mid-job: the scheduler restarts it, with the job's workers,
// in a new epoch, and the new driver resumes from the newest snapshot the agents still
// hold (every 2 steps; checkpoints only every 4), never from the start; the job ends with
// the one-process losses.
TEST_F(Multihost, DriverKilledMidJobIsRestartedAndResumesFromTheNewestSnapshot) {
  Cluster c(hosts(2));
  const fs::path dir = *root_ / "driver-kill";
  const std::string job = c.submit_command({"--nproc", "4", "--layout", "dp=2,n=2"},
                                           train_args("driver-kill", "dp=2,n=2", "slow@1:any:0"));
  ASSERT_TRUE(wait_until([&] { return latest_step_records(dir / "metrics.jsonl").size() >= 5; },
                         std::chrono::seconds(90), std::chrono::milliseconds(10)))
      << c.logs_of_daemons();
  const size_t steps_before = latest_step_records(dir / "metrics.jsonl").size();
  ASSERT_LT(steps_before, static_cast<size_t>(kSteps)) << "the job ended before the kill";
  pid_t driver = 0;
  for (const auto& p : procs_of(c, job)) {
    if (p.value("role", "") == "driver" && p.value("state", "") == "running") driver = p.value("pid", 0);
  }
  ASSERT_GT(driver, 0);
  const auto kill_at = Clock::now();
  ASSERT_EQ(::kill(driver, SIGKILL), 0);
  // The restarted driver writes a "resumed" record, then steps on.
  nlohmann::json resumed;
  ASSERT_TRUE(wait_until(
      [&] {
        for (const auto& r : troupe::test::read_jsonl(dir / "metrics.jsonl")) {
          if (r.value("resumed", false)) resumed = r;
        }
        return !resumed.is_null();
      },
      std::chrono::seconds(90), std::chrono::milliseconds(10)))
      << c.logs_of_daemons();
  const double resumed_s = seconds_since(kill_at);
  const int64_t from = resumed["step"].get<int64_t>();
  EXPECT_GE(from, static_cast<int64_t>(steps_before) - kSnapshotEvery)
      << "resumed from step " << from << ": not from the newest snapshot";
  // At most the first driver's last step: its records come before the restarted one's
  // "resumed" record (on a loaded machine it completed step 6 between the count of 5 above
  // and the kill, and step 6's snapshot was the newest).
  int64_t last_of_first = 0;
  for (const auto& rec : troupe::test::read_jsonl(dir / "metrics.jsonl")) {
    if (rec.value("resumed", false)) break;
    if (rec.contains("loss") && rec.contains("step"))
      last_of_first = std::max(last_of_first, rec["step"].get<int64_t>());
  }
  EXPECT_LE(from, last_of_first);
  const auto restored = events_named(dir / "events.jsonl", "restore_from_snapshot");
  ASSERT_EQ(restored.size(), 1u) << c.logs_of_daemons();
  EXPECT_EQ(restored[0]["step"].get<int64_t>(), from);
  EXPECT_EQ(restored[0]["why"], "restarted driver");
  ASSERT_TRUE(wait_until([&] { return step_records_after(dir, static_cast<size_t>(from)); },
                         std::chrono::seconds(90), std::chrono::milliseconds(10)))
      << c.logs_of_daemons();
  const double next_step_s = seconds_since(kill_at);
  ASSERT_TRUE(c.wait_state(job, "succeeded", std::chrono::seconds(120))) << c.logs_of_daemons();
  expect_one_process_losses("driver-kill");
  int restarts = 0;
  for (const auto& e : c.events(job))
    restarts += e.value("type", e.value("event", "")) == "driver_restarting";
  EXPECT_EQ(restarts, 1);
  std::printf(
      "[multihost driver-kill] driver SIGKILLed after step %zu: restarted, resumed from the in-memory "
      "snapshot of "
      "step %lld the agents held in %.2f s, next step %.2f s after the kill\n",
      steps_before, static_cast<long long>(from), resumed_s, next_step_s);
}

}  // namespace
