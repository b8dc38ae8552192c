// scheduler/cli/cli_elastic.cc — `troupe scale|replace <job id | run dir>` and `troupe drain`
// (cli_elastic.h): requests to a job's driver through the job's store, the one channel
// the Trainer takes operator requests from.
#include "scheduler/cli/cli_elastic.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "comm/rendezvous_store.h"
#include "core/env.h"
#include "core/job_env.h"
#include "scheduler/cli/cli.h"
#include "scheduler/client/local_auth.h"
#include "scheduler/client/scheduler_store.h"

namespace troupe::sched {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

bool job_finished(const std::string& dir) {
  std::ifstream in(dir + "/events.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("\"job_finished\"") != std::string::npos) return true;
  }
  return false;
}

// Sends `req` to the driver of scheduler job `job` through the job's store (epoch 0: an
// elastic job never restarts its workers) and prints its answer.
// Sends `req` to the job's driver through the one channel it takes operator requests
// from (training/driver/trainer_requests.h): the key "<job>/elastic/request/<k>" of the
// job's store, k the first free number; waits up to wait_s for "<job>/elastic/answer/<k>"
// and prints it. `ended` (may be empty) says the job is over: no answer will come.
int send_request(comm::RendezvousStore& store, const std::string& job, const nlohmann::json& req, int wait_s,
                 const char* cmd, const std::function<std::optional<std::string>()>& ended) {
  const std::string pre = job + "/elastic/";
  // The first free request number (the driver takes them in order).
  int64_t k = 0;
  while (true) {
    auto has = store.contains(pre + fmt::format("request/{}", k));
    if (!has.ok()) {
      fmt::print(stderr, "troupe {}: job {}: {}\n", cmd, job, has.status().message());
      return cli_exit_code(has.status());
    }
    if (!*has) break;
    ++k;
  }
  Status st = store.set(pre + fmt::format("request/{}", k), req.dump());
  if (!st.ok()) {
    fmt::print(stderr, "troupe {}: {}\n", cmd, st.message());
    return 1;
  }
  if (wait_s <= 0) return 0;
  const auto deadline = Clock::now() + std::chrono::seconds(wait_s);
  Result<std::string> ans = unavailable("no answer yet");
  while (true) {
    // In slices, so a job that ended without answering is noticed.
    ans = store.get(pre + fmt::format("answer/{}", k),
                    std::min(deadline, Clock::now() + std::chrono::milliseconds(500)));
    if (ans.ok() || Clock::now() >= deadline) break;
    if (ended) {
      if (std::optional<std::string> why = ended()) {
        fmt::print(stderr, "troupe {}: the job ended before answering: {}\n", cmd, *why);
        return 1;
      }
    }
  }
  if (!ans.ok()) {
    fmt::print(stderr,
               "troupe {}: no answer from the job's driver within {} s (the request stays queued): {}\n", cmd,
               wait_s, ans.status().message());
    return 1;
  }
  const nlohmann::json a = nlohmann::json::parse(*ans, nullptr, false);
  const std::string ev = a.is_object() ? a.value("event", "") : "";
  if (ev == "scaled") {
    fmt::print("scaled dp {} -> {} (grad_accum {}) after step {} in {} ms\n", a["from_dp"].get<int>(),
               a["to_dp"].get<int>(), a["grad_accum"].get<int>(), a["after_step"].get<int64_t>(), a["ms"].get<int64_t>());
    return 0;
  }
  if (ev == "replaced") {
    fmt::print("replaced worker slot {} after step {} in {} ms (epoch {}), steps lost {}\n",
               a["slot"].get<int>(), a["after_step"].get<int64_t>(), a["ms"].get<int64_t>(),
               a["epoch"].get<int64_t>(), a.value("steps_lost", int64_t{0}));
    return 0;
  }
  if (ev == "scale_unchanged") {
    fmt::print("dp is already {}\n", a["dp"].get<int>());
    return 0;
  }
  fmt::print(stderr, "troupe {}: refused: {}\n", cmd, *ans);
  return 1;
}

