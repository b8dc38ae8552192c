// training/stage/stage.cc — Stage (stage.h): construction, the communicators, the model
// part of one rank and its parameters, the step engine's setup and the dp gradient
// buckets. The micro-batches and the 1F1B pipeline are in stage_pipeline.cc; the step
// (gradient synchronisation, the ZeRO-1 optimizer shard, launch/finish, metrics,
// evaluation) in stage_step.cc.
#include "training/stage/stage.h"

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

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda/host_wait.h"
#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif
#if TROUPE_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace troupe::training {

Stage::Stage(const layers::TrainConfig& tc, int rank, layers::TokenShards train, layers::TokenShards val)
    : tc_(tc), rank_(rank), train_data_(std::move(train)), val_data_(std::move(val)) {}

Stage::~Stage() {
  // Sends still in flight reference tensors we own; wait for them (bounded by the op
  // timeout) before the buffers go.
  for (auto& w : pending_sends_) (void)w->wait();
  for (auto& b : buckets_) {
    if (b.param.op.pending()) (void)b.param.op.work->wait();
    if (b.grad.op.pending()) (void)b.grad.op.work->wait();
#if TROUPE_HAVE_CUDA
    for (CommOp* op : {&b.param.op, &b.grad.op})
      if (op->event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(op->event));
#endif
  }
  graph_.reset();  // waits for a replay still running, then gives its memory back
  readback_.reset();
  marks_.reset();
#if TROUPE_HAVE_CUDA
  for (CommOp& op : pending_send_ops_)
    if (op.event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(op.event));
  for (void* st : {comm_stream_, p2p_streams_[0], p2p_streams_[1]}) {
    if (st == nullptr) continue;
    cudaStreamSynchronize(static_cast<cudaStream_t>(st));
    cudaStreamDestroy(static_cast<cudaStream_t>(st));
  }
#endif
}

Result<std::unique_ptr<Stage>> Stage::create(const layers::TrainConfig& tc, int rank,
                                             const ProgramFactory& program, comm::RendezvousStore& store,
                                             const comm::StoreNamespace& ns, layers::TokenShards train,
                                             layers::TokenShards val, const layers::Ctx& ctx) {
  if (!program) return invalid_argument("Stage: no stage program given");
  std::unique_ptr<Stage> s(new Stage(tc, rank, std::move(train), std::move(val)));
  s->ctx_ = ctx;
  s->init_snapshot_copy();
  s->bind_device();
  if (ctx.on_device()) {
    const auto& par = tc.parallel;
#if !TROUPE_HAVE_NCCL
    return unimplemented("Stage on {}: this build has no NCCL (needed for GPU workers)", ctx.ex.device);
#endif
    s->time_.set_device(&s->ctx_);
#if TROUPE_HAVE_CUDA
    if (par.overlap_a2a || par.overlap_grad_sync || par.overlap_param_gather) {
      cudaStream_t cs = nullptr;
      CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
      s->comm_stream_ = cs;
      s->time_.set_comm_stream(cs);
    }
    if (par.pp > 1) {
      for (void*& ps : s->p2p_streams_) {
        cudaStream_t st = nullptr;
        CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        ps = st;
      }
    }
#endif
  }
  TROUPE_RETURN_IF_ERROR(s->build(program, store, ns));
  return s;
}

