// scheduler/cli/cli.cc — the troupe CLI commands.
#include "scheduler/cli/cli.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "checkpoint/reader.h"
#include "checkpoint/snapshot_keeper.h"
#include "core/env.h"
#include "core/job_env.h"
#include "core/logging.h"
#include "scheduler/cli/cli_health.h"
#include "scheduler/client/local_auth.h"
#include "scheduler/daemons/agent.h"
#include "scheduler/daemons/scheduler.h"

namespace troupe::sched {

int cli_exit_code(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return 0;
    case StatusCode::kInvalidArgument:
      return 2;
    case StatusCode::kNotFound:
      return 3;
    case StatusCode::kUnavailable:
      return 4;
    case StatusCode::kPermissionDenied:
      return 5;
    default:
      return 1;
  }
}

namespace {

using nlohmann::json;

bool g_local_auth = false;  // open_client used this user's credential (local authentication)

int fail(const Status& s) {
  std::fprintf(stderr, "troupe: %s\n", s.message().c_str());
  if (s.code() == StatusCode::kPermissionDenied && g_local_auth) {
    std::fprintf(
        stderr,
        "troupe: this scheduler accepts only the credential of the user who started it; this user's is %s "
        "(local authentication: see docs/cluster.md)\n",
        credential_path().c_str());
  }
  return cli_exit_code(s);
}

}  // namespace

Result<std::pair<std::string, ClientSecurity>> client_connection(const CliConnection& c) {
  const std::string addr =
      c.scheduler.empty() ? env::get_or(job_env::kScheduler, kDefaultSchedulerAddress) : c.scheduler;
  TROUPE_ASSIGN_OR_RETURN(std::string ep, normalize_endpoint(addr));
  ClientSecurity sec;
  if (!c.scheduler_key.empty()) {
    TROUPE_ASSIGN_OR_RETURN(auto server, read_key_file(c.scheduler_key));
    sec.server_public_key = server.public_key;
    if (c.curve_key.empty()) return invalid_argument("--scheduler-key needs --curve-key (this client's key pair)");
  }
  if (!c.curve_key.empty()) {
    TROUPE_ASSIGN_OR_RETURN(auto mine, read_key_file(c.curve_key));
    if (mine.secret_key.empty()) return invalid_argument("{} holds no secret key", c.curve_key);
    sec.client_keys = mine;
    if (sec.server_public_key.empty()) return invalid_argument("--curve-key needs --scheduler-key (the scheduler's public key)");
  }
  if (c.scheduler_key.empty() && c.curve_key.empty() && is_local_endpoint(ep)) {
    // A loopback scheduler without key flags: local authentication with our credential.
    TROUPE_ASSIGN_OR_RETURN(sec, local_client_security());
  }
  return std::make_pair(ep, sec);
}