// A request to scheduler job `job`, through the job's store at the scheduler (epoch 0: an
// elastic job never restarts its workers).
int store_request(const CliConnection& c, const std::string& job, const nlohmann::json& req, int wait_s,
                  const char* cmd) {
  auto conn = client_connection(c);
  if (!conn.ok()) {
    fmt::print(stderr, "troupe {}: {}\n", cmd, conn.status().message());
    return cli_exit_code(conn.status());
  }
  auto store = SchedulerStore::connect(conn->first, conn->second, job, 0);
  if (!store.ok()) {
    fmt::print(stderr, "troupe {}: {}\n", cmd, store.status().message());
    return cli_exit_code(store.status());
  }
  return send_request(**store, job, req, wait_s, cmd, {});
}

// A request to the standalone launcher's job in `run_dir`, through its store (a FileStore
// in <run dir>/rendezvous); the job's id is in its job_started event.
int run_dir_request(const std::string& run_dir, const nlohmann::json& req, int wait_s, const char* cmd) {
  if (!is_elastic_run_dir(run_dir)) {
    fmt::print(
        stderr,
        "troupe {}: {} is not the run directory of a training job (no events.jsonl and status.json of its "
        "Trainer)\n",
        cmd, run_dir);
    return 2;
  }
  if (job_finished(run_dir)) {
    fmt::print(stderr, "troupe {}: the job in {} has finished\n", cmd, run_dir);
    return 1;
  }
  nlohmann::json started;
  {
    std::ifstream in(run_dir + "/events.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      if (line.find("\"job_started\"") == std::string::npos) continue;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("event", "") == "job_started") started = j;
    }
  }
  if (!started.is_object() || !started.contains("job")) {
    fmt::print(stderr, "troupe {}: the job in {} has not started yet (no job_started in its events.jsonl)\n",
               cmd, run_dir);
    return 1;
  }
  if (started.value("one_process", false)) {
    fmt::print(stderr,
               "troupe {}: the job in {} runs in one process (its worker is a thread of the Trainer), which "
               "cannot be rescaled or have its worker replaced; run it with elastic.isolate_workers = true\n",
               cmd, run_dir);
    return 1;
  }
  auto store = comm::FileStore::open(run_dir + "/rendezvous");
  if (!store.ok()) {
    fmt::print(stderr, "troupe {}: {}\n", cmd, store.status().message());
    return 1;
  }
  const auto ended = [&]() -> std::optional<std::string> {
    std::ifstream in(run_dir + "/events.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      if (line.find("\"job_failed\"") == std::string::npos &&
          line.find("\"job_finished\"") == std::string::npos)
        continue;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("ts_ms", int64_t{0}) >= started.value("ts_ms", int64_t{0}))
        return j.value("error", "finished");
    }
    return std::nullopt;
  };
  return send_request(**store, started["job"].get<std::string>(), req, wait_s, cmd, ended);
}

}  // namespace

bool is_elastic_run_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(path + "/events.jsonl", ec) &&
         (fs::exists(path + "/status.json", ec) || fs::is_directory(path + "/rendezvous", ec));
}

int cli_elastic_scale(const CliConnection& c, const std::string& target, int dp, int wait_s) {
  const nlohmann::json req{{"op", "scale"}, {"dp", dp}};
  if (std::filesystem::is_directory(target)) return run_dir_request(target, req, wait_s, "scale");
  return store_request(c, target, req, wait_s, "scale");
}

int cli_elastic_replace(const CliConnection& c, const std::string& target, int slot, int wait_s) {
  const nlohmann::json req{{"op", "replace"}, {"slot", slot}};
  if (std::filesystem::is_directory(target)) return run_dir_request(target, req, wait_s, "replace");
  return store_request(c, target, req, wait_s, "replace");
}