Status Stage::build(const ProgramFactory& program, comm::RendezvousStore& store,
                    const comm::StoreNamespace& ns) {
  const auto& par = tc_.parallel;
  TROUPE_RETURN_IF_ERROR(par.validate(tc_.model, tc_.train));
  TROUPE_ASSIGN_OR_RETURN(
      ParallelLayout layout,
      ParallelLayout::make(static_cast<int>(par.pp), static_cast<int>(par.dp), static_cast<int>(par.n)));
  layout_ = std::make_unique<ParallelLayout>(layout);
  if (rank_ < 0 || rank_ >= layout.world_size()) {
    return invalid_argument("rank {} is outside the layout {} ({} ranks)", rank_, layout.to_string(),
                            layout.world_size());
  }
  coord_ = layout.coord(rank_);
  loader_ = std::make_unique<layers::DataLoader>(train_data_, tc_.train.seed, tc_.train.seq_len);
  val_loader_ = std::make_unique<layers::DataLoader>(val_data_, tc_.train.seed, tc_.train.seq_len);

  // ---- communicators (the same order on every rank) ----------------------------------
  comm::CommSpec base;
  base.store = &store;
  base.ns = ns;
  comm::CommFactory inner = [](const comm::CommSpec& spec) { return comm::make_gloo_communicator(spec); };
#if TROUPE_HAVE_NCCL
  if (ctx_.on_device()) {
    inner = [device = ctx_.ex.device.index](const comm::CommSpec& spec) {
      return comm::make_nccl_communicator(spec, comm::NcclOptions{device});
    };
  }
#endif
  const comm::CommFactory factory = elastic_factory(std::move(inner));
  TROUPE_ASSIGN_OR_RETURN(groups_, comm::make_process_groups(layout, rank_, base, factory));
  comm::CommSpec ws = base;
  ws.name = "world";
  ws.rank = rank_;
  ws.size = layout.world_size();
  TROUPE_ASSIGN_OR_RETURN(world_, factory(ws));
  first_ = coord_.pp == 0;
  last_ = coord_.pp == layout.pp() - 1;
  if (ctx_.on_device() && layout.pp() > 1) {
    comm::CommSpec bs = base;
    bs.name = "back_" + layout.pp_group_name(rank_);
    bs.rank = coord_.pp;
    bs.size = layout.pp();
    TROUPE_ASSIGN_OR_RETURN(pp_back_, factory(bs));
  }

  // ---- the program (this rank's model part) -------------------------------------------
  batch_ = tc_.train.micro_batch_size;
  seq_local_ = tc_.train.seq_len / layout.n();
  loss_weight_ = 1.0f / static_cast<float>(tc_.train.grad_accum * layout.dp());
  const StageEnv env{tc_,        coord_,       layout.pp(), layout.dp(),
                     layout.n(), first_,       last_,       batch_,
                     seq_local_, loss_weight_, ctx_,        layout.n() > 1 ? groups_.n.get() : nullptr,
                     time_};
  TROUPE_ASSIGN_OR_RETURN(program_, program(env));
  if (program_ == nullptr) return internal_error("Stage: the program factory returned nothing");
  num_blocks_ = program_->num_blocks();
  std::vector<ProgramParam> params = program_->parameters();
  // The tied pair: the first stage's tied parameter and the last stage's copy.
  int tied = 0, copies = 0;
  for (const auto& p : params) {
    if (p.param == nullptr) return invalid_argument("stage program: parameter '{}' has no Parameter", p.name);
    if (p.tied && p.tied_copy)
      return invalid_argument("stage program: '{}' is both tied and a tied copy", p.name);
    if ((p.tied && !first_) || (p.tied_copy && !last_)) {
      return invalid_argument("stage program: '{}' is {} on stage {} (tied: first stage; copies: last stage)",
                              p.name, p.tied ? "tied" : "a tied copy", coord_.pp);
    }
    if (p.tied_copy && !p.name.ends_with("[tied copy]")) {
      return invalid_argument("stage program: the tied copy '{}' must be named '<parameter>[tied copy]'",
                              p.name);
    }
    tied += p.tied ? 1 : 0;
    copies += p.tied_copy ? 1 : 0;
    if ((p.tied || p.tied_copy) && layout.pp() > 1) tied_params_.push_back(p.param);
  }
  if (tied > 1 || copies > 1)
    return invalid_argument("stage program: more than one tied parameter per stage");
  if (layout.pp() > 1 && !tied_params_.empty()) {
    comm::CommSpec ts = base;
    ts.name = fmt::format("tied_dp{}_n{}", coord_.dp, coord_.n);
    ts.rank = first_ ? 0 : 1;
    ts.size = 2;
    TROUPE_ASSIGN_OR_RETURN(tied_, factory(ts));
  }
  TROUPE_RETURN_IF_ERROR(setup_params(params));
  return setup_engine();
}

