// actors/training/trainer.h — defines the two ends of a distributed training job:
//   Trainer (driver process): drives the steps ("run step N" -> "step done" with loss and
//   metrics, "evaluate", "stop") through a StepDriver, writes metrics.jsonl and the
//   console lines as the single-process app does, and supervises the workers: while
//   waiting for a reply the StepDriver watches them (Downs, reported errors) and polls a
//   supervision callback (e.g. worker processes alive), failing the job with the first
//   problem, bounded by a per-command deadline.
//   run_stage_host (worker process): serves one Stage's commands through a StepServer;
//   world rank 0's reply carries the metrics.
#pragma once

#include <chrono>
#include <functional>
#include <ostream>
#include <string>

#include "actors/training/checkpointing.h"
#include "actors/training/control.h"
#include "actors/training/stage.h"

namespace troupe::training {

struct TrainerOptions {
  std::chrono::milliseconds command_timeout{600000};  // per step / evaluation
  // OK while every worker is healthy; else the problem (polled while waiting).
  Supervisor supervise;
  // GPU runs: the GPUs of the job and the model FLOPs per token, for "mfu" in the metrics
  // (tokens/s * flops_per_token / (989 TFLOP/s * num_gpus)); 0: no mfu (CPU).
  int num_gpus = 0;
  double flops_per_token = 0;
  // Resume: the first step to run (a checkpoint of step first_step - 1 was loaded).
  int64_t first_step = 1;
  int64_t tokens_seen = 0;  // tokens trained on before first_step
  // Periodic checkpoints (checkpoint.every > 0): after a due step the workers are told to
  // save ("save" command; their reply's blocked time goes into metrics.jsonl as
  // ckpt_blocked_ms) and the committer finalizes the step in the background.
  CheckpointCommitter* checkpoints = nullptr;
};

class Trainer {
 public:
  Trainer(const layers::TrainConfig& tc, StepDriver& driver, std::ostream& metrics, TrainerOptions opts);
  // Runs the whole job: validation at step 0, every step, periodic validation, stop.
  Status run();
  double first_val_loss() const { return val0_; }
  double last_val_loss() const { return last_val_; }

 private:
  Result<nlohmann::json> call(Command::Kind kind, int64_t step);
  // Tells the workers to save after `step`, adds the blocked time to `rec`, and hands the
  // step to the committer.
  Status save_checkpoint(int64_t step, int64_t tokens_seen, nlohmann::json& rec);
  const layers::TrainConfig& tc_;
  StepDriver& driver_;
  std::ostream& metrics_;
  TrainerOptions opts_;
  int64_t seq_ = 0;
  double val0_ = 0, last_val_ = 0;
};

// Worker side: executes commands until "stop". With `checkpoints`, "save" snapshots the
// stage's state and writes it in the background; "stop" waits for the write in flight.
Status run_stage_host(Stage& stage, StepServer& server, std::chrono::milliseconds command_timeout,
                      RankCheckpointer* checkpoints = nullptr);

nlohmann::json step_report_json(const StepReport& r);

// The data position recorded with a checkpoint after `step` (the loader is a function of
// the seed and the step: the next step to read says everything).
nlohmann::json data_position_json(const layers::TrainConfig& tc, int64_t step, int64_t tokens_seen);

}  // namespace troupe::training
