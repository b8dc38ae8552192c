// tests/scheduler/harness.cc — Cluster, Daemon, CLI runner and the /proc scan.
#include "tests/scheduler/harness.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "scheduler/client/local_auth.h"
#include "scheduler/daemons/spawner.h"

extern char** environ;

namespace troupe::sched::test {

namespace {
// $TROUPE_TEST_BIN_DIR/<name> when set (the same tests against another build's
// executables, e.g. to show a fault suite fails before a fix), else this build's.
std::string bin_or(const char* name, const char* built) {
  const char* dir = std::getenv("TROUPE_TEST_BIN_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) + "/" + name : std::string(built);
}
}  // namespace

std::string scheduler_bin() {
  return bin_or("troupe-scheduler", TROUPE_TEST_SCHEDULER_BIN);
}
std::string agent_bin() {
  return bin_or("troupe-agent", TROUPE_TEST_AGENT_BIN);
}
std::string cli_bin() {
  return bin_or("troupe", TROUPE_TEST_CLI_BIN);
}
std::string worker_bin() { return TROUPE_TEST_WORKER_BIN; }

namespace {

std::vector<std::string> my_env(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    // TROUPE_CONFIG_DIR stays: the tests' daemons and CLI share its credential.
    if (kv.rfind("TROUPE_", 0) != 0 || kv.rfind("TROUPE_CONFIG_DIR=", 0) == 0) env.emplace_back(kv);
  }
  env.push_back("SPDLOG_LEVEL=info");
  for (const auto& e : extra) env.push_back(e);
  return env;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

std::string make_temp_dir(const std::string& what) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("troupe-" + what + "-XXXXXX")).string();
  if (!mkdtemp(tmpl.data())) ADD_FAILURE() << "mkdtemp failed";
  return tmpl;
}

void set_tmpdir(std::vector<std::string>& env, const std::string& dir) {
  std::erase_if(env, [](const std::string& e) { return e.rfind("TMPDIR=", 0) == 0; });
  env.push_back("TMPDIR=" + dir);
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout, std::chrono::milliseconds step) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(step);
  }
}

bool pid_alive(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  auto rp = line.rfind(')');
  if (rp == std::string::npos || rp + 2 >= line.size()) return false;
  return line[rp + 2] != 'Z' && line[rp + 2] != 'X';
}

std::vector<pid_t> procs_with_tag(const std::string& tag) {
  std::vector<pid_t> out;
  std::string needle = "TW_TAG=" + tag;
  DIR* d = opendir("/proc");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/environ", std::ios::binary);
    if (!f) continue;
    std::string env((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    size_t pos = 0;
    while (pos < env.size()) {
      size_t z = env.find('\0', pos);
      if (z == std::string::npos) z = env.size();
      if (env.compare(pos, z - pos, needle) == 0 && pid_alive(static_cast<pid_t>(pid))) {
        out.push_back(static_cast<pid_t>(pid));
        break;
      }
      pos = z + 1;
    }
  }
  closedir(d);
  return out;
}

std::vector<nlohmann::json> read_events(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const std::exception& e) {
      ADD_FAILURE() << "bad line in " << path << ": " << line;
    }
  }
  return out;
}

CliResult run_cli(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  static int counter = 0;
  std::string log = (std::filesystem::temp_directory_path() /
                     fmt::format("troupe-cli-{}-{}.out", getpid(), counter++)).string();
  // What the command leaves in its temporary folder (the state directory of a failed
  // `troupe run`) goes with the call.
  const std::string tmp = log + ".tmp";
  std::filesystem::create_directories(tmp);
  SpawnOptions so;
  so.argv = {cli_bin()};
  so.argv.insert(so.argv.end(), args.begin(), args.end());
  so.env = my_env({});
  set_tmpdir(so.env, tmp);
  so.log_path = log;
  CliResult r;
  auto child = spawn_process(so);
  if (!child.ok()) {
    r.output = child.status().to_string();
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
    return r;
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::optional<ExitInfo> ex;
  while (!(ex = try_reap(child->pid))) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill_process_group(child->pid, SIGKILL).ignore();
      while (!(ex = try_reap(child->pid))) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      r.output = "(timed out)\n";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (child->pidfd >= 0) close(child->pidfd);
  r.exit_code = ex->exit_status();
  r.output += slurp(log);
  std::filesystem::remove(log);
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  return r;
}

// ------------------------------------------------------------------ Daemon

Daemon::Daemon(const std::vector<std::string>& argv, const std::string& log, const std::vector<std::string>& extra_env)
    : log_(log) {
  SpawnOptions so;
  so.argv = argv;
  so.env = my_env(extra_env);
  so.log_path = log;
  auto child = spawn_process(so);
  if (!child.ok()) {
    ADD_FAILURE() << "cannot start " << argv[0] << ": " << child.status().to_string();
    return;
  }
  if (child->pidfd >= 0) close(child->pidfd);
  pid_ = child->pid;
}

int Daemon::stop(int sig) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, sig);
  if (sig == SIGSTOP) return 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::optional<ExitInfo> ex;
  while (!(ex = try_reap(pid_))) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Anything the daemon left in its own group goes too (it should have been nothing).
  kill_process_group(pid_, SIGKILL).ignore();
  pid_ = 0;
  return ex->exit_status();
}

