// scheduler/client/job_spec.h — defines JobSpec (what a user submits: command, arguments,
// environment, number of workers, parallel layout, elastic bounds, restart policy,
// checkpoint directory) and its JSON form, which is what travels in `submit` and lives
// in SQLite. The layout is core's ParallelLayout (core/parallel_layout.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/parallel_layout.h"
#include "core/status.h"

namespace troupe::sched {

struct JobSpec {
  std::string name;                          // for people; the scheduler assigns the id
  std::vector<std::string> argv;             // argv[0] is the program (PATH is searched)
  std::map<std::string, std::string> env;    // added to every process's environment
  int nproc = 1;                             // workers (the driver is extra)
  std::string layout;                        // ParallelLayout::parse() text; empty: pp=1,dp=nproc,n=1
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
  // What the scheduler does when its faulty-machine detector flags one of the job's
  // workers (scheduler/daemons/health_monitor.h): "flag" (an event, a log line, the Prometheus
  // counter), "replace" (that worker, as `troupe replace`) or "drain" (every worker of
  // the job on that worker's agent, as `troupe drain`). replace and drain need a driver
  // that supervises its workers (elastic); otherwise the flag is all that happens.
  std::string health_policy = "flag";

  // Checks every field and fills defaults (bounds, layout: rewritten in to_string() form);
  // errors name the field.
  Status validate();
  ParallelLayout parsed_layout() const;      // valid after validate()

  std::string to_json() const;
  static Result<JobSpec> from_json(const std::string& text);
};

}  // namespace troupe::sched
