// tests/common/train_moe_harness.h — defines the shared harness of the tests that run
// train_moe (and the troupe CLI) as real processes: running a child in its own process
// group with a deadline and its output captured (spawn / finish / run), preparing token
// data (troupe-prepare), the train_moe command line with `--set` overrides
// (TrainMoeCommand, tiny_model_sets), reading metrics.jsonl and events.jsonl, the
// relative difference the equivalence checks use, a job's worker processes from /proc,
// and per-suite temporary run roots.
//
// Used by tests/training (training_equivalence_test, checkpoint_resume_test,
// training_gpu_test) and tests/elastic (elastic_fault_test, elastic_cluster_test).
// Everything here is a plain function of its arguments: no global state, no threads.
// Calls block the calling thread; every wait is bounded by the timeout it is given.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace troupe::test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The executables and the source tree of this build (set by CMake for this library);
// $TROUPE_TEST_BIN_DIR, when set, names another directory holding train_moe.
std::string train_moe_bin();
std::string source_dir();

// ---------------------------------------------------------------------------------------
// Child processes.

struct RunResult {
  int exit_code = -1;      // the child's exit status; -1 when it was killed (deadline or signal)
  bool timed_out = false;  // the deadline passed and the child's group was killed
  std::string output;      // stdout and stderr together (the log file's text)
  double seconds = 0;      // from the start to the end of the clean-up
  // Set only with RunOptions::group_exit_wait: after a clean exit, every other process of
  // the child's group was gone within that wait.
  bool group_empty_after_exit = false;
};

struct RunOptions {
  // NAME=VALUE entries added to (or replacing in) the child's inherited environment.
  std::vector<std::string> env;
  // Called on the waiting thread about every 20 ms while the child runs (may itself run
  // children); the deadline still applies.
  std::function<void()> tick;
  // After the child exits by itself: wait up to this long for the rest of its process
  // group (workers that die with it or exit after "stop") and report the result in
  // group_empty_after_exit. Without it the group is killed at once.
  std::optional<std::chrono::milliseconds> group_exit_wait;
};

// Starts argv (argv[0] is a path, not looked up in PATH) in a new process group whose id
// is the child's pid, stdout and stderr written to `log` (truncated), `env` added to its
// environment, TMPDIR set to `log`'s folder/tmp unless `env` sets it (the child's temporary
// folders go with the test's run root). The caller owns the child: finish() must reap it.
// Exit code 126 from the child: `log` could not be opened; 127: exec failed.
pid_t spawn(const std::vector<std::string>& argv, const fs::path& log,
            const std::vector<std::string>& env = {});

// Waits for the child `pid` from spawn() until `t0 + timeout` (then SIGKILLs its group and
// reaps it), then kills whatever is left of its group (a failed launcher's workers) and
// reads `log`. Always reaps `pid`; a `pid` the caller reaped already counts as timed out.
RunResult finish(pid_t pid, const fs::path& log, Clock::time_point t0, std::chrono::seconds timeout,
                 const RunOptions& opts = {});

// spawn() + finish(): runs argv to completion or to the deadline; no process of its
// group survives the call.
RunResult run(const std::vector<std::string>& argv, const fs::path& log, std::chrono::seconds timeout,
              const RunOptions& opts = {});

// Pids of the live children of `pid` (every thread's, from /proc/<pid>/task/*/children),
// empty when `pid` is gone.
std::vector<pid_t> children_of(pid_t pid);

// TROUPE_RANK from the environment of a worker process; -1 when absent or unreadable.
int worker_rank_of(pid_t pid);

// ---------------------------------------------------------------------------------------
// Run roots and token data.

// A new empty directory <tmp>/<prefix>-<pid>-<random hex>; the caller removes it
// (remove_run_root) when the suite ends.
fs::path make_run_root(const std::string& prefix);
// Removes `root` and everything under it (errors are ignored: a clean-up), unless a case of
// this test program failed: then it stays, and a line says where.
void remove_run_root(const fs::path& root);

// What troupe-prepare reads and makes: the source folders (relative to source_dir())
// whose files with one of `extensions` form the corpus, the tokenizer's vocabulary size
// and the corpus size cap. The defaults are the tiny model's corpus (TinyModel).
struct PrepareSpec {
  std::vector<std::string> inputs = {"layers", "kernels"};
  std::vector<std::string> extensions = {".cc", ".h"};
  int64_t vocab = 320;
  int64_t max_bytes = 300000;
};

// Runs `troupe-prepare --input <src>/<in>... --out <out_dir> --vocab V --max-bytes B
// --ext E...`; the log goes to `log`.
RunResult prepare_data(const fs::path& out_dir, const PrepareSpec& spec, const fs::path& log,
                       std::chrono::seconds timeout);

// ---------------------------------------------------------------------------------------
// The train_moe command line.

// `train_moe --config C [--backend B] --run-dir D (--set S)... [--parallel P] [--resume R]`,
// in that order; empty optional parts are left out.
struct TrainMoeCommand {
  fs::path config = fs::path(source_dir()) / "apps/configs/tiny.toml";
  std::string backend;
  fs::path run_dir;
  std::vector<std::string> sets;  // `key=value` config overrides, applied in order
  std::string parallel;
  std::string resume;

  std::vector<std::string> argv() const;
};

// The tests' tiny MoE model on the tiny.toml config: 4 blocks (dense, MoE, dense, MoE),
// d 32, ffn 64, 4 experts of hidden 32, vocab 320, sequences of 16, micro-batches of 2,
// no periodic eval. The fields are what the suites vary (defaults: the elastic suites').
// The global batch (sequences per step) is the same in every layout, so one set of keys
// serves each layout a suite compares.
struct TinyModel {
  int64_t global_batch = 4;
  int64_t steps = 8;
  int64_t eval_batches = 2;
  int64_t log_every = 1;
  int64_t warmup_steps = 3;
  fs::path data_dir;  // from prepare_data with vocab 320
};
std::vector<std::string> tiny_model_sets(const TinyModel& m);

// ---------------------------------------------------------------------------------------
// metrics.jsonl and events.jsonl.

// The records of a JSON-lines file, in order; empty when it does not exist. A last line
// without its newline is a record still being written and is left out; empty lines are
// skipped; any other line that is not JSON throws (nlohmann::json::parse_error).
std::vector<nlohmann::json> read_jsonl(const fs::path& file);

// The training-step records (those with "loss") of metrics.jsonl, in file order.
std::vector<nlohmann::json> step_records(const fs::path& metrics);

// One training-step record per step, by step number: a step run again after a
// checkpoint restore replaces the earlier record of that step and of every later one.
std::vector<nlohmann::json> latest_step_records(const fs::path& metrics);

// Loss by step from metrics.jsonl (a later record of a step wins).
std::map<int64_t, double> losses_by_step(const fs::path& metrics);

// The records of events.jsonl whose "event" is `name`, in order.
std::vector<nlohmann::json> events_named(const fs::path& events, const std::string& name);

// |reference - value| / |reference| (the denominator floored at 1e-30).
double rel_diff(double reference, double value);

// gtest EXPECTs that the run's metrics.jsonl (latest record of each step) has as many
// steps as `reference` (step records) and each loss within `tolerance` relative to it;
// prints "[<label>] N steps, max relative loss difference vs <against> D" and returns D.
double expect_losses_match(const std::vector<nlohmann::json>& reference, const fs::path& metrics,
                           double tolerance, const std::string& label, const std::string& against);

}  // namespace troupe::test
