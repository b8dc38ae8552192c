// training/run_config.h — defines TrainConfig, everything a training run reads from its
// TOML file: [model] (ModelConfig), [train], [optim], [data], [parallel], [checkpoint],
// [elastic], [observe], and the fenced [bench] and [test] sections, with
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

inline constexpr int64_t kMaxStepsInFlight = 8;

struct TrainOptions {
  uint64_t seed = 1234;           // model initialisation and data order
  int64_t steps = 100;            // optimizer steps
  int64_t seq_len = 128;          // tokens per sequence
  // The batch of one optimizer step, in sequences, the same in every layout: what the run
  // trains on does not depend on how it is spread. 0: micro_batch_size (one micro-batch at
  // layout 1x1x1).
  int64_t global_batch = 0;
  int64_t micro_batch_size = 8;  // sequences per micro-batch of one data-parallel replica
  // Micro-batches per step of each data-parallel replica: derived, not a config key —
  // global_batch / (micro_batch_size * parallel.dp) (micro_batches_per_replica), set by
  // parse_train_config for the configured layout and again by every change of dp.
  int64_t grad_accum = 1;
  int64_t eval_every = 50;        // validation loss every N steps (0: only at the start and end)
  int64_t eval_batches = 4;       // micro-batches of validation data per evaluation
  int64_t log_every = 1;          // a console line every N steps
  // Wall-clock budget in seconds (0: none). When a step ends past it, training stops
  // after the steps already in flight (at most steps_in_flight - 1 more), with the final
  // validation and checkpoint as usual: `make demo` uses it as a safety net.
  double time_limit_s = 0;
  // Step commands the Trainer keeps in flight: step k+1 is sent before step k's report
  // arrives, so a worker finds its next command queued and never idles for a round trip
  // to its driver (1: send each step after the last one's report, for comparison).
  // Evaluations, checkpoints, stops and membership changes stay in order; a failure with
  // several steps in flight restores a step every survivor holds (docs/elastic.md).
  int64_t steps_in_flight = 2;
  // The step engine's switches (the Stage, every layout; training/stage/stage.h "Step
  // engine"). Each defaults to the fast way; false keeps the plain one, for comparison:
  // keys of the fenced [bench] section (bench.device_stats, ...; parse_test_sections).
  // The step's statistics (loss, gradient norm, tokens, the program's: router loads and
  // aux losses) accumulate in one device buffer, are summed over the world on the device
  // and read once per step, asynchronously; false: read back inside the step and summed
  // in fp64 on the host (per-layer read-backs with n > 1). A program that keeps its own
  // on the host uses the host way. The CPU runs the same code.
  bool device_stats = true;
  // The experts' dW products leave their sums of squares for the clip's gradient norm,
  // which then reads only the other gradients, where that is exact: dp = 1 (a dp
  // reduction changes the gradients after the product) and one micro-batch a step (later
  // ones add); elsewhere the norm reads every gradient. false: always read.
  bool fold_grad_norm = true;
  // GPUs: from the second step on, each step is one replay of a CUDA graph captured once
  // (bench_1b's ~1,560 launches cost one; the collectives of dp and pp inside it), its
  // batch copied into the graph's inputs, its learning rate read from the device; a step
  // whose batch has other counts of targets runs op by op. Needs device_stats. A step
  // that cannot be captured (n > 1: the expert dispatch maps its peers' buffers, or reads
  // token counts, on the host) runs op by op with a note
  // saying why, or, when the config sets cuda_graph = true itself, is refused at start.
  // false: every launch enqueued one by one (for kernel profilers that want launches).
  // CPU workers have no launches to capture: the switch does not apply to them.
  bool cuda_graph = true;
  bool cuda_graph_asked = false;  // the config (or an override) set bench.cuda_graph
  // The next step may be enqueued before this step's statistics are read (the worker
  // launches step k+1, then finishes step k), so the device does not wait for the host's
  // read, logging, uploads and driver between steps. On GPUs from the captured step on,
  // and not where the host changes the next step between steps (the router's bias
  // update); losses and norms are the same either way. On the CPU a step runs whole when
  // launched, so this only orders the work.
  bool launch_ahead = true;
  // GPU runs on Hopper: the attention backward computes dQ inside its
  // dK/dV kernel, each key block adding its share in no fixed order (~1.5% faster on
  // bench_1b; two runs agree to rounding). false: dQ in its own kernel, in a fixed order
  // (kernels::CudaContext::attention_fused_dq). With it off no kernel we know of adds in
  // no fixed order (the embedding backward's atomics are gone): the two-GPU tests' runs
  // give the same losses bit for bit (bench/RESULTS.md).
  bool attention_fused_dq = true;
  // GPUs of compute capability 9.0 and up: kernels launch with programmatic dependent
  // launch (kernels::CudaContext::pdl). bench.pdl = false turns it off, for comparison.
  bool pdl = true;
  // The experts' weight gradients: f32 (default), or bf16 ("bf16": each is its grouped dW
  // product rounded once to bf16, as PyTorch autocast's gradients of bf16 weight copies
  // are; the norm, clipping and AdamW then compute in f32 from it; the dp reduce-scatter
  // sends them as bf16 and sums them in f32). Half the bytes for the dW products to write
  // and the norm, the reduction and AdamW to read (bench_1b: ~2.4 GB of each a step).
  // Needs grad_accum = 1. Every layout and backend.
  DType expert_grads = DType::kF32;
  // The f32 master weights on a GPU: "f32" (default: a value tensor beside each bf16
  // working copy), or "split": each matrix's master kept as its bf16 working copy plus a
  // 16-bit low half (layers::ParamBuffer::split_masters; exact, the same f32 bits). AdamW
  // then reads and writes 26 bytes a parameter instead of 28 (bench_1b: ~2.6 GB less a
  // step); the values are brought up to date for checkpoints and copies; with dp > 1 the
  // shard's values are joined for the all-gather. The working copy rounds ties away from
  // zero instead of to even. CPU workers compute from f32 masters (no working copies)
  // and keep them, saying so in a note.
  bool split_master = false;
  // A Hugging Face model directory (config.json + safetensors of a Mixtral or Qwen3-MoE)
  // whose weights start the run instead of the seed's initialisation: each rank reads its
  // own slices of it (train_moe --init-from sets it, with the [model] keys its config.json
  // gives). Empty: initialised from the seed.
  std::string init_from;
  // train.recompute = "blocks": programs on the transformer program base keep only each
  // block's input per micro-batch and run the block's forward again in its backward (less
  // activation memory, one more forward of every block); "none" (default) keeps what the
  // backward needs. Apps not on the base refuse it (train_moe: model.recompute_swiglu).
  bool recompute_blocks = false;
  // Non-empty: every rank writes, per step, its per-thread communication and compute
  // timings as JSON lines into this directory (bench/overlap/timeline.py draws them).
  std::string timeline_dir;
  // The file-mode mask (octal, as umask(1) takes it) of everything a training process
  // creates: the run directory, metrics, events, logs and checkpoints. The default "077"
  // keeps them readable by their owner only; "027" lets the owner's group read them.
  std::string umask = "077";
};

