// apps/train_moe/main.cc — train_moe, the flagship app. One binary, four jobs:
//   train_moe --config apps/configs/tiny.toml [--set key=value ...] [--run-dir D]   train
//   train_moe train --resume <run dir> [--parallel ...]                             resume
//   train_moe prepare --input <files|dirs> --out <dir> --vocab <n>                 data
//   train_moe sample --run <dir> | --checkpoint <dir> --prompt "..."              generate
//   train_moe eval --checkpoint <dir> | --init-from <hf dir> --tokens rows.npy     loss, logits
//   train_moe export --run <dir> --format hf --family mixtral --out <dir>          Hugging Face
//   train_moe plot --run <dir>                                                     PNGs
// main() parses the command line and calls the subcommand (apps/train_moe/commands.h);
// training runs under the framework (training::run_app, training/app/app.cc): the
// Trainer (training/driver/trainer.cc) drives the Stage (training/stage/stage.cc) of every
// rank — in this one process for layout 1x1x1, in worker processes otherwise.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>

#include "apps/train_moe/commands.h"
#include "apps/train_moe/moe_stage.h"
#include "core/exit_status.h"
#include "training/app/preflight.h"
#include "training/run_config.h"

namespace troupe::train_moe {

Status run_plot(const PlotOptions& o) {
  namespace fs = std::filesystem;
  if (o.run.empty()) return invalid_argument("plot: --run is required");
  if (!fs::exists(o.run + "/metrics.jsonl")) return not_found("plot: {}/metrics.jsonl not found", o.run);
  std::string script = o.script;
  if (script.empty()) {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    const fs::path beside = exe.parent_path() / "train_moe_plot.py";
    script = (!ec && fs::exists(beside)) ? beside.string() : std::string(TROUPE_TRAIN_MOE_PLOT_SCRIPT);
  }
  if (!fs::exists(script)) return not_found("plot: script {} not found", script);
  const pid_t pid = fork();
  if (pid < 0) return io_error("plot: fork failed");
  if (pid == 0) {
    execl(o.python.c_str(), o.python.c_str(), script.c_str(), o.run.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return internal_error("plot: {} {} exited with status {} (is python3-matplotlib installed?)", o.python, script,
                          WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  return ok_status();
}

}  // namespace troupe::train_moe

int main(int argc, char** argv) {
  using namespace troupe::train_moe;
  CLI::App app{"train_moe: train a Mixture-of-Experts language model with Troupe"};
  app.require_subcommand(0, 1);

  TrainOptions train;
  // The training options, on the app itself (`train_moe --config ...`) and on the `train`
  // subcommand (`train_moe train --resume ...`), bound to the same variables.
  auto add_train_options = [&train](CLI::App* a) { troupe::training::add_run_options(*a, train); };
  add_train_options(&app);
  CLI::App* trn = app.add_subcommand("train", "train (the default when no subcommand is given)");
  add_train_options(trn);
  for (int i = 0; i < argc; ++i) train.argv.emplace_back(argv[i]);

  PrepareOptions prep;
  CLI::App* prepare = app.add_subcommand("prepare",
                                         "tokenize a corpus (text files, JSON lines) into shards, with a "
                                         "Hugging Face tokenizer or one trained here (as troupe-prepare)");
  troupe::prepare::add_prepare_options(*prepare, prep);

  SampleOptions sample;
  CLI::App* samp = app.add_subcommand("sample", "generate text from a trained run");
  samp->add_option("--run", sample.run, "run directory: its newest valid checkpoint");
  samp->add_option("--checkpoint", sample.checkpoint,
                   "sample from the newest valid checkpoint of a run dir, checkpoints dir or step_<N> dir");
  samp->add_option("--prompt", sample.prompt, "text to continue");
  samp->add_option("--tokens", sample.tokens, "tokens to generate");
  samp->add_option("--temperature", sample.temperature, "0 = greedy");
  samp->add_option("--top-k", sample.top_k, "sample among the k most likely tokens (0 = all)");
  samp->add_option("--seed", sample.seed, "sampling seed");

  EvalOptions eval;
  CLI::App* evl = app.add_subcommand(
      "eval", "loss and logits of token rows (.npy) under a checkpoint or a Hugging Face model");
  evl->add_option("--checkpoint", eval.checkpoint,
                  "run dir, checkpoints dir or step_<N> dir (newest valid checkpoint)");
  evl->add_option("--init-from", eval.init_from, "or a Hugging Face model directory");
  evl->add_option("--tokens", eval.tokens, "token rows: .npy of int32/int64 [rows, positions]")->required();
  evl->add_option("--logits", eval.logits,
                  "write every position's logits here (.npy, f32 [rows, positions, vocab])");

  ExportOptions exp;
  CLI::App* ex =
      app.add_subcommand("export", "write a run's checkpoint (any layout) as a Hugging Face model directory");
  ex->add_option("--run", exp.run, "run directory: its newest valid checkpoint");
  ex->add_option("--checkpoint", exp.checkpoint, "or a checkpoints dir / step_<N> dir");
  ex->add_option("--format", exp.format, "hf (config.json + safetensors + tokenizer)");
  ex->add_option("--family", exp.family, "mixtral or qwen3_moe")->required();
  ex->add_option("--out", exp.out, "output directory")->required();
  ex->add_option("--dtype", exp.dtype, "bf16 (default) or f32");
  ex->add_option("--max-shard-size", exp.max_shard_size, "largest safetensors file (e.g. 5GB, 500MB)");
  ex->add_option("--threads", exp.threads, "stored slices converted at a time (each holds one in memory)");

  PlotOptions plot;
  CLI::App* plt = app.add_subcommand("plot", "draw loss, throughput and expert load PNGs from metrics.jsonl");
  plt->add_option("--run", plot.run, "run directory")->required();
  plt->add_option("--python", plot.python, "python with matplotlib");
  plt->add_option("--script", plot.script, "plot script (default: the installed plot.py)");

  CLI11_PARSE(app, argc, argv);

  troupe::Status st;
  bool training = false;  // prepare, sample and plot exit 1 on any error
  if (*prepare) {
    st = run_prepare(prep);
  } else if (*samp) {
    st = run_sample(sample);
  } else if (*evl) {
    st = run_eval(eval);
  } else if (*ex) {
    st = run_export(exp);
  } else if (*plt) {
    st = run_plot(plot);
  } else {
    if (train.config.empty() && train.resume.empty()) {
      fmt::print(stderr,
                 "train_moe: give --config <file> (or --resume <run dir>) to train, or a subcommand "
                 "(prepare, sample, eval, export, plot)\n{}",
                 app.help());
      return 2;
    }
    if (troupe::Status j = troupe::training::adopt_job_flags(train);
        !j.ok()) {  // troupe run's --backend/--layout
      fmt::print(stderr, "train_moe: error: {}\n", j.to_string());
      return troupe::exit_status_for(j);
    }
    if (auto p = troupe::training::all_overrides(train); !p.ok()) {  // a bad --parallel: usage error
      fmt::print(stderr, "train_moe: error: {}\n", p.status().to_string());
      return 2;
    }
    auto resolved = resolve_train_options(train);
    if (!resolved.ok()) {
      fmt::print(stderr, "train_moe: error: {}\n", resolved.status().to_string());
      return troupe::exit_status_for(resolved.status());
    }
    training = true;
    // The device (CUDA stream, caching allocator, CudaContext) lives here, for the whole run.
    auto dev = RunDevice::create(train.backend);
    if (!dev.ok()) {  // no CUDA build, no visible GPU: exit_status.h says which are permanent
      fmt::print(stderr, "train_moe: error: {}\n", dev.status().to_string());
      return troupe::exit_status_for(dev.status());
    }
    auto tc = troupe::training::load_run_config(*resolved);
    if (!tc.ok()) {
      fmt::print(stderr, "train_moe: error: {}\n", tc.status().to_string());
      return troupe::exit_status_for(tc.status());
    }
    (*dev)->set_attention_fused_dq(tc->train.attention_fused_dq);
    (*dev)->set_pdl(tc->train.pdl);
    // The framework's Trainer and Stage run train_moe's stage program (app.cc): in this
    // process for layout 1x1x1, else in the workers it (or troupe run) starts.
    st = troupe::training::run_app(moe_app(), *resolved, (*dev)->ctx());
  }
  if (!st.ok()) {
    fmt::print(stderr, "train_moe: error: {}\n", st.to_string());
    // A permanent failure (bad config or data, a layout that cannot run, a model larger
    // than the device...) exits 78: troupe-scheduler fails the job instead of restarting it.
    return training ? troupe::exit_status_for(st) : 1;
  }
  return 0;
}