namespace {

Result<std::unique_ptr<ClientEndpoint>> open_client(const CliConnection& c) {
  TROUPE_ASSIGN_OR_RETURN(auto conn, client_connection(c));
  if (conn.second.client_keys && c.curve_key.empty()) g_local_auth = true;  // for the refusal's message
  std::string id = fmt::format("cli:{}:{:x}", getpid(), std::random_device{}());
  return ClientEndpoint::connect(conn.first, conn.second, id);
}

Result<json> request_json(ClientEndpoint& client, Payload p, int timeout_ms) {
  TROUPE_ASSIGN_OR_RETURN(Reply r, client.request(std::move(p), std::chrono::milliseconds(timeout_ms)));
  TROUPE_RETURN_IF_ERROR(r.status());
  if (r.body.empty()) return json::object();
  try {
    return json::parse(r.body);
  } catch (const std::exception& e) {
    return data_loss("the scheduler sent a reply that is not JSON: {}", e.what());
  }
}

std::string age(int64_t since_ms) {
  if (since_ms <= 0) return "-";
  int64_t s = (wall_ms() - since_ms) / 1000;
  if (s < 120) return fmt::format("{}s", s);
  if (s < 7200) return fmt::format("{}m", s / 60);
  return fmt::format("{}h", s / 3600);
}

// Fixed-width table: every column as wide as its widest cell.
std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows) {
    if (w.size() < r.size()) w.resize(r.size(), 0);
    for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(w[i] - r[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

std::atomic<int> g_interrupts{0};  // signal handler -> troupe run's loop
void on_interrupt(int) { g_interrupts.fetch_add(1); }

// How long `troupe run` may take to stop after SIGINT/SIGTERM/SIGHUP: the job is
// cancelled (SIGTERM to each process group), waited for kRunCancelWait, the agent then
// kills what is left (kRunStopGrace), and past kRunHardStop a watchdog SIGKILLs every
// process group and exits 130 whatever phase the run is in.
constexpr auto kRunCancelWait = std::chrono::milliseconds(2500);
constexpr auto kRunStopGrace = std::chrono::milliseconds(1000);
constexpr auto kRunHardStop = std::chrono::milliseconds(4300);

int64_t read_long_file(const char* path) {
  std::ifstream f(path);
  int64_t v = -1;
  if (!(f >> v)) return -1;
  return v;
}

}  // namespace

std::optional<SlurmAllocation> slurm_allocation_from_env() {
  const std::optional<std::string> id = env::get("SLURM_JOB_ID");
  if (!id) return std::nullopt;
  // Slurm's counts; one that is not a count (a value Slurm never writes) reads as unset.
  auto num = [](const char* name, int dflt) {
    return static_cast<int>(env::get_int(name, dflt, 0, 999999).value_or(dflt));
  };
  SlurmAllocation a;
  a.job_id = *id;
  // Inside an srun step its own nodes count (srun -N1 in a larger allocation is one node).
  a.nodelist = env::get_or("SLURM_STEP_NODELIST", env::get_or("SLURM_JOB_NODELIST"));
  a.nodes = num("SLURM_STEP_NUM_NODES", num("SLURM_JOB_NUM_NODES", num("SLURM_NNODES", 1)));
  a.ntasks = num("SLURM_NTASKS", num("SLURM_NPROCS", 0));
  a.gpus_on_node = num("SLURM_GPUS_ON_NODE", -1);
  return a;
}

Status check_process_limit(int needed) {
  // The user's process limit (RLIMIT_NPROC counts every process and thread of the user)
  // less what the user runs now, and the kernel's pid and thread limits less what runs.
  int64_t user_procs = 0, all_procs = 0;
  const uid_t uid = getuid();
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string n = e.path().filename().string();
    if (n.empty() || !std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    ++all_procs;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) == 0 && st.st_uid == uid) ++user_procs;
  }
  rlimit rl{};
  if (getrlimit(RLIMIT_NPROC, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    const int64_t left = static_cast<int64_t>(rl.rlim_cur) - user_procs;
    if (needed > left) {
      return invalid_argument(
          "--nproc needs {} processes, but the process limit (ulimit -u, RLIMIT_NPROC) is {} and this user "
          "already runs "
          "{}: at most {} more",
          needed, static_cast<int64_t>(rl.rlim_cur), user_procs, std::max<int64_t>(0, left));
    }
  }
  for (const char* path : {"/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"}) {
    const int64_t max = read_long_file(path);
    if (max > 0 && needed > max - all_procs) {
      return invalid_argument(
          "--nproc needs {} processes, but the kernel limit {} is {} and {} processes run: at most {} more",
          needed, path, max, all_procs, std::max<int64_t>(0, max - all_procs));
    }
  }
  return ok_status();
}

namespace {

// Prints what processes wrote to their log files since the last call, line by line.
class LogTailer {
 public:
  LogTailer(std::string dir, bool prefix) : dir_(std::move(dir)), prefix_(prefix) {}
  void poll(bool flush_partial) {
    std::error_code ec;
    if (!std::filesystem::is_directory(dir_, ec)) return;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      if (e.path().extension() != ".log") continue;
      std::string name = e.path().stem().string();
      auto& st = files_[name];
      std::ifstream f(e.path(), std::ios::binary);
      f.seekg(0, std::ios::end);
      auto size = static_cast<int64_t>(f.tellg());
      if (size < st.offset) st.offset = 0;
      if (size > st.offset) {
        std::string chunk(static_cast<size_t>(size - st.offset), '\0');
        f.seekg(st.offset);
        f.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
        st.offset = size;
        st.pending += chunk;
      }
      size_t nl;
      while ((nl = st.pending.find('\n')) != std::string::npos) {
        emit(name, st.pending.substr(0, nl));
        st.pending.erase(0, nl + 1);
      }
      if (flush_partial && !st.pending.empty()) {
        emit(name, st.pending);
        st.pending.clear();
      }
    }
    std::fflush(stdout);
  }

 private:
  struct FileState {
    int64_t offset = 0;
    std::string pending;
  };
  void emit(const std::string& name, const std::string& line) {
    if (prefix_) std::fprintf(stdout, "[%s] %s\n", name.c_str(), line.c_str());
    else std::fprintf(stdout, "%s\n", line.c_str());
  }
  std::string dir_;
  bool prefix_;
  std::map<std::string, FileState> files_;
};

}  // namespace

