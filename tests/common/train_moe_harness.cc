// tests/common/train_moe_harness.cc — the shared harness of the tests that run train_moe
// as real processes (see train_moe_harness.h for the contracts).
#include "tests/common/train_moe_harness.h"

#include <errno.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <system_error>
#include <thread>

namespace troupe::test {

std::string train_moe_bin() {
  // $TROUPE_TEST_BIN_DIR/train_moe when set (as tests/scheduler/harness.cc's daemons).
  const char* dir = std::getenv("TROUPE_TEST_BIN_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) + "/train_moe" : std::string(TROUPE_TRAIN_MOE_BIN);
}
std::string source_dir() {
  return TROUPE_SOURCE_DIR;
}

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(20);

bool group_gone(pid_t pgid) {
  return kill(-pgid, 0) == -1 && errno == ESRCH;
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

pid_t spawn(const std::vector<std::string>& argv, const fs::path& log,
            const std::vector<std::string>& env_in) {
  // The child's temporary folders (troupe run's state directory, snapshot keepers' and
  // agents' sockets) go under the folder of its log, the test's run root: they go with it,
  // or stay beside the logs when a case fails. Not where a test sets TMPDIR itself, nor where
  // the path would be too long for a Unix socket under it (108 bytes).
  std::vector<std::string> env = env_in;
  const bool own_tmp =
      std::any_of(env.begin(), env.end(), [](const std::string& e) { return e.rfind("TMPDIR=", 0) == 0; });
  const fs::path tmp = log.parent_path() / "tmp";
  if (!own_tmp && !log.parent_path().empty() && tmp.string().size() <= 64) {
    std::error_code ec;
    fs::create_directories(tmp, ec);
    if (fs::is_directory(tmp, ec)) env.push_back("TMPDIR=" + tmp.string());
  }
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    FILE* f = std::fopen(log.c_str(), "w");
    if (f == nullptr) _exit(126);
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    // The child's copies of the strings outlive putenv: the process image is replaced next.
    for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  // Also from the parent, so that a kill of the group right after spawn() cannot miss it.
  setpgid(pid, pid);
  return pid;
}

RunResult finish(pid_t pid, const fs::path& log, Clock::time_point t0, std::chrono::seconds timeout,
                 const RunOptions& opts) {
  RunResult r;
  int status = 0;
  bool done = false;
  while (Clock::now() - t0 < timeout) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      done = true;
      break;
    }
    if (opts.tick) opts.tick();
    std::this_thread::sleep_for(kPollInterval);
  }
  if (!done) {
    r.timed_out = true;
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
  } else if (opts.group_exit_wait) {
    const auto until = Clock::now() + *opts.group_exit_wait;
    while (Clock::now() < until && !group_gone(pid)) std::this_thread::sleep_for(kPollInterval);
    r.group_empty_after_exit = group_gone(pid);
  }
  // Whatever is left of the group (workers of a failed launcher) goes too.
  kill(-pid, SIGKILL);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (done && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  r.output = read_text(log);
  return r;
}

RunResult run(const std::vector<std::string>& argv, const fs::path& log, std::chrono::seconds timeout,
              const RunOptions& opts) {
  const auto t0 = Clock::now();
  return finish(spawn(argv, log, opts.env), log, t0, timeout, opts);
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& task : fs::directory_iterator(fmt::format("/proc/{}/task", pid), ec)) {
    std::ifstream in(task.path() / "children");
    pid_t c = 0;
    while (in >> c) out.push_back(c);
  }
  return out;
}

int worker_rank_of(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/environ", pid), std::ios::binary);
  std::string var;
  while (std::getline(in, var, '\0')) {
    // The rank, which is the worker's slot (the scheduler's and the standalone
    // launcher's workers alike; core/job_env.h).
    if (var.rfind("TROUPE_RANK=", 0) == 0) return std::atoi(var.c_str() + 12);
  }
  return -1;
}

fs::path make_run_root(const std::string& prefix) {
  std::random_device rd;
  const fs::path root = fs::temp_directory_path() / fmt::format("{}-{}-{:x}", prefix, getpid(), rd());
  fs::create_directories(root);
  return root;
}

void remove_run_root(const fs::path& root) {
  // A failed case's runs (logs, metrics, events) stay for whoever reads the failure.
  if (::testing::UnitTest::GetInstance()->failed_test_count() > 0) {
    std::printf("kept the run folder %s: a case failed\n", root.string().c_str());
    return;
  }
  std::error_code ec;
  fs::remove_all(root, ec);
}

RunResult prepare_data(const fs::path& out_dir, const PrepareSpec& spec, const fs::path& log,
                       std::chrono::seconds timeout) {
  std::vector<std::string> a{TROUPE_PREPARE_BIN};
  for (const auto& in : spec.inputs) a.insert(a.end(), {"--input", source_dir() + "/" + in});
  a.insert(a.end(), {"--out", out_dir.string(), "--vocab", std::to_string(spec.vocab), "--max-bytes",
                     std::to_string(spec.max_bytes)});
  for (const auto& e : spec.extensions) a.insert(a.end(), {"--ext", e});
  return run(a, log, timeout);
}

std::vector<std::string> TrainMoeCommand::argv() const {
  std::vector<std::string> a{train_moe_bin(), "--config", config.string()};
  if (!backend.empty()) a.insert(a.end(), {"--backend", backend});
  a.insert(a.end(), {"--run-dir", run_dir.string()});
  for (const auto& s : sets) {
    a.insert(a.end(), {"--set", s});
    // The fenced [bench]/[test] keys (switches for comparison, fault injection) need the
    // opt-in a production run never gives.
    if ((s.rfind("bench.", 0) == 0 || s.rfind("test.", 0) == 0) &&
        std::find(a.begin(), a.end(), "--allow-test-config") == a.end()) {
      a.push_back("--allow-test-config");
    }
  }
  if (!parallel.empty()) a.insert(a.end(), {"--parallel", parallel});
  if (!resume.empty()) a.insert(a.end(), {"--resume", resume});
  return a;
}

std::vector<std::string> tiny_model_sets(const TinyModel& m) {
  return {"model.vocab_size=320",
          "model.d_model=32",
          "model.ffn_hidden=64",
          "model.moe.num_experts=4",
          "model.moe.expert_hidden=32",
          "train.seq_len=16",
          "train.micro_batch_size=2",
          fmt::format("train.global_batch={}", m.global_batch),
          fmt::format("train.steps={}", m.steps),
          fmt::format("train.eval_batches={}", m.eval_batches),
          "train.eval_every=0",
          fmt::format("train.log_every={}", m.log_every),
          fmt::format("optim.warmup_steps={}", m.warmup_steps),
          fmt::format("data.dir=\"{}\"", m.data_dir.string())};
}

std::vector<nlohmann::json> read_jsonl(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline after it: the writer is not done with this record
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::vector<nlohmann::json> step_records(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  for (auto& j : read_jsonl(metrics)) {
    if (j.contains("loss")) out.push_back(std::move(j));
  }
  return out;
}

std::vector<nlohmann::json> latest_step_records(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  for (auto& j : step_records(metrics)) {
    const int64_t step = j["step"].get<int64_t>();
    if (static_cast<int64_t>(out.size()) >= step) out.resize(static_cast<size_t>(step - 1));
    out.push_back(std::move(j));
  }
  return out;
}

std::map<int64_t, double> losses_by_step(const fs::path& metrics) {
  std::map<int64_t, double> out;
  for (const auto& j : step_records(metrics)) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  return out;
}

std::vector<nlohmann::json> events_named(const fs::path& events, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (auto& j : read_jsonl(events)) {
    if (j.value("event", "") == name) out.push_back(std::move(j));
  }
  return out;
}

double rel_diff(double reference, double value) {
  return std::fabs(reference - value) / std::max(std::fabs(reference), 1e-30);
}

double expect_losses_match(const std::vector<nlohmann::json>& reference, const fs::path& metrics,
                           double tolerance, const std::string& label, const std::string& against) {
  const std::vector<nlohmann::json> got = latest_step_records(metrics);
  EXPECT_EQ(got.size(), reference.size()) << label << ": " << metrics;
  double worst = 0;
  for (size_t i = 0; i < std::min(got.size(), reference.size()); ++i) {
    const double d = rel_diff(reference[i]["loss"].get<double>(), got[i]["loss"].get<double>());
    EXPECT_LE(d, tolerance) << label << " step " << i + 1;
    worst = std::max(worst, d);
  }
  std::printf("[%s] %zu steps, max relative loss difference vs %s %.3g\n", label.c_str(), got.size(),
              against.c_str(), worst);
  return worst;
}

}  // namespace troupe::test
