// actors/training/stage.cc — Stage: communicators, the model part of one rank, the 1F1B
// schedule, gradient synchronisation, the ZeRO-1 optimizer shard and the step metrics.
#include "actors/training/stage.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "comm/gloo_communicator.h"
#include "core/check.h"

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
  return ok_status();
}

Status Stage::setup_params(const std::vector<ProgramParam>& params) {
  const bool n_lead = coord_.n == 0;
  std::vector<Entry> rep, exp;
  for (const auto& p : params) {
    const int64_t ready = p.grad_ready;
    if (ready != kGradReadyAtEnd && ready != kGradReadyAfterHead && (ready < 0 || ready >= num_blocks_)) {
      return invalid_argument(
          "stage program: parameter '{}' has grad_ready {} (blocks 0..{}, or kGradReadyAtEnd / "
          "kGradReadyAfterHead)",
          p.name, ready, num_blocks_ - 1);
    }
    // n-sharded parameters count in the norm on every rank; replicated ones on n-rank 0;
    // a tied copy never (the first stage counts the parameter).
    Entry e{p.name, p.param, p.sharded, p.sharded || (n_lead && !p.tied_copy), ready, p.role};
    (p.sharded ? exp : rep).push_back(std::move(e));
  }
  entries_ = std::move(rep);
  int64_t off = 0;
  for (auto& e : entries_) {
    e.offset = off;
    off += e.param->numel();
  }
  rep_size_ = off;
  for (auto& e : exp) {
    e.offset = off;
    off += e.param->numel();
    entries_.push_back(e);
  }
  flat_size_ = off;
  const int64_t dp = layout_->dp();
  const int64_t padded = (off + dp - 1) / dp * dp;
  const bool dev = ctx_.on_device();
  flat_value_ = dev ? ctx_.zeros({std::max<int64_t>(padded, 1)}, DType::kF32)
                    : Tensor::zeros({std::max<int64_t>(padded, 1)}, DType::kF32);
  flat_grad_ = dev ? ctx_.zeros({std::max<int64_t>(padded, 1)}, DType::kF32)
                   : Tensor::zeros({std::max<int64_t>(padded, 1)}, DType::kF32);
  // Rebind every parameter onto the flat buffers (a tied head shares the Parameter, so it
  // follows). On a device the matrices also get a working copy in the activation dtype.
  for (auto& e : entries_) {
    const Shape shape = e.param->value.shape();
    Tensor v = flat_value_.narrow(0, e.offset, e.param->numel()).view(shape);
    if (dev) {
      ctx_.copy_to_device(e.param->value.contiguous(), v);
      e.param->work = shape.size() >= 2 && ctx_.act != DType::kF32 ? ctx_.empty(shape, ctx_.act) : Tensor();
    } else {
      v.copy_from(e.param->value);
    }
    e.param->value = v;
    e.param->grad = flat_grad_.narrow(0, e.offset, e.param->numel()).view(shape);
  }
  if (dev) refresh_working_copies();
  shard_len_ = std::max<int64_t>(padded, 1) / dp;
  shard_lo_ = coord_.dp * shard_len_;
  shard_grad_ = dp > 1
                    ? (dev ? ctx_.zeros({shard_len_}, DType::kF32) : Tensor::zeros({shard_len_}, DType::kF32))
                    : flat_grad_;
  pieces_.reserve(entries_.size());
  std::vector<layers::NamedParameter> named;
  for (auto& e : entries_) {
    const int64_t a = std::max(e.offset, shard_lo_);
    const int64_t b = std::min(e.offset + e.param->numel(), shard_lo_ + shard_len_);
    if (a >= b) continue;
    layers::Parameter piece;
    piece.value = flat_value_.narrow(0, a, b - a);
    piece.grad = shard_grad_.narrow(0, a - (dp > 1 ? shard_lo_ : 0), b - a);
    piece.decay = e.param->decay;
    // Unsharded (dp == 1), each piece is its whole parameter: AdamW writes the working copy
    // in its own pass (no cast pass after the step).
    if (dp == 1 && e.param->work.defined()) piece.work = e.param->work.view({e.param->numel()});
    pieces_.push_back(piece);
    piece_in_norm_.push_back(e.in_norm);
  }
  for (size_t i = 0; i < pieces_.size(); ++i) named.push_back({fmt::format("piece{}", i), &pieces_[i]});
  opt_ = std::make_unique<layers::AdamW>(named, tc_.optim, ctx_);
  opt_->write_working_copies(dp == 1);
  setup_buckets();
  return ok_status();
}

