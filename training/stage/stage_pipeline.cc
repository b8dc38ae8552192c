// training/stage/stage_pipeline.cc — Stage (stage.h): a step's micro-batches (read,
// upload, per-micro-batch inputs) and the pipeline's sends, receives, forward and backward
// of one micro-batch. The schedule that orders them is the step's (stage_step.cc).
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
    void* mark0 = time_.device_mark();
    x = program_->block_forward(c, i, x, m.saved[static_cast<size_t>(i)], train);
    if (time_.tracing()) {
      time_.span("main", "forward " + program_->block_name(i), ts0, comm::Work::now_ns());
      time_.device_span("gpu", "forward " + program_->block_name(i), mark0, time_.device_mark());
    }
  }
  return x;
}

Tensor Stage::blocks_backward(const layers::Ctx& c, Tensor dy, Micro& m) {
  for (int64_t i = num_blocks_; i-- > 0;) {
    const int64_t ts0 = time_.tracing() ? comm::Work::now_ns() : 0;
    void* mark0 = time_.device_mark();
    std::unique_ptr<StageProgram::Saved>& saved = m.saved[static_cast<size_t>(i)];
    TROUPE_CHECK(saved != nullptr);  // block_forward must leave what its backward needs
    dy = program_->block_backward(c, i, dy, *saved);
    saved.reset();  // free activations as soon as they are used
    if (time_.tracing()) {
      time_.span("main", "backward " + program_->block_name(i), ts0, comm::Work::now_ns());
      time_.device_span("gpu", "backward " + program_->block_name(i), mark0, time_.device_mark());
    }
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
      Tensor slot = stats_.narrow(0, kStatsOwn + index, 1);
      if (losses.defined()) {
        kernels::sum_rows(c.ex, losses.view({losses.numel(), 1}), slot, /*accumulate=*/false);
        kernels::scale(c.ex, slot, scale);
      } else {
        // A program whose loss is a host value (no head()): written into the slot (one
        // host read; such a step is never captured as a CUDA graph, setup_engine).
        const double lm = program_->head_forward_backward(c, x, m.targets, scale, m.head_dx);
        kernels::fill(c.ex, slot, static_cast<float>(lm * static_cast<double>(scale)));
      }
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

}  // namespace troupe::training
