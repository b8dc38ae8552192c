// apps/train_moe/commands.h — the subcommands of train_moe, one function each, called by
// main.cc after CLI parsing: run_prepare (corpus -> tokenizer + token shards), run_train
// (the single-process training loop), run_sample (text from a trained run), run_plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace troupe::train_moe {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or directories
  std::string out;                  // output directory
  int64_t vocab = 1024;
  int64_t max_bytes = 8'000'000;     // corpus cap (whole files, in path order)
  double val_fraction = 0.05;
  std::vector<std::string> extensions = {".py", ".txt", ".md", ".rst"};  // for directory walks
  int64_t shard_tokens = 16'000'000;
};
Status run_prepare(const PrepareOptions& o);

struct TrainOptions {
  std::string config;
  std::vector<std::string> overrides;
  std::string run_dir;  // default: runs/<config name>
  std::string backend = "cpu";
  // --resume: a run directory, its checkpoints directory, or one step_<N> checkpoint;
  // the newest valid checkpoint is loaded into the current layout and training goes on.
  std::string resume;
  std::vector<std::string> argv;  // the whole command line (the distributed launcher re-runs it)
};
class RunDevice;  // apps/train_moe/device.h
// o.backend must name dev's backend (main() makes dev from it).
Status run_train(const TrainOptions& o, RunDevice& dev);

// Distributed mode (apps/train_moe/distributed.cc), called by run_train when the layout
// has more than one rank or the process was started by Troupe (TROUPE_ROLE):
// - TROUPE_ROLE=worker: hosts the Stage of rank TROUPE_RANK;
// - TROUPE_ROLE=driver: runs the Trainer (troupe run started the workers);
// - no TROUPE_ROLE: a standalone launcher — checks the layout, starts pp*dp*n local
//   worker processes and runs the Trainer in this process.
// dev: this process's device (--backend); a worker builds its Stage on it (GPU workers:
// NCCL), the driver reports mfu for a CUDA run.
Status run_distributed(const TrainOptions& o, const std::string& run_dir, RunDevice& dev);

// "pp=2,n=2,dispatch=allgather" -> {"parallel.pp=2", "parallel.n=2", "parallel.dispatch=\"allgather\""}:
// the layout parts (read by core's parse_layout_items: key=value or PxDxN) that were given,
// then dispatch and compression.
Result<std::vector<std::string>> parse_parallel_flag(const std::string& spec);

struct SampleOptions {
  std::string run;         // run directory: model.bin, else its checkpoints (sample.cc)
  std::string checkpoint;  // run dir, checkpoints dir or step_<N> dir: always a checkpoint
  std::string prompt;
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 0;
};
Status run_sample(const SampleOptions& o);

struct PlotOptions {
  std::string run;
  std::string python = "/usr/bin/python3";
  std::string script;  // plot.py; default: beside the binary, else in the source tree
};
Status run_plot(const PlotOptions& o);

}  // namespace troupe::train_moe
