// training/run_config.cc — TrainConfig parsing and validation.
#include "training/run_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace troupe::layers {

Result<ParallelLayout> ParallelOptions::layout() const {
  Result<ParallelLayout> l = ParallelLayout::make(pp, dp, n);
  if (!l.ok()) return l.status().with_context("[parallel]");
  return l;
}

Status ParallelOptions::validate(const ModelConfig& m) const {
  TROUPE_RETURN_IF_ERROR(layout().status());
  if (m.n_layers % pp != 0) {
    return invalid_argument("parallel.pp={} does not divide model.n_layers={}", pp, m.n_layers);
  }
  if (m.n_heads % n != 0 || m.n_kv_heads % n != 0) {
    return invalid_argument("parallel.n={} must divide model.n_heads={} and model.n_kv_heads={}", n, m.n_heads,
                            m.n_kv_heads);
  }
  bool any_moe = false;
  for (int64_t i = 0; i < m.n_layers; ++i) any_moe |= m.is_moe_block(i);
  if (any_moe && m.moe.num_experts % n != 0) {
    return invalid_argument("parallel.n={} does not divide model.moe.num_experts={}", n, m.moe.num_experts);
  }
  if (dispatch != "alltoall" && dispatch != "allgather") {
    return invalid_argument("parallel.dispatch must be \"alltoall\" or \"allgather\" (got \"{}\")", dispatch);
  }
  if (chunks < 1 || chunks > 64) return invalid_argument("parallel.chunks={} must be in [1, 64]", chunks);
  if (fp8_dispatch && dispatch != "alltoall") {
    return invalid_argument("parallel.fp8_dispatch needs parallel.dispatch = \"alltoall\"");
  }
  if (device_dispatch_required && dispatch != "alltoall") {
    return invalid_argument("parallel.device_dispatch needs parallel.dispatch = \"alltoall\"");
  }
  return ok_status();
}

Status ParallelOptions::validate(const ModelConfig& m, const TrainOptions& t) const {
  TROUPE_RETURN_IF_ERROR(validate(m));
  if (t.seq_len % n != 0) {
    return invalid_argument("parallel.n={} does not divide train.seq_len={} (Ulysses gives each rank seq_len/n "
                            "tokens of every sequence)",
                            n, t.seq_len);
  }
  if (m.moe.capacity_factor > 0 && n > 1) {
    return invalid_argument("parallel.n={} needs dropless routing (model.moe.capacity_factor = 0): with token "
                            "dropping the capacity would be counted per rank and differ from one process",
                            n);
  }
  return ok_status();
}

Result<int64_t> micro_batches_per_replica(const TrainOptions& t, int64_t dp) {
  const int64_t per_micro = t.micro_batch_size * dp;
  if (dp < 1 || per_micro <= 0 || t.global_batch % per_micro != 0) {
    return invalid_argument(
        "train.global_batch = {} sequences cannot be split over dp = {} replicas of micro-batches of "
        "train.micro_batch_size = {} ({} is not a multiple of {} x {} = {}): choose a global batch that "
        "every layout you run divides, or another micro_batch_size",
        t.global_batch, dp, t.micro_batch_size, t.global_batch, t.micro_batch_size, dp, per_micro);
  }
  return t.global_batch / per_micro;
}