Status Stage::setup_params(const std::vector<ProgramParam>& params) {
  const bool n_lead = coord_.n == 0;
  std::vector<Entry> all;
  for (const auto& p : params) {
    const int64_t ready = p.grad_ready;
    if (ready != kGradReadyAtEnd && ready != kGradReadyAfterHead && (ready < 0 || ready >= num_blocks_)) {
      return invalid_argument(
          "stage program: parameter '{}' has grad_ready {} (blocks 0..{}, or kGradReadyAtEnd / "
          "kGradReadyAfterHead)",
          p.name, ready, num_blocks_ - 1);
    }
    for (const Entry& e : all) {
      if (e.param == p.param)
        return invalid_argument("stage program: parameter '{}' is listed twice", p.name);
    }
    // n-sharded parameters count in the norm on every rank; replicated ones on n-rank 0;
    // a tied copy never (the first stage counts the parameter).
    all.push_back(Entry{p.name, p.param, p.sharded, p.sharded || (n_lead && !p.tied_copy), ready, p.role});
  }
  // The buffer's order: the n-replicated parameters, then the n-sharded ones (a bf16
  // gradient tail among the latter: ParamBuffer puts those last).
  std::vector<layers::NamedParameter> named;
  for (const bool sharded : {false, true}) {
    for (const Entry& e : all)
      if (e.expert == sharded) named.push_back({e.name, e.param});
  }
  const int64_t dp = layout_->dp();
  layers::ParamBuffer::Options o;
  o.expert_grads = tc_.train.expert_grads;
  o.shards = dp;
  buf_.build(ctx_, named, o);
  entries_.clear();
  rep_size_ = -1;
  for (const layers::ParamBuffer::Slot& s : buf_.slots()) {
    Entry e = *std::find_if(all.begin(), all.end(), [&](const Entry& x) { return x.param == s.param; });
    e.offset = s.offset;
    if (s.low && !e.expert) {
      return invalid_argument(
          "stage program: '{}' would get a bf16 gradient (train.expert_grads) but is replicated over the "
          "n-group, whose gradient sum is f32: only n-sharded parameters may",
          e.name);
    }
    if (e.expert && rep_size_ < 0) rep_size_ = e.offset;
    entries_.push_back(std::move(e));
  }
  if (rep_size_ < 0) rep_size_ = buf_.used();
  flat_size_ = buf_.used();
  int64_t low = 0;
  for (const layers::ParamBuffer::Slot& s : buf_.slots()) low += s.low ? 1 : 0;
  if (low > 0 && rank_ == 0) {
    fmt::print("stage: the experts' weight gradients are bf16 ({} parameters, train.expert_grads)\n", low);
  }
  in_norm_.clear();
  for (const Entry& e : entries_) in_norm_.push_back(e.in_norm);
  // train.master_weights = "split" where the products read bf16 working copies (GPUs); the
  // CPU computes from the f32 masters (app.cc says so).
  if (tc_.train.split_master && ctx_.on_device()) buf_.split_masters(ctx_);

  shard_len_ = buf_.size() / dp;
  shard_lo_ = coord_.dp * shard_len_;
  shard_grad_ = dp > 1 ? ctx_.zeros({shard_len_}, DType::kF32) : Tensor();
  pieces_.clear();
  piece_in_norm_.clear();
  for (auto& e : entries_) {
    const int64_t a = std::max(e.offset, shard_lo_);
    const int64_t b = std::min(e.offset + e.param->numel(), shard_lo_ + shard_len_);
    if (a >= b) continue;
    layers::Parameter piece;
    piece.value = buf_.values().narrow(0, a, b - a);
    piece.grad = dp > 1 ? shard_grad_.narrow(0, a - shard_lo_, b - a)
                        : e.param->grad.view({e.param->numel()}).narrow(0, a - e.offset, b - a);
    piece.decay = e.param->decay;
    // A split master's piece is its halves' slices: AdamW updates those (values are joined
    // before the dp all-gather).
    if (e.param->work_lo.defined()) {
      piece.work = e.param->work.view({e.param->numel()}).narrow(0, a - e.offset, b - a);
      piece.work_lo = e.param->work_lo.view({e.param->numel()}).narrow(0, a - e.offset, b - a);
    }
    pieces_.push_back(piece);
    piece_in_norm_.push_back(e.in_norm);
  }
  // Unsharded (dp == 1) the optimizer updates the parameters themselves, writing their
  // working copies in its own pass (no cast pass after the step); with dp > 1 its pieces.
  std::vector<layers::NamedParameter> opt_params;
  if (dp == 1) {
    for (auto& e : entries_) opt_params.push_back({e.name, e.param});
  } else {
    for (size_t i = 0; i < pieces_.size(); ++i)
      opt_params.push_back({fmt::format("piece{}", i), &pieces_[i]});
  }
  opt_ = std::make_unique<layers::AdamW>(opt_params, tc_.optim, ctx_);
  opt_->write_working_copies(true);
  // The folded norm where it is exact: n-sharded gradients (never summed over the n-group)
  // that no dp reduction changes between their product and the norm.
  if (tc_.train.fold_grad_norm && dp == 1) {
    std::vector<bool> eligible;
    for (const Entry& e : entries_) eligible.push_back(e.expert);
    const int64_t folded = buf_.enable_grad_norm_fold(ctx_, eligible);
    if (folded > 0 && rank_ == 0) {
      fmt::print("stage: gradient norm folded into the dW products of {} parameters (bench.fold_grad_norm)\n",
                 folded);
    }
  }
  setup_buckets();
  return ok_status();
}