std::string render_status_table(const json& status, bool with_procs) {
  std::string out;
  std::vector<std::vector<std::string>> rows = {
      {"JOB", "NAME", "STATE", "WORKERS", "EPOCH", "RESTARTS", "EXIT", "AGE", "COMMAND"}};
  for (const auto& j : status.value("jobs", json::array())) {
    std::string cmd;
    for (const auto& a : j.value("argv", json::array())) cmd += (cmd.empty() ? "" : " ") + a.get<std::string>();
    if (cmd.size() > 40) cmd = cmd.substr(0, 37) + "...";
    std::string state = j.value("state", "");
    bool final = state == "succeeded" || state == "failed" || state == "cancelled";
    rows.push_back({j.value("id", ""), j.value("name", "").empty() ? "-" : j.value("name", ""), state,
                    final ? std::to_string(j.value("nproc", 0))
                          : fmt::format("{}/{}", j.value("running_workers", 0), j.value("nproc", 0)),
                    std::to_string(j.value("epoch", 0)),
                    fmt::format("{}/{}", j.value("restarts", 0), j.value("max_restarts", 0)),
                    final ? std::to_string(j.value("exit_code", 0)) : "-", age(j.value("created_ms", int64_t{0})), cmd});
  }
  out += table(rows);
  if (with_procs) {
    for (const auto& j : status.value("jobs", json::array())) {
      if (!j.value("message", "").empty()) out += fmt::format("\n{}: {}\n", j.value("id", ""), j.value("message", ""));
      std::vector<std::vector<std::string>> prow = {{"PROCESS", "ROLE", "RANK", "AGENT", "SLOT", "PID", "STATE", "EXIT", "EPOCH"}};
      for (const auto& p : j.value("procs", json::array())) {
        std::string st = p.value("state", "");
        prow.push_back({p.value("name", ""), p.value("role", ""), p.value("rank", 0) < 0 ? "-" : std::to_string(p.value("rank", 0)),
                        p.value("agent", ""), p.value("slot", -1) < 0 ? "-" : std::to_string(p.value("slot", -1)),
                        p.value("pid", 0) ? std::to_string(p.value("pid", 0)) : "-", st,
                        st == "exited" ? std::to_string(p.value("exit_status", 0)) : "-",
                        std::to_string(p.value("epoch", 0))});
      }
      if (prow.size() > 1) out += "\n" + table(prow);
    }
  }
  std::vector<std::vector<std::string>> arows = {
      {"AGENT", "HOST", "SLOTS", "GPUS", "ALIVE", "SNAPSHOTS HELD"}};
  for (const auto& a : status.value("agents", json::array())) {
    const json s = a.value("snapshots", json::object());
    checkpoint::KeeperTotals t;
    t.bytes = s.value("bytes", uint64_t{0});
    t.parts = s.value("parts", 0);
    t.copies = s.value("copies", 0);
    arows.push_back({a.value("id", ""), a.value("host", ""), std::to_string(a.value("slots", 0)),
                     std::to_string(a.value("gpus", 0)), a.value("alive", false) ? "yes" : "no",
                     checkpoint::keeper_totals_text(t)});
  }
  out += "\n" + table(arows);
  return out;
}

int cli_submit(const CliConnection& c, JobSpec spec, bool as_json) {
  Status v = spec.validate();
  if (!v.ok()) return fail(v);
  auto client = open_client(c);
  if (!client.ok()) return fail(client.status());
  auto r = request_json(**client, SubmitJob{spec.to_json()}, c.timeout_ms);
  if (!r.ok()) return fail(r.status());
  if (as_json) std::printf("%s\n", r->dump().c_str());
  else std::printf("%s\n", r->value("job_id", "").c_str());
  return 0;
}

