// training/stage/stage.cc — Stage: communicators, the model part of one rank, the 1F1B
// schedule, gradient synchronisation, the ZeRO-1 optimizer shard, the step metrics, and
// the step engine (launch_step / finish_step: statistics on the device, CUDA graph,
// launch-ahead; stage.h "Step engine").
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

using Clock = std::chrono::steady_clock;

struct Stage::Micro {
  Tensor ids, targets;                                      // local slices, i32 [B*S/n]
  int64_t tokens = 0;                                       // tokens with a target in the whole micro-batch
  std::vector<std::unique_ptr<StageProgram::Saved>> saved;  // per block
  Tensor head_dx;                                           // last stage: gradient from the LM head
};

// A step's training micro-batches as the loader gives them (first and last stage: the
// rank's slices of the sequences; other stages read no data).
struct Stage::HostBatch {
  std::vector<Tensor> ids, targets;  // per micro-batch, i32 [B*S/n] (host)
  std::vector<int64_t> tokens;       // per micro-batch: tokens with a target in the whole micro-batch
};

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

Status Stage::setup_engine() {
  const auto& t = tc_.train;
  const int64_t program_size = program_->device_stats_size();
  // The step's statistics stay on the device unless asked not to, or the program keeps its
  // own on the host (e.g. a z-loss router), or its head reports the loss as a host value.
  device_stats_ = t.device_stats && program_size >= 0 && (!last_ || program_->head() != nullptr);
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
      why = "the stage program keeps its step statistics on the host (e.g. a router with a z-loss)";
    } else {
      why = program_->graph_blocker();
    }
    if (!why.empty() && t.cuda_graph_asked) {
      return failed_precondition(
          "bench.cuda_graph = true cannot capture this layout's step ({}): {}; set "
          "bench.cuda_graph = false",
          layout_->to_string(), why);
    }
    if (!why.empty()) {
      if (rank_ == 0) {
        fmt::print("note: the step runs op by op, not as a CUDA graph (bench.cuda_graph), in layout {}: {}\n",
                   layout_->to_string(), why);
      }
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

// ---- micro-batches and the pipeline ------------------------------------------------------

namespace {
int64_t count_targets(const Tensor& targets) {
  const int32_t* tp = targets.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) n += tp[i] >= 0 ? 1 : 0;
  return n;
}
}  // namespace

Stage::HostBatch Stage::read_batch(int64_t step) const {
  HostBatch b;
  if (!first_ && !last_) return b;
  const int64_t ga = tc_.train.grad_accum, off = coord_.n * seq_local_;
  for (int64_t m = 0; m < ga; ++m) {
    Tensor ids, targets;
    loader_->train_batch(step, coord_.dp, m, ga, batch_, ids, targets);
    b.tokens.push_back(count_targets(targets));
    b.ids.push_back(ids.narrow(1, off, seq_local_).contiguous().view({batch_ * seq_local_}));
    b.targets.push_back(targets.narrow(1, off, seq_local_).contiguous().view({batch_ * seq_local_}));
  }
  return b;
}

void Stage::upload(const HostBatch& b) {
  if (inputs_.size() != b.ids.size()) {
    inputs_.clear();
    for (size_t m = 0; m < b.ids.size(); ++m)
      inputs_.push_back(
          {ctx_.empty(b.ids[m].shape(), DType::kI32), ctx_.empty(b.targets[m].shape(), DType::kI32)});
  }
  // Enqueued on the stream: a step still running keeps reading the previous batch.
  for (size_t m = 0; m < b.ids.size(); ++m) {
    ctx_.copy_to_device(b.ids[m], inputs_[m].ids);
    ctx_.copy_to_device(b.targets[m], inputs_[m].targets);
  }
  micro_tokens_ = b.tokens;
}

void Stage::inputs_for(int64_t index, Micro& m) const {
  const size_t i = static_cast<size_t>(index);
  m.ids = inputs_.at(i).ids;
  m.targets = inputs_[i].targets;
  m.tokens = micro_tokens_.at(i);
}

void Stage::load_eval(int64_t index, Micro& m) const {
  Tensor ids, targets;
  val_loader_->eval_batch(index, tc_.train.eval_batches, batch_, ids, targets);
  m.tokens = count_targets(targets);
  const int64_t off = coord_.n * seq_local_;
  m.ids = ctx_.to_device(ids.narrow(1, off, seq_local_).contiguous().view({batch_ * seq_local_}));
  m.targets = ctx_.to_device(targets.narrow(1, off, seq_local_).contiguous().view({batch_ * seq_local_}));
}

Tensor Stage::recv_from(int peer_pp, bool grad) {
  Tensor buf = ctx_.empty({batch_ * seq_local_, program_->activation_width()});
  if (!ctx_.on_device()) {
    time_.wait(groups_.pp->recv(buf, peer_pp), "pipeline recv");
    return buf;
  }
  comm::Communicator& comm = grad ? *pp_back_ : *groups_.pp;
  CommOp op = time_.launch([&](const comm::OpOptions& o) { return comm.recv(buf, peer_pp, o); },
                           "pipeline recv", p2p_streams_[grad ? 1 : 0]);
  time_.await(op);
  return buf;
}

