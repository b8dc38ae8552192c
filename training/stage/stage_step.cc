// training/stage/stage_step.cc — Stage (stage.h): the step: gradient synchronisation,
// the ZeRO-1 optimizer shard, the step engine (launch_step / finish_step: statistics on
// the device, CUDA graph, launch-ahead; stage.h "Step engine"), the step metrics and
// evaluation. Their order is the step's numerics: GPU bitwise tests depend on it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "comm/gloo_communicator.h"
#include "core/check.h"
#include "core/process_memory.h"
#include "training/stage/stage.h"

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda/host_wait.h"
#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif
#if TROUPE_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

#include "training/stage/stage_micro.h"

namespace troupe::training {

using Clock = std::chrono::steady_clock;

namespace {
// Device->host read-backs of this process so far (core/cuda/host_wait.h; 0 without CUDA).
int64_t host_reads() {
#if TROUPE_HAVE_CUDA
  return cuda::host_wait_count(cuda::HostWait::kReadBack);
#else
  return 0;
#endif
}
// Host->device uploads that waited for their copy, likewise.
int64_t host_uploads() {
#if TROUPE_HAVE_CUDA
  return cuda::host_wait_count(cuda::HostWait::kUpload);
#else
  return 0;
#endif
}
}  // namespace

// ---- the step ------------------------------------------------------------------------------

void Stage::sync_grads() {
  // Whatever the step's products did not write is zero (the buckets launched in backward
  // settled their own already).
  buf_.settle_grads(ctx_);
  if (layout_->dp() <= 1) {
    if (layout_->n() > 1 && rep_size_ > 0) {
      all_reduce_sum(*groups_.n, buf_.grad_range(0, rep_size_), time_, "replicated grads all_reduce (n)");
    }
    if (tied_) {
      for (const layers::Parameter* w : tied_params_)
        all_reduce_sum(*tied_, w->grad.view({w->numel()}), time_, "tied embedding all_reduce");
    }
    return;
  }
  // dp first (per bucket, most already launched during backward), then the n-group sum
  // of the replicated part on this rank's shard: the same order on every schedule.
  if (tied_) {
    for (const layers::Parameter* w : tied_params_)
      all_reduce_sum(*tied_, w->grad.view({w->numel()}), time_, "tied embedding all_reduce");
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (!buckets_[i].grad_launched) launch_grad_buckets(buckets_[i].ready);
    if (!tc_.parallel.overlap_grad_sync)
      grad_bucket_finish(ctx_, buckets_[i].grad, shard_grad_, shard_len_, time_);
  }
  if (tc_.parallel.overlap_grad_sync) {
    for (auto& bk : buckets_) grad_bucket_finish(ctx_, bk.grad, shard_grad_, shard_len_, time_);
  }
  const int64_t rep_in_shard = std::clamp<int64_t>(rep_size_ - shard_lo_, 0, shard_len_);
  if (layout_->n() > 1 && rep_in_shard > 0) {
    all_reduce_sum(*groups_.n, shard_grad_.narrow(0, 0, rep_in_shard), time_,
                   "replicated grads all_reduce (n)");
  }
}

void Stage::optimizer_step(double lr) {
  snapshot_fence();  // a snapshot's copy still reading the state (CPU)
  const int64_t t0 = time_.tracing() ? comm::Work::now_ns() : 0;
  void* mark0 = time_.device_mark();
  if (device_stats_) {
    // Clipped by the world's norm, which never leaves the device.
    const Tensor norm = stats_.narrow(0, kSumSq, 1);
    if (opt_->device_schedule()) {
      opt_->enqueue_update(ctx_, norm);  // launch_step uploaded the step's schedule
    } else {
      opt_->step(ctx_, lr, norm);
    }
  } else {
    opt_->step(ctx_, lr, std::sqrt(host_sumsq_));
  }
  if (time_.tracing()) time_.span("main", "optimizer", t0, comm::Work::now_ns());
  time_.device_span("gpu", "optimizer", mark0, time_.device_mark());
  if (layout_->dp() == 1) return;  // AdamW wrote the working copies in its pass
  // A split master's shard is its halves: its f32 values for the all-gather.
  for (layers::Parameter& p : pieces_) {
    if (!p.work_lo.defined()) continue;
    kernels::master_join(ctx_.ex, p.work, p.work_lo, p.value);
    p.value_stale = false;
  }
  // Per bucket, in forward order; the next forward waits for each block's own bucket
  // (elastic workers wait here: their state is committed right after the step; a captured
  // step joins every stream it forked before its end).
  for (size_t i : param_order_) {
    buckets_[i].param.lo = buckets_[i].lo;
    buckets_[i].param.hi = buckets_[i].hi;
    param_bucket_launch(*groups_.dp, ctx_, buf_.values(), shard_len_, buckets_[i].param, time_,
                        "params all_gather (dp)");
  }
  params_pending_ = true;
  if (!tc_.parallel.overlap_param_gather || throw_on_comm_error() || graph_) await_params(kEndBucket - 1);
}

void Stage::enqueue_step(int64_t step, bool capturing) {
  lm_acc_ = tokens_acc_ = 0;
  if (device_stats_) kernels::fill(ctx_.ex, stats_, 0.0f);
  buf_.zero_grad(ctx_);

  // ---- 1F1B over the micro-batches ---------------------------------------------------
  const int64_t mcount = tc_.train.grad_accum;
  const int64_t warm = std::min<int64_t>(layout_->pp() - coord_.pp - 1, mcount);
  std::vector<Micro> micro(static_cast<size_t>(mcount));
  int64_t f = 0, k = 0;
  for (auto& bk : buckets_) bk.grad_launched = false;
  for (; f < warm; ++f) forward(f, micro[static_cast<size_t>(f)]);
  for (; f < mcount; ++f) {
    forward(f, micro[static_cast<size_t>(f)]);
    last_micro_ = k == mcount - 1;
    backward(micro[static_cast<size_t>(k++)]);
  }
  for (; k < mcount; ++k) {
    last_micro_ = k == mcount - 1;
    backward(micro[static_cast<size_t>(k)]);
  }
  last_micro_ = false;
  await_sends();

  // ---- gradient synchronisation ------------------------------------------------------
  sync_grads();
  if (tc_.parallel.measure_compression && tc_.parallel.compression && layout_->dp() > 1 && !ctx_.on_device())
    measure_compression(step);

  // ---- norm, statistics, optimizer ---------------------------------------------------
  if (device_stats_) {
    Tensor sumsq = stats_.narrow(0, kSumSq, 1);
    if (layout_->dp() == 1) {
      buf_.grad_norm_squared_into(ctx_, sumsq, in_norm_);  // folded gradients from their slots
    } else {
      std::vector<const Tensor*> norm;
      for (size_t i = 0; i < pieces_.size(); ++i)
        if (piece_in_norm_[i]) norm.push_back(&pieces_[i].grad);
      kernels::sum_squares_into(ctx_.ex, norm, sumsq, /*accumulate=*/false);
    }
    if (tokens_acc_ > 0) {
      Tensor tokens = stats_.narrow(0, kTokens, 1);
      kernels::fill(ctx_.ex, tokens, static_cast<float>(tokens_acc_));  // a replay's are the captured step's
    }
    if (!capturing && time_.seconds() > 0) {
      Tensor secs = stats_.narrow(0, kCommSeconds, 1);  // a replay waits on nothing
      kernels::fill(ctx_.ex, secs, static_cast<float>(time_.seconds()));
    }
    program_->finish_device_stats(ctx_);
    all_reduce_sum(*world_, stats_, time_, "step metrics");
  } else {
    host_metrics();
  }
  optimizer_step(tc_.lr.at(step));
}

void Stage::host_metrics() {
  // Host statistics (bench.device_stats = false, or a program keeping its own on the
  // host): [sum of squares, LM loss, tokens, comm seconds | the program's statistics],
  // read back and summed over the world in fp64.
  const std::vector<double> stats = program_->step_stats();
  std::vector<double> v(kHostOwn + stats.size(), 0.0);
  std::copy(stats.begin(), stats.end(), v.begin() + kHostOwn);
  v[0] = grad_sum_squares();
  v[1] = lm_acc_;
  v[2] = tokens_acc_;
  v[3] = time_.seconds();
  sum_doubles(*world_, v, time_, "step metrics");
  host_sumsq_ = v[0];
  host_stats_ = std::move(v);
}

void Stage::measure_compression(int64_t step) {
  // bench.measure_compression (tests, benches; host tensors): the relative L2 error of
  // the compressed gradient against an extra fp32 exchange of the same gradients.
  Tensor exact = Tensor::zeros({shard_len_}, DType::kF32);
  for (const auto& bk : buckets_) {
    Bucket x;
    x.lo = bk.lo;
    x.hi = bk.hi;
    grad_bucket_launch(*groups_.dp, ctx_, buf_.grad_range(bk.lo, bk.hi), shard_len_, DType::kF32, x, time_,
                       "measure grads reduce_scatter (dp)");
    grad_bucket_finish(ctx_, x, exact, shard_len_, time_);
  }
  const int64_t rep_in_shard = std::clamp<int64_t>(rep_size_ - shard_lo_, 0, shard_len_);
  if (layout_->n() > 1 && rep_in_shard > 0) {
    all_reduce_sum(*groups_.n, exact.narrow(0, 0, rep_in_shard), time_, "measure grads all_reduce (n)");
  }
  std::vector<double> v{0.0, 0.0};  // [squared error, squared reference]
  const float* base = shard_grad_.data<float>();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (!piece_in_norm_[i]) continue;
    const float* g = pieces_[i].grad.data<float>();
    const float* x = exact.data<float>() + (g - base);
    for (int64_t j = 0; j < pieces_[i].grad.numel(); ++j) {
      const double d = static_cast<double>(g[j]) - static_cast<double>(x[j]);
      v[0] += d * d;
      v[1] += static_cast<double>(x[j]) * static_cast<double>(x[j]);
    }
  }
  sum_doubles(*world_, v, time_, "measure grads metrics");
  if (rank_ == 0) {
    fmt::print(stderr, "compression: step {} relative gradient error {:.4e} (bf16 gradient exchange{})\n",
               step, v[1] > 0 ? std::sqrt(v[0] / v[1]) : 0.0,
               tc_.parallel.fp8_dispatch ? ", fp8 dispatch" : "");
  }
}