int cli_status(const CliConnection& c, const std::string& job_id, bool as_json, bool health) {
  auto client = open_client(c);
  if (!client.ok()) return fail(client.status());
  auto r = request_json(**client, StatusQuery{job_id}, c.timeout_ms);
  if (!r.ok()) return fail(r.status());
  if (as_json) {
    std::printf("%s\n", r->dump(2).c_str());
  } else {
    std::printf("%s", render_status_table(*r, !job_id.empty()).c_str());
    const json hjobs = r->value("jobs", json::array());
    if (health && hjobs.size() == 1) {
      const std::string h = render_health_table(hjobs[0].value("health", json::object()));
      std::printf("\n%s", h.empty() ? "health: no report from the job's processes yet\n" : h.c_str());
    }
    // One job: its checkpoints too, when its checkpoint directory is readable from here.
    const json jobs = r->value("jobs", json::array());
    std::error_code ec;
    if (!job_id.empty() && jobs.size() == 1) {
      const std::string dir = job_checkpoint_dir(jobs[0]);
      if (!dir.empty() && std::filesystem::is_directory(dir, ec)) {
        std::printf("\ncheckpoints in %s\n%s", dir.c_str(), render_checkpoints_table(dir).c_str());
      }
    }
  }
  return 0;
}

Result<json> fetch_job_status(const CliConnection& c, const std::string& job_id) {
  TROUPE_ASSIGN_OR_RETURN(auto client, open_client(c));
  TROUPE_ASSIGN_OR_RETURN(json r, request_json(*client, StatusQuery{job_id}, c.timeout_ms));
  const json jobs = r.value("jobs", json::array());
  if (jobs.size() != 1) return not_found("no job {}", job_id);
  return jobs[0];
}

std::string job_checkpoint_dir(const json& job) {
  namespace fs = std::filesystem;
  std::string dir = job.value("checkpoint_dir", "");
  if (dir.empty()) {
    // train_moe's default: <run dir>/checkpoints, the run dir from --run-dir or
    // runs/<config stem>; a --set checkpoint.dir="..." wins.
    const std::vector<std::string> argv = job.value("argv", std::vector<std::string>{});
    std::string run_dir, config;
    for (size_t i = 0; i + 1 < argv.size(); ++i) {
      if (argv[i] == "--run-dir") run_dir = argv[i + 1];
      if (argv[i] == "--config") config = argv[i + 1];
      if (argv[i] == "--set" && argv[i + 1].rfind("checkpoint.dir=", 0) == 0) {
        dir = argv[i + 1].substr(15);
        if (dir.size() >= 2 && dir.front() == '"' && dir.back() == '"') dir = dir.substr(1, dir.size() - 2);
      }
    }
    if (dir.empty() && run_dir.empty() && !config.empty()) run_dir = "runs/" + fs::path(config).stem().string();
    if (dir.empty() && !run_dir.empty()) dir = (fs::path(run_dir) / "checkpoints").string();
  }
  const std::string work = job.value("work_dir", "");
  if (!dir.empty() && fs::path(dir).is_relative() && !work.empty()) dir = (fs::path(work) / dir).string();
  return dir;
}

std::string render_checkpoints_table(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::vector<std::string>> rows = {{"STEP", "STATE", "LAYOUT", "RANKS", "SIZE", "AGE", "PATH"}};
  std::error_code ec;
  // Unfinished saves (step_<N>.tmp) first: a save in progress, or one that crashed.
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string name = de.path().filename().string();
    if (name.size() <= 4 || name.compare(name.size() - 4, 4, ".tmp") != 0) continue;
    const auto step = checkpoint::parse_step_dir_name(name.substr(0, name.size() - 4));
    if (!step) continue;
    int parts = 0;
    for (const auto& f : fs::directory_iterator(de.path(), ec)) parts += f.path().string().ends_with(".part.json") ? 1 : 0;
    rows.push_back({std::to_string(*step), "unfinished", "-", fmt::format("{} parts", parts), "-", "-", de.path().string()});
  }
  for (const auto& [step, path] : checkpoint::list_checkpoints(dir)) {
    auto r = checkpoint::CheckpointReader::open(path, checkpoint::VerifyMode::kStructure);
    if (!r.ok()) {
      rows.push_back({std::to_string(step), "invalid: " + r.status().message().substr(0, 60), "-", "-", "-", "-", path});
      continue;
    }
    const checkpoint::Manifest& m = (*r)->manifest();
    rows.push_back({std::to_string(step), "committed", m.layout.to_string(), std::to_string(m.world_size),
                    fmt::format("{:.2f} MB", static_cast<double>(m.total_bytes()) / 1e6), age(m.created_unix_ms), path});
  }
  std::string out = table(rows);
  auto latest = std::ifstream((fs::path(dir) / checkpoint::kLatestFile).string());
  std::string l;
  if (latest && std::getline(latest, l)) out += fmt::format("latest: {}\n", l);
  return out;
}

