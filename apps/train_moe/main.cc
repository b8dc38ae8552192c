// apps/train_moe/main.cc — train_moe, the flagship app. One binary, four jobs:
//   train_moe --config apps/configs/tiny.toml [--set key=value ...] [--run-dir D]   train
//   train_moe train --resume <run dir> [--parallel ...]                             resume
//   train_moe prepare --input <files|dirs> --out <dir> --vocab <n>                 data
//   train_moe sample --run <dir> | --checkpoint <dir> --prompt "..."              generate
//   train_moe plot --run <dir>                                                     PNGs
// main() parses the command line and calls the subcommand (apps/train_moe/commands.h);
// training runs in train.cc (one process) or under the framework (training::run_app,
// actors/training/app.cc -> the Trainer's step loop in actors/training/trainer.cc).
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>

#include "actors/training/preflight.h"
#include "apps/train_moe/commands.h"
#include "apps/train_moe/moe_stage.h"
#include "core/exit_status.h"
#include "layers/train_config.h"

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
  CLI::App* prepare = app.add_subcommand("prepare", "tokenize a text corpus into shards and train the tokenizer");
  prepare->add_option("--input", prep.inputs, "files or directories (repeatable)")->required();
  prepare->add_option("--out", prep.out, "output directory")->required();
  prepare->add_option("--vocab", prep.vocab, "vocabulary size (bytes + end-of-text + merges)");
  prepare->add_option("--max-bytes", prep.max_bytes, "stop reading files after this many bytes");
  prepare->add_option("--val-fraction", prep.val_fraction, "fraction of documents for validation");
  prepare->add_option("--ext", prep.extensions, "file extensions taken from directories (e.g. .py .txt)");
  prepare->add_option("--shard-tokens", prep.shard_tokens, "tokens per shard file");

  SampleOptions sample;
  CLI::App* samp = app.add_subcommand("sample", "generate text from a trained run");
  samp->add_option("--run", sample.run, "run directory: its model.bin, else its newest valid checkpoint");
  samp->add_option("--checkpoint", sample.checkpoint,
                   "sample from the newest valid checkpoint of a run dir, checkpoints dir or step_<N> dir "
                   "(even when model.bin exists)");
  samp->add_option("--prompt", sample.prompt, "text to continue");
  samp->add_option("--tokens", sample.tokens, "tokens to generate");
  samp->add_option("--temperature", sample.temperature, "0 = greedy");
  samp->add_option("--top-k", sample.top_k, "sample among the k most likely tokens (0 = all)");
  samp->add_option("--seed", sample.seed, "sampling seed");

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
  } else if (*plt) {
    st = run_plot(plot);
  } else {
    if (train.config.empty() && train.resume.empty()) {
      fmt::print(stderr, "train_moe: give --config <file> (or --resume <run dir>) to train, or a subcommand "
                         "(prepare, sample, plot)\n{}",
                 app.help());
      return 2;
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
    if (!dev.ok()) {
      fmt::print(stderr, "train_moe: error: {}\n", dev.status().to_string());
      return 1;
    }
    auto tc = troupe::layers::load_train_config(resolved->config, resolved->overrides);
    if (!tc.ok()) {
      fmt::print(stderr, "train_moe: error: {}\n", tc.status().to_string());
      return troupe::exit_status_for(tc.status());
    }
    (*dev)->set_attention_fused_dq(tc->train.attention_fused_dq);
    if (tc->parallel.world() == 1 && std::getenv("TROUPE_ROLE") == nullptr) {
      troupe::training::apply_file_mask(*tc);
      st = troupe::training::preflight_check(*tc, (*dev)->ctx());
      if (st.ok()) st = run_train(*resolved, **dev);  // one process: the loop in train.cc
    } else {
      // Several ranks, or started by Troupe: the framework's Trainer and workers run
      // train_moe's stage program (app.cc -> trainer.cc).
      st = troupe::training::run_app(moe_app(), *resolved, (*dev)->ctx());
    }
  }
  if (!st.ok()) {
    fmt::print(stderr, "train_moe: error: {}\n", st.to_string());
    // A permanent failure (bad config or data, a layout that cannot run, a model larger
    // than the device...) exits 78: troupe-scheduler fails the job instead of restarting it.
    return training ? troupe::exit_status_for(st) : 1;
  }
  return 0;
}
