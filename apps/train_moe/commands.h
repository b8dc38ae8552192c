// apps/train_moe/commands.h — the subcommands of train_moe, one function each, called by
// main.cc after CLI parsing: run_prepare (corpus -> tokenizer + token shards),
// resolve_train_options (training's command line made whole; training itself is
// training::run_app with moe_app()), run_sample (text from a trained run), run_eval (loss
// and logits of token rows), run_export (a Hugging Face model directory), run_plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "apps/prepare/prepare.h"
#include "core/status.h"
#include "training/app/app.h"
#include "training/app/run_device.h"

namespace troupe::train_moe {

// `train_moe prepare`: apps/prepare/prepare.h, the troupe-prepare tool's function.
using prepare::PrepareOptions;
inline Status run_prepare(const PrepareOptions& o) {
  return prepare::prepare_corpus(o);
}

// The training command line (training/app/app.h: --config, --set, --parallel,
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

// `train_moe export --format hf`: a checkpoint (any layout) as a Hugging Face model
// directory (export.cc).
struct ExportOptions {
  std::string run;         // run dir: its newest valid checkpoint
  std::string checkpoint;  // or a checkpoints dir / step_<N> dir
  std::string format = "hf";
  std::string family;  // mixtral, qwen3_moe
  std::string out;
  std::string dtype = "bf16";  // bf16 or f32
  std::string max_shard_size = "5GB";
  int threads = 2;  // stored slices converted at a time (each holds one slice in memory)
};
Status run_export(const ExportOptions& o);

// `train_moe eval`: loss and logits of given token rows (eval.cc).
struct EvalOptions {
  std::string checkpoint;  // run dir, checkpoints dir or step_<N> dir
  std::string init_from;   // or a Hugging Face model directory
  std::string tokens;      // .npy, int32/int64 [rows, positions]
  std::string logits;      // .npy to write, f32 [rows, positions, vocab] (optional)
};
Status run_eval(const EvalOptions& o);

struct PlotOptions {
  std::string run;
  std::string python = "/usr/bin/python3";
  std::string script;  // plot.py; default: beside the binary, else in the source tree
};
Status run_plot(const PlotOptions& o);

}  // namespace troupe::train_moe