int cli_elastic_drain(const CliConnection& c, const std::string& agent, int wait_s) {
  auto conn = client_connection(c);
  if (!conn.ok()) {
    fmt::print(stderr, "troupe drain: {}\n", conn.status().message());
    return cli_exit_code(conn.status());
  }
  auto ep = normalize_endpoint(conn->first);
  if (!ep.ok()) {
    fmt::print(stderr, "troupe drain: {}\n", ep.status().message());
    return cli_exit_code(ep.status());
  }
  auto client = ClientEndpoint::connect(*ep, conn->second, fmt::format("cli-drain:{:x}", std::random_device{}()));
  if (!client.ok()) {
    fmt::print(stderr, "troupe drain: {}\n", client.status().message());
    return cli_exit_code(client.status());
  }
  auto reply = (*client)->request(StatusQuery{""}, std::chrono::milliseconds(c.timeout_ms));
  if (!reply.ok() || !reply->status().ok()) {
    const Status why = reply.ok() ? reply->status() : reply.status();
    fmt::print(stderr, "troupe drain: cannot read the scheduler's status: {}\n", why.message());
    return cli_exit_code(why);
  }
  const nlohmann::json st = nlohmann::json::parse(reply->body, nullptr, false);
  if (!st.is_object()) {
    fmt::print(stderr, "troupe drain: the scheduler's status is not JSON\n");
    return 1;
  }
  bool known = false;
  for (const auto& a : st.value("agents", nlohmann::json::array())) known |= a.value("id", "") == agent;
  if (!known) {
    fmt::print(stderr, "troupe drain: no agent '{}'\n", agent);
    return 3;
  }
  int moved = 0, failed = 0;
  for (const auto& job : st.value("jobs", nlohmann::json::array())) {
    if (job.value("state", "") != "running") continue;
    std::vector<int> slots;
    for (const auto& p : job.value("procs", nlohmann::json::array())) {
      if (p.value("role", "") == "worker" && p.value("agent", "") == agent &&
          (p.value("state", "") == "running" || p.value("state", "") == "starting")) {
        slots.push_back(p.value("rank", -1));
      }
    }
    if (slots.empty()) continue;
    const std::string id = job.value("id", "");
    if (!job.value("elastic", false)) {
      fmt::print("job {}: {} worker(s) on {} left in place (its driver does not supervise its workers)\n", id,
                 slots.size(), agent);
      continue;
    }
    for (int slot : slots) {
      fmt::print("job {}: ", id);
      std::fflush(stdout);
      const int rc = store_request(c, id, nlohmann::json{{"op", "replace"}, {"slot", slot}, {"avoid", agent}}, wait_s,
                                   "drain");
      (rc == 0 ? moved : failed) += 1;
    }
  }
  fmt::print("drained {}: {} worker(s) moved, {} failed\n", agent, moved, failed);
  return failed == 0 ? 0 : 1;
}

