// training/app/app.h — defines App (what a training app hands the framework: its name
// and its stage program) and run_app, which trains it as whatever this process was
// started as. An app's main() parses its command line (add_run_options gives every
// training app the same flags), makes its device and calls run_app; it writes no
// launcher, fork, rendezvous, step loop or recovery code (docs/writing-an-app.md).
//
// The role comes from the launcher:
// - TROUPE_ROLE=worker (troupe run / submit, or the standalone launcher below): a worker
//   hosting the actors of its slot and the Stage running the app's program
//   (run_worker_process, trainer.h);
// - TROUPE_ROLE=driver (troupe run / submit): the Trainer, over the workers the scheduler
//   started (run_trainer);
// - no role: the standalone launcher — the Trainer in this process and, for layout 1x1x1,
//   its worker too (a thread of this process: no child, no socket; it cannot survive its
//   worker, elastic.isolate_workers = true makes the worker a child that can be replaced);
//   otherwise pp*dp*n local worker processes forked from the same command line,
//   rendezvous in <run dir>/rendezvous.
// Every job of worker processes survives a lost worker ([elastic] in the config tunes
// how; docs/elastic.md).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "layers/context.h"
#include "training/run_config.h"
#include "training/stage/stage_program.h"

namespace CLI {
class App;
}

namespace troupe::training {

struct App {
  std::string name;        // "train_moe", "dense_lm": log prefixes and the default run dir
  ProgramFactory program;  // the model part of each pipeline stage
  // Optional: refuses a config the program cannot train (naming the key), before any
  // worker starts.
  std::function<Status(const layers::TrainConfig&)> check;
  // Whether the program honours train.recompute = "blocks" (the transformer program base
  // does); other apps refuse it.
  bool recomputes_blocks = false;
};

// The command line of a training run, the same for every app (add_run_options).
struct RunOptions {
  std::string config;                  // TOML config ([model], [train], [optim], [data], [parallel], ...)
  std::vector<std::string> overrides;  // "key=value", applied in order (--set, then --parallel's)
  std::string run_dir;                 // default: runs/<config name> (resolve_run_dir)
  std::string backend = "cpu";         // "cpu" or "cuda" (each worker: one GPU)
  bool backend_given = false;          // --backend was on the command line
  std::string parallel;                // --parallel pp=2,dp=2,... (turned into overrides)
  // A run directory, its checkpoints directory or one step_<N> checkpoint: the newest
  // valid checkpoint is loaded into the current layout and training goes on.
  std::string resume;
  // A Hugging Face model directory to start from (its config.json's model, its weights):
  // becomes the [model] overrides and train.init_from (all_overrides).
  std::string init_from;
  std::vector<std::string> argv;  // the whole command line (the standalone launcher re-runs it)
  // --gradcheck: check the program's gradients by finite differences instead of training
  // (gradcheck.h; on the CPU, layout 1x1x1).
  bool gradcheck = false;
  // --allow-test-config: the config may set the [bench] and [test] sections (switches for
  // comparison, fault injection; layers::TestSections). Off, a config that sets one is
  // refused, so a benchmark's config copied into production fails at start.
  bool allow_test_config = false;
};

// Adds --config, --set, --parallel, --run-dir, --backend, --resume, --init-from, --gradcheck and
// --allow-test-config to
// `cli`, bound to `o`.
void add_run_options(CLI::App& cli, RunOptions& o);

// "pp=2,n=2,dispatch=allgather" -> {"parallel.pp=2", "parallel.n=2", "parallel.dispatch=\"allgather\""}:
// the layout parts given (core's parse_layout_items: key=value or PxDxN), then dispatch
// and compression.
Result<std::vector<std::string>> parallel_overrides(const std::string& spec);

// o.overrides (--set), then o.parallel's (--parallel), then o.init_from's (every
// architecture key of its config.json as model.*, and train.init_from, its absolute path;
// a --set of one of those keys to another value is an error): the overrides a run applies
// and records.
Result<std::vector<std::string>> all_overrides(const RunOptions& o);

// Under troupe run/submit, the job's --backend and --layout (core/job_env.h: kBackend,
// kLayout) and the app's own --backend and --parallel are one choice: an app flag not given
// takes the job's; a --backend that differs is an error naming both (run_app refuses a
// config layout that differs from the job's). Call after parsing the command line, before
// the device is made.
Status adopt_job_flags(RunOptions& o);

// Loads the config (o.config with all_overrides(o)) — the result of add_run_options after
// parsing.
Result<layers::TrainConfig> load_run_config(const RunOptions& o);

// The run directory of a new run: --run-dir, else runs/<config file stem>, which is
// refused (naming --run-dir and --resume) when it holds an earlier run's metrics.jsonl that
// this run would overwrite — unless the run resumes from that directory, or it is a driver
// the scheduler restarted (TROUPE_DRIVER_RESTARTS > 0: the same job). Workers take the
// default as it is (they write no metrics).
Result<std::string> resolve_run_dir(const RunOptions& o);

// A new (or resumed) run directory: the tokenizer of tc.data.dir must fit
// model.vocab_size; creates `run_dir` and copies the tokenizer and the config (`config`)
// into it, with `overrides` in overrides.txt.
Status prepare_run_dir(const layers::TrainConfig& tc, const std::string& config,
                       const std::vector<std::string>& overrides, const std::string& run_dir);

// Sets this process's file-mode mask from train.umask (run directories, logs and
// checkpoints owner-only by default). run_app calls it first.
void apply_file_mask(const layers::TrainConfig& tc);

// Trains `app` as this process's role (above). `ctx`: this process's device (a worker
// builds its Stage on it; GPU workers use NCCL). o.resume needs o.config here (train_moe
// finds the config of a checkpoint itself).
Status run_app(const App& app, const RunOptions& o, const layers::Ctx& ctx);

}  // namespace troupe::training
