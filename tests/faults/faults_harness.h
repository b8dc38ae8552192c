// tests/faults/faults_harness.h — defines what the fault campaign's tests share: a
// `troupe run` of the tiny train_moe job (its command line, the pid of a process of the
// job by role), the fault-free reference of a configuration (the same job under the
// standalone launcher, which runs the same Trainer and layout), the scheduler's event log
// of a finished `troupe run` (kept in the run directory), and file checks (modes, bytes).
//
// Every child runs in its own process group with a deadline (tests/common's harness);
// every job process carries TW_TAG=<tag> in its environment, so none can be missed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/common/train_moe_harness.h"

namespace troupe::faults {

namespace fs = std::filesystem;
using test::Clock;
using test::RunResult;

std::string troupe_bin();  // troupe (the CLI), this build's or $TROUPE_TEST_BIN_DIR's
int64_t wall_ms();         // the system clock in ms (events' ts_ms)

// The tiny model's job (tests/common TinyModel) with `steps` steps, data in `data_dir`,
// run directory `run_dir`, layout `parallel`, and extra `key=value` overrides.
test::TrainMoeCommand tiny_job(const fs::path& data_dir, const fs::path& run_dir, int64_t steps,
                               const std::string& parallel, const std::vector<std::string>& extra = {});

// `troupe run --nproc N [flags] --env TW_TAG=<tag> -- <job argv>`.
std::vector<std::string> troupe_run_argv(int nproc, const std::string& tag,
                                         const std::vector<std::string>& flags,
                                         const std::vector<std::string>& job_argv);

// Pids of live processes whose environment holds TW_TAG=<tag> and TROUPE_ROLE=<role>
// ("driver", "worker").
std::vector<pid_t> job_pids(const std::string& tag, const std::string& role);
std::string environ_value(pid_t pid, const std::string& name);  // "" when absent

// Waits (bounded) until metrics.jsonl of `run_dir` holds at least `steps` step records.
bool wait_for_steps(const fs::path& run_dir, size_t steps, std::chrono::seconds timeout);

// The state directory `troupe run` printed on failure ("logs and events are in X"); "".
std::string kept_state_dir(const std::string& output);
// The records of a JSON-lines event log whose "type" (scheduler) or "event" (trainer) is
// `name`.
std::vector<nlohmann::json> records(const fs::path& jsonl, const std::string& name);

// Every file and directory under `root` (root included) whose mode gives anything to the
// group or others: "path (mode 0644)" each.
std::vector<std::string> not_owner_only(const fs::path& root);
// Whether `bytes` occurs anywhere in `file`.
bool file_contains(const fs::path& file, const std::string& bytes);

// Data prepared once per test process (tests/common PrepareSpec defaults) under `root`.
fs::path prepared_data(const fs::path& root);

}  // namespace troupe::faults