void Stage::send_to(const Tensor& t, int peer_pp, bool grad) {
  if (!ctx_.on_device()) {
    pending_sends_.push_back(groups_.pp->send(t.contiguous(), peer_pp));
    return;
  }
  comm::Communicator& comm = grad ? *pp_back_ : *groups_.pp;
  const Tensor tc = t.contiguous();
  pending_send_ops_.push_back(
      time_.launch([&](const comm::OpOptions& o) { return comm.send(tc, peer_pp, o); }, "pipeline send",
                   p2p_streams_[grad ? 1 : 0]));
}

void Stage::await_sends() {
  time_.wait_all(pending_sends_, "pipeline send");
  pending_sends_.clear();
  for (CommOp& op : pending_send_ops_) time_.await(op);
  pending_send_ops_.clear();
}

Tensor Stage::blocks_forward(const layers::Ctx& c, Tensor x, Micro& m, bool train) {
  m.saved.resize(static_cast<size_t>(num_blocks_));
  for (int64_t i = 0; i < num_blocks_; ++i) {
    if (train) await_params(i);
    const int64_t ts0 = time_.tracing() ? comm::Work::now_ns() : 0;
    x = program_->block_forward(c, i, x, m.saved[static_cast<size_t>(i)], train);
    if (time_.tracing()) time_.span("main", "forward " + program_->block_name(i), ts0, comm::Work::now_ns());
  }
  return x;
}

Tensor Stage::blocks_backward(const layers::Ctx& c, Tensor dy, Micro& m) {
  for (int64_t i = num_blocks_; i-- > 0;) {
    const int64_t ts0 = time_.tracing() ? comm::Work::now_ns() : 0;
    std::unique_ptr<StageProgram::Saved>& saved = m.saved[static_cast<size_t>(i)];
    TROUPE_CHECK(saved != nullptr);  // block_forward must leave what its backward needs
    dy = program_->block_backward(c, i, dy, *saved);
    saved.reset();  // free activations as soon as they are used
    if (time_.tracing()) time_.span("main", "backward " + program_->block_name(i), ts0, comm::Work::now_ns());
    // The step's last micro-batch has finished this block: its gradients are final.
    if (last_micro_ && tc_.parallel.overlap_grad_sync) launch_grad_buckets(i);
  }
  return dy;
}

void Stage::forward(int64_t index, Micro& m) {
  const layers::Ctx& c = ctx_;
  if (first_ || last_) inputs_for(index, m);
  if (first_) await_params(kEndBucket);
  Tensor x = first_ ? program_->embed(c, m.ids) : recv_from(coord_.pp - 1, false);
  x = blocks_forward(c, x, m, true);
  if (last_) {
    await_params(kHeadBucket);
    await_params(kEndBucket);
    const float scale = m.tokens > 0 ? loss_weight_ / static_cast<float>(m.tokens) : 0.0f;
    if (device_stats_) {
      // The token losses summed on the device into this micro-batch's slot, weighted as
      // the step's loss counts them (the token count is the host's: a replayed step has
      // the captured step's counts).
      Tensor losses = program_->head_losses(c, x, m.targets, scale, m.head_dx);
      TROUPE_CHECK(losses.defined(), "stage program: head_losses gave no token losses on the device");
      Tensor slot = stats_.narrow(0, kStatsOwn + index, 1);
      kernels::sum_rows(c.ex, losses.view({losses.numel(), 1}), slot, /*accumulate=*/false);
      kernels::scale(c.ex, slot, scale);
    } else {
      const double lm = program_->head_forward_backward(c, x, m.targets, scale, m.head_dx);
      lm_acc_ += lm * static_cast<double>(scale);
    }
    if (index == tc_.train.grad_accum - 1 && tc_.parallel.overlap_grad_sync) launch_grad_buckets(kHeadBucket);
    if (coord_.n == 0) tokens_acc_ += static_cast<double>(m.tokens);
  } else {
    send_to(x, coord_.pp + 1, false);
  }
}

void Stage::backward(Micro& m) {
  const layers::Ctx& c = ctx_;
  Tensor dy = last_ ? m.head_dx : recv_from(coord_.pp + 1, true);
  dy = blocks_backward(c, dy, m);
  if (first_) {
    program_->embed_backward(c, m.ids, dy);
  } else {
    send_to(dy, coord_.pp - 1, true);
  }
  m = Micro();
}

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
  const bool capture = graph_ && !graph_->captured() && steps_launched_ >= 1;
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
  if (params_pending_ && throw_on_comm_error()) {
    // Elastic workers await the gather inside the step; one still pending here belongs to
    // an interrupted step whose state was rolled back.
    for (auto& bk : buckets_) bk.param = Bucket();
    params_pending_ = false;
  }
  time_.reset();
  time_.set_tracing(!tc_.train.timeline_dir.empty());
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
  }
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
    for (const TraceEvent& e : time_.take_trace()) {
      std::fprintf(fp,
                   "{\"step\":%lld,\"rank\":%d,\"lane\":\"%s\",\"what\":\"%s\",\"t0\":%lld,\"t1\":%lld}\n",
                   static_cast<long long>(step), rank_, e.lane.c_str(), e.what.c_str(),
                   static_cast<long long>(e.t0), static_cast<long long>(e.t1));
    }
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
