// scheduler/cli/cli_top.h — `troupe top <job id | run dir>`: a terminal view of a running
// training job, redrawn every --interval seconds (ANSI clear + redraw), or one frame with
// --once (for scripts and tests). Everything shown is read from what the job already
// writes; nothing is asked of the training processes:
//   <run dir>/metrics.jsonl   step, loss, val_loss, tokens/s, mfu, step/compute/comm ms
//                             (rank 0's, and the world mean of comm), checkpoint figures
//   <run dir>/status.json     elastic launcher: per worker slot, rank, pid, alive,
//                             straggler flag, and the last step's step/compute/comm ms
//   <run dir>/events.jsonl    elastic launcher events (failures, recoveries, rescales)
//   the scheduler's record    (a job id) state, workers, restarts, its processes, its
//                             events.jsonl (<job_dir>), and for driver-supervised jobs the
//                             driver's status from the job's store
// The run directory of a scheduler job is its train_moe --run-dir (relative to the job's
// work_dir), else runs/<config stem>.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "scheduler/cli/cli.h"

namespace troupe::sched {

struct TopOptions {
  std::string target;      // a run directory, else a scheduler job id
  double interval_s = 2.0;  // between redraws
  bool once = false;        // one frame, no ANSI codes, then exit
  int events = 8;           // recent events shown
};

// Runs until Ctrl-C (or, for a scheduler job, until the job has ended and its final frame
// is drawn). Exit status: 0; 2 bad options; 3 no such job or directory; 4 scheduler
// unreachable.
int cli_top(const CliConnection& c, const TopOptions& o);

// One frame as text. `job`: the scheduler's job record (with procs), when the target is a
// job; `elastic`: the driver's status from the job's store, when there is one.
// `run_dir` may be empty (a job whose run directory is unknown).
std::string render_top_frame(const std::string& title, const std::string& run_dir, const nlohmann::json* job,
                             const std::optional<nlohmann::json>& elastic, int max_events);

// The train_moe run directory of a scheduler job record ("" when its argv names none).
std::string job_run_dir(const nlohmann::json& job);

}  // namespace troupe::sched
