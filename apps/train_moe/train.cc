// apps/train_moe/train.cc — `train_moe --config ...`: the single-process training run,
// read top to bottom: config -> data and tokenizer -> model and optimizer -> steps
// (micro-batches, clip, AdamW, router-bias update, metrics, validation) -> weights.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>

#include "actors/training/checkpointing.h"
#include "actors/training/run_metrics.h"
#include "actors/training/trainer.h"
#include "apps/train_moe/commands.h"
#include "apps/train_moe/model_state.h"
#include "apps/train_moe/moe_stage.h"
#include "apps/train_moe/weights_io.h"
#include "layers/model.h"
#include "layers/optimizer.h"
#include "layers/token_data.h"
#include "layers/tokenizer.h"
#include "layers/train_config.h"

namespace troupe::train_moe {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double evaluate(const layers::Ctx& c, layers::Model& model, const layers::DataLoader& val, const layers::TrainConfig& tc) {
  double sum = 0;
  int64_t tokens = 0;
  for (int64_t k = 0; k < tc.train.eval_batches; ++k) {
    Tensor ids, targets;
    val.eval_batch(k, tc.train.eval_batches, tc.train.micro_batch_size, ids, targets);
    int64_t n = 0;
    sum += model.eval_loss_sum(c, ids, targets, n);
    tokens += n;
  }
  return sum / static_cast<double>(std::max<int64_t>(1, tokens));
}

// --resume without --config: the saved run's config (its text is in every manifest) and
// overrides, then this command line's overrides (so --set and --parallel still apply);
// the run directory defaults to the one the checkpoints belong to.
Result<TrainOptions> with_checkpoint_config(const TrainOptions& o) {
  std::error_code ec;
  const fs::path p = fs::path(o.resume).lexically_normal();
  fs::path run_dir, ckdir;
  if (fs::is_directory(p / "checkpoints", ec)) {
    run_dir = p;
    ckdir = p / "checkpoints";
  } else if (fs::exists(p / checkpoint::kManifestFile, ec) || checkpoint::parse_step_dir_name(p.filename().string())) {
    ckdir = p.parent_path();
  } else {
    ckdir = p;
  }
  if (run_dir.empty() && ckdir.filename() == "checkpoints") run_dir = ckdir.parent_path();
  TrainOptions r = o;
  if (r.run_dir.empty()) {
    if (run_dir.empty()) return invalid_argument("--resume {} without --config: give --run-dir", o.resume);
    r.run_dir = run_dir.string();
  }
  // Any manifest of the run holds its config; the newest readable one is taken.
  std::vector<std::string> dirs;
  if (fs::exists(p / checkpoint::kManifestFile, ec)) dirs.push_back(p.string());
  for (const auto& [step, d] : checkpoint::list_checkpoints(ckdir.string())) dirs.push_back(d);
  for (const std::string& d : dirs) {
    Result<std::unique_ptr<checkpoint::CheckpointReader>> m =
        checkpoint::CheckpointReader::open(d, checkpoint::VerifyMode::kManifestOnly);
    if (!m.ok() || (*m)->manifest().config_text.empty()) continue;
    fs::create_directories(r.run_dir, ec);
    const std::string path = r.run_dir + "/config.resume.toml";
    // Every process of a distributed run writes the same text: tmp + rename keeps it whole.
    const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << (*m)->manifest().config_text;
      if (!out) return io_error("cannot write {}", tmp);
    }
    fs::rename(tmp, path, ec);
    if (ec) return io_error("cannot rename {} to {}: {}", tmp, path, ec.message());
    r.config = path;
    r.overrides.clear();
    for (const auto& v : (*m)->manifest().metadata.value("overrides", nlohmann::json::array())) {
      r.overrides.push_back(v.get<std::string>());
    }
    r.overrides.insert(r.overrides.end(), o.overrides.begin(), o.overrides.end());
    fmt::print("train_moe: config from checkpoint {} ({} overrides, then this command's {})\n", d,
               r.overrides.size() - o.overrides.size(), o.overrides.size());
    return r;
  }
  return not_found("--resume {} without --config: no checkpoint manifest with a config found in {}", o.resume,
                   ckdir.string());
}

}  // namespace

