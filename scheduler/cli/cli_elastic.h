// scheduler/cli/cli_elastic.h — the `troupe` subcommands for elastic train_moe jobs run by the
// standalone launcher (docs/elastic.md), addressed by their run directory:
//   troupe scale <run dir> --dp N     rescale data parallelism at the next step boundary
//   troupe replace <run dir> <slot>   replace one worker (restored from a dp peer)
//   troupe status <run dir>           the job's workers, epoch, dp, recoveries, stragglers
//   troupe drain <agent>              move the workers of driver-supervised jobs off that agent
// Requests are files the launcher polls at step boundaries (<run dir>/scale_request,
// replace_request); the commands wait (bounded) for the launcher's answer in events.jsonl.
// For a troupe-scheduler job (its driver supervises its workers) the requests are store keys of the job
// ("<job>/elastic/request/<k>", answered at "answer/<k>").
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "scheduler/cli/cli.h"

namespace troupe::sched {

// True when `path` is the run directory of an elastic job (it has events.jsonl and
// status.json or the launcher's rendezvous directory).
bool is_elastic_run_dir(const std::string& path);

// `job` is an elastic launcher's run directory, or the id of a troupe-scheduler job
// whose driver supervises its workers (the request then travels through the job's store, connected
// with `c`, and the job's driver answers there).
int cli_elastic_scale(const CliConnection& c, const std::string& job, int dp, int wait_s);
int cli_elastic_replace(const CliConnection& c, const std::string& job, int slot, int wait_s);
// `actors`: the table of the job's actors (id, role, rank, worker, node, device, state, last step).
int cli_elastic_status(const std::string& run_dir, bool json, bool actors = false);
// After `troupe status <job>` of a driver-supervised scheduler job: the driver's view (slots,
// ranks, straggler flags), from the job's store; prints nothing for other jobs.
// False when the job has no driver status (not a training job, or no step done yet).
bool print_elastic_job_status(const CliConnection& c, const std::string& job, bool actors = false);
// The driver's status of a driver-supervised scheduler job (store key <job>/elastic/status):
// step, epoch, dp, recoveries, workers; nullopt when there is none (yet).
std::optional<nlohmann::json> elastic_job_status(const CliConnection& c, const std::string& job);
// troupe drain <agent>: every worker of a running --elastic job on that agent is replaced
// (restored from a dp peer) by one placed on another agent. Other jobs are
// listed, not moved.
int cli_elastic_drain(const CliConnection& c, const std::string& agent, int wait_s);

}  // namespace troupe::sched