struct DataOptions {
  std::string dir;  // output of `troupe-prepare` (tokenizer.json, train/val shards)
};

// Layout pp x dp x n (docs/parallelism.md): the [parallel] table's pp, dp, n;
// layout() is the same as core's ParallelLayout.
struct ParallelOptions {
  int64_t pp = 1, dp = 1, n = 1;
  // Expert dispatch inside the n-group: "alltoall" (all_to_all_v of the routed rows) or
  // "allgather" (all-gather -> local scatter ... local gather -> reduce-scatter; better
  // when top_k is large).
  std::string dispatch = "alltoall";
  bool compression = false;  // data-parallel gradient reduce-scatter with bf16 on the wire
  // ---- communication overlap (docs/parallelism.md): keys of the fenced [bench] section ----
  // Each switch changes only when the step waits, never the arithmetic: a run with a
  // switch off gives bitwise the same numbers as with it on.
  bool overlap_a2a = true;           // Ulysses and expert all-to-alls in flight behind compute
  bool overlap_grad_sync = true;     // dp gradient reduce-scatter in buckets during backward
  bool overlap_param_gather = true;  // dp parameter all-gather behind the next forward
  // Token chunks of each expert dispatch (the expert GEMMs of chunk c run while chunk c+1
  // is dispatched and chunk c-1 combined). Part of the arithmetic (expert weight gradients
  // are summed per chunk), so compare runs at equal chunks. 1 by default: with the step a
  // CUDA graph and the counts on the device, one chunk ran 6-8% faster at n=2 on two
  // H200s than two (each chunk's expert GEMMs run on a part of the rows; docs/parallelism.md).
  int64_t chunks = 1;
  bool fp8_dispatch = false;  // expert token dispatch in fp8 e4m3 with per-token scales
  // GPUs: the expert all-to-all driven by counts that stay on the device (the n-group's
  // GPUs write into and read from each other's mapped buffers), so no MoE block waits on
  // the host. On by default wherever it can work (n > 1 on GPUs, dispatch = "alltoall",
  // the n-group's GPUs on one host and able to map each other's memory); elsewhere the
  // counts go through the host, with a note. Costs memory: each rank's expert rows are
  // sized for the worst case, n times the routed rows (docs/parallelism.md "Expert counts
  // on the device"); false gives it back. Set true in a config, it is required: refused
  // with dispatch = "allgather", and a group whose GPUs cannot map each other fails.
  bool device_dispatch = true;
  bool device_dispatch_required = false;  // device_dispatch = true was set explicitly
  // bench.measure_compression: print each step's relative error of the compressed
  // gradient exchange against an extra fp32 exchange of the same gradients (tests,
  // benches; CPU ranks; costs that exchange).
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
  int64_t every = 0;   // save after every N-th step and after the last one (0: no periodic ones)
  int64_t keep = 3;    // complete checkpoints kept (older ones are deleted)
  // Save the last step's state when training ends (even with every = 0): the run's final
  // weights, which `train_moe sample --run` reads and `--resume` continues. false: only
  // the periodic ones (benchmarks that do not want the write).
  bool final = true;
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
  // A worker that does not join a new epoch in time: replaced. A new GPU worker of a 1B
  // model (CUDA context, model, pinned snapshot memory) was once measured over 30 s to
  // join: raise it for such models (docs/elastic.md).
  int64_t join_timeout_ms = 30000;
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
  // 20: bench_1b on an H200 measured ~0.7 s from a snapshot to its commit (copy, checksums,
  // every part landed); at K = 10 (0.63 s) the next snapshot waited 50-70 ms for a free
  // generation (docs/elastic.md, "Choosing K").
  int64_t snapshot_every = 20;
  // Planned rescales "<after step>:<dp>,..." (test.scale_at, in the fenced [test] section;
  // `troupe scale` at run time).
  std::string scale_at;
  // Fault injection for tests and demos (test.inject, in the fenced [test] section):
  // "<kill|stop|slow|cut|hang|cutctl>@<step>:<phase>:<slot>,..." (training/worker/elastic.h,
  // FaultSpec).
  std::string inject;
  // A job of one worker (layout 1x1x1) started without a launcher runs the Trainer and its
  // worker in one process (no child, no socket): the fastest form, but a crash of the
  // worker is a crash of the job, and nothing can replace or add workers. true: the
  // worker is a child process the Trainer supervises, so a lost worker is replaced from
  // the last checkpoint and `troupe scale` can add data-parallel replicas (elastic.max_dp).
  // Fault injection (inject) needs it. Jobs of several workers always isolate them.
  bool isolate_workers = false;
  // How long the job rides out an outage of its scheduler (troupe-scheduler restarting or
  // unreachable): training goes on meanwhile and every process logs that it is waiting;
  // past this limit each process ends with a permanent failure (docs/elastic.md).
  int64_t scheduler_outage_limit_ms = 300000;
};

