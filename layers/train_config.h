// layers/train_config.h — defines TrainConfig, everything a training run reads from its
// TOML file: [model] (ModelConfig), [train], [optim], [data], [parallel], [checkpoint]
// and [elastic], with
// strict parsing (an unknown key or a bad value is an error naming the key) and
// command-line overrides ("--set train.steps=10").
#pragma once

#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/parallel_layout.h"
#include "core/status.h"
#include "layers/model_config.h"
#include "layers/optimizer.h"

namespace troupe::layers {

struct TrainOptions {
  uint64_t seed = 1234;           // model initialisation and data order
  int64_t steps = 100;            // optimizer steps
  int64_t seq_len = 128;          // tokens per sequence
  int64_t micro_batch_size = 8;   // sequences per micro-batch (per data-parallel rank)
  int64_t grad_accum = 1;         // micro-batches per step (per data-parallel rank)
  int64_t eval_every = 50;        // validation loss every N steps (0: only at the start and end)
  int64_t eval_batches = 4;       // micro-batches of validation data per evaluation
  int64_t log_every = 1;          // a console line every N steps
  // Wall-clock budget in seconds (0: none). When a step ends past it, training stops
  // there (final validation and weights as usual): `make demo` uses it as a safety net.
  double time_limit_s = 0;
  // GPU runs: keep the step's statistics on the device until its one read (issue 20; with
  // n > 1 summed over the n-group on the device; not with a z-loss); false: the host
  // statistics (per-layer read-backs), for comparison.
  bool device_stats = true;
  // With device_stats and grad_accum 1 in the single-process loop: the experts' dW products
  // leave their sums of squares for the clip's gradient norm, which then reads only the
  // other gradients (Model::enable_grad_norm_fold); false: the norm reads every gradient,
  // for comparison.
  bool fold_grad_norm = true;
  // With device_stats in the single-process loop on a GPU: from the second step on, each
  // step is one replay of a CUDA graph captured once (bench_1b's ~1,560 launches cost
  // one), its inputs copied into the graph's, its learning rate read from the device; a
  // step whose batch has another count of targets runs without it. false: every launch
  // enqueued one by one, for comparison (and for kernel profilers that want launches).
  bool cuda_graph = true;
  // With cuda_graph: a replayed step's successor is enqueued before the step's statistics
  // are read (copied out asynchronously, the buffer cleared), so the device does not wait
  // for the host's read, logging and uploads between steps (~0.35 ms a bench_1b step).
  // Not before an evaluation or a checkpoint, nor with a time limit or the router's bias
  // update (host work the next step depends on). Losses and norms are the same either way.
  bool launch_ahead = true;
  // GPU runs on Hopper: the attention backward computes dQ inside its
  // dK/dV kernel, each key block adding its share in no fixed order (~1.5% faster on
  // bench_1b; two runs agree to rounding). false: dQ in its own kernel, in a fixed order
  // (kernels::CudaContext::attention_fused_dq). The embedding backward adds repeated ids
  // in no fixed order either way, so gradient norms can differ in their last bits.
  bool attention_fused_dq = true;
  // The experts' weight gradients on a GPU in the single-process loop: f32 (default), or
  // bf16 ("bf16": each is its grouped dW product rounded once to bf16, as PyTorch autocast's
  // gradients of bf16 weight copies are; the norm, clipping and AdamW then compute in f32
  // from it). Half the bytes for the dW products to write and AdamW to read (bench_1b: ~2.4
  // GB of each a step). Needs grad_accum = 1. The Trainer's stages keep f32 (their gradient
  // buffers and reductions are f32) and CPU runs too, each saying so in a note.
  DType expert_grads = DType::kF32;
  // The f32 master weights on a GPU in the single-process loop: "f32" (default: a value
  // tensor beside each bf16 working copy), or "split": each matrix's master kept as its
  // bf16 working copy plus a 16-bit low half (Model::split_masters; exact, the same f32
  // bits). AdamW then reads and writes 26 bytes a parameter instead of 28 (bench_1b: ~2.6
  // GB less a step); the values are brought up to date for checkpoints and the final
  // weights. The working copy rounds ties away from zero instead of to even. The
  // Trainer's stages and CPU runs keep "f32", each saying so in a note.
  bool split_master = false;
  // Non-empty: every rank writes, per step, its per-thread communication and compute
  // timings as JSON lines into this directory (bench/overlap/timeline.py draws them).
  std::string timeline_dir;
};

struct DataOptions {
  std::string dir;  // output of `train_moe prepare` (tokenizer.json, train/val shards)
};

// Layout pp x dp x n (see DESIGN.md "Parallel layout"): the [parallel] table's pp, dp, n;
// layout() is the same as core's ParallelLayout.
struct ParallelOptions {
  int64_t pp = 1, dp = 1, n = 1;
  // Expert dispatch inside the n-group: "alltoall" (all_to_all_v of the routed rows) or
  // "allgather" (all-gather -> local scatter ... local gather -> reduce-scatter; better
  // when top_k is large).
  std::string dispatch = "alltoall";
  bool compression = false;  // data-parallel gradient reduce-scatter with bf16 on the wire
  // ---- communication overlap and compression (issue 17; docs/parallelism.md) ----
  // Each switch changes only when the step waits, never the arithmetic: a run with a
  // switch off gives bitwise the same numbers as with it on.
  bool overlap_a2a = true;           // Ulysses and expert all-to-alls in flight behind compute
  bool overlap_grad_sync = true;     // dp gradient reduce-scatter in buckets during backward
  bool overlap_param_gather = true;  // dp parameter all-gather behind the next forward
  // Token chunks of each expert dispatch (the expert GEMMs of chunk c run while chunk c+1
  // is dispatched and chunk c-1 combined). Part of the arithmetic (expert weight gradients
  // are summed per chunk), so compare runs at equal chunks.
  int64_t chunks = 2;
  bool fp8_dispatch = false;  // expert token dispatch in fp8 e4m3 with per-token scales
  // GPUs: the expert all-to-all driven by counts that stay on the device (the n-group's
  // GPUs write into and read from each other's mapped buffers; needs one host, else the
  // counts go through the host as without it). Costs memory: each rank's expert
  // activations are sized for the worst case, n times the routed rows
  // (docs/parallelism.md "Expert counts on the device").
  bool device_dispatch = false;
  // Print each step's relative error of the compressed gradient exchange against an extra
  // fp32 exchange of the same gradients (tests, benches; CPU ranks; costs that exchange).
  bool measure_compression = false;
  int64_t world() const { return pp * dp * n; }
  // InvalidArgument naming the part of pp, dp, n that is not >= 1 (ParallelLayout::make).
  Result<ParallelLayout> layout() const;
  // The layout must fit the model: layers divisible by pp, heads, kv heads and experts
  // by n.
  Status validate(const ModelConfig& m) const;
  // And the training shapes: the sequence split in n equal parts (Ulysses), the
  // micro-batch count of a pipeline.
  Status validate(const ModelConfig& m, const TrainOptions& t) const;
};

// Periodic checkpoints of a training run ([checkpoint]; see checkpoint/README.md).
struct CheckpointOptions {
  int64_t every = 0;   // save after every N-th step and after the last one (0: never)
  int64_t keep = 3;    // complete checkpoints kept (older ones are deleted)
  // Where step_<N> directories go; empty: $TROUPE_CHECKPOINT_DIR when the job sets it,
  // else <run dir>/checkpoints (filled in by the training app).
  std::string dir;
  // Background write rate per rank in MB/s (0: unlimited), so saves do not starve data
  // loading on a shared disk (tests use it to catch a save in the middle).
  double max_mb_per_s = 0;
};

// Failure handling of distributed runs ([elastic]; docs/elastic.md). Every distributed
// job is elastic: these only tune detection and policy.
struct ElasticOptions {
  // A worker whose heartbeat stops for this long is killed and replaced. 0: the job's
  // setting (troupe run/submit --heartbeat-timeout-ms, handed to the driver by the
  // scheduler), else 2000.
  int64_t heartbeat_timeout_ms = 0;
  int64_t comm_error_grace_ms = 300;      // a data-plane error with nobody dead: rebuild after this
  int64_t step_watchdog_ms = 60000;       // a command running this long with everyone beating: rebuild
  int64_t join_timeout_ms = 30000;        // a worker that does not join a new epoch in time: replaced
  int64_t spares = -1;                    // replacement workers the job may start (-1: unlimited)
  int64_t min_dp = 1;                     // bounds of `troupe scale --dp` and of shrinking
  int64_t max_dp = 0;                     // 0: parallel.dp
  double straggler_ratio = 1.5;           // compute time > ratio x the peers' median ...
  int64_t straggler_window = 5;           // ... for this many consecutive steps: flagged
  std::string straggler_policy = "flag";  // "flag" or "replace"
  // In-memory snapshots (docs/elastic.md "Snapshots"): after every this many steps each
  // rank copies its state into memory its node's keeper holds (outside the worker, with a
  // copy on another node); a recovery goes back to the newest complete one, so at most
  // this many steps run again. 0: none (a recovery needs a checkpoint).
  int64_t snapshot_every = 10;
  // Planned rescales "<after step>:<dp>,..." (demos and tests; `troupe scale` at run time).
  std::string scale_at;
  // Fault injection for tests and demos: "<kill|stop|slow|cut|hang|cutctl>@<step>:<phase>:<slot>,..."
  // (actors/training/elastic.h, FaultSpec).
  std::string inject;
};

struct TrainConfig {
  ModelConfig model;
  TrainOptions train;
  AdamWOptions optim;
  LrSchedule lr;
  DataOptions data;
  ParallelOptions parallel;
  CheckpointOptions checkpoint;
  ElasticOptions elastic;
  std::string source;  // the config file

  int64_t global_batch() const { return train.micro_batch_size * train.grad_accum * parallel.dp; }
  int64_t tokens_per_step() const { return global_batch() * train.seq_len; }
};

// Parses `path`, applies `overrides` ("key=value", TOML-typed), reads every section and
// rejects unknown keys. Errors name the key and the file.
Result<TrainConfig> load_train_config(const std::string& path, const std::vector<std::string>& overrides);
Result<TrainConfig> parse_train_config(ConfigTable& cfg);

}  // namespace troupe::layers