bool Stage::can_launch_ahead() const {
  if (!tc_.train.launch_ahead) return false;
  if (!ctx_.on_device() || !device_stats_) return true;  // launch_step runs the whole step
  return graph_ && graph_->captured() && !program_->updates_between_steps();
}

void Stage::launch_step(int64_t step) {
  bind_device();
  TROUPE_CHECK(launched_.empty() || launched_.back()->step == step - 1,
               "Stage::launch_step({}) after step {} (steps are launched in order)", step,
               launched_.empty() ? 0 : launched_.back()->step);
  TROUPE_CHECK(launched_.size() < 2, "Stage::launch_step({}): two steps are unfinished already", step);
  auto l = std::make_unique<Launched>();
  l->step = step;
  l->lr = tc_.lr.at(step);
  l->launched_at = Clock::now();
  const HostBatch b = read_batch(step);
  // Replayed while the batch's target counts are the captured step's (its loss scale).
  const bool replay = graph_ && graph_->captured() && b.tokens == graph_tokens_;
  bool capture = graph_ && !graph_->captured() && graph_warm_;
  if (capture) {
    // What the program decided in its op-by-op step may keep it op by op (e.g. an expert
    // dispatch that fell back to the host counts).
    const std::string why = program_->graph_blocker();
    if (!why.empty()) {
      if (Status st = graph_blocked(why, " from now on"); !st.ok()) throw std::runtime_error(st.to_string());
      graph_.reset();
      capture = false;
    }
  }
  if (graph_ && graph_->captured() && !replay && !graph_mismatch_told_ && rank_ == 0) {
    fmt::print(
        "stage: step {} has other counts of targets than the captured step: it runs op by op (so does "
        "any such step)\n",
        step);
    graph_mismatch_told_ = true;
  }
  // A step that runs its host code cannot interleave it with a step in flight.
  if (!replay) complete_in_flight();
  if (launched_.empty() && ctx_.on_device()) ctx_.alloc->reset_peak();
  time_.reset();
  time_.set_tracing(!tc_.train.timeline_dir.empty());
  time_.set_trace_step(step);
  void* step_mark = time_.device_mark();
  l->t0_ns = comm::Work::now_ns();
  const int64_t syncs0 = host_reads();
  const int64_t uploads0 = host_uploads();
  if (ctx_.on_device()) l->bytes0 = static_cast<int64_t>(ctx_.alloc->bytes_in_use());
  if (marks_) {
    marks_->begin(static_cast<int>(step % 3));
    if (first_marked_step_ < 0) first_marked_step_ = step;
  }
  upload(b);
  if (opt_->device_schedule()) opt_->prepare_step(ctx_, l->lr);
  if (replay) {
    graph_->replay();
    l->replay = true;
    // The replay's collectives were captured: one fence per communicator tracks them.
    for (ElasticComm* c : elastic_comms_) {
      if (c->size() > 1) time_.issue(c->fence(time_.op_options()), "captured step");
    }
  } else if (capture) {
    Status st = graph_->begin_capture();
    if (st.ok()) {
      enqueue_step(step, /*capturing=*/true);
      st = graph_->end_capture();
    }
    if (!st.ok()) throw std::runtime_error(st.to_string());
    graph_peak_ = ctx_.alloc->peak_bytes_in_use();
    graph_tokens_ = b.tokens;
    program_->step_captured();
    graph_->replay();  // the captured step itself
    for (ElasticComm* c : elastic_comms_) {
      if (c->size() > 1) time_.issue(c->fence(time_.op_options()), "captured step");
    }
    if (rank_ == 0) {
      fmt::print(
          "stage: step {} captured as a CUDA graph ({:.2f} GiB of activations and temporaries held by "
          "it); later steps replay it\n",
          step, static_cast<double>(graph_->pool_bytes()) / 1073741824.0);
    }
  } else {
    enqueue_step(step, /*capturing=*/false);
    graph_warm_ = graph_ != nullptr;
  }
  time_.device_span("gpu", "step", step_mark, time_.device_mark());
  if (marks_) marks_->end(static_cast<int>(step % 3));
  if (device_stats_) readback_->start(static_cast<int>(step % 2), stats_);
  l->host_syncs = host_reads() - syncs0;
  l->upload_waits = host_uploads() - uploads0;
  l->comm_s = time_.seconds();
  l->comm_by_kind_s = time_.by_kind();
  ++steps_launched_;
  launched_.push_back(std::move(l));
  // Host statistics: the step is done (its sums were read inside it).
  if (!device_stats_) {
    Launched& h = *launched_.back();
    h.report = complete(h);
    h.done = true;
  }
}