// [observe]: what the run writes for dashboards besides metrics.jsonl
// (training/driver/run_metrics.h).
struct ObserveOptions {
  bool tensorboard = true;           // event files in <run dir>/tensorboard
  std::string prometheus_listen;     // the driver's /metrics on HOST:PORT ("": not served; port 0: any)
  std::string prometheus_auth_file;  // basic auth (user:password, mode 0600); needed off loopback
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
  ObserveOptions observe;
  std::string source;  // the config file
  // The [bench] and [test] keys the config sets (admitted: TestSections::kAdmit).
  std::vector<std::string> test_keys;

  int64_t global_batch() const { return train.global_batch; }
  int64_t tokens_per_step() const { return global_batch() * train.seq_len; }
};

// Micro-batches per step of each of `dp` data-parallel replicas: t.global_batch /
// (t.micro_batch_size * dp). InvalidArgument naming the three numbers when dp replicas of
// micro-batches of that size cannot make the global batch.
Result<int64_t> micro_batches_per_replica(const TrainOptions& t, int64_t dp);

// Whether a config may set the [bench] and [test] sections (A/B switches for comparison,
// fault injection, planned rescales: train_config.cc, parse_test_sections). kRefuse: a
// config that sets one is an error naming the keys (a production run); kAdmit: benchmarks
// and tests (apps: --allow-test-config), and a checkpoint's own recorded config.
enum class TestSections { kRefuse, kAdmit };

// Parses `path`, applies `overrides` ("key=value", TOML-typed), reads every section and
// rejects unknown keys. Errors name the key and the file.
Result<TrainConfig> load_train_config(const std::string& path, const std::vector<std::string>& overrides,
                                      TestSections test_sections = TestSections::kRefuse);
Result<TrainConfig> parse_train_config(ConfigTable& cfg, TestSections test_sections = TestSections::kRefuse);

}  // namespace troupe::layers