void Stage::setup_buckets() {
  buckets_.clear();
  param_order_.clear();
  if (layout_->dp() <= 1) return;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    const int64_t key = e.ready;
    const bool split = e.offset == rep_size_;  // replicated and expert parts never share one
    if (buckets_.empty() || buckets_.back().ready != key || split || buckets_.back().hi != e.offset) {
      buckets_.emplace_back();
      buckets_.back().lo = e.offset;
      buckets_.back().ready = key;
    }
    buckets_.back().hi = e.offset + e.param->numel();
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
  const DType wire = tc_.parallel.compression ? DType::kBF16 : DType::kF32;
  for (auto& b : buckets_) {
    if (b.ready != ready || b.grad_launched) continue;
    b.grad_launched = true;
    b.grad.lo = b.lo;
    b.grad.hi = b.hi;
    grad_bucket_launch(
        *groups_.dp, ctx_, flat_grad_, shard_len_, wire, b.grad, time_,
        tc_.parallel.compression ? "bf16 grads reduce_scatter (dp)" : "grads reduce_scatter (dp)");
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
    if (ctx_.on_device()) {
      for (size_t i : b.entries) {
        layers::Parameter* p = entries_[i].param;
        if (p->work.defined()) kernels::cast(ctx_.ex, p->value, p->work);
      }
    }
  }
  params_pending_ = any_left;
}

void Stage::settle() {
  bind_device();
  await_params(kEndBucket - 1);  // every bucket
  if (ctx_.on_device()) {
    time_.drain("parameter all_gather (dp)");
    synchronize();
  }
}

void Stage::refresh_working_copies() {
  for (auto& e : entries_) {
    if (e.param->work.defined()) kernels::cast(ctx_.ex, e.param->value, e.param->work);
  }
}

double Stage::grad_sum_squares() const {
  double sumsq = 0;
  if (!ctx_.on_device()) {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (piece_in_norm_[i]) sumsq += kernels::sum_squares(ctx_.ex, pieces_[i].grad);
    }
    return sumsq;
  }
  // Device: one reduction (one host sync) per run of adjacent pieces that count, instead
  // of one per parameter. The pieces tile the shard's gradient in order.
  const auto* base = static_cast<const char*>(shard_grad_.data_ptr());
  size_t i = 0;
  while (i < pieces_.size()) {
    if (!piece_in_norm_[i]) {
      ++i;
      continue;
    }
    const int64_t lo =
        (static_cast<const char*>(pieces_[i].grad.data_ptr()) - base) / static_cast<int64_t>(sizeof(float));
    int64_t len = pieces_[i].grad.numel();
    size_t j = i + 1;
    while (j < pieces_.size() && piece_in_norm_[j] &&
           static_cast<const char*>(pieces_[j].grad.data_ptr()) ==
               base + (lo + len) * static_cast<int64_t>(sizeof(float))) {
      len += pieces_[j].grad.numel();
      ++j;
    }
    sumsq += kernels::sum_squares(ctx_.ex, shard_grad_.narrow(0, lo, len));
    i = j;
  }
  return sumsq;
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

void Stage::load(bool eval, int64_t step, int64_t index, Micro& m) const {
  Tensor ids, targets;
  if (eval) {
    val_loader_->eval_batch(index, tc_.train.eval_batches, batch_, ids, targets);
  } else {
    loader_->train_batch(step, coord_.dp, index, tc_.train.grad_accum, batch_, ids, targets);
  }
  const int32_t* tp = targets.data<int32_t>();
  m.tokens = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) m.tokens += tp[i] >= 0 ? 1 : 0;
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
    const int64_t ts0 = comm::Work::now_ns();
    x = program_->block_forward(c, i, x, m.saved[static_cast<size_t>(i)], train);
    time_.span("main", "forward " + program_->block_name(i), ts0, comm::Work::now_ns());
  }
  return x;
}