StepReport Stage::finish_step(int64_t step) {
  bind_device();
  TROUPE_CHECK(!launched_.empty() && launched_.front()->step == step,
               "Stage::finish_step({}): the oldest unfinished step is {}", step,
               launched_.empty() ? std::string("none") : std::to_string(launched_.front()->step));
  std::unique_ptr<Launched> l = std::move(launched_.front());
  launched_.pop_front();
  StepReport rep = l->done ? std::move(l->report) : complete(*l);
  // A step launched while another was in flight began, for its cost, when that one's
  // results were in: the time between two such finishes is what each step costs.
  const Clock::time_point t0 = std::max(l->launched_at, last_finish_);
  last_finish_ = Clock::now();
  if (!l->done || device_stats_) {
    rep.step_ms = std::chrono::duration<double>(last_finish_ - t0).count() * 1e3;
    rep.compute_ms = rep.step_ms - rep.comm_ms;
  }
  return rep;
}

void Stage::complete_in_flight() {
  for (auto& l : launched_) {
    if (l->done) continue;
    l->report = complete(*l);
    l->done = true;
  }
}

StepReport Stage::complete(Launched& l) {
  StepReport rep;
  rep.step = l.step;
  rep.lr = l.lr;
  std::vector<double> program_sums;
  if (device_stats_) {
    // The step's one read: its statistics, summed over the world on the device.
    const float* p = readback_->wait(static_cast<int>(l.step % 2));
    // The step's work is done: check its collectives (not while a later step is in flight:
    // its own are checked with it).
    const bool last = launched_.empty() || launched_.back().get() == &l;
    if (ctx_.on_device() && last) time_.drain("step collectives");
    if (l.replay) program_->step_replayed();
    rep.grad_norm = std::sqrt(static_cast<double>(p[kSumSq]));
    rep.tokens = std::llround(static_cast<double>(p[kTokens]));
    rep.comm_ms_mean = static_cast<double>(p[kCommSeconds]) / layout_->world_size() * 1e3;
    for (int64_t m = 0; m < tc_.train.grad_accum; ++m) rep.lm_loss += static_cast<double>(p[kStatsOwn + m]);
    const float* q = p + kStatsOwn + tc_.train.grad_accum;
    program_sums.assign(q, q + program_stats_);
  } else {
    rep.grad_norm = std::sqrt(host_stats_[0]);
    rep.lm_loss = host_stats_[1];
    rep.tokens = std::llround(host_stats_[2]);
    rep.comm_ms_mean = host_stats_[3] / layout_->world_size() * 1e3;
    program_sums.assign(host_stats_.begin() + kHostOwn, host_stats_.end());
    if (ctx_.on_device()) time_.drain("step collectives");
  }
  // The program's statistics (e.g. aux loss, expert loads; train_moe updates its router
  // biases from the loads here).
  program_->end_step(ctx_, program_sums, rep);
  rep.loss = rep.lm_loss + rep.aux_loss;
  rep.comm_ms = l.comm_s * 1e3;
  for (const auto& [kind, sec] : l.comm_by_kind_s) rep.comm_by_kind_ms[kind] = sec * 1e3;
  if (ctx_.on_device()) {
    // A replay allocates nothing: its peak is the captured step's.
    size_t peak = ctx_.alloc->peak_bytes_in_use();
    if (l.replay) peak = std::max(peak, graph_peak_);
    rep.peak_bytes = static_cast<int64_t>(peak);
    rep.host_syncs = l.host_syncs;
    rep.upload_waits = l.upload_waits;
    rep.activation_bytes = std::max<int64_t>(0, rep.peak_bytes - l.bytes0);
    rep.device_ms = marks_->ms(static_cast<int>(l.step % 3));
    if (first_marked_step_ >= 0 && l.step - 1 >= first_marked_step_)
      rep.device_gap_ms = marks_->gap_ms(static_cast<int>((l.step - 1) % 3), static_cast<int>(l.step % 3));
  }
  rep.rss_peak_bytes = peak_resident_bytes();
  rep.step_ms = std::chrono::duration<double>(Clock::now() - l.launched_at).count() * 1e3;
  rep.compute_ms = rep.step_ms - rep.comm_ms;
  if (time_.tracing()) write_trace(l.step, l.t0_ns);
  return rep;
}