Status Stage::graph_blocked(std::string_view why, std::string_view when) const {
  if (tc_.train.cuda_graph_asked) {
    return failed_precondition(
        "bench.cuda_graph = true cannot capture this layout's step ({}): {}; set bench.cuda_graph = false",
        layout_->to_string(), why);
  }
  if (rank_ == 0) {
    fmt::print("note: the step runs op by op{}, not as a CUDA graph (bench.cuda_graph), in layout {}: {}\n",
               when, layout_->to_string(), why);
  }
  return ok_status();
}

Status Stage::setup_engine() {
  const auto& t = tc_.train;
  const int64_t program_size = program_->device_stats_size();
  // The step's statistics stay on the device unless asked not to, or the program keeps its
  // own on the host, or its head reports the loss as a host value.
  // Every rank decides the same from the config alone (device_stats_size()'s contract):
  // the step's statistics are one collective over the world (an all-reduce on the device,
  // or an fp64 all-gather on the host), and no exchange may decide it at setup (a
  // replacement worker sets up alone while the survivors keep their Stage).
  device_stats_ = t.device_stats && program_size >= 0;
  if (device_stats_) {
    program_stats_ = program_size;
    stats_ = ctx_.zeros({kStatsOwn + t.grad_accum + program_size}, DType::kF32);
    if (program_size > 0)
      program_->bind_device_stats(stats_.narrow(0, kStatsOwn + t.grad_accum, program_size));
    readback_ = std::make_unique<StatsReadback>(ctx_, 2);
  }
  if (ctx_.on_device()) marks_ = std::make_unique<DeviceMarks>(ctx_, 3);
  if (ctx_.on_device() && t.cuda_graph) {
    std::string why;
    if (!t.device_stats) {
      why = "bench.device_stats = false reads the step's statistics on the host inside the step";
    } else if (!device_stats_) {
      why = "the stage program keeps its step statistics on the host";
    } else if (last_ && program_->head() == nullptr) {
      why = "the stage program's loss (no head()) is a host value";
    } else if (const auto faults = parse_faults(tc_.elastic.inject);
               faults.ok() && std::any_of(faults->begin(), faults->end(),
                                          [](const FaultSpec& f) { return f.inside_step(); })) {
      why = "test.inject has faults at points inside a step, which a replayed graph does not pass";
    } else {
      why = program_->graph_blocker();
    }
    if (!why.empty()) {
      TROUPE_RETURN_IF_ERROR(graph_blocked(why, ""));
    } else {
      graph_ = std::make_unique<StepGraph>(ctx_);
      opt_->use_device_schedule(ctx_);  // the update's launch the same every step
    }
  }
  return ok_status();
}

