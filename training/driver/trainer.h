// training/driver/trainer.h — defines the Trainer's entry points: run_trainer (the driver of
// a distributed job: it starts or asks for the workers, drives the steps, writes
// metrics.jsonl, events.jsonl and status.json, decides checkpoints, and handles every
// membership change — a lost, hung or straggling worker, `troupe scale|replace|drain` —
// through the protocol of training/worker/elastic.h) and run_worker_process (a worker:
// hosts its Stage and serves the Trainer until "stop").
//
// Every job runs this way, from one process to many; failure handling needs no flag
// (docs/elastic.md). Three ways to own the workers:
// - one process (no scheduler, layout 1x1x1, elastic.isolate_workers = false): the worker
//   is a thread of the Trainer's process, its actors in the Trainer's actor system (the
//   commands and replies are local deliveries), the store in memory (comm::MemoryStore):
//   no child, no socket. It cannot survive its worker: a failure ends the job (with the
//   checkpoints it wrote, for --resume);
// - standalone (no scheduler, otherwise): the Trainer forks the workers itself (the same
//   program and arguments, TROUPE_ROLE=worker) and rendezvous through a FileStore in
//   <run dir>/rendezvous;
// - under troupe-scheduler (`troupe run` / `troupe submit`): the scheduler starts, kills
//   and reports the workers; the Trainer claims their supervision with the key
//   "<job>/elastic/claim" of the job's store, so the scheduler reports a lost worker to
//   it instead of restarting the whole job.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/rendezvous_store.h"
#include "training/messages.h"
#include "training/run_config.h"
#include "training/stage/stage.h"
#include "training/stage/stage_program.h"
#include "training/worker/elastic.h"

namespace troupe::training {

struct TrainerOptions {
  std::string app = "train";  // the app's name: the prefix of the Trainer's console lines
  // The program and arguments every worker runs (the standalone launcher execs
  // /proc/self/exe with them); unused under the scheduler, which starts the workers.
  std::vector<std::string> argv;
  std::string config;                  // the config file, recorded in checkpoints
  std::vector<std::string> overrides;  // its "key=value" overrides, likewise
  std::string resume;                  // a checkpoint (any layout) to continue from; empty: a fresh job
  std::string run_dir;                 // metrics.jsonl, events.jsonl, status.json, checkpoints/
  // Workers on GPUs: each gets its own device.
  bool gpu = false;
  // GPU runs: model FLOPs per token (ModelConfig::train_flops_per_token), for "mfu" in
  // metrics.jsonl (tokens/s x flops / (kPeakBf16FlopsPerGpu x GPUs)); 0: none.
  double flops_per_token = 0;
  // Under the scheduler: records the actor placement of an epoch (actor id -> process
  // name, e.g. "stage.3" -> "worker-3") in the scheduler's durable state, with the layout the
  // workers run as ("pp=2,dp=2,n=1"). May be empty.
  std::function<Status(const std::vector<std::pair<std::string, std::string>>&, const std::string& layout)>
      publish_placement;
  // A one-process run's worker (it runs in this process): the app's stage program and the
  // process's device, which must outlive run_trainer.
  ProgramFactory program;
  layers::Ctx worker_ctx = layers::Ctx::cpu();
};

// Whether run_trainer runs its worker in its own process (see above): no scheduler,
// layout 1x1x1 and elastic.isolate_workers false.
bool runs_in_one_process(const layers::TrainConfig& tc, bool scheduled);
// For such a run: InvalidArgument naming a setting that needs worker processes
// (test.inject, elastic.max_dp > 1, test.scale_at) and the key that gives them.
Status check_one_process(const layers::TrainConfig& tc);

// Runs the job to its end as its driver. `scheduled_store`: the job's store under
// troupe-scheduler (TROUPE_ROLE=driver); null: the standalone launcher. `tc` is the loaded
// configuration (its [elastic] section tunes detection and policy).
Status run_trainer(const TrainerOptions& o, const layers::TrainConfig& tc,
                   std::unique_ptr<comm::RendezvousStore> scheduled_store);

// A worker process (TROUPE_ROLE=worker; TROUPE_JOB_ID, TROUPE_RANK (its slot) and
// TROUPE_ELASTIC_EPOCH, handed over by whoever started it: core/job_env.h). `cut_control`
// closes its control-plane connection (the cutctl fault; may be empty).
// `ctx`: the CPU, or the worker's GPU.
// `program`: the app's stage program.
Status run_worker_process(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& store, std::function<void()> cut_control = {},
                          const layers::Ctx& ctx = layers::Ctx::cpu(), observe::StepProbe* steps = nullptr);

// A worker's reply to a command (typed, messages.h) as the JSON the Trainer records:
// the step report's keys, "val_loss", and the checkpoint/replica notes.
nlohmann::json step_reply_json(const StepReply& r);

// The data position recorded with a checkpoint after `step` (the loader is a function of
// the seed and the step: the next step to read says everything).
nlohmann::json data_position_json(const layers::TrainConfig& tc, int64_t step, int64_t tokens_seen);

}  // namespace troupe::training