namespace {
// The job's actors (the Trainer's last answers from each: status.json "actors").
void print_actor_table(const nlohmann::json& st) {
  const nlohmann::json actors = st.value("actors", nlohmann::json::array());
  if (actors.empty()) {
    fmt::print("no actors recorded yet (the trainer lists them after the first step)\n");
    return;
  }
  fmt::print("{} actors\n", actors.size());
  fmt::print("{:<14} {:<10} {:>5} {:<10} {:<8} {:<14} {:>8} {:<8} {:<11} {:>6} {:>10} {:>9}\n", "ID", "ROLE",
             "RANK", "WORKER", "NODE", "HOST", "PID", "DEVICE", "STATE", "STEPS", "STEP_MS", "PARAMS");
  for (const auto& a : actors) {
    const int64_t pid = a.value("pid", int64_t{0});
    fmt::print("{:<14} {:<10} {:>5} {:<10} {:<8} {:<14} {:>8} {:<8} {:<11} {:>6} {:>10.1f} {:>9}\n",
               a.value("id", ""), a.value("role", ""), a.value("rank", -1), a.value("worker", ""),
               a.value("node", ""), a.value("host", "").substr(0, 14), pid > 0 ? std::to_string(pid) : "-",
               a.value("device", ""), a.value("state", ""), a.value("steps_done", int64_t{0}),
               a.value("last_step_ms", 0.0), a.value("params", int64_t{0}));
  }
}

void print_elastic_table(const std::string& what, const nlohmann::json& st, bool finished, bool actors) {
  if (actors) {
    fmt::print("job {}: step {}, epoch {}, dp {}{}{}\n", what, st.value("step", int64_t{0}),
               st.value("epoch", int64_t{0}), st.value("dp", int64_t{0}), finished ? ", finished" : "",
               st.value("failed", false) ? ", FAILED" : "");
    print_actor_table(st);
    return;
  }
  fmt::print("elastic job {}: step {}, epoch {}, dp {} (grad_accum {}), {} recoveries{}{}\n", what,
             st.value("step", int64_t{0}), st.value("epoch", int64_t{0}), st.value("dp", int64_t{0}),
             st.value("grad_accum", int64_t{0}), st.value("recoveries", int64_t{0}), finished ? ", finished" : "",
             st.value("failed", false) ? ", FAILED" : "");
  // A recovery in progress (the Trainer writes it as it detects the failure).
  if (st.contains("recovering") && st["recovering"].is_object()) {
    const auto& r = st["recovering"];
    fmt::print("recovering: {} (slots {})\n", r.value("cause", ""),
               r.value("slots", nlohmann::json::array()).dump());
  }
  if (st.contains("snapshots") && st["snapshots"].is_object()) {
    const nlohmann::json& s = st["snapshots"];
    const int64_t newest = s.value("newest_committed", int64_t{-1});
    fmt::print(
        "snapshots every {} steps: newest committed {}{}\n", s.value("every", int64_t{0}),
        newest >= 0 ? fmt::format("step {}", newest) : std::string("none yet"),
        s.contains("held") ? fmt::format("; held by the launcher: {}", s.value("held", "")) : std::string());
  }
  fmt::print("{:>6} {:>6} {:>9} {:<16} {:>7}  {}\n", "SLOT", "RANK", "PID", "HOST", "ALIVE", "FLAGS");
  for (const auto& w : st.value("workers", nlohmann::json::array())) {
    const int64_t pid = w.value("pid", int64_t{-1});
    fmt::print("{:>6} {:>6} {:>9} {:<16} {:>7}  {}\n", w.value("slot", -1), w.value("rank", -1),
               pid > 0 ? std::to_string(pid) : "-", w.value("host", "").substr(0, 16),
               w.value("alive", false) ? "yes" : "NO", w.value("straggler", false) ? "straggler" : "");
  }
}
}  // namespace

int cli_elastic_status(const std::string& run_dir, bool json, bool actors) {
  std::ifstream in(run_dir + "/status.json");
  const nlohmann::json st = nlohmann::json::parse(in, nullptr, false);
  if (!in || st.is_discarded() || !st.is_object()) {
    fmt::print(stderr, "troupe status: {} has no readable status.json yet (the job writes it after each step)\n", run_dir);
    return 1;
  }
  if (json) {
    fmt::print("{}\n", st.dump(1));
    return 0;
  }
  print_elastic_table(run_dir, st, job_finished(run_dir), actors);
  return 0;
}

std::optional<nlohmann::json> elastic_job_status(const CliConnection& c, const std::string& job) {
  auto conn = client_connection(c);
  if (!conn.ok()) return std::nullopt;
  auto store = SchedulerStore::connect(conn->first, conn->second, job, 0);
  if (!store.ok()) return std::nullopt;
  const std::string k = job + "/elastic/status";
  auto has = (*store)->contains(k);
  if (!has.ok() || !*has) return std::nullopt;  // not an elastic job, or no step done yet
  auto v = (*store)->get(k, SchedulerStore::Clock::now() + std::chrono::seconds(3));
  if (!v.ok()) return std::nullopt;
  nlohmann::json st = nlohmann::json::parse(*v, nullptr, false);
  if (!st.is_object()) return std::nullopt;
  return st;
}

bool print_elastic_job_status(const CliConnection& c, const std::string& job, bool actors) {
  const std::optional<nlohmann::json> st = elastic_job_status(c, job);
  if (!st) return false;
  fmt::print("\n");
  print_elastic_table(job, *st, false, actors);
  return true;
}

}  // namespace troupe::sched