Tensor Stage::blocks_backward(const layers::Ctx& c, Tensor dy, Micro& m) {
  for (int64_t i = num_blocks_; i-- > 0;) {
    const int64_t ts0 = comm::Work::now_ns();
    std::unique_ptr<StageProgram::Saved>& saved = m.saved[static_cast<size_t>(i)];
    TROUPE_CHECK(saved != nullptr);  // block_forward must leave what its backward needs
    dy = program_->block_backward(c, i, dy, *saved);
    saved.reset();  // free activations as soon as they are used
    time_.span("main", "backward " + program_->block_name(i), ts0, comm::Work::now_ns());
    // The step's last micro-batch has finished this block: its gradients are final.
    if (last_micro_ && tc_.parallel.overlap_grad_sync) launch_grad_buckets(i);
  }
  return dy;
}

void Stage::forward(int64_t step, int64_t index, Micro& m) {
  const layers::Ctx& c = ctx_;
  if (first_ || last_) load(false, step, index, m);
  if (first_) await_params(kEndBucket);
  Tensor x = first_ ? program_->embed(c, m.ids) : recv_from(coord_.pp - 1, false);
  x = blocks_forward(c, x, m, true);
  if (last_) {
    await_params(kHeadBucket);
    await_params(kEndBucket);
    const float scale = m.tokens > 0 ? loss_weight_ / static_cast<float>(m.tokens) : 0.0f;
    Tensor losses =
        stats_dev_.defined() ? program_->head_losses(c, x, m.targets, scale, m.head_dx) : Tensor();
    if (losses.defined()) {
      // Summed on the device into this micro-batch's slot, read with the step's statistics.
      Tensor slot = stats_dev_.narrow(0, 1 + index, 1);
      kernels::sum_rows(c.ex, losses.view({losses.numel(), 1}), slot, /*accumulate=*/false);
      micro_tokens_[static_cast<size_t>(index)] = m.tokens;
    } else {
      const double lm = program_->head_forward_backward(c, x, m.targets, scale, m.head_dx);
      lm_acc_ += m.tokens > 0 ? lm / static_cast<double>(m.tokens) * static_cast<double>(loss_weight_) : 0.0;
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
}  // namespace

StepReport Stage::run_step(int64_t step) {
  const auto t0 = Clock::now();
  const int64_t syncs0 = host_reads();
  bind_device();
  time_.reset();
  time_.set_tracing(!tc_.train.timeline_dir.empty());
  const int64_t step_t0 = comm::Work::now_ns();
  if (params_pending_ && throw_on_comm_error()) {
    // Elastic workers await the gather inside the step; one still pending here belongs to
    // an interrupted step whose state was rolled back.
    for (auto& bk : buckets_) bk.param = Bucket();
    params_pending_ = false;
  }
  lm_acc_ = tokens_acc_ = 0;
  if (ctx_.on_device()) {
    ctx_.alloc->reset_peak();
    kernels::fill(ctx_.ex, flat_grad_, 0.0f);
    if (tc_.train.device_stats) {
      if (!stats_dev_.defined() || stats_dev_.numel() != 1 + tc_.train.grad_accum)
        stats_dev_ = ctx_.zeros({1 + tc_.train.grad_accum}, DType::kF32);
      kernels::fill(ctx_.ex, stats_dev_, 0.0f);
      micro_tokens_.assign(static_cast<size_t>(tc_.train.grad_accum), 0);
    }
  } else {
    flat_grad_.fill(0.0f);
  }

  // ---- 1F1B over the micro-batches ---------------------------------------------------
  const int64_t mcount = tc_.train.grad_accum;
  const int64_t warm = std::min<int64_t>(layout_->pp() - coord_.pp - 1, mcount);
  std::vector<Micro> micro(static_cast<size_t>(mcount));
  int64_t f = 0, b = 0;
  for (auto& bk : buckets_) bk.grad_launched = false;
  for (; f < warm; ++f) forward(step, f, micro[static_cast<size_t>(f)]);
  for (; f < mcount; ++f) {
    forward(step, f, micro[static_cast<size_t>(f)]);
    last_micro_ = b == mcount - 1;
    backward(micro[static_cast<size_t>(b++)]);
  }
  for (; b < mcount; ++b) {
    last_micro_ = b == mcount - 1;
    backward(micro[static_cast<size_t>(b)]);
  }
  last_micro_ = false;
  await_sends();

  // ---- gradient synchronisation ------------------------------------------------------
  if (layout_->dp() <= 1) {
    if (layout_->n() > 1 && rep_size_ > 0) {
      all_reduce_sum(*groups_.n, flat_grad_.narrow(0, 0, rep_size_), time_,
                     "replicated grads all_reduce (n)");
    }
    if (tied_) {
      for (const layers::Parameter* w : tied_params_)
        all_reduce_sum(*tied_, w->grad.view({w->numel()}), time_, "tied embedding all_reduce");
    }
  } else {
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

  // ---- norm, metrics, optimizer ------------------------------------------------------
  double sumsq = 0;
  if (stats_dev_.defined()) {
    // The step's one read of its own statistics: the norm's sum of squares and the loss
    // sum of every micro-batch.
    std::vector<const Tensor*> norm;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (piece_in_norm_[i]) norm.push_back(&pieces_[i].grad);
    }
    Tensor slot = stats_dev_.narrow(0, 0, 1);
    if (!norm.empty()) kernels::sum_squares_into(ctx_.ex, norm, slot, /*accumulate=*/false);
    const Tensor h = ctx_.to_host(stats_dev_);
    const float* p = h.data<float>();
    sumsq = static_cast<double>(p[0]);
    for (size_t m = 0; m < micro_tokens_.size(); ++m) {
      if (micro_tokens_[m] > 0)
        lm_acc_ += static_cast<double>(p[1 + m]) / static_cast<double>(micro_tokens_[m]) *
                   static_cast<double>(loss_weight_);
    }
  } else {
    sumsq = grad_sum_squares();
  }
  // [sum of squares, LM loss, tokens, comm seconds, compression error, its reference |
  // the program's statistics].
  constexpr size_t kOwn = 6;
  const std::vector<double> stats = program_->step_stats();
  std::vector<double> v(kOwn + stats.size(), 0.0);
  std::copy(stats.begin(), stats.end(), v.begin() + kOwn);
  // parallel.measure_compression (tests, benches; host tensors): the relative L2 error of
  // the compressed gradient against an extra fp32 exchange of the same gradients.
  const bool measured =
      tc_.parallel.measure_compression && tc_.parallel.compression && layout_->dp() > 1 && !ctx_.on_device();
  if (measured) {
    Tensor exact = Tensor::zeros({shard_len_}, DType::kF32);
    for (const auto& bk : buckets_) {
      Bucket x;
      x.lo = bk.lo;
      x.hi = bk.hi;
      grad_bucket_launch(*groups_.dp, ctx_, flat_grad_, shard_len_, DType::kF32, x, time_,
                         "measure grads reduce_scatter (dp)");
      grad_bucket_finish(ctx_, x, exact, shard_len_, time_);
    }
    const int64_t rep_in_shard = std::clamp<int64_t>(rep_size_ - shard_lo_, 0, shard_len_);
    if (layout_->n() > 1 && rep_in_shard > 0) {
      all_reduce_sum(*groups_.n, exact.narrow(0, 0, rep_in_shard), time_, "measure grads all_reduce (n)");
    }
    const float* base = shard_grad_.data<float>();
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (!piece_in_norm_[i]) continue;
      const float* g = pieces_[i].grad.data<float>();
      const float* x = exact.data<float>() + (g - base);
      for (int64_t j = 0; j < pieces_[i].grad.numel(); ++j) {
        const double d = static_cast<double>(g[j]) - static_cast<double>(x[j]);
        v[4] += d * d;
        v[5] += static_cast<double>(x[j]) * static_cast<double>(x[j]);
      }
    }
  }
  v[0] = sumsq;
  v[1] = lm_acc_;
  v[2] = tokens_acc_;
  v[3] = time_.seconds();
  sum_doubles(*world_, v, time_, "step metrics");
  if (measured && rank_ == 0) {
    fmt::print(stderr, "compression: step {} relative gradient error {:.4e} (bf16 gradient exchange{})\n",
               step, v[5] > 0 ? std::sqrt(v[4] / v[5]) : 0.0,
               tc_.parallel.fp8_dispatch ? ", fp8 dispatch" : "");
  }

  StepReport rep;
  rep.step = step;
  rep.grad_norm = std::sqrt(v[0]);
  rep.lm_loss = v[1];
  rep.tokens = static_cast<int64_t>(std::llround(v[2]));
  rep.comm_ms_mean = v[3] / layout_->world_size() * 1e3;
  rep.lr = tc_.lr.at(step);

  snapshot_fence();  // a snapshot's copy still reading the state (CPU)
  const int64_t opt_t0 = comm::Work::now_ns();
  opt_->step(ctx_, rep.lr, rep.grad_norm);
  time_.span("main", "optimizer", opt_t0, comm::Work::now_ns());
  // The working copies: AdamW wrote them in its pass (dp == 1); with dp > 1 await_params
  // refreshes each bucket's as its all-gather lands.
  if (layout_->dp() > 1) {
    // Per bucket, in forward order; the next forward waits for each block's own bucket
    // (elastic workers wait here: their state is committed right after the step).
    for (size_t i : param_order_) {
      buckets_[i].param.lo = buckets_[i].lo;
      buckets_[i].param.hi = buckets_[i].hi;
      param_bucket_launch(*groups_.dp, ctx_, flat_value_, shard_len_, buckets_[i].param, time_,
                          "params all_gather (dp)");
    }
    params_pending_ = true;
    if (!tc_.parallel.overlap_param_gather || throw_on_comm_error()) await_params(kEndBucket - 1);
  }
  // The program's statistics (e.g. aux loss, expert loads; train_moe updates its router
  // biases from the loads here).
  program_->end_step(ctx_, std::vector<double>(v.begin() + kOwn, v.end()), rep);
  rep.loss = rep.lm_loss + rep.aux_loss;
  if (ctx_.on_device()) {
    time_.drain("step collectives");
    synchronize();  // the step's time includes its device work
    rep.peak_bytes = static_cast<int64_t>(ctx_.alloc->peak_bytes_in_use());
  }
  rep.step_ms = std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
  if (ctx_.on_device()) rep.host_syncs = host_reads() - syncs0;
  rep.comm_ms = time_.seconds() * 1e3;
  rep.compute_ms = rep.step_ms - rep.comm_ms;
  for (const auto& [kind, sec] : time_.by_kind()) rep.comm_by_kind_ms[kind] = sec * 1e3;
  if (time_.tracing()) {
    // One JSON line per event (bench/overlap/timeline.py draws them).
    const std::string path = fmt::format("{}/rank{}.jsonl", tc_.train.timeline_dir, rank_);
    if (FILE* fp = std::fopen(path.c_str(), "a")) {
      time_.span("main", "step", step_t0, comm::Work::now_ns());
      for (const TraceEvent& e : time_.take_trace()) {
        std::fprintf(fp,
                     "{\"step\":%lld,\"rank\":%d,\"lane\":\"%s\",\"what\":\"%s\",\"t0\":%lld,\"t1\":%lld}\n",
                     static_cast<long long>(step), rank_, e.lane.c_str(), e.what.c_str(),
                     static_cast<long long>(e.t0), static_cast<long long>(e.t1));
      }
      std::fclose(fp);
    }
  }
  return rep;
}

double Stage::evaluate() {
  settle();
  bind_device();
  const layers::Ctx& c = ctx_;
  double sum = 0, tokens = 0;
  for (int64_t k = 0; k < tc_.train.eval_batches; ++k) {
    if (k % layout_->dp() != coord_.dp) continue;
    Micro m;
    if (first_ || last_) load(true, 0, k, m);
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
