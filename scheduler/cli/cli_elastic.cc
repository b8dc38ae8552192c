// scheduler/cli/cli_elastic.cc — `troupe scale|replace|status <run dir>` for elastic
// train_moe jobs (cli_elastic.h).
#include "scheduler/cli/cli_elastic.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "core/env.h"
#include "core/job_env.h"
#include "scheduler/cli/cli.h"
#include "scheduler/client/local_auth.h"
#include "scheduler/client/scheduler_store.h"

namespace troupe::sched {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Writes `text` to <dir>/<name> through a temporary file and a rename (the launcher never
// reads half a request).
bool write_request(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string tmp = fmt::format("{}/.{}.tmp", dir, name);
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return false;
    out << text << "\n";
  }
  std::error_code ec;
  fs::rename(tmp, dir + "/" + name, ec);
  return !ec;
}

// Waits up to wait_s for an event named in `names` written at or after `since_ms`.
std::optional<nlohmann::json> wait_event(const std::string& dir, const std::vector<std::string>& names, int64_t since_ms,
                                         int wait_s) {
  const auto deadline = Clock::now() + std::chrono::seconds(wait_s);
  while (Clock::now() < deadline) {
    std::ifstream in(dir + "/events.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_object() || j.value("ts_ms", int64_t{0}) < since_ms) continue;
      for (const auto& n : names) {
        if (j.value("event", "") == n) return j;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return std::nullopt;
}

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
  const std::string pre = job + "/elastic/";
  // The first free request number (the driver takes them in order).
  int64_t k = 0;
  while (true) {
    auto has = (*store)->contains(pre + fmt::format("request/{}", k));
    if (!has.ok()) {
      fmt::print(stderr, "troupe {}: job {}: {}\n", cmd, job, has.status().message());
      return cli_exit_code(has.status());
    }
    if (!*has) break;
    ++k;
  }
  Status st = (*store)->set(pre + fmt::format("request/{}", k), req.dump());
  if (!st.ok()) {
    fmt::print(stderr, "troupe {}: {}\n", cmd, st.message());
    return 1;
  }
  if (wait_s <= 0) return 0;
  auto ans = (*store)->get(pre + fmt::format("answer/{}", k), Clock::now() + std::chrono::seconds(wait_s));
  if (!ans.ok()) {
    fmt::print(stderr, "troupe {}: no answer from the job's driver within {} s ({})\n", cmd, wait_s,
               ans.status().message());
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
    fmt::print("replaced worker slot {} after step {} in {} ms (epoch {})\n", a["slot"].get<int>(),
               a["after_step"].get<int64_t>(), a["ms"].get<int64_t>(), a["epoch"].get<int64_t>());
    return 0;
  }
  if (ev == "scale_unchanged") {
    fmt::print("dp is already {}\n", a["dp"].get<int>());
    return 0;
  }
  fmt::print(stderr, "troupe {}: refused: {}\n", cmd, *ans);
  return 1;
}

}  // namespace

bool is_elastic_run_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(path + "/events.jsonl", ec) &&
         (fs::exists(path + "/status.json", ec) || fs::is_directory(path + "/rendezvous", ec));
}

int cli_elastic_scale(const CliConnection& c, const std::string& run_dir, int dp, int wait_s) {
  if (!std::filesystem::is_directory(run_dir)) {
    return store_request(c, run_dir, nlohmann::json{{"op", "scale"}, {"dp", dp}}, wait_s, "scale");
  }
  if (!is_elastic_run_dir(run_dir)) {
    fmt::print(stderr,
               "troupe scale: {} is not the run directory of a training job (no events.jsonl and status.json "
               "of its Trainer)\n",
               run_dir);
    return 2;
  }
  if (job_finished(run_dir)) {
    fmt::print(stderr, "troupe scale: the job in {} has finished\n", run_dir);
    return 1;
  }
  const int64_t t0 = now_ms();
  if (!write_request(run_dir, "scale_request", std::to_string(dp))) {
    fmt::print(stderr, "troupe scale: cannot write {}/scale_request\n", run_dir);
    return 1;
  }
  if (wait_s <= 0) return 0;
  const auto ev = wait_event(run_dir, {"scaled", "scale_refused", "job_failed", "job_finished"}, t0, wait_s);
  if (!ev) {
    fmt::print(stderr, "troupe scale: no answer from the job within {} s (the request stays queued)\n", wait_s);
    return 1;
  }
  if ((*ev)["event"] == "job_failed" || (*ev)["event"] == "job_finished") {
    fmt::print(stderr, "troupe scale: the job ended before answering: {}\n", ev->value("error", "finished"));
    return 1;
  }
  if ((*ev)["event"] == "scale_refused") {
    fmt::print(stderr, "troupe scale: refused: {}\n", ev->dump());
    return 1;
  }
  fmt::print("scaled dp {} -> {} (grad_accum {}) after step {} in {} ms\n", (*ev)["from_dp"].get<int>(),
             (*ev)["to_dp"].get<int>(), (*ev)["grad_accum"].get<int>(), (*ev)["after_step"].get<int64_t>(),
             (*ev)["ms"].get<int64_t>());
  return 0;
}

int cli_elastic_replace(const CliConnection& c, const std::string& run_dir, int slot, int wait_s) {
  if (!std::filesystem::is_directory(run_dir)) {
    return store_request(c, run_dir, nlohmann::json{{"op", "replace"}, {"slot", slot}}, wait_s, "replace");
  }
  if (!is_elastic_run_dir(run_dir)) {
    fmt::print(stderr,
               "troupe replace: {} is not the run directory of a training job (no events.jsonl and "
               "status.json of its Trainer)\n",
               run_dir);
    return 2;
  }
  if (job_finished(run_dir)) {
    fmt::print(stderr, "troupe replace: the job in {} has finished\n", run_dir);
    return 1;
  }
  const int64_t t0 = now_ms();
  if (!write_request(run_dir, "replace_request", std::to_string(slot))) {
    fmt::print(stderr, "troupe replace: cannot write {}/replace_request\n", run_dir);
    return 1;
  }
  if (wait_s <= 0) return 0;
  const auto ev = wait_event(run_dir, {"recovered", "replace_refused", "job_failed", "job_finished"}, t0, wait_s);
  if (!ev) {
    fmt::print(stderr, "troupe replace: no answer from the job within {} s (the request stays queued)\n", wait_s);
    return 1;
  }
  if ((*ev)["event"] == "job_failed" || (*ev)["event"] == "job_finished") {
    fmt::print(stderr, "troupe replace: the job ended before answering: {}\n", ev->value("error", "finished"));
    return 1;
  }
  if ((*ev)["event"] == "replace_refused") {
    fmt::print(stderr, "troupe replace: refused: {}\n", ev->value("why", ""));
    return 1;
  }
  fmt::print("replaced worker slot {}: step {} completed {:.2f} s later, steps lost {}\n", slot,
             (*ev)["step"].get<int64_t>(), (*ev)["recovery_s"].get<double>(), (*ev)["steps_lost"].get<int64_t>());
  return 0;
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
