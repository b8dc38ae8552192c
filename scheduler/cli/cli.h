// scheduler/cli/cli.h — defines the troupe CLI's commands as functions over parsed options
// (troupe_main.cc does the CLI11 parsing): run (embedded scheduler + agent), submit,
// status, logs, cancel, keygen; and the table / JSON renderers of `troupe status`.
// Each returns the process exit status; errors are printed as "troupe: <reason>".
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "scheduler/client/job_spec.h"
#include "scheduler/client/transport.h"

namespace troupe::sched {

struct CliConnection {
  std::string scheduler;        // ADDR; default $TROUPE_SCHEDULER or tcp://127.0.0.1:7460
  std::string curve_key;        // this client's key pair file
  std::string scheduler_key;    // the scheduler's public key file (turns CURVE on)
  int timeout_ms = 3000;
};

// Where a CLI command's requests go and with what credentials: the scheduler's endpoint
// (--scheduler, else $TROUPE_SCHEDULER, else kDefaultSchedulerAddress; normalized) and
// this client's security (--curve-key with --scheduler-key: CURVE; neither, to a loopback
// scheduler: local authentication). Errors name the flag that is missing or wrong.
Result<std::pair<std::string, ClientSecurity>> client_connection(const CliConnection& c);

struct RunOptions {
  JobSpec spec;
  std::string state_dir;        // empty: a temporary directory, removed after success
  bool verbose = false;
  bool prefix_output = true;    // "[worker-0] " before each line of a process's output
  int slots = 0;                // the embedded agent's slots; 0: as many as --nproc
  bool nproc_given = true;      // false: take it from the Slurm allocation (SlurmAllocation)
  std::string metrics_listen;   // the embedded scheduler's /metrics (empty: none)
  std::vector<std::string> detector;  // KEY=VALUE thresholds (observe/peer_detector.h)
  int agent_timeout_ms = 3000;        // the embedded agent silent this long is declared dead
};

// What `troupe run` reads from a Slurm allocation (salloc, sbatch, srun): SLURM_JOB_ID,
// SLURM_NTASKS (the default --nproc), SLURM_STEP_NUM_NODES / SLURM_JOB_NUM_NODES and
// their node lists (more than one node: troupe run refuses, naming troupe.sbatch), and
// SLURM_GPUS_ON_NODE (GPUs of this node: --backend cuda needs one per worker).
struct SlurmAllocation {
  std::string job_id;
  std::string nodelist;
  int nodes = 1;
  int ntasks = 0;         // 0: not given
  int gpus_on_node = -1;  // -1: not given
};
// nullopt outside an allocation (no SLURM_JOB_ID).
std::optional<SlurmAllocation> slurm_allocation_from_env();

// Ok when `needed` more processes fit under the user's process limit (RLIMIT_NPROC) and
// the kernel's pid_max / threads-max, counting what runs now; else InvalidArgument
// naming the limit and its value.
Status check_process_limit(int needed);

// The CLI's exit status for an error (docs/cluster.md): 2 bad arguments, 3 unknown job,
// 4 scheduler unreachable, 5 refused credentials, 1 anything else; 0 for OK. Every
// command maps its errors through this one table.
int cli_exit_code(const Status& s);

int cli_run(const RunOptions& opts);
int cli_submit(const CliConnection& c, JobSpec spec, bool json);
// `health`: with one job, the table of its workers' health reports (cli_health.h).
int cli_status(const CliConnection& c, const std::string& job_id, bool json, bool health = false);
int cli_logs(const CliConnection& c, const std::string& job_id, const std::string& proc, bool follow);
int cli_cancel(const CliConnection& c, const std::string& job_id, bool json);
int cli_keygen(const std::string& prefix);
// Validates a key file (a .key pair whose halves match, or a .pub) and prints its public
// key; 1 with the reason when it is not one.
int cli_keygen_check(const std::string& file);
// Waits until the job has ended and every process of it is gone; returns its exit status
// (130 when it was cancelled), so scripts (scripts/slurm/troupe.sbatch) can exit with it.
int cli_wait(const CliConnection& c, const std::string& job_id, bool quiet);
// The checkpoints of a job: its checkpoint directory (the job's checkpoint_dir, else the
// train_moe run directory of its command: --run-dir D -> D/checkpoints, relative to the
// job's work_dir), or `dir` when given (then no scheduler is asked).
int cli_checkpoints(const CliConnection& c, const std::string& job_id, const std::string& dir, bool json);

// The checkpoint directory a job's status record points at ("" when it names none).
std::string job_checkpoint_dir(const nlohmann::json& job);
// A table of the checkpoints in `dir`: step, layout, ranks, size, age, state (committed,
// or an unfinished save), newest first.
std::string render_checkpoints_table(const std::string& dir);

// The scheduler's record of one job (with its processes); NotFound names an unknown job.
Result<nlohmann::json> fetch_job_status(const CliConnection& c, const std::string& job_id);

// Human tables of a status document (the scheduler's JSON).
std::string render_status_table(const nlohmann::json& status, bool with_procs);

}  // namespace troupe::sched