std::string Daemon::log_text() const { return slurp(log_); }

// ------------------------------------------------------------------ Cluster

Cluster::Cluster(Options opts) : opts_(opts) {
  dir_ = make_temp_dir("cluster");
  std::filesystem::create_directories(out_dir());
  address_ = fmt::format("tcp://{}:{}", opts_.scheduler_host, free_port());
  tag_ = fmt::format("{}-{:x}", getpid(), std::random_device{}());
  // Without CURVE flags the daemons and the CLI use local authentication: the user's
  // credential, kept in this cluster's directory (inherited by every process started).
  setenv("TROUPE_CONFIG_DIR", (dir_ + "/config").c_str(), 1);
  if (opts_.curve) {
    std::filesystem::create_directories(dir_ + "/keys/allowed");
    for (const char* who : {"scheduler", "agent", "client", "rogue"}) {
      auto r = run_cli({"keygen", dir_ + "/keys/" + who});
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
    std::filesystem::copy_file(dir_ + "/keys/agent.pub", dir_ + "/keys/allowed/agent.pub");
    std::filesystem::copy_file(dir_ + "/keys/client.pub", dir_ + "/keys/allowed/client.pub");
  }
  start_scheduler();
  for (int i = 0; i < opts_.agents; ++i) {
    std::string id = fmt::format("a{}", i + 1);
    std::vector<std::string> argv = {agent_bin(), "--scheduler", address_, "--slots", std::to_string(opts_.slots_per_agent),
                                     "--id", id, "--work-dir", dir_ + "/" + id, "--heartbeat-ms", "200"};
    if (static_cast<size_t>(i) < opts_.agent_hosts.size())
      argv.insert(argv.end(), {"--host-addr", opts_.agent_hosts[i]});
    if (opts_.curve) {
      argv.insert(argv.end(), {"--curve-key", dir_ + "/keys/agent.key", "--scheduler-key", scheduler_pub()});
    }
    agents_.emplace_back(argv, dir_ + "/" + id + ".log");
  }
  bool up = wait_until(
      [&] {
        try {
          auto st = status("");
          int alive = 0;
          for (const auto& a : st["agents"]) alive += a.value("alive", false) ? 1 : 0;
          return alive == opts_.agents;
        } catch (const std::exception&) {
          return false;
        }
      },
      std::chrono::seconds(15), std::chrono::milliseconds(50));
  EXPECT_TRUE(up) << "agents did not register\n" << logs_of_daemons();
}

void Cluster::start_scheduler() {
  std::vector<std::string> argv = {scheduler_bin(), "--listen", address_, "--state-dir", dir_ + "/state",
                                   "--agent-timeout-ms", std::to_string(opts_.agent_timeout_ms)};
  argv.insert(argv.end(), opts_.scheduler_args.begin(), opts_.scheduler_args.end());
  if (opts_.curve) {
    argv.insert(argv.end(), {"--curve-key", dir_ + "/keys/scheduler.key", "--allow-keys", dir_ + "/keys/allowed"});
  }
  scheduler_ = Daemon(argv, dir_ + "/scheduler.log");
}

void Cluster::stop_scheduler(int sig) {
  scheduler_.stop(sig);
}

void Cluster::restart_scheduler(int sig) {
  scheduler_.stop(sig);
  start_scheduler();
}

Cluster::~Cluster() {
  for (auto& a : agents_) a.stop(SIGTERM);
  scheduler_.stop(SIGTERM);
  // The proof of "no orphans": nothing started for this test may still run.
  bool clean = wait_until([&] { return procs_with_tag(tag_).empty(); }, std::chrono::seconds(5));
  EXPECT_TRUE(clean) << procs_with_tag(tag_).size() << " process(es) left behind";
  for (pid_t p : procs_with_tag(tag_)) ::kill(p, SIGKILL);
  if (!::testing::Test::HasFailure()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  } else {
    std::fprintf(stderr, "cluster files kept in %s\n", dir_.c_str());
  }
}

std::vector<std::string> Cluster::conn_args() const {
  std::vector<std::string> a = {"--scheduler", address_};
  if (opts_.curve) a.insert(a.end(), {"--curve-key", client_key(), "--scheduler-key", scheduler_pub()});
  return a;
}

CliResult Cluster::cli(const std::vector<std::string>& args, std::chrono::milliseconds timeout) const {
  std::vector<std::string> a;
  if (!args.empty()) a.push_back(args.front());
  const auto conn = conn_args();
  a.insert(a.end(), conn.begin(), conn.end());
  if (!args.empty()) a.insert(a.end(), args.begin() + 1, args.end());
  return run_cli(a, timeout);
}

std::string Cluster::submit_command(const std::vector<std::string>& flags,
                                    const std::vector<std::string>& argv) {
  std::vector<std::string> args = {"submit"};
  args.insert(args.end(), flags.begin(), flags.end());
  args.insert(args.end(), {"--env", "TW_TAG=" + tag_, "--"});
  args.insert(args.end(), argv.begin(), argv.end());
  auto r = cli(args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::string id = r.output;
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

std::string Cluster::submit(int nproc, const std::vector<std::string>& flags,
                            const std::map<std::string, std::string>& env) {
  std::vector<std::string> f = {"--nproc", std::to_string(nproc)};
  f.insert(f.end(), flags.begin(), flags.end());
  f.insert(f.end(), {"--env", "TW_OUT=" + out_dir()});
  for (const auto& [k, v] : env) f.insert(f.end(), {"--env", k + "=" + v});
  return submit_command(f, {worker_bin()});
}

nlohmann::json Cluster::status(const std::string& job) {
  ClientSecurity sec;
  if (opts_.curve) {
    sec.server_public_key = read_key_file(scheduler_pub())->public_key;
    sec.client_keys = *read_key_file(client_key());
  } else {
    auto local = local_client_security();
    if (!local.ok()) throw std::runtime_error(local.status().to_string());
    sec = *local;
  }
  auto c = ClientEndpoint::connect(address_, sec, fmt::format("test:{:x}", std::random_device{}()));
  if (!c.ok()) throw std::runtime_error(c.status().to_string());
  auto r = (*c)->request(StatusQuery{job}, std::chrono::milliseconds(2000));
  if (!r.ok()) throw std::runtime_error(r.status().to_string());
  if (!r->status().ok()) throw std::runtime_error(r->status().to_string());
  return nlohmann::json::parse(r->body);
}

nlohmann::json Cluster::proc(const std::string& job, const std::string& name) {
  auto st = status(job);
  for (const auto& p : st["jobs"][0]["procs"]) {
    if (p.value("name", "") == name) return p;
  }
  return nlohmann::json();
}

std::string Cluster::job_state(const std::string& job) {
  try {
    return status(job)["jobs"][0].value("state", "");
  } catch (const std::exception&) {
    return "";
  }
}

bool Cluster::wait_state(const std::string& job, const std::string& state, std::chrono::milliseconds timeout) {
  return wait_until([&] { return job_state(job) == state; }, timeout, std::chrono::milliseconds(50));
}

bool Cluster::wait_running(const std::string& job, const std::vector<std::string>& names, uint64_t epoch,
                           std::chrono::milliseconds timeout) {
  return wait_until(
      [&] {
        try {
          auto st = status(job);
          size_t ok = 0;
          for (const auto& p : st["jobs"][0]["procs"]) {
            for (const auto& n : names) {
              if (p.value("name", "") == n && p.value("state", "") == "running" && p.value("epoch", uint64_t{0}) == epoch &&
                  p.value("heartbeating", false)) {
                ++ok;
              }
            }
          }
          return ok == names.size();
        } catch (const std::exception&) {
          return false;
        }
      },
      timeout, std::chrono::milliseconds(50));
}

std::vector<nlohmann::json> Cluster::events(const std::string& job) {
  return read_events(dir_ + "/state/jobs/" + job + "/events.jsonl");
}

std::string Cluster::logs_of_daemons() const {
  std::string out = "--- scheduler\n" + scheduler_.log_text();
  for (const auto& a : agents_) out += "--- " + a.log() + "\n" + a.log_text();
  return out;
}

}  // namespace troupe::sched::test