namespace {

// [bench] and [test]: switches that exist to compare runs or to break them, not to train:
// the step engine's and the overlap's A/B switches (each defaults to the fast way; off
// keeps the plain one, for comparison: the numbers stay the same), the exchange's error
// measurement, fault injection and planned rescales. A config that sets any of them is
// refused unless its caller admits them (apps: --allow-test-config), so a benchmark's or
// a test's config copied into production fails at start instead of training with overlap
// off or with a worker killed at step 3. Each key read here is read from [bench] or
// [test] only; the names they had before are refused with where they went.
Status parse_test_sections(ConfigTable& cfg, TrainConfig& tc, TestSections test_sections) {
  static constexpr std::pair<const char*, const char*> kMoved[] = {
      {"train.device_stats", "bench.device_stats"},
      {"train.fold_grad_norm", "bench.fold_grad_norm"},
      {"train.cuda_graph", "bench.cuda_graph"},
      {"train.launch_ahead", "bench.launch_ahead"},
      {"parallel.overlap_a2a", "bench.overlap_a2a"},
      {"parallel.overlap_grad_sync", "bench.overlap_grad_sync"},
      {"parallel.overlap_param_gather", "bench.overlap_param_gather"},
      {"parallel.measure_compression", "bench.measure_compression"},
      {"elastic.inject", "test.inject"},
      {"elastic.scale_at", "test.scale_at"}};
  for (const auto& [old_key, new_key] : kMoved) {
    if (cfg.has(old_key)) {
      return invalid_argument(
          "{}: key '{}' is now '{}': switches for comparison and fault injection live in the [bench] "
          "and [test] sections, which only a run started with --allow-test-config reads (docs/config.md)",
          cfg.origin(old_key), old_key, new_key);
    }
  }
  TrainOptions& t = tc.train;
  ParallelOptions& p = tc.parallel;
  ElasticOptions& e = tc.elastic;
  TROUPE_ASSIGN_OR_RETURN(t.device_stats,
                          cfg.get_bool("bench.device_stats", t.device_stats,
                                       "the step's statistics summed on the device and read once a step; "
                                       "false: read back inside the step and summed on the host"));
  TROUPE_ASSIGN_OR_RETURN(
      t.fold_grad_norm,
      cfg.get_bool("bench.fold_grad_norm", t.fold_grad_norm,
                   "the experts' dW products leave their sums of squares for the "
                   "clip's norm where that is exact; false: the norm reads every gradient"));
  t.cuda_graph_asked = cfg.has("bench.cuda_graph");
  TROUPE_ASSIGN_OR_RETURN(t.cuda_graph,
                          cfg.get_bool("bench.cuda_graph", t.cuda_graph,
                                       "GPUs: each step from the second on is one replay of a captured CUDA "
                                       "graph; false: launches one by one (for kernel profilers)"));
  TROUPE_ASSIGN_OR_RETURN(t.launch_ahead,
                          cfg.get_bool("bench.launch_ahead", t.launch_ahead,
                                       "the next step is enqueued before this step's statistics are read; "
                                       "false: each step waits for the last one's read"));
  TROUPE_ASSIGN_OR_RETURN(t.pdl, cfg.get_bool("bench.pdl", t.pdl,
                                              "GPUs of compute capability 9.0 and up: kernels launch with "
                                              "programmatic dependent launch; false: plain stream order"));
  TROUPE_ASSIGN_OR_RETURN(p.overlap_a2a,
                          cfg.get_bool("bench.overlap_a2a", p.overlap_a2a,
                                       "Ulysses and expert all-to-alls in flight behind compute"));
  TROUPE_ASSIGN_OR_RETURN(p.overlap_grad_sync,
                          cfg.get_bool("bench.overlap_grad_sync", p.overlap_grad_sync,
                                       "dp gradient reduce-scatter in buckets during the backward"));
  TROUPE_ASSIGN_OR_RETURN(p.overlap_param_gather,
                          cfg.get_bool("bench.overlap_param_gather", p.overlap_param_gather,
                                       "dp parameter all-gather behind the next forward"));
  TROUPE_ASSIGN_OR_RETURN(p.measure_compression,
                          cfg.get_bool("bench.measure_compression", p.measure_compression,
                                       "print each step's relative error of the compressed gradient exchange "
                                       "against an extra fp32 exchange (CPU ranks)"));
  TROUPE_ASSIGN_OR_RETURN(e.inject,
                          cfg.get_string("test.inject", e.inject,
                                         "fault injection: \"<kill|stop|slow|cut|hang|cutctl>@<step>:"
                                         "<phase>:<slot>,...\" (docs/elastic.md)"));
  TROUPE_ASSIGN_OR_RETURN(e.scale_at,
                          cfg.get_string("test.scale_at", e.scale_at,
                                         "planned rescales \"<after step>:<dp>,...\" (troupe scale "
                                         "does it at run time)"));
  std::vector<std::string> set = cfg.keys_under("bench");
  for (std::string& k : cfg.keys_under("test")) set.push_back(std::move(k));
  if (!set.empty() && test_sections != TestSections::kAdmit) {
    return invalid_argument(
        "{}: sets {} of the [bench]/[test] sections (switches for comparison, fault injection): a "
        "production run does not read them; start a benchmark or test with --allow-test-config",
        cfg.origin(set.front()), fmt::format("'{}'", fmt::join(set, "', '")));
  }
  tc.test_keys = std::move(set);
  return ok_status();
}

}  // namespace

