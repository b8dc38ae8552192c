// actors/training/trainer.h — defines the Trainer's entry points: run_trainer (the driver of
// a distributed job: it starts or asks for the workers, drives the steps, writes
// metrics.jsonl, events.jsonl and status.json, decides checkpoints, and handles every
// membership change — a lost, hung or straggling worker, `troupe scale|replace|drain` —
// through the protocol of actors/training/elastic.h) and run_worker_process (a worker:
// hosts its Stage and serves the Trainer until "stop").
//
// Every distributed job runs this way; failure handling needs no flag (docs/elastic.md).
// Two ways to own the processes:
// - standalone (no scheduler): the Trainer forks the workers itself (the same program and
//   arguments, TROUPE_ROLE=worker) and rendezvous through a FileStore in
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

#include "actors/training/elastic.h"
#include "actors/training/messages.h"
#include "actors/training/stage.h"
#include "actors/training/stage_program.h"
#include "comm/rendezvous_store.h"
#include "layers/train_config.h"

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
  // GPU runs: model FLOPs per token, for "mfu" in metrics.jsonl (tokens/s x flops /
  // (989 TFLOP/s x GPUs)); 0: none.
  double flops_per_token = 0;
  // Under the scheduler: records the actor placement of an epoch (actor id -> process
  // name, e.g. "stage.3" -> "worker-3") in the scheduler's durable state. May be empty.
  std::function<Status(const std::vector<std::pair<std::string, std::string>>&)> publish_placement;
};

// Runs the job to its end as its driver. `scheduled_store`: the job's store under
// troupe-scheduler (TROUPE_ROLE=driver); null: the standalone launcher. `tc` is the loaded
// configuration (its [elastic] section tunes detection and policy).
Status run_trainer(const TrainerOptions& o, const layers::TrainConfig& tc,
                   std::unique_ptr<comm::RendezvousStore> scheduled_store);

// A worker process (TROUPE_ROLE=worker; TROUPE_JOB_ID, and TROUPE_ELASTIC_SLOT or
// TROUPE_RANK, TROUPE_ELASTIC_EPOCH, handed over by whoever started it). `cut_control`
// closes its control-plane connection (the cutctl fault; may be empty).
// `ctx`: the CPU, or the worker's GPU.
// `program`: the app's stage program.
Status run_worker_process(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& store, std::function<void()> cut_control = {},
                          const layers::Ctx& ctx = layers::Ctx::cpu());

// A worker's reply to a command (typed, messages.h) as the JSON the Trainer records:
// the step report's keys, "val_loss", and the checkpoint/replica notes.
nlohmann::json step_reply_json(const StepReply& r);

// The data position recorded with a checkpoint after `step` (the loader is a function of
// the seed and the step: the next step to read says everything).
nlohmann::json data_position_json(const layers::TrainConfig& tc, int64_t step, int64_t tokens_seen);

}  // namespace troupe::training