int cli_checkpoints(const CliConnection& c, const std::string& job_id, const std::string& dir_opt, bool as_json) {
  std::string dir = dir_opt;
  if (dir.empty()) {
    auto client = open_client(c);
    if (!client.ok()) return fail(client.status());
    auto r = request_json(**client, StatusQuery{job_id}, c.timeout_ms);
    if (!r.ok()) return fail(r.status());
    const json jobs = r->value("jobs", json::array());
    if (jobs.empty()) return fail(not_found("no job {}", job_id));
    dir = job_checkpoint_dir(jobs[0]);
    if (dir.empty()) {
      return fail(not_found("job {} names no checkpoint directory (no checkpoint_dir, no train_moe --run-dir or "
                            "--config); give --dir",
                            job_id));
    }
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return fail(not_found("checkpoint directory {} does not exist (yet)", dir));
  if (as_json) {
    json out = json::array();
    for (const auto& [step, path] : checkpoint::list_checkpoints(dir)) {
      auto r = checkpoint::CheckpointReader::open(path, checkpoint::VerifyMode::kStructure);
      json j{{"step", step}, {"path", path}, {"valid", r.ok()}};
      if (r.ok()) {
        j["layout"] = (*r)->layout().to_string();
        j["world_size"] = (*r)->manifest().world_size;
        j["bytes"] = (*r)->manifest().total_bytes();
        j["created_unix_ms"] = (*r)->manifest().created_unix_ms;
      } else {
        j["error"] = r.status().to_string();
      }
      out.push_back(j);
    }
    std::printf("%s\n", json{{"dir", dir}, {"checkpoints", out}}.dump(2).c_str());
  } else {
    std::printf("checkpoints in %s\n%s", dir.c_str(), render_checkpoints_table(dir).c_str());
  }
  return 0;
}

int cli_cancel(const CliConnection& c, const std::string& job_id, bool as_json) {
  auto client = open_client(c);
  if (!client.ok()) return fail(client.status());
  auto rep = (*client)->request(CancelJob{job_id}, std::chrono::milliseconds(c.timeout_ms));
  if (!rep.ok()) return fail(rep.status());
  if (!rep->status().ok()) return fail(rep->status());
  if (as_json) std::printf("%s\n", rep->body.c_str());
  else std::printf("%s\n", rep->message.c_str());
  return 0;
}

int cli_logs(const CliConnection& c, const std::string& job_id, const std::string& proc, bool follow) {
  auto client = open_client(c);
  if (!client.ok()) return fail(client.status());
  int64_t offset = 0;
  signal(SIGINT, on_interrupt);
  for (;;) {
    auto rep = (*client)->request(LogsQuery{LogsRequest{job_id, proc, offset, 1 << 20}},
                                  std::chrono::milliseconds(c.timeout_ms));
    if (!rep.ok()) return fail(rep.status());
    if (!rep->status().ok()) return fail(rep->status());
    std::fwrite(rep->data.data(), 1, rep->data.size(), stdout);
    std::fflush(stdout);
    bool more = rep->offset > offset && !rep->data.empty();
    offset = rep->offset;
    if (more) continue;
    if (!follow || g_interrupts.load() > 0) return 0;
    // Stop following once the job has ended and everything was printed.
    auto st = request_json(**client, StatusQuery{job_id}, c.timeout_ms);
    if (st.ok()) {
      const auto& j = (*st)["jobs"][0];
      std::string state = j.value("state", "");
      if ((state == "succeeded" || state == "failed" || state == "cancelled") && j.value("running_procs", 0) == 0) {
        auto last = (*client)->request(LogsQuery{LogsRequest{job_id, proc, offset, 1 << 20}},
                                       std::chrono::milliseconds(c.timeout_ms));
        if (last.ok() && last->status().ok()) std::fwrite(last->data.data(), 1, last->data.size(), stdout);
        return 0;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

int cli_wait(const CliConnection& c, const std::string& job_id, bool quiet) {
  auto client = open_client(c);
  if (!client.ok()) return fail(client.status());
  for (;;) {
    auto st = request_json(**client, StatusQuery{job_id}, c.timeout_ms);
    if (!st.ok()) return fail(st.status());
    const json jobs = st->value("jobs", json::array());
    if (jobs.empty()) return fail(not_found("no job {}", job_id));
    const json& j = jobs[0];
    const std::string state = j.value("state", "");
    if ((state == "succeeded" || state == "failed" || state == "cancelled") &&
        j.value("running_procs", 0) == 0) {
      const int code = state == "cancelled" ? 130 : j.value("exit_code", 1);
      if (!quiet) {
        std::fprintf(stderr, "troupe: job %s %s (exit status %d)%s%s\n", job_id.c_str(), state.c_str(), code,
                     j.value("message", "").empty() ? "" : ": ", j.value("message", "").c_str());
      }
      return code;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

int cli_keygen(const std::string& prefix) {
  std::error_code ec;
  auto parent = std::filesystem::path(prefix).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) return fail(io_error("cannot create {}: {}", parent.string(), ec.message()));
  auto keys = generate_curve_keypair();
  if (!keys.ok()) return fail(keys.status());
  Status s = write_key_files(prefix, *keys);
  if (!s.ok()) return fail(s);
  std::printf("wrote %s.key (key pair, keep private) and %s.pub (public key)\n", prefix.c_str(), prefix.c_str());
  return 0;
}

int cli_keygen_check(const std::string& file) {
  auto keys = read_key_file(file);
  if (!keys.ok()) return fail(keys.status());
  std::printf("public = \"%s\"\n", keys->public_key.c_str());
  return 0;
}

// The embedded scheduler's record of a `troupe run` job outlives its temporary state
// directory: copied to <run dir>/scheduler_events.jsonl when the job's driver named its run
// directory (the supervision claim of a training driver: training/driver/trainer.cc).
void keep_scheduler_events(const std::string& events) {
  std::string run_dir;
  {
    std::ifstream in(events);
    std::string line;
    while (std::getline(in, line)) {
      const json j = json::parse(line, nullptr, false);
      if (j.is_object() && j.value("type", "") == "supervision_claimed" && j.contains("run_dir") &&
          j["run_dir"].is_string())
        run_dir = j["run_dir"].get<std::string>();
    }
  }
  if (run_dir.empty()) return;
  std::error_code ec;
  std::filesystem::copy_file(events, run_dir + "/scheduler_events.jsonl",
                             std::filesystem::copy_options::overwrite_existing, ec);
  if (ec) {
    std::fprintf(stderr, "troupe: cannot keep the scheduler's events in %s: %s\n", run_dir.c_str(),
                 ec.message().c_str());
  }
}

int cli_run(const RunOptions& opts) {
  // The embedded scheduler's and agent's files (state, logs, keys) and the job's, as the
  // daemons' (scheduler_main.cc, agent_main.cc): their owner's only.
  ::umask(077);
  // Signals first: an interrupt in any phase below ends the run (see kRunHardStop).
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  JobSpec spec = opts.spec;
  if (auto slurm = slurm_allocation_from_env()) {
    if (slurm->nodes > 1) {
      return fail(
          invalid_argument("troupe run runs on one node, and Slurm job {} has {} ({}): start a scheduler and "
                           "one troupe-agent per node "
                           "with scripts/slurm/troupe.sbatch (docs/cluster.md), or use srun -N1",
                           slurm->job_id, slurm->nodes, slurm->nodelist));
    }
    if (!opts.nproc_given) {
      if (slurm->ntasks <= 0) {
        return fail(invalid_argument("Slurm job {} sets no SLURM_NTASKS: give --nproc", slurm->job_id));
      }
      spec.nproc = slurm->ntasks;
    }
    if (spec.backend == "cuda" && slurm->gpus_on_node >= 0 && spec.nproc > slurm->gpus_on_node) {
      return fail(invalid_argument(
          "--backend cuda needs one GPU per worker: {} workers, Slurm gave this node {} GPU(s) "
          "(SLURM_GPUS_ON_NODE)",
          spec.nproc, slurm->gpus_on_node));
    }
    if (opts.verbose) {
      std::fprintf(stderr, "troupe: in Slurm job %s on %s: %d worker(s)\n", slurm->job_id.c_str(),
                   slurm->nodelist.c_str(), spec.nproc);
    }
  } else if (!opts.nproc_given) {
    return fail(invalid_argument(
        "--nproc is required (outside a Slurm allocation, where it defaults to SLURM_NTASKS)"));
  }
  Status v = spec.validate();
  if (!v.ok()) return fail(v);
  const int needed = spec.nproc + (spec.driver ? 1 : 0);
  if (opts.slots > 0 && spec.nproc > opts.slots) {
    return fail(invalid_argument("--nproc {} is more than the {} slots of this machine's agent (--slots {})",
                                 spec.nproc, opts.slots, opts.slots));
  }
  if (Status lim = check_process_limit(needed); !lim.ok()) return fail(lim);
  init_logging(LoggingOptions{"troupe run", "", opts.verbose ? spdlog::level::info : spdlog::level::warn});
  if (!opts.verbose && !env::get("SPDLOG_LEVEL")) make_logger("control")->set_level(spdlog::level::err);

  std::string state_dir = opts.state_dir;
  bool temp_dir = state_dir.empty();
  if (temp_dir) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "troupe-run-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) return fail(io_error("mkdtemp {}: {}", tmpl, std::strerror(errno)));
    state_dir = tmpl;
  } else {
    // A --state-dir that does not exist yet is made (as troupe-scheduler makes its own);
    // one that cannot be is named with the reason, before anything starts.
    std::error_code ec;
    std::filesystem::create_directories(state_dir, ec);
    if (ec || !std::filesystem::is_directory(state_dir)) {
      return fail(io_error("--state-dir {}: cannot create the directory: {}", state_dir,
                           ec ? ec.message() : "a file of that name exists"));
    }
  }
  // The embedded scheduler accepts only this run's own key pair (written into the
  // state directory, mode 0600): other local users cannot submit to it or read its logs.
  auto run_keys = generate_curve_keypair();
  if (!run_keys.ok()) return fail(run_keys.status());
  const std::string key_prefix = state_dir + "/run-credential";
  if (Status ks = write_key_files(key_prefix, *run_keys); !ks.ok()) return fail(ks);
  SchedulerOptions so;
  so.listen = "tcp://127.0.0.1:0";
  so.state_dir = state_dir;
  so.security.server_keys = *run_keys;
  so.security.allowed_client_keys = {run_keys->public_key};
  so.metrics.listen = opts.metrics_listen;
  so.agent_timeout_ms = opts.agent_timeout_ms;
  for (const std::string& kv : opts.detector) {
    if (Status ds = so.detector.set(kv); !ds.ok()) return fail(ds);
  }
  auto sched = Scheduler::create(so);
  if (!sched.ok()) return fail(sched.status());
  if (!(*sched)->metrics_url().empty())
    fmt::print(stderr, "troupe run: Prometheus metrics at {}\n", (*sched)->metrics_url());
  if (spec.backend == "cuda") {
    int gpus = detect_gpus();
    if (gpus < spec.nproc) {
      return fail(failed_precondition("--backend cuda needs one GPU per worker: {} workers, {} GPU(s) visible",
                                      spec.nproc, gpus));
    }
  }
  AgentOptions ao;
  ao.scheduler = (*sched)->endpoint();
  ao.agent_id = "local";
  ao.slots = spec.nproc;
  ao.work_dir = state_dir;
  ao.stop_grace_ms = static_cast<int>(kRunStopGrace.count());
  ao.security.server_public_key = run_keys->public_key;
  ao.security.client_keys = *run_keys;
  ao.key_file = key_prefix + ".key";
  auto agent = Agent::create(ao);
  if (!agent.ok()) return fail(agent.status());
  if (g_interrupts.load() > 0) return 130;  // interrupted while starting: nothing runs yet

  Scheduler* s = sched->get();
  Agent* a = agent->get();
  std::thread sched_thread([s] { s->run(); });
  std::thread agent_thread([a] { a->run(); });
  // The watchdog: whatever the main thread waits for, kRunHardStop after the first
  // signal every process group is killed and the run exits 130.
  std::atomic<bool> run_done{false};
  std::thread watchdog([a, &run_done] {
    while (!run_done.load() && g_interrupts.load() == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto deadline = std::chrono::steady_clock::now() + kRunHardStop;
    while (!run_done.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (run_done.load()) return;
    a->kill_all_now();
    std::fprintf(stderr, "troupe: still stopping %lld ms after the signal: killed every process, exiting\n",
                 static_cast<long long>(kRunHardStop.count()));
    std::fflush(stderr);
    _exit(130);
  });

  int exit_code = 1;
  std::string summary;
  std::string run_job_id;
  {
    CliConnection conn{(*sched)->endpoint(), key_prefix + ".key", key_prefix + ".pub", 5000};
    auto client = open_client(conn);
    std::string job_id, job_dir;
    Status err;
    if (!client.ok()) err = client.status();
    if (err.ok()) {
      auto r = request_json(**client, SubmitJob{spec.to_json()}, 5000);
      if (r.ok()) {
        job_id = r->value("job_id", "");
        job_dir = r->value("job_dir", "");
        run_job_id = job_id;
      } else {
        err = r.status();
      }
    }
    LogTailer tailer(state_dir + "/jobs/" + job_id + "/logs", opts.prefix_output);
    bool cancelled = false;
    auto cancel_started = std::chrono::steady_clock::now();
    while (err.ok()) {
      tailer.poll(false);
      if (g_interrupts.load() > 0 && !cancelled) {
        cancelled = true;
        cancel_started = std::chrono::steady_clock::now();
        std::fprintf(stderr, "troupe: interrupted, cancelling %s\n", job_id.c_str());
        (*client)->request(CancelJob{job_id}, std::chrono::milliseconds(1000)).status().ignore();
      }
      auto st = request_json(**client, StatusQuery{job_id}, cancelled ? 1000 : 5000);
      if (!st.ok()) {
        err = st.status();
        break;
      }
      const auto& j = (*st)["jobs"][0];
      std::string state = j.value("state", "");
      bool final = state == "succeeded" || state == "failed" || state == "cancelled";
      if (final && (j.value("running_procs", 0) == 0 ||
                    std::chrono::steady_clock::now() - cancel_started > std::chrono::seconds(5))) {
        exit_code = j.value("exit_code", 1);
        summary = fmt::format("job {} {} (exit status {}{}{})", job_id, state, exit_code,
                              j.value("message", "").empty() ? "" : ": ", j.value("message", ""));
        if (state == "cancelled") exit_code = 130;
        break;
      }
      if (g_interrupts.load() > 1) break;  // a second Ctrl-C: stop waiting, kill below
      if (cancelled && std::chrono::steady_clock::now() - cancel_started > kRunCancelWait) {
        exit_code = 130;  // the agent kills what is left below
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    tailer.poll(true);
    if (!err.ok()) {
      exit_code = fail(err);
      summary.clear();
    }
  }
  a->stop();
  agent_thread.join();  // kills and reaps whatever is still running
  s->stop();
  sched_thread.join();
  run_done.store(true);
  watchdog.join();
  agent->reset();
  sched->reset();
  if (g_interrupts.load() > 0 && exit_code != 130 && summary.empty()) exit_code = 130;
  if (!run_job_id.empty()) keep_scheduler_events(state_dir + "/jobs/" + run_job_id + "/events.jsonl");
  if (!summary.empty() && (opts.verbose || exit_code != 0)) std::fprintf(stderr, "troupe: %s\n", summary.c_str());
  if (temp_dir && exit_code == 0) {
    std::error_code ec;
    std::filesystem::remove_all(state_dir, ec);
  } else if (exit_code != 0) {
    std::fprintf(stderr, "troupe: logs and events are in %s\n", state_dir.c_str());
  }
  return exit_code;
}

}  // namespace troupe::sched
