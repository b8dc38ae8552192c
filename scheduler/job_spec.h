// scheduler/job_spec.h — defines JobSpec (what a user submits: command, arguments,
// environment, number of workers, parallel layout, elastic bounds, restart policy,
// checkpoint directory), ParallelLayout (pp × dp × n, parsed from "pp=2,dp=2,n=4" or
// "2x2x4") and their JSON form, which is what travels in `submit` and lives in SQLite.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace troupe::sched {

struct ParallelLayout {
  int pp = 1;
  int dp = 1;
  int n = 1;  // the MoE group: n slots that must share one node

  int world_size() const { return pp * dp * n; }
  std::string to_string() const;  // "pp=1,dp=4,n=2"
};

// Accepts "pp=P,dp=D,n=N" (any order, missing parts default to 1) or "PxDxN".
Result<ParallelLayout> parse_layout(const std::string& text);

struct JobSpec {
  std::string name;                          // for people; the scheduler assigns the id
  std::vector<std::string> argv;             // argv[0] is the program (PATH is searched)
  std::map<std::string, std::string> env;    // added to every process's environment
  int nproc = 1;                             // workers (the driver is extra)
  std::string layout;                        // empty: pp=1,dp=nproc,n=1
  int min_workers = 0;                       // elastic bounds; 0 = nproc
  int max_workers = 0;
  int max_restarts = 0;                      // worker restarts of the whole job
  int max_driver_restarts = 3;               // restarts of a driver that died
  std::string checkpoint_dir;
  std::string backend = "cpu";               // cpu | cuda
  std::string work_dir;                      // empty: the agent's directory
  bool driver = true;                        // run a driver process besides the workers
  int heartbeat_timeout_ms = 3000;           // per process, once it has said hello
  // Elastic: the driver owns membership (a lost worker is reported to the driver, which
  // asks for replacements; scheduler_elastic.cc). Set when the job's driver claims the
  // supervision of its workers (the store key "<job>/elastic/claim": train_moe's Trainer
  // does at start), or from the start by `--elastic`. Otherwise a lost worker restarts
  // every worker of the job (max_restarts).
  bool elastic = false;

  // Checks every field and fills defaults (bounds, layout); errors name the field.
  Status validate();
  ParallelLayout parsed_layout() const;      // valid after validate()

  std::string to_json() const;
  static Result<JobSpec> from_json(const std::string& text);
};

}  // namespace troupe::sched