void Stage::write_trace(int64_t step, int64_t t0_ns) {
  // One JSON line per event (bench/overlap/timeline.py draws them).
  const std::string path = fmt::format("{}/rank{}.jsonl", tc_.train.timeline_dir, rank_);
  if (FILE* fp = std::fopen(path.c_str(), "a")) {
    time_.span("main", "step", t0_ns, comm::Work::now_ns());
    const auto line = [&](int64_t s, const TraceEvent& e) {
      std::fprintf(fp,
                   "{\"step\":%lld,\"rank\":%d,\"lane\":\"%s\",\"what\":\"%s\",\"t0\":%lld,\"t1\":%lld}\n",
                   static_cast<long long>(s), rank_, e.lane.c_str(), e.what.c_str(),
                   static_cast<long long>(e.t0), static_cast<long long>(e.t1));
    };
    for (const TraceEvent& e : time_.take_trace()) line(step, e);
    // Device spans (lanes "gpu ..."): ns since their step's first mark on the device, written
    // once their events have completed (an earlier step's, with launch-ahead).
    for (const auto& [s, e] : time_.take_device_trace()) line(s, e);
    std::fclose(fp);
  }
}

double Stage::evaluate() {
  settle();
  bind_device();
  const layers::Ctx& c = ctx_;
  double sum = 0, tokens = 0;
  for (int64_t k = 0; k < tc_.train.eval_batches; ++k) {
    if (k % layout_->dp() != coord_.dp) continue;
    Micro m;
    if (first_ || last_) load_eval(k, m);
    Tensor x = first_ ? program_->embed(c, m.ids) : recv_from(coord_.pp - 1, false);
    x = blocks_forward(c, x, m, false);
    if (last_) {
      sum += program_->head_loss_sum(c, x, m.targets);
      if (coord_.n == 0) tokens += static_cast<double>(m.tokens);
    } else {
      send_to(x, coord_.pp + 1, false);
    }
  }
  await_sends();
  time_.drain("eval collectives");
  std::vector<double> v{sum, tokens};
  sum_doubles(*world_, v, time_, "eval metrics");
  return v[0] / std::max(1.0, v[1]);
}

}  // namespace troupe::training