// Dense bf16 peak of one H100/H200 SXM (TFLOP/s), the MFU denominator of issue 10.
constexpr double kPeakFlopsPerGpu = 989e12;

Result<TrainOptions> resolve_train_options(const TrainOptions& opts) {
  // --parallel becomes overrides after --set's (recorded with the run and its checkpoints).
  TrainOptions folded = opts;
  TROUPE_ASSIGN_OR_RETURN(folded.overrides, training::all_overrides(opts));
  folded.parallel.clear();
  if (folded.config.empty() && !folded.resume.empty()) return with_checkpoint_config(folded);
  if (folded.config.empty()) return invalid_argument("train: --config is required");
  return folded;
}

Status run_train(const TrainOptions& o, RunDevice& dev) {
  // ---- configuration ------------------------------------------------------------------
  TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, layers::load_train_config(o.config, o.overrides));
  if (tc.data.dir.empty()) return invalid_argument("{}: data.dir is not set (the output of train_moe prepare)", tc.source);
  if (tc.parallel.world() != 1) {
    return invalid_argument(
        "{}: the single-process loop runs layout 1x1x1, not pp={} dp={} n={} (run_app does)", tc.source,
        tc.parallel.pp, tc.parallel.dp, tc.parallel.n);
  }

  // ---- data and tokenizer -------------------------------------------------------------
  std::string run_dir = o.run_dir;
  if (run_dir.empty()) run_dir = "runs/" + fs::path(o.config).stem().string();
  TROUPE_RETURN_IF_ERROR(training::prepare_run_dir(tc, o.config, o.overrides, run_dir));
  TROUPE_ASSIGN_OR_RETURN(layers::Tokenizer tok, layers::Tokenizer::load(tc.data.dir + "/tokenizer.json"));
  TROUPE_ASSIGN_OR_RETURN(layers::TokenShards train_data, layers::TokenShards::open(tc.data.dir, "train"));
  TROUPE_ASSIGN_OR_RETURN(layers::TokenShards val_data, layers::TokenShards::open(tc.data.dir, "val"));
  for (const auto* d : {&train_data, &val_data}) {
    if (d->size() <= tc.train.seq_len + 1) {
      return failed_precondition("{}: a split holds {} tokens, fewer than one sequence of {}", tc.data.dir,
                                 d->size(), tc.train.seq_len + 1);
    }
  }
  const layers::DataLoader loader(train_data, tc.train.seed, tc.train.seq_len);
  const layers::DataLoader val_loader(val_data, tc.train.seed, tc.train.seq_len);

  // --resume: the newest checkpoint that verifies (checksums), loaded below.
  std::unique_ptr<checkpoint::CheckpointReader> resume;
  if (!o.resume.empty()) {
    TROUPE_ASSIGN_OR_RETURN(resume, training::open_resume_checkpoint(o.resume));
    TROUPE_RETURN_IF_ERROR(training::check_resume_compatible(resume->manifest(), tc));
    TROUPE_RETURN_IF_ERROR(training::trim_metrics(run_dir + "/metrics.jsonl", resume->step()));
  }
  std::ofstream metrics(run_dir + "/metrics.jsonl", resume ? std::ios::app : std::ios::trunc);
  if (!metrics) return io_error("cannot write {}/metrics.jsonl", run_dir);
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<training::RunMetrics> run_metrics,
                          training::RunMetrics::open(tc.observe, run_dir));

  // ---- model and optimizer ------------------------------------------------------------
  const layers::Ctx& c = dev.ctx();
  // Built and initialised on the host (deterministic, identical on every backend), then
  // moved: f32 master weights and gradients, bf16 working copies on a GPU.
  layers::Model model(tc.model, tc.train.seed);
  // train.expert_grads = "bf16": the experts' gradients in bf16 on a GPU (Model::to_device).
  const bool bf16_expert_grads = dev.is_cuda() && tc.train.expert_grads == DType::kBF16;
  if (!dev.is_cuda() && tc.train.expert_grads != DType::kF32) {
    fmt::print("train_moe: train.expert_grads = \"{}\" applies on GPUs; this CPU run keeps f32 gradients\n",
               dtype_name(tc.train.expert_grads));
  }
  model.to_device(c, bf16_expert_grads ? DType::kBF16 : DType::kF32);
  if (bf16_expert_grads) {
    fmt::print("train_moe: the experts' weight gradients are bf16 ({:.2f} GiB; train.expert_grads)\n",
               static_cast<double>(model.low_precision_grads().nbytes()) / 1073741824.0);
  }
  // On a GPU the step's statistics stay on the device until its one read (issue 20).
  // train.device_stats = false keeps the host statistics (per-layer read-backs), for comparison.
  const bool device_stats = dev.is_cuda() && tc.train.device_stats && model.enable_device_stats(c);
  // The experts' dW products also leave their sums of squares for that norm, which then
  // reads only the other ~9% of the gradient (issue 20). Exact here: this loop all-reduces
  // no gradient (layout 1x1x1). Only with one micro-batch per step: later ones add to the
  // dW, and the norm would read those gradients anyway (Parameter::grad_sum_squares_valid).
  if (device_stats && tc.train.fold_grad_norm && tc.train.grad_accum == 1) {
    const int64_t folded = model.enable_grad_norm_fold(c);
    fmt::print("train_moe: gradient norm folded into the dW products of {} parameters\n", folded);
  }
  // train.master_weights = "split": the matrices' f32 masters as their bf16 working copies
  // and a 16-bit low half each (Model::split_masters), read and written by AdamW's pass.
  if (tc.train.split_master && !dev.is_cuda()) {
    fmt::print(
        "train_moe: train.master_weights = \"split\" applies on GPUs; this CPU run keeps f32 masters\n");
  } else if (tc.train.split_master) {
    const int64_t split = model.split_masters(c);
    fmt::print(
        "train_moe: {} master weights split into their bf16 working copies and 16-bit low halves "
        "(train.master_weights)\n",
        split);
  }
  layers::AdamW opt(model.parameters(), tc.optim, c);
  opt.write_working_copies(true);  // the bf16 working copies come out of the optimizer's pass
  // A CUDA graph of the step (train.cuda_graph): the first step runs launch by launch (it
  // makes the lazily built plans and the allocator's blocks), the second is captured and
  // replayed, every later one replayed. Needs the device statistics (nothing in the step
  // may wait on the host); AdamW reads its learning rate from the device.
  const bool use_graph = device_stats && tc.train.cuda_graph;
  if (use_graph) opt.use_device_schedule(c);
  std::vector<Tensor> graph_ids, graph_targets;  // the graph's inputs, at fixed addresses
  std::vector<int64_t> graph_tokens, graph_selections;
  size_t graph_peak = 0;
  bool graph_mismatch_told = false;
  int64_t first_step = 1, tokens_seen = 0;
  if (resume) {
    TROUPE_RETURN_IF_ERROR(load_model_state(c, *resume, model, opt));
    first_step = resume->step() + 1;
    tokens_seen = resume->manifest().data_position.value("tokens_seen", int64_t{0});
    fmt::print("train_moe: resumed from {} (step {}, saved with layout {})\n", resume->path(), resume->step(),
               resume->layout().to_string());
  }
  // Periodic checkpoints: this process is rank 0 of layout 1x1x1 and its own committer.
  std::unique_ptr<training::RankCheckpointer> ckpt;
  std::unique_ptr<training::CheckpointCommitter> committer;
  if (tc.checkpoint.every > 0) {
    training::CommitterOptions co;
    co.dir = training::checkpoint_dir_for(tc, run_dir);
    co.keep = static_cast<int>(tc.checkpoint.keep);
    TROUPE_ASSIGN_OR_RETURN(co.info, training::run_checkpoint_info(o.config, o.overrides, tc, run_dir + "/tokenizer.json"));
    TROUPE_RETURN_IF_ERROR(training::prepare_checkpoint_dir(co.dir, first_step - 1));
    TROUPE_ASSIGN_OR_RETURN(
        ckpt, training::RankCheckpointer::create(co.dir, ParallelLayout{}, 0,
                                                 static_cast<uint64_t>(tc.checkpoint.max_mb_per_s * 1e6)));
    committer = std::make_unique<training::CheckpointCommitter>(std::move(co));
  }
  // Model FLOPs per token (issue 10): 6 * active parameters + 6 * L * s * d (causal attention).
  const double flops_per_token = 6.0 * static_cast<double>(tc.model.num_active_params()) +
                                 6.0 * static_cast<double>(tc.model.n_layers * tc.train.seq_len * tc.model.d_model);
  const size_t state_bytes = dev.bytes_in_use();
  fmt::print("train_moe: {} parameters ({} active per token), {} blocks ({} MoE), {} tokens/step, {} steps, "
             "run dir {}\n",
             tc.model.num_params(), tc.model.num_active_params(), tc.model.n_layers, model.num_moe_blocks(),
             tc.tokens_per_step(), tc.train.steps, run_dir);
  fmt::print("device: {}, {:.3f} GFLOP per token{}\n", dev.name(), flops_per_token / 1e9,
             dev.is_cuda() ? fmt::format(", {:.2f} GiB of weights, gradients and optimizer state on the device",
                                         static_cast<double>(state_bytes) / 1073741824.0)
                           : "");
  fmt::print("data: {} train tokens, {} val tokens, vocab {} (ln vocab = {:.3f})\n", train_data.size(),
             val_data.size(), tok.vocab_size(), std::log(static_cast<double>(tc.model.vocab_size)));

  const double val0 = evaluate(c, model, val_loader, tc);
  fmt::print("{}step {} | val_loss {:.4f}\n", resume ? "resumed | " : "", first_step - 1, val0);
  nlohmann::json rec0{{"step", first_step - 1}, {"val_loss", val0}, {"tokens", tokens_seen}};
  if (resume) rec0["resumed"] = true;
  metrics << rec0.dump() << "\n";
  metrics.flush();

  // ---- steps --------------------------------------------------------------------------
  const auto t_start = Clock::now();
  const int64_t tokens_before = tokens_seen;  // of the saved run, when resumed
  int64_t steps_done = first_step - 1;
  double last_val = val0;
  const float loss_weight = 1.0f / static_cast<float>(tc.train.grad_accum);
  // A step's host batch (its micro-batches and their target counts). On a GPU the next
  // step's is read while this step runs on the device (`ahead`): the loader is a function
  // of the step, so this changes only when the host does it.
  struct HostBatch {
    int64_t step = -1;
    std::vector<Tensor> ids, targets;
    std::vector<int64_t> tokens;
  };
  const auto read_batch = [&](int64_t s) {
    HostBatch b;
    b.step = s;
    b.ids.resize(static_cast<size_t>(tc.train.grad_accum));
    b.targets.resize(b.ids.size());
    b.tokens.resize(b.ids.size());
    for (size_t m = 0; m < b.ids.size(); ++m) {
      loader.train_batch(s, /*dp_rank=*/0, static_cast<int64_t>(m), tc.train.grad_accum,
                         tc.train.micro_batch_size, b.ids[m], b.targets[m]);
      b.tokens[m] = layers::Model::target_tokens(c, b.targets[m]);  // host batches: no device read
    }
    return b;
  };
  HostBatch ahead;
  // Steps launched ahead (train.launch_ahead): a replayed step's successor is enqueued
  // before its statistics are read (they are copied out and the buffer cleared first), so
  // the device goes on while the host reads, logs and prepares. Not across an evaluation,
  // a checkpoint, a time limit or a host-side update between steps (the router's bias).
  const bool launch_ahead =
      use_graph && tc.train.launch_ahead && tc.train.time_limit_s <= 0 && !model.updates_between_steps();
  // Uploads a replayed step's batch and learning rate and launches the graph.
  const auto replay = [&](int64_t s, const HostBatch& b, int slot) {
    for (size_t m = 0; m < b.ids.size(); ++m) {
      c.copy_to_device(b.ids[m], graph_ids[m]);
      c.copy_to_device(b.targets[m], graph_targets[m]);
    }
    opt.prepare_step(c, tc.lr.at(s));
    dev.mark_begin(slot);
    dev.launch_graph();
  };
  bool launched = false;  // this step was enqueued by the previous one (launch_ahead)
  bool ahead_told = false;
  auto ready_at = Clock::now();  // when the previous step's statistics were read
  for (int64_t step = first_step; step <= tc.train.steps; ++step) {
    // A step launched ahead began when its predecessor's results were in: the time between
    // two such reads is what each step costs.
    const auto t0 = launched ? ready_at : Clock::now();
    const int slot = static_cast<int>(step % 2);  // its device-time events
    dev.reset_peak();
    dev.range_push("step");
    const size_t step_base_bytes = dev.bytes_in_use();
    const int64_t syncs_before = dev.host_syncs(), uploads_before = dev.upload_waits();
    double lm_sum = 0, aux = 0, host_s = 0;
    // Right before the step's first launch: the host's time so far, and the device's mark.
    const auto begin_device_work = [&] {
      host_s = std::chrono::duration<double>(Clock::now() - t0).count();
      dev.mark_begin(slot);
    };
    int64_t step_tokens = 0;
    const double lr = tc.lr.at(step);
    HostBatch batch = ahead.step == step ? std::move(ahead) : read_batch(step);
    ahead = HostBatch{};
    std::vector<Tensor>& ids = batch.ids;
    std::vector<Tensor>& targets = batch.targets;
    const std::vector<int64_t>& tokens = batch.tokens;
    for (int64_t n : tokens) step_tokens += n;
    // Replayed while the batch's target counts are the captured step's (its loss scale).
    const bool graph_step =
        launched || (use_graph && step > first_step && (graph_tokens.empty() || tokens == graph_tokens));
    if (use_graph && !graph_step && !graph_tokens.empty() && !graph_mismatch_told) {
      fmt::print(
          "train_moe: step {} has another count of targets than the captured step ({} against {}): it "
          "runs without the CUDA graph (so does any such step)\n",
          step, step_tokens, std::accumulate(graph_tokens.begin(), graph_tokens.end(), int64_t{0}));
      graph_mismatch_told = true;
    }
    if (launched) {
      // (enqueued by the previous step)
    } else if (graph_step && !dev.has_graph()) {
      for (size_t m = 0; m < ids.size(); ++m) {  // allocated before the capture: the caller's
        graph_ids.push_back(c.to_device(ids[m]));
        graph_targets.push_back(c.to_device(targets[m]));
      }
      graph_tokens = tokens;
      opt.prepare_step(c, lr);
      const std::vector<int64_t> selections_before = model.pending_selections();
      TROUPE_RETURN_IF_ERROR(dev.begin_capture());
      model.zero_grad(c);
      for (size_t m = 0; m < ids.size(); ++m)
        model.forward_backward(c, graph_ids[m], graph_targets[m], loss_weight, tokens[m]);
      opt.enqueue_update(c, model.grad_norm_squared_on_device(c));
      TROUPE_RETURN_IF_ERROR(dev.end_capture());
      graph_peak = dev.peak_bytes();
      graph_selections = model.pending_selections();
      for (size_t i = 0; i < graph_selections.size(); ++i) graph_selections[i] -= selections_before[i];
      begin_device_work();
      dev.launch_graph();
      fmt::print(
          "train_moe: step {} captured as a CUDA graph ({:.2f} GiB of activations and temporaries held "
          "by it); later steps replay it\n",
          step, static_cast<double>(dev.graph_pool_bytes()) / 1073741824.0);
    } else if (graph_step) {
      model.add_pending_selections(graph_selections);
      host_s = std::chrono::duration<double>(Clock::now() - t0).count();
      replay(step, batch, slot);
    } else {
      begin_device_work();
      model.zero_grad(c);
      for (size_t m = 0; m < ids.size(); ++m) {
        layers::Model::MicroBatchStats st =
            model.forward_backward(c, ids[m], targets[m], loss_weight, tokens[m]);
        // Each micro-batch has the same token count, so the mean of means is the mean.
        lm_sum += st.lm_loss_sum / static_cast<double>(std::max<int64_t>(1, st.tokens)) * loss_weight;
        aux += st.aux_loss * loss_weight;
      }
    }
    // The global norm: one reduction over the flat gradient buffer on a device (left there
    // in device-stats mode, where AdamW clips by it on the device).
    double grad_norm = 0;
    if (graph_step) {
      // (the update is in the graph)
    } else if (device_stats) {
      opt.step(c, lr, model.grad_norm_squared_on_device(c));
    } else {
      grad_norm =
          std::sqrt(model.flat_grads().defined() ? model.grad_norm_squared(c) : opt.grad_norm_squared(c));
      opt.step(c, lr, grad_norm);
    }
    dev.mark_end(slot);
    // Host waits while the step's work was enqueued (before its metrics read below).
    const int64_t step_syncs = dev.host_syncs() - syncs_before,
                  step_uploads = dev.upload_waits() - uploads_before;
    if (dev.is_cuda() && step < tc.train.steps) ahead = read_batch(step + 1);  // while the device works
    // The next step enqueued now, behind this one, where nothing between them needs the host.
    const bool eval_due =
        (tc.train.eval_every > 0 && step % tc.train.eval_every == 0) || step == tc.train.steps;
    const bool ckpt_due = ckpt && training::checkpoint_due(tc.checkpoint.every, step, step == tc.train.steps);
    const bool launch_next = launch_ahead && graph_step && dev.has_graph() && step < tc.train.steps &&
                             !eval_due && !ckpt_due && ahead.step == step + 1 && ahead.tokens == graph_tokens;
    if (launch_next) {
      dev.read_async(model.device_stats_buffer());  // this step's statistics, then a clear buffer
      model.clear_device_stats(c);
      replay(step + 1, ahead, 1 - slot);
      if (!ahead_told) {
        fmt::print("train_moe: step {} enqueued before step {}'s statistics were read (train.launch_ahead)\n",
                   step + 1, step);
        ahead_told = true;
      }
    }
    const std::vector<std::vector<int64_t>> load =
        launch_next ? model.end_step_with(c, dev.read_wait()) : model.end_step(c);
    if (launch_next) model.add_pending_selections(graph_selections);  // the next step's, after this one's
    if (device_stats) {
      const layers::Model::StepStats& ss = model.last_step_stats();
      lm_sum = ss.lm_loss_sum / static_cast<double>(std::max<int64_t>(1, step_tokens));
      aux = ss.aux_loss * loss_weight;
      grad_norm = std::sqrt(ss.grad_norm_squared);
    }
    dev.range_pop();
    // The step's time includes its optimizer update (with the next step enqueued, the read
    // above waited for this step's end alone).
    if (!launch_next) dev.synchronize();
    ready_at = Clock::now();
    launched = launch_next;
    const double step_s = std::chrono::duration<double>(ready_at - t0).count();
    const double device_ms = dev.device_ms(slot);
    // A replay allocates nothing: its peak is the captured step's.
    const size_t peak_bytes = graph_step ? std::max(graph_peak, dev.peak_bytes()) : dev.peak_bytes();
    tokens_seen += step_tokens;
    const double tps = static_cast<double>(step_tokens) / step_s;
    const double loss = lm_sum + aux;
    // Load imbalance: the busiest expert's share over the mean share, worst MoE layer.
    double imbalance = 0;
    for (const auto& layer : load) {
      int64_t total = 0, mx = 0;
      for (int64_t v : layer) total += v, mx = std::max(mx, v);
      if (total > 0) imbalance = std::max(imbalance, static_cast<double>(mx) * static_cast<double>(layer.size()) / static_cast<double>(total));
    }
    if (!std::isfinite(loss)) return aborted("step {}: the loss is {} (diverged)", step, loss);

    nlohmann::json rec{{"step", step},       {"loss", loss},          {"lm_loss", lm_sum},
                       {"aux_loss", aux},    {"lr", lr},              {"grad_norm", grad_norm},
                       {"tokens", tokens_seen}, {"tokens_per_s", tps}, {"step_ms", step_s * 1e3},
                       {"expert_load", load}, {"load_imbalance", imbalance}};
    if (dev.is_cuda()) {
      // Device->host read-backs while the step was enqueued (the metrics read after it is one
      // more), and uploads that waited (the batch, at the step's start).
      rec["host_syncs"] = step_syncs;
      rec["upload_waits"] = step_uploads;
      rec["peak_gib"] = static_cast<double>(peak_bytes) / 1073741824.0;
      // The step's device time (its first to its last enqueued op), and the host's time
      // before its first op was enqueued (the batch, the uploads; the capture at step 2).
      rec["device_ms"] = device_ms;
      rec["host_before_ms"] = host_s * 1e3;
      rec["mfu"] = tps * flops_per_token / (kPeakFlopsPerGpu * dev.num_gpus());
      rec["peak_bytes"] = peak_bytes;  // caching allocator high-water mark in this step
      rec["activation_bytes"] = peak_bytes - std::min(peak_bytes, step_base_bytes);
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
    const bool out_of_time = tc.train.time_limit_s > 0 && elapsed > tc.train.time_limit_s && step < tc.train.steps;
    const bool eval_now =
        (tc.train.eval_every > 0 && step % tc.train.eval_every == 0) || step == tc.train.steps || out_of_time;
    if (eval_now) {
      last_val = evaluate(c, model, val_loader, tc);
      rec["val_loss"] = last_val;
    }
    if (ckpt && training::checkpoint_due(tc.checkpoint.every, step, step == tc.train.steps || out_of_time)) {
      // Blocked: the snapshot into the writer's host buffer; the write goes on behind.
      const auto s0 = Clock::now();
      Result<training::SaveFigures> f = ckpt->save(model_state(c, model, opt, tc));
      rec["ckpt_blocked_ms"] = std::chrono::duration<double>(Clock::now() - s0).count() * 1e3;
      if (f.ok()) {
        rec["ckpt_bytes_rank0"] = f->bytes;
        committer->commit(step, training::data_position_json(tc, step, tokens_seen), nlohmann::json{{"adam_steps", step}});
      } else {
        fmt::print(stderr, "checkpoint: step {} could not be saved: {}\n", step, f.status().to_string());
      }
    }
    metrics << rec.dump() << "\n";
    metrics.flush();
    run_metrics->on_step(rec);
    if (step % tc.train.log_every == 0 || step == 1 || eval_now) {
      fmt::print(
          "step {}/{} | loss {:.4f} | lm {:.4f} | aux {:.4f} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s | "
          "{:.0f} ms{}{}{}\n",
          step, tc.train.steps, loss, lm_sum, aux, lr, grad_norm, tps, step_s * 1e3,
          load.empty() ? "" : fmt::format(" | load max/mean {:.2f}", imbalance),
          dev.is_cuda()
              ? fmt::format(
                    " | mfu {:.1f}% | act {:.2f} GiB | peak {:.2f} GiB | syncs {}",
                    100.0 * rec["mfu"].get<double>(),
                    static_cast<double>(peak_bytes - std::min(peak_bytes, step_base_bytes)) / 1073741824.0,
                    static_cast<double>(peak_bytes) / 1073741824.0, step_syncs)
              : "",
          eval_now ? fmt::format(" | val_loss {:.4f}", last_val) : "");
      std::fflush(stdout);
    }
    steps_done = step;
    if (out_of_time) {
      fmt::print("train_moe: time limit of {:.0f}s reached after step {}; stopping\n", tc.train.time_limit_s, step);
      break;
    }
  }
  if (ckpt) TROUPE_RETURN_IF_ERROR(ckpt->finish());
  if (committer) TROUPE_RETURN_IF_ERROR(committer->finish());
  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();

  // ---- weights ------------------------------------------------------------------------
  model.to_host(c);
  TROUPE_RETURN_IF_ERROR(save_weights(run_dir + "/model.bin", model,
                                      WeightsInfo{tc.model, tc.train.seq_len, steps_done}));
  fmt::print("train_moe: done in {:.1f}s ({:.0f} tokens/s); val_loss {:.4f} -> {:.4f}; weights in {}/model.bin\n",
             total_s, static_cast<double>(tokens_seen - tokens_before) / total_s, val0, last_val, run_dir);
  return ok_status();
}

}  // namespace troupe::train_moe
