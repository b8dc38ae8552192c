// tests/faults/faults_harness.cc — the fault campaign's shared helpers (faults_harness.h).
#include "tests/faults/faults_harness.h"

#include <dirent.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <thread>

namespace troupe::faults {

std::string troupe_bin() {
  const char* dir = std::getenv("TROUPE_TEST_BIN_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) + "/troupe" : std::string(TROUPE_CLI_BIN);
}

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

test::TrainMoeCommand tiny_job(const fs::path& data_dir, const fs::path& run_dir, int64_t steps,
                               const std::string& parallel, const std::vector<std::string>& extra) {
  test::TrainMoeCommand c;
  c.run_dir = run_dir;
  c.sets = test::tiny_model_sets({.steps = steps, .data_dir = data_dir});
  c.sets.insert(c.sets.end(), extra.begin(), extra.end());
  c.parallel = parallel;
  return c;
}

std::vector<std::string> troupe_run_argv(int nproc, const std::string& tag,
                                         const std::vector<std::string>& flags,
                                         const std::vector<std::string>& job_argv) {
  std::vector<std::string> a{troupe_bin(), "run", "--nproc", std::to_string(nproc)};
  a.insert(a.end(), flags.begin(), flags.end());
  a.insert(a.end(), {"--env", "TW_TAG=" + tag, "--"});
  a.insert(a.end(), job_argv.begin(), job_argv.end());
  return a;
}

namespace {
std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
}  // namespace

std::string environ_value(pid_t pid, const std::string& name) {
  const std::string env = read_all(fmt::format("/proc/{}/environ", pid));
  const std::string key = name + "=";
  for (size_t at = 0; at < env.size();) {
    size_t end = env.find('\0', at);
    if (end == std::string::npos) end = env.size();
    if (env.compare(at, key.size(), key) == 0) return env.substr(at + key.size(), end - at - key.size());
    at = end + 1;
  }
  return "";
}

std::vector<pid_t> job_pids(const std::string& tag, const std::string& role) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    if (environ_value(static_cast<pid_t>(pid), "TW_TAG") != tag) continue;
    if (environ_value(static_cast<pid_t>(pid), "TROUPE_ROLE") != role) continue;
    // Not a zombie.
    const std::string stat = read_all(fmt::format("/proc/{}/stat", pid));
    const size_t rp = stat.rfind(')');
    if (rp != std::string::npos && rp + 2 < stat.size() && stat[rp + 2] == 'Z') continue;
    out.push_back(static_cast<pid_t>(pid));
  }
  closedir(d);
  return out;
}

bool wait_for_steps(const fs::path& run_dir, size_t steps, std::chrono::seconds timeout) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    try {
      if (test::step_records(run_dir / "metrics.jsonl").size() >= steps) return true;
    } catch (const std::exception&) {
      // a line being written
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

std::string kept_state_dir(const std::string& output) {
  const std::string key = "logs and events are in ";
  const size_t at = output.rfind(key);
  if (at == std::string::npos) return "";
  const size_t end = output.find('\n', at);
  return output.substr(at + key.size(), end == std::string::npos ? std::string::npos : end - at - key.size());
}

std::vector<nlohmann::json> records(const fs::path& jsonl, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (auto& j : test::read_jsonl(jsonl)) {
    if (j.value("type", "") == name || j.value("event", "") == name) out.push_back(std::move(j));
  }
  return out;
}

std::vector<std::string> not_owner_only(const fs::path& root) {
  std::vector<std::string> out;
  auto check = [&](const fs::path& p) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || S_ISLNK(st.st_mode) || S_ISSOCK(st.st_mode)) return;
    if ((st.st_mode & 077) != 0)
      out.push_back(fmt::format("{} (mode {:04o})", p.string(), st.st_mode & 07777));
  };
  check(root);
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    check(it->path());
  }
  return out;
}

bool file_contains(const fs::path& file, const std::string& bytes) {
  return read_all(file).find(bytes) != std::string::npos;
}

fs::path prepared_data(const fs::path& root) {
  const fs::path data = root / "data";
  if (!fs::exists(data / "tokenizer.json")) {
    const RunResult p = test::prepare_data(data, {}, root / "prepare.log", std::chrono::seconds(120));
    EXPECT_EQ(p.exit_code, 0) << p.output;
  }
  return data;
}

}  // namespace troupe::faults