Result<TrainConfig> parse_train_config(ConfigTable& cfg, TestSections test_sections) {
  TrainConfig tc;
  tc.source = cfg.source();
  TROUPE_ASSIGN_OR_RETURN(tc.model, parse_model_config(cfg));

  TrainOptions& t = tc.train;
  TROUPE_ASSIGN_OR_RETURN(
      int64_t seed, cfg.get_int("train.seed", static_cast<int64_t>(t.seed),
                                "initialisation (every value from (seed, parameter name)) and data order"));
  t.seed = static_cast<uint64_t>(seed);
  TROUPE_ASSIGN_OR_RETURN(t.steps, cfg.get_int("train.steps", t.steps, "optimizer steps"));
  TROUPE_ASSIGN_OR_RETURN(
      t.seq_len, cfg.get_int("train.seq_len", t.seq_len, "tokens per sequence; parallel.n must divide it"));
  TROUPE_ASSIGN_OR_RETURN(t.micro_batch_size,
                          cfg.get_int("train.micro_batch_size", t.micro_batch_size,
                                      "sequences per micro-batch of one data-parallel replica"));
  TROUPE_ASSIGN_OR_RETURN(
      t.global_batch,
      cfg.get_int("train.global_batch", t.micro_batch_size,
                  "sequences per optimizer step, the same in every layout (\"The global batch\" below)",
                  "train.micro_batch_size"));
  if (cfg.has("train.grad_accum")) {
    return invalid_argument(
        "{}: key 'train.grad_accum' is no longer read: state the batch of a step as train.global_batch "
        "(sequences; the micro-batches per replica follow from the layout: global_batch / "
        "(micro_batch_size x dp))",
        cfg.source());
  }
  TROUPE_ASSIGN_OR_RETURN(t.eval_every,
                          cfg.get_int("train.eval_every", t.eval_every,
                                      "validation every N steps (0: at the start and the end only)"));
  TROUPE_ASSIGN_OR_RETURN(t.eval_batches, cfg.get_int("train.eval_batches", t.eval_batches,
                                                      "micro-batches of validation data per evaluation"));
  TROUPE_ASSIGN_OR_RETURN(t.log_every,
                          cfg.get_int("train.log_every", t.log_every, "a console line every N steps"));
  TROUPE_ASSIGN_OR_RETURN(t.time_limit_s,
                          cfg.get_double("train.time_limit_s", t.time_limit_s,
                                         "stop after the step that passes this wall time in seconds, with "
                                         "the final validation and checkpoint (0: none)"));
  if (t.time_limit_s < 0) return invalid_argument("{}: key 'train.time_limit_s' must be >= 0", cfg.source());
  TROUPE_ASSIGN_OR_RETURN(
      t.steps_in_flight,
      cfg.get_int(
          "train.steps_in_flight", t.steps_in_flight,
          "step commands the driver keeps in flight, 1 to 8 (docs/elastic.md, \"Commands in flight\")"));
  if (t.steps_in_flight < 1 || t.steps_in_flight > kMaxStepsInFlight) {
    return invalid_argument("{}: key 'train.steps_in_flight' must be in [1, {}] (got {})", cfg.source(),
                            kMaxStepsInFlight, t.steps_in_flight);
  }
  const std::pair<const char*, int64_t> positive[] = {{"train.steps", t.steps},
                                                      {"train.seq_len", t.seq_len},
                                                      {"train.micro_batch_size", t.micro_batch_size},
                                                      {"train.global_batch", t.global_batch},
                                                      {"train.eval_batches", t.eval_batches},
                                                      {"train.log_every", t.log_every}};
  for (const auto& [key, v] : positive) {
    if (v <= 0) return invalid_argument("{}: key '{}' must be positive (got {})", cfg.source(), key, v);
  }
  if (t.eval_every < 0) return invalid_argument("{}: key 'train.eval_every' must be >= 0", cfg.source());

  AdamWOptions& o = tc.optim;
  TROUPE_ASSIGN_OR_RETURN(
      tc.lr.lr, cfg.get_double("optim.lr", 1e-3,
                               "peak learning rate (linear warm-up, cosine decay to min_lr at train.steps)"));
  TROUPE_ASSIGN_OR_RETURN(
      tc.lr.min_lr, cfg.get_double("optim.min_lr", tc.lr.lr * 0.1, "final learning rate of the cosine decay",
                                   "optim.lr / 10"));
  TROUPE_ASSIGN_OR_RETURN(tc.lr.warmup_steps,
                          cfg.get_int("optim.warmup_steps", 0, "steps of linear warm-up"));
  tc.lr.total_steps = t.steps;
  TROUPE_ASSIGN_OR_RETURN(o.beta1, cfg.get_double("optim.beta1", o.beta1, "AdamW beta1"));
  TROUPE_ASSIGN_OR_RETURN(o.beta2, cfg.get_double("optim.beta2", o.beta2, "AdamW beta2"));
  TROUPE_ASSIGN_OR_RETURN(o.eps, cfg.get_double("optim.eps", o.eps, "AdamW epsilon"));
  TROUPE_ASSIGN_OR_RETURN(o.weight_decay,
                          cfg.get_double("optim.weight_decay", o.weight_decay,
                                         "decoupled weight decay; not applied to norm gains"));
  TROUPE_ASSIGN_OR_RETURN(o.grad_clip, cfg.get_double("optim.grad_clip", o.grad_clip,
                                                      "max global gradient norm (<= 0: no clipping)"));
  if (!(tc.lr.lr > 0)) return invalid_argument("{}: key 'optim.lr' must be positive", cfg.source());
  if (tc.lr.min_lr < 0 || tc.lr.min_lr > tc.lr.lr) {
    return invalid_argument("{}: key 'optim.min_lr' must be in [0, optim.lr]", cfg.source());
  }
  if (tc.lr.warmup_steps < 0) return invalid_argument("{}: key 'optim.warmup_steps' must be >= 0", cfg.source());
  if (o.beta1 < 0 || o.beta1 >= 1) return invalid_argument("{}: key 'optim.beta1' must be in [0, 1)", cfg.source());
  if (o.beta2 < 0 || o.beta2 >= 1) return invalid_argument("{}: key 'optim.beta2' must be in [0, 1)", cfg.source());
  if (!(o.eps > 0)) return invalid_argument("{}: key 'optim.eps' must be positive", cfg.source());
  if (o.weight_decay < 0) return invalid_argument("{}: key 'optim.weight_decay' must be >= 0", cfg.source());

  TROUPE_ASSIGN_OR_RETURN(
      tc.data.dir,
      cfg.get_string(
          "data.dir", "",
          "a folder made by troupe-prepare (tokenizer.json, train-*.bin, val-*.bin); required to train"));

  TROUPE_ASSIGN_OR_RETURN(tc.parallel.pp,
                          cfg.get_int("parallel.pp", 1, "pipeline stages (docs/parallelism.md)"));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.dp, cfg.get_int("parallel.dp", 1, "data-parallel replicas"));
  TROUPE_ASSIGN_OR_RETURN(
      tc.parallel.n,
      cfg.get_int("parallel.n", 1,
                  "ranks of an expert/sequence group (Ulysses attention, expert parallelism)"));
  TROUPE_ASSIGN_OR_RETURN(
      tc.parallel.dispatch,
      cfg.get_string(
          "parallel.dispatch", tc.parallel.dispatch,
          "expert dispatch in the n-group: \"alltoall\" or \"allgather\" (better when top_k is large)"));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.compression,
                          cfg.get_bool("parallel.compression", tc.parallel.compression,
                                       "data-parallel gradient reduce-scatter with bf16 on the wire"));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.chunks,
                          cfg.get_int("parallel.chunks", tc.parallel.chunks,
                                      "token chunks of each expert dispatch, 1 to 64 (expert GEMMs of one "
                                      "chunk overlap the next's dispatch; part of the arithmetic)"));
  TROUPE_ASSIGN_OR_RETURN(
      tc.parallel.fp8_dispatch,
      cfg.get_bool(
          "parallel.fp8_dispatch", tc.parallel.fp8_dispatch,
          "expert token dispatch in fp8 e4m3 with per-token scales (needs dispatch = \"alltoall\")"));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.device_dispatch,
                          cfg.get_bool("parallel.device_dispatch", tc.parallel.device_dispatch,
                                       "GPUs of one host: the expert all-to-all driven by counts that stay "
                                       "on the device; the default takes it wherever it can work, true "
                                       "requires it (costs memory: docs/parallelism.md)",
                                       "on where it can work"));
  tc.parallel.device_dispatch_required = tc.parallel.device_dispatch && cfg.has("parallel.device_dispatch");
  TROUPE_ASSIGN_OR_RETURN(tc.train.attention_fused_dq,
                          cfg.get_bool("train.attention_fused_dq", tc.train.attention_fused_dq,
                                       "Hopper attention backward: dQ inside the dK/dV kernel (not bitwise "
                                       "repeatable); false: its own fixed-order kernel"));
  TROUPE_ASSIGN_OR_RETURN(std::string expert_grads,
                          cfg.get_string("train.expert_grads", "f32",
                                         "the experts' weight gradients: \"f32\" or \"bf16\" (needs one "
                                         "micro-batch a step: global_batch = micro_batch_size x dp)"));
  if (expert_grads == "f32") {
    tc.train.expert_grads = DType::kF32;
  } else if (expert_grads == "bf16") {
    tc.train.expert_grads = DType::kBF16;
  } else {
    return invalid_argument("{}: key 'train.expert_grads' must be \"f32\" or \"bf16\" (got \"{}\")",
                            cfg.source(), expert_grads);
  }
  TROUPE_ASSIGN_OR_RETURN(std::string master,
                          cfg.get_string("train.master_weights", "f32",
                                         "GPU master weights: \"f32\", or \"split\" (the bf16 working copy "
                                         "plus a 16-bit low half; CPU workers keep f32)"));
  if (master == "f32" || master == "split") {
    tc.train.split_master = master == "split";
  } else {
    return invalid_argument("{}: key 'train.master_weights' must be \"f32\" or \"split\" (got \"{}\")",
                            cfg.source(), master);
  }
  TROUPE_ASSIGN_OR_RETURN(std::string recompute,
                          cfg.get_string("train.recompute", "none",
                                         "\"blocks\": apps on the transformer program base keep only each "
                                         "block's input and run its forward again in backward; \"none\""));
  if (recompute != "none" && recompute != "blocks") {
    return invalid_argument("{}: key 'train.recompute' must be \"none\" or \"blocks\" (got \"{}\")",
                            cfg.source(), recompute);
  }
  tc.train.recompute_blocks = recompute == "blocks";
  TROUPE_ASSIGN_OR_RETURN(tc.train.timeline_dir,
                          cfg.get_string("train.timeline_dir", tc.train.timeline_dir,
                                         "per-rank, per-step communication and compute timings as JSON lines "
                                         "into this directory (bench/overlap/timeline.py); \"\": none"));
  TROUPE_ASSIGN_OR_RETURN(
      tc.train.init_from,
      cfg.get_string("train.init_from", tc.train.init_from,
                     "a Hugging Face model directory whose weights start the run (set by --init-from, with "
                     "the [model] keys of its config.json); \"\": the seed's initialisation"));
  TROUPE_ASSIGN_OR_RETURN(
      tc.train.umask,
      cfg.get_string("train.umask", tc.train.umask,
                     "octal file-mode mask of everything a training process creates (run directory, metrics, "
                     "logs, checkpoints); \"027\": the owner's group may read"));
  if (tc.train.umask.empty() || tc.train.umask.size() > 4 ||
      tc.train.umask.find_first_not_of("01234567") != std::string::npos) {
    return invalid_argument("{}: key 'train.umask' must be an octal mask such as \"077\" (got \"{}\")",
                            cfg.origin("train.umask"), tc.train.umask);
  }
  TROUPE_ASSIGN_OR_RETURN(
      tc.checkpoint.every,
      cfg.get_int("checkpoint.every", tc.checkpoint.every,
                  "save after every N-th step and after the last one (0: no periodic ones)"));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.keep,
                          cfg.get_int("checkpoint.keep", tc.checkpoint.keep,
                                      "complete checkpoints kept (older ones are deleted)"));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.final,
                          cfg.get_bool("checkpoint.final", tc.checkpoint.final,
                                       "save the last step's state when training ends, even with every = 0"));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.dir,
                          cfg.get_string("checkpoint.dir", tc.checkpoint.dir,
                                         "where step_<N> directories go; \"\": $TROUPE_CHECKPOINT_DIR under "
                                         "the scheduler, else <run dir>/checkpoints"));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.max_mb_per_s,
                          cfg.get_double("checkpoint.max_mb_per_s", tc.checkpoint.max_mb_per_s,
                                         "background write rate per rank in MB/s (0: unlimited)"));
  if (tc.checkpoint.max_mb_per_s < 0) return invalid_argument("{}: key 'checkpoint.max_mb_per_s' must be >= 0", cfg.source());
  if (tc.checkpoint.every < 0) return invalid_argument("{}: key 'checkpoint.every' must be >= 0", cfg.source());
  if (tc.checkpoint.keep < 1) return invalid_argument("{}: key 'checkpoint.keep' must be >= 1", cfg.source());

  ElasticOptions& e = tc.elastic;
  TROUPE_ASSIGN_OR_RETURN(
      e.heartbeat_timeout_ms,
      cfg.get_int("elastic.heartbeat_timeout_ms", e.heartbeat_timeout_ms,
                  "a worker silent this long is replaced; 0: the job's --heartbeat-timeout-ms, else 2000"));
  TROUPE_ASSIGN_OR_RETURN(
      e.comm_error_grace_ms,
      cfg.get_int("elastic.comm_error_grace_ms", e.comm_error_grace_ms,
                  "a data-plane error with nobody dead: the group is rebuilt after this"));
  TROUPE_ASSIGN_OR_RETURN(
      e.step_watchdog_ms,
      cfg.get_int("elastic.step_watchdog_ms", e.step_watchdog_ms,
                  "a command running this long with every worker beating: the group is rebuilt"));
  TROUPE_ASSIGN_OR_RETURN(e.join_timeout_ms,
                          cfg.get_int("elastic.join_timeout_ms", e.join_timeout_ms,
                                      "a worker that does not join a new epoch in this time is replaced"));
  TROUPE_ASSIGN_OR_RETURN(e.spares, cfg.get_int("elastic.spares", e.spares,
                                                "replacement workers the job may start (-1: unlimited)"));
  TROUPE_ASSIGN_OR_RETURN(
      e.min_dp, cfg.get_int("elastic.min_dp", e.min_dp, "lower bound of troupe scale --dp and of shrinking"));
  TROUPE_ASSIGN_OR_RETURN(
      e.max_dp, cfg.get_int("elastic.max_dp", e.max_dp, "upper bound of troupe scale --dp (0: parallel.dp)"));
  TROUPE_ASSIGN_OR_RETURN(
      e.straggler_ratio, cfg.get_double("elastic.straggler_ratio", e.straggler_ratio,
                                        "a worker whose compute time exceeds ratio x its peers' median ..."));
  TROUPE_ASSIGN_OR_RETURN(e.straggler_window,
                          cfg.get_int("elastic.straggler_window", e.straggler_window,
                                      "... for this many consecutive steps is a straggler"));
  TROUPE_ASSIGN_OR_RETURN(e.straggler_policy,
                          cfg.get_string("elastic.straggler_policy", e.straggler_policy,
                                         "what happens to a straggler: \"flag\" or \"replace\""));
  TROUPE_ASSIGN_OR_RETURN(e.snapshot_every,
                          cfg.get_int("elastic.snapshot_every", e.snapshot_every,
                                      "in-memory snapshot of every rank's state after every N steps "
                                      "(docs/elastic.md \"Snapshots\"); 0: none"));
  for (const char* gone : {"elastic.replica_every", "elastic.gpu_state"}) {
    if (cfg.has(gone)) {
      return invalid_argument(
          "{}: key '{}' is gone: every job's workers snapshot their state into memory held outside them "
          "(elastic.snapshot_every, docs/elastic.md \"Snapshots\")",
          cfg.source(), gone);
    }
  }
  TROUPE_ASSIGN_OR_RETURN(e.isolate_workers,
                          cfg.get_bool("elastic.isolate_workers", e.isolate_workers,
                                       "a 1x1x1 job runs its worker as a supervised child process "
                                       "(replaceable, scalable) instead of in the driver's process"));
  TROUPE_ASSIGN_OR_RETURN(
      e.scheduler_outage_limit_ms,
      cfg.get_int("elastic.scheduler_outage_limit_ms", e.scheduler_outage_limit_ms,
                  "how long the job rides out an outage of its scheduler before failing"));
  const std::pair<const char*, int64_t> non_negative[] = {
      {"elastic.heartbeat_timeout_ms", e.heartbeat_timeout_ms},
      {"elastic.comm_error_grace_ms", e.comm_error_grace_ms},
      {"elastic.max_dp", e.max_dp},
      {"elastic.snapshot_every", e.snapshot_every}};
  for (const auto& [key, v] : non_negative) {
    if (v < 0) return invalid_argument("{}: key '{}' must be >= 0 (got {})", cfg.source(), key, v);
  }
  const std::pair<const char*, int64_t> positive_e[] = {
      {"elastic.step_watchdog_ms", e.step_watchdog_ms},
      {"elastic.join_timeout_ms", e.join_timeout_ms},
      {"elastic.min_dp", e.min_dp},
      {"elastic.straggler_window", e.straggler_window},
      {"elastic.scheduler_outage_limit_ms", e.scheduler_outage_limit_ms}};
  for (const auto& [key, v] : positive_e) {
    if (v <= 0) return invalid_argument("{}: key '{}' must be positive (got {})", cfg.source(), key, v);
  }
  if (e.spares < -1)
    return invalid_argument("{}: key 'elastic.spares' must be >= -1 (-1: unlimited)", cfg.source());
  if (!(e.straggler_ratio > 1)) {
    return invalid_argument("{}: key 'elastic.straggler_ratio' must be > 1 (got {})", cfg.source(),
                            e.straggler_ratio);
  }
  if (e.straggler_policy != "flag" && e.straggler_policy != "replace") {
    return invalid_argument("{}: key 'elastic.straggler_policy' must be \"flag\" or \"replace\" (got \"{}\")",
                            cfg.source(), e.straggler_policy);
  }
  if (e.max_dp > 0 && e.max_dp < e.min_dp) {
    return invalid_argument("{}: elastic.max_dp ({}) is below elastic.min_dp ({})", cfg.source(), e.max_dp,
                            e.min_dp);
  }

  TROUPE_RETURN_IF_ERROR(parse_test_sections(cfg, tc, test_sections));

  ObserveOptions& ob = tc.observe;
  TROUPE_ASSIGN_OR_RETURN(ob.tensorboard, cfg.get_bool("observe.tensorboard", ob.tensorboard,
                                                       "TensorBoard event files in <run dir>/tensorboard/"));
  TROUPE_ASSIGN_OR_RETURN(ob.prometheus_listen,
                          cfg.get_string("observe.prometheus_listen", ob.prometheus_listen,
                                         "the driver's Prometheus /metrics on HOST:PORT (port 0: a free one, "
                                         "written to <run dir>/metrics_url); \"\": not served"));
  TROUPE_ASSIGN_OR_RETURN(
      ob.prometheus_auth_file,
      cfg.get_string(
          "observe.prometheus_auth_file", ob.prometheus_auth_file,
          "HTTP basic auth for /metrics (one line user:password, mode 0600); needed off loopback"));

  Status st = tc.parallel.validate(tc.model, tc.train);
  if (!st.ok()) return st.with_context(cfg.source());
  Result<int64_t> micro = micro_batches_per_replica(tc.train, tc.parallel.dp);
  if (!micro.ok()) return micro.status().with_context(cfg.source());
  tc.train.grad_accum = *micro;
  if (tc.train.expert_grads == DType::kBF16 && tc.train.grad_accum != 1) {
    return invalid_argument(
        "{}: key 'train.expert_grads' = \"bf16\" needs one micro-batch per step (train.global_batch = "
        "micro_batch_size x dp = {}; got {}, {} micro-batches): later micro-batches would add to the "
        "gradient in bf16; use \"f32\"",
        cfg.source(), tc.train.micro_batch_size * tc.parallel.dp, tc.train.global_batch, tc.train.grad_accum);
  }

  TROUPE_RETURN_IF_ERROR(cfg.check_all_keys_used());
  return tc;
}

Result<TrainConfig> load_train_config(const std::string& path, const std::vector<std::string>& overrides,
                                      TestSections test_sections) {
  TROUPE_ASSIGN_OR_RETURN(ConfigTable cfg, ConfigTable::parse_file(path));
  for (const auto& o : overrides) TROUPE_RETURN_IF_ERROR(cfg.set_from_string(o));
  return parse_train_config(cfg, test_sections);
}

}  // namespace troupe::layers