void Stage::setup_buckets() {
  buckets_.clear();
  param_order_.clear();
  if (layout_->dp() <= 1) return;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    const int64_t key = e.ready;
    // Replicated and expert parts never share one, nor f32 and bf16 gradients.
    const bool split = e.offset == rep_size_ || e.offset == buf_.low_begin();
    if (buckets_.empty() || buckets_.back().ready != key || split || buckets_.back().hi != e.offset) {
      buckets_.emplace_back();
      buckets_.back().lo = e.offset;
      buckets_.back().ready = key;
    }
    // The padding after a parameter travels with it (zeros), so neighbours stay one range.
    buckets_.back().hi = std::min(e.offset + layers::ParamBuffer::padded(e.param->numel()), buf_.size());
    buckets_.back().entries.push_back(i);
  }
  // Forward order for the parameter all-gather: the embedding, each block (replicated,
  // then experts), the head, a tied copy.
  auto rank_of = [&](const SyncBucket& b) -> int64_t {
    if (b.ready == kEndBucket) return first_ && b.lo == 0 ? -1 : num_blocks_ + 1;
    if (b.ready == kHeadBucket) return num_blocks_;
    return b.ready;
  };
  for (size_t i = 0; i < buckets_.size(); ++i) param_order_.push_back(i);
  std::stable_sort(param_order_.begin(), param_order_.end(),
                   [&](size_t a, size_t b) { return rank_of(buckets_[a]) < rank_of(buckets_[b]); });
}

void Stage::launch_grad_buckets(int64_t ready) {
  for (auto& b : buckets_) {
    if (b.ready != ready || b.grad_launched) continue;
    b.grad_launched = true;
    buf_.settle_grads(ctx_, b.entries);  // a gradient no product wrote is zero, not stale
    b.grad.lo = b.lo;
    b.grad.hi = b.hi;
    // bf16 gradients (train.expert_grads) travel as they are; f32 ones in bf16 with
    // parallel.compression. Either way the shard sums them in f32.
    const bool low = b.lo >= buf_.low_begin();
    const DType wire = low || tc_.parallel.compression ? DType::kBF16 : DType::kF32;
    grad_bucket_launch(*groups_.dp, ctx_, buf_.grad_range(b.lo, b.hi), shard_len_, wire, b.grad, time_,
                       wire == DType::kBF16 ? "bf16 grads reduce_scatter (dp)" : "grads reduce_scatter (dp)");
  }
}

void Stage::await_params(int64_t ready) {
  if (!params_pending_) return;
  bool any_left = false;
  for (auto& b : buckets_) {
    if (!b.param.op.pending()) continue;
    if (ready != kEndBucket - 1 && b.ready != ready) {
      any_left = true;
      continue;
    }
    time_.await(b.param.op);
    b.param.send = b.param.recv = Tensor();
    buf_.refresh_working_copies(ctx_, b.entries);  // the copies (split halves) of what landed
  }
  params_pending_ = any_left;
}

void Stage::settle() {
  bind_device();
  TROUPE_CHECK(launched_.empty(), "Stage: rank {}: step {} is launched and not finished: finish_step first",
               rank_, launched_.empty() ? 0 : launched_.front()->step);
  await_params(kEndBucket - 1);  // every bucket
  if (ctx_.on_device()) {
    time_.drain("parameter all_gather (dp)");
    synchronize();
  }
  buf_.sync_master_values(ctx_);  // split masters: the values up to date for readers
}

void Stage::refresh_working_copies() {
  buf_.values_written();
  buf_.refresh_working_copies(ctx_);
}

double Stage::grad_sum_squares() const {
  if (layout_->dp() == 1) return buf_.grad_norm_squared(ctx_, in_norm_);
  std::vector<const Tensor*> norm;
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (piece_in_norm_[i]) norm.push_back(&pieces_[i].grad);
  return norm.empty() ? 0.0 : kernels::sum_squares_multi(ctx_.ex, norm);
}

void Stage::bind_device() const {
#if TROUPE_HAVE_CUDA
  if (ctx_.on_device()) CUDA_CHECK(cudaSetDevice(ctx_.ex.device.index));
#endif
}

void Stage::synchronize() const {
#if TROUPE_HAVE_CUDA
  if (ctx_.on_device() && ctx_.ex.cuda != nullptr) CUDA_CHECK(cudaStreamSynchronize(ctx_.ex.cuda->stream));
#endif
}

}  // namespace troupe::training
