// training/run_config.cc — TrainConfig parsing and validation.
#include "training/run_config.h"

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
  if (device_dispatch && dispatch != "alltoall") {
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

Result<TrainConfig> parse_train_config(ConfigTable& cfg) {
  TrainConfig tc;
  tc.source = cfg.source();
  TROUPE_ASSIGN_OR_RETURN(tc.model, parse_model_config(cfg));

  TrainOptions& t = tc.train;
  TROUPE_ASSIGN_OR_RETURN(int64_t seed, cfg.get_int("train.seed", static_cast<int64_t>(t.seed)));
  t.seed = static_cast<uint64_t>(seed);
  TROUPE_ASSIGN_OR_RETURN(t.steps, cfg.get_int("train.steps", t.steps));
  TROUPE_ASSIGN_OR_RETURN(t.seq_len, cfg.get_int("train.seq_len", t.seq_len));
  TROUPE_ASSIGN_OR_RETURN(t.micro_batch_size, cfg.get_int("train.micro_batch_size", t.micro_batch_size));
  TROUPE_ASSIGN_OR_RETURN(t.global_batch, cfg.get_int("train.global_batch", t.micro_batch_size));
  if (cfg.has("train.grad_accum")) {
    return invalid_argument(
        "{}: key 'train.grad_accum' is no longer read: state the batch of a step as train.global_batch "
        "(sequences; the micro-batches per replica follow from the layout: global_batch / "
        "(micro_batch_size x dp))",
        cfg.source());
  }
  TROUPE_ASSIGN_OR_RETURN(t.eval_every, cfg.get_int("train.eval_every", t.eval_every));
  TROUPE_ASSIGN_OR_RETURN(t.eval_batches, cfg.get_int("train.eval_batches", t.eval_batches));
  TROUPE_ASSIGN_OR_RETURN(t.log_every, cfg.get_int("train.log_every", t.log_every));
  TROUPE_ASSIGN_OR_RETURN(t.time_limit_s, cfg.get_double("train.time_limit_s", t.time_limit_s));
  if (t.time_limit_s < 0) return invalid_argument("{}: key 'train.time_limit_s' must be >= 0", cfg.source());
  TROUPE_ASSIGN_OR_RETURN(t.steps_in_flight, cfg.get_int("train.steps_in_flight", t.steps_in_flight));
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
  TROUPE_ASSIGN_OR_RETURN(tc.lr.lr, cfg.get_double("optim.lr", 1e-3));
  TROUPE_ASSIGN_OR_RETURN(tc.lr.min_lr, cfg.get_double("optim.min_lr", tc.lr.lr * 0.1));
  TROUPE_ASSIGN_OR_RETURN(tc.lr.warmup_steps, cfg.get_int("optim.warmup_steps", 0));
  tc.lr.total_steps = t.steps;
  TROUPE_ASSIGN_OR_RETURN(o.beta1, cfg.get_double("optim.beta1", o.beta1));
  TROUPE_ASSIGN_OR_RETURN(o.beta2, cfg.get_double("optim.beta2", o.beta2));
  TROUPE_ASSIGN_OR_RETURN(o.eps, cfg.get_double("optim.eps", o.eps));
  TROUPE_ASSIGN_OR_RETURN(o.weight_decay, cfg.get_double("optim.weight_decay", o.weight_decay));
  TROUPE_ASSIGN_OR_RETURN(o.grad_clip, cfg.get_double("optim.grad_clip", o.grad_clip));
  if (!(tc.lr.lr > 0)) return invalid_argument("{}: key 'optim.lr' must be positive", cfg.source());
  if (tc.lr.min_lr < 0 || tc.lr.min_lr > tc.lr.lr) {
    return invalid_argument("{}: key 'optim.min_lr' must be in [0, optim.lr]", cfg.source());
  }
  if (tc.lr.warmup_steps < 0) return invalid_argument("{}: key 'optim.warmup_steps' must be >= 0", cfg.source());
  if (o.beta1 < 0 || o.beta1 >= 1) return invalid_argument("{}: key 'optim.beta1' must be in [0, 1)", cfg.source());
  if (o.beta2 < 0 || o.beta2 >= 1) return invalid_argument("{}: key 'optim.beta2' must be in [0, 1)", cfg.source());
  if (!(o.eps > 0)) return invalid_argument("{}: key 'optim.eps' must be positive", cfg.source());
  if (o.weight_decay < 0) return invalid_argument("{}: key 'optim.weight_decay' must be >= 0", cfg.source());

  TROUPE_ASSIGN_OR_RETURN(tc.data.dir, cfg.get_string("data.dir", ""));

  TROUPE_ASSIGN_OR_RETURN(tc.parallel.pp, cfg.get_int("parallel.pp", 1));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.dp, cfg.get_int("parallel.dp", 1));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.n, cfg.get_int("parallel.n", 1));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.dispatch, cfg.get_string("parallel.dispatch", tc.parallel.dispatch));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.compression, cfg.get_bool("parallel.compression", tc.parallel.compression));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.overlap_a2a,
                          cfg.get_bool("parallel.overlap_a2a", tc.parallel.overlap_a2a));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.overlap_grad_sync,
                          cfg.get_bool("parallel.overlap_grad_sync", tc.parallel.overlap_grad_sync));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.overlap_param_gather,
                          cfg.get_bool("parallel.overlap_param_gather", tc.parallel.overlap_param_gather));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.chunks, cfg.get_int("parallel.chunks", tc.parallel.chunks));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.fp8_dispatch,
                          cfg.get_bool("parallel.fp8_dispatch", tc.parallel.fp8_dispatch));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.device_dispatch,
                          cfg.get_bool("parallel.device_dispatch", tc.parallel.device_dispatch));
  TROUPE_ASSIGN_OR_RETURN(tc.parallel.measure_compression,
                          cfg.get_bool("parallel.measure_compression", tc.parallel.measure_compression));
  TROUPE_ASSIGN_OR_RETURN(tc.train.device_stats, cfg.get_bool("train.device_stats", tc.train.device_stats));
  TROUPE_ASSIGN_OR_RETURN(tc.train.fold_grad_norm,
                          cfg.get_bool("train.fold_grad_norm", tc.train.fold_grad_norm));
  tc.train.cuda_graph_asked = cfg.has("train.cuda_graph");
  TROUPE_ASSIGN_OR_RETURN(tc.train.cuda_graph, cfg.get_bool("train.cuda_graph", tc.train.cuda_graph));
  TROUPE_ASSIGN_OR_RETURN(tc.train.launch_ahead, cfg.get_bool("train.launch_ahead", tc.train.launch_ahead));
  TROUPE_ASSIGN_OR_RETURN(tc.train.attention_fused_dq,
                          cfg.get_bool("train.attention_fused_dq", tc.train.attention_fused_dq));
  TROUPE_ASSIGN_OR_RETURN(std::string expert_grads, cfg.get_string("train.expert_grads", "f32"));
  if (expert_grads == "f32") {
    tc.train.expert_grads = DType::kF32;
  } else if (expert_grads == "bf16") {
    tc.train.expert_grads = DType::kBF16;
  } else {
    return invalid_argument("{}: key 'train.expert_grads' must be \"f32\" or \"bf16\" (got \"{}\")",
                            cfg.source(), expert_grads);
  }
  TROUPE_ASSIGN_OR_RETURN(std::string master, cfg.get_string("train.master_weights", "f32"));
  if (master == "f32" || master == "split") {
    tc.train.split_master = master == "split";
  } else {
    return invalid_argument("{}: key 'train.master_weights' must be \"f32\" or \"split\" (got \"{}\")",
                            cfg.source(), master);
  }
  TROUPE_ASSIGN_OR_RETURN(std::string recompute, cfg.get_string("train.recompute", "none"));
  if (recompute != "none" && recompute != "blocks") {
    return invalid_argument("{}: key 'train.recompute' must be \"none\" or \"blocks\" (got \"{}\")",
                            cfg.source(), recompute);
  }
  tc.train.recompute_blocks = recompute == "blocks";
  TROUPE_ASSIGN_OR_RETURN(tc.train.timeline_dir, cfg.get_string("train.timeline_dir", tc.train.timeline_dir));
  TROUPE_ASSIGN_OR_RETURN(tc.train.init_from, cfg.get_string("train.init_from", tc.train.init_from));
  TROUPE_ASSIGN_OR_RETURN(tc.train.umask, cfg.get_string("train.umask", tc.train.umask));
  if (tc.train.umask.empty() || tc.train.umask.size() > 4 ||
      tc.train.umask.find_first_not_of("01234567") != std::string::npos) {
    return invalid_argument("{}: key 'train.umask' must be an octal mask such as \"077\" (got \"{}\")",
                            cfg.origin("train.umask"), tc.train.umask);
  }
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.every, cfg.get_int("checkpoint.every", tc.checkpoint.every));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.keep, cfg.get_int("checkpoint.keep", tc.checkpoint.keep));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.final, cfg.get_bool("checkpoint.final", tc.checkpoint.final));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.dir, cfg.get_string("checkpoint.dir", tc.checkpoint.dir));
  TROUPE_ASSIGN_OR_RETURN(tc.checkpoint.max_mb_per_s, cfg.get_double("checkpoint.max_mb_per_s", tc.checkpoint.max_mb_per_s));
  if (tc.checkpoint.max_mb_per_s < 0) return invalid_argument("{}: key 'checkpoint.max_mb_per_s' must be >= 0", cfg.source());
  if (tc.checkpoint.every < 0) return invalid_argument("{}: key 'checkpoint.every' must be >= 0", cfg.source());
  if (tc.checkpoint.keep < 1) return invalid_argument("{}: key 'checkpoint.keep' must be >= 1", cfg.source());

  ElasticOptions& e = tc.elastic;
  TROUPE_ASSIGN_OR_RETURN(e.heartbeat_timeout_ms,
                          cfg.get_int("elastic.heartbeat_timeout_ms", e.heartbeat_timeout_ms));
  TROUPE_ASSIGN_OR_RETURN(e.comm_error_grace_ms,
                          cfg.get_int("elastic.comm_error_grace_ms", e.comm_error_grace_ms));
  TROUPE_ASSIGN_OR_RETURN(e.step_watchdog_ms, cfg.get_int("elastic.step_watchdog_ms", e.step_watchdog_ms));
  TROUPE_ASSIGN_OR_RETURN(e.join_timeout_ms, cfg.get_int("elastic.join_timeout_ms", e.join_timeout_ms));
  TROUPE_ASSIGN_OR_RETURN(e.spares, cfg.get_int("elastic.spares", e.spares));
  TROUPE_ASSIGN_OR_RETURN(e.min_dp, cfg.get_int("elastic.min_dp", e.min_dp));
  TROUPE_ASSIGN_OR_RETURN(e.max_dp, cfg.get_int("elastic.max_dp", e.max_dp));
  TROUPE_ASSIGN_OR_RETURN(e.straggler_ratio, cfg.get_double("elastic.straggler_ratio", e.straggler_ratio));
  TROUPE_ASSIGN_OR_RETURN(e.straggler_window, cfg.get_int("elastic.straggler_window", e.straggler_window));
  TROUPE_ASSIGN_OR_RETURN(e.straggler_policy, cfg.get_string("elastic.straggler_policy", e.straggler_policy));
  TROUPE_ASSIGN_OR_RETURN(e.snapshot_every, cfg.get_int("elastic.snapshot_every", e.snapshot_every));
  for (const char* gone : {"elastic.replica_every", "elastic.gpu_state"}) {
    if (cfg.has(gone)) {
      return invalid_argument(
          "{}: key '{}' is gone: every job's workers snapshot their state into memory held outside them "
          "(elastic.snapshot_every, docs/elastic.md \"Snapshots\")",
          cfg.source(), gone);
    }
  }
  TROUPE_ASSIGN_OR_RETURN(e.scale_at, cfg.get_string("elastic.scale_at", e.scale_at));
  TROUPE_ASSIGN_OR_RETURN(e.inject, cfg.get_string("elastic.inject", e.inject));
  TROUPE_ASSIGN_OR_RETURN(e.isolate_workers, cfg.get_bool("elastic.isolate_workers", e.isolate_workers));
  TROUPE_ASSIGN_OR_RETURN(e.scheduler_outage_limit_ms,
                          cfg.get_int("elastic.scheduler_outage_limit_ms", e.scheduler_outage_limit_ms));
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

  ObserveOptions& ob = tc.observe;
  TROUPE_ASSIGN_OR_RETURN(ob.tensorboard, cfg.get_bool("observe.tensorboard", ob.tensorboard));
  TROUPE_ASSIGN_OR_RETURN(ob.prometheus_listen,
                          cfg.get_string("observe.prometheus_listen", ob.prometheus_listen));
  TROUPE_ASSIGN_OR_RETURN(ob.prometheus_auth_file,
                          cfg.get_string("observe.prometheus_auth_file", ob.prometheus_auth_file));

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

Result<TrainConfig> load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  TROUPE_ASSIGN_OR_RETURN(ConfigTable cfg, ConfigTable::parse_file(path));
  for (const auto& o : overrides) TROUPE_RETURN_IF_ERROR(cfg.set_from_string(o));
  return parse_train_config(cfg);
}

}  // namespace troupe::layers
