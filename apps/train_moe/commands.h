// apps/train_moe/commands.h — the subcommands of train_moe, one function each, called by
// main.cc after CLI parsing: run_prepare (corpus -> tokenizer + token shards),
// resolve_train_options (training's command line made whole; training itself is
// training::run_app with moe_app()), run_sample (text from a trained run), run_plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "actors/training/app.h"
#include "actors/training/run_device.h"
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

// The training command line (actors/training/app.h: --config, --set, --parallel,
// --run-dir, --backend, --resume), the same as every Troupe training app's.
using TrainOptions = training::RunOptions;
using training::RunDevice;
// The command line made whole: --parallel folded into the overrides; with --resume and no
// --config, the saved run's config and overrides (then this command's) and its run dir.
Result<TrainOptions> resolve_train_options(const TrainOptions& o);

struct SampleOptions {
  std::string run;         // run directory: its newest valid checkpoint (sample.cc)
  std::string checkpoint;  // run dir, checkpoints dir or step_<N> dir (checkpoints kept elsewhere)
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
