// apps/train_moe/commands.h — the subcommands of train_moe, one function each, called by
// main.cc after CLI parsing: run_prepare (corpus -> tokenizer + token shards), run_train
// (training: one process here, several through the framework), run_sample (text from a
// trained run), run_plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "actors/training/app.h"
#include "actors/training/run_device.h"
#include "apps/prepare/prepare.h"
#include "core/status.h"

namespace troupe::train_moe {

// `train_moe prepare`: apps/prepare/prepare.h, the troupe-prepare tool's function.
using prepare::PrepareOptions;
inline Status run_prepare(const PrepareOptions& o) {
  return prepare::prepare_corpus(o);
}

// The training command line (actors/training/app.h: --config, --set, --parallel,
// --run-dir, --backend, --resume), the same as every Troupe training app's.
using TrainOptions = training::RunOptions;
using training::RunDevice;
// The command line made whole: --parallel folded into the overrides; with --resume and no
// --config, the saved run's config and overrides (then this command's) and its run dir.
Result<TrainOptions> resolve_train_options(const TrainOptions& o);
// One process, layout 1x1x1 (not started by Troupe): the single-process loop. (Any
// other layout, or a process Troupe started, runs under the framework: main() calls
// training::run_app with moe_app(), apps/train_moe/moe_stage.h.) `o` resolved;
// o.backend must name dev's backend (main() makes dev from it).
Status run_train(const TrainOptions& o, RunDevice& dev);

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
