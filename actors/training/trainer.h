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
  const layers::TrainConfig& tc_;
  StepDriver& driver_;
  std::ostream& metrics_;
  TrainerOptions opts_;
  int64_t seq_ = 0;
  double val0_ = 0, last_val_ = 0;
};

// Worker side: executes commands until "stop".
Status run_stage_host(Stage& stage, StepServer& server, std::chrono::milliseconds command_timeout);

nlohmann::json step_report_json(const StepReport& r);

}  // namespace troupe::training
