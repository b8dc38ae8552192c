// layers/model.h — defines Model, the MoE language model: token embedding -> blocks (dense
// or MoE per ModelConfig) -> LM head with cross-entropy. It owns every parameter under a
// stable name (parameters()), runs the forward and backward of a micro-batch, evaluates,
// and returns logits for sampling.
//
// Loss of a training step = sum over its micro-batches m of loss_weight_m * (mean CE_m +
// aux_m), with loss_weight = 1 / micro-batches: gradients accumulate over micro-batches.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/block.h"
#include "layers/lm_head.h"
#include "layers/param_buffer.h"

namespace troupe::layers {

class Model {
 public:
  struct MicroBatchStats {
    double lm_loss_sum = 0;  // sum of token losses
    int64_t tokens = 0;      // tokens with a target
    double aux_loss = 0;     // sum over MoE blocks of their aux losses
    std::vector<MoELayer::Stats> moe;  // one per MoE block, in block order
  };

  // Builds the model and initialises it deterministically from `seed` (see init_normal).
  Model(const ModelConfig& cfg, uint64_t seed);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  // Every parameter, in a fixed order: embedding, blocks, final norm, LM head.
  std::vector<NamedParameter> parameters();
  std::vector<NamedBuffer> buffers();  // router biases
  int64_t num_moe_blocks() const;

  // ids, targets i32 [B, S] (targets -1 = ignored). Runs forward and backward, adding the
  // gradients of loss_weight * (mean CE + aux) to every Parameter::grad.
  // tokens >= 0: the caller's count of targets that are not ignored (target_tokens of the
  // host batch), so that device-resident targets need no read-back (a CUDA graph of the
  // step: train_moe); -1 counts them here.
  MicroBatchStats forward_backward(const Ctx& c, const Tensor& ids, const Tensor& targets, float loss_weight,
                                   int64_t tokens = -1);
  // The number of targets that are not ignored (>= 0); reads a device tensor back.
  static int64_t target_tokens(const Ctx& c, const Tensor& targets);
  // Forward only: sum of token losses and the count of tokens with a target.
  double eval_loss_sum(const Ctx& c, const Tensor& ids, const Tensor& targets, int64_t& tokens);
  // Logits [V] of the last position of ids i32 [1, S].
  std::vector<float> last_logits(const Ctx& c, const Tensor& ids);

  // Clears every gradient for a new step. Gradients whose backward can overwrite them
  // (Parameter::overwrites_grad) are marked stale instead: the step's first
  // forward_backward writes them, and at its end clears any that it did not write, so
  // after every forward_backward all gradients are the step's sums.
  void zero_grad(const Ctx& c);
  // After the optimizer step: returns each MoE block's selections of the step (summed over
  // micro-batches) and applies the aux-loss-free bias update with them.
  std::vector<std::vector<int64_t>> end_step();
  std::vector<std::vector<int64_t>> end_step(const Ctx& c);
  // end_step in two halves, for a loop that enqueues the next step before reading this
  // one's statistics (train_moe): the caller copies device_stats_buffer() to the host
  // (asynchronously), then clear_device_stats() zeroes it for the next step, and
  // end_step_with() takes the copy (device mode; nullptr otherwise).
  const Tensor& device_stats_buffer() const { return stats_dev_; }
  void clear_device_stats(const Ctx& c);
  std::vector<std::vector<int64_t>> end_step_with(const Ctx& c, const float* stats);
  // Whether end_step changes what the next step computes (an MoE block's aux-loss-free
  // bias update, from this step's loads): then the next step must not be enqueued first.
  bool updates_between_steps() const;

  // Puts every parameter into one ParamBuffer (layers/param_buffer.h) on c's device (host
  // memory for a CPU Ctx): f32 master values and gradients in flat buffers (so zeroing
  // what products add to and the global norm are one op each), and a working copy in
  // c.act of every matrix (dim >= 2) the products read. Call once after construction (and
  // loading), before the optimizer. expert_grads kBF16 (train.expert_grads): the gradients
  // of the parameters whose products can write bf16 (Parameter::bf16_grad_ok) are bf16
  // (ParamBuffer's low_grads); meant for one micro-batch per step, where each such
  // gradient is one rounded product (as in PyTorch autocast); the caller refuses more.
  void to_device(const Ctx& c, DType expert_grads = DType::kF32);
  const ParamBuffer& param_buffer() const { return buf_; }
  // Zeroes the gradients still marked stale (no backward wrote them) and clears the marks;
  // forward_backward ends with it.
  void settle_grads(const Ctx& c);
  // Refreshes the working copies (and split halves) from the master values (after
  // anything writes the values: loading a checkpoint).
  void refresh_working_copies(const Ctx& c);
  // train.master_weights = "split" (after to_device; ParamBuffer::split_masters): every
  // master with a bf16 working copy and no product reading value itself is kept as that
  // copy and a 16-bit low half, so that an optimizer step reads and writes 4 bytes a
  // parameter for both instead of 4 + 2. Values are then behind after each step: whoever
  // reads them (checkpoints, to_host) calls sync_master_values first. Returns the number
  // of parameters split.
  int64_t split_masters(const Ctx& c);
  void sync_master_values(const Ctx& c);
  // Copies values and buffers back to host tensors (before saving weights); syncs split
  // masters first.
  void to_host(const Ctx& c);
  // Every f32 gradient as one buffer (padding zero), or undefined before to_device.
  const Tensor& flat_grads() const { return buf_.grads(); }
  // The bf16 gradients of to_device's expert_grads = kBF16 as one buffer, else undefined.
  const Tensor& low_precision_grads() const { return buf_.low_grads(); }
  // The squared global norm of every gradient, read back (host mode; one wait).
  double grad_norm_squared(const Ctx& c) const;

  // Step statistics on the device (one process, after to_device; the training
  // loop uses it on GPUs, the CPU runs it too for tests): the
  // LM loss sum, the squared gradient norm and every MoE block's selection counts and aux
  // loss accumulate in one device buffer that end_step reads once, so a step enqueues its
  // forward, backward and clipped optimizer update without a host wait. In this mode
  // forward_backward returns lm_loss_sum = aux_loss = 0 and end_step fills
  // last_step_stats(). Returns false (nothing changes) where a MoE block
  // cannot keep its statistics on the device (a group all-reduce without its device form, a
  // replaced dispatch).
  bool enable_device_stats(const Ctx& c);
  bool device_stats() const { return stats_dev_.defined(); }
  // Device mode: the squared global norm of flat_grads() into the buffer; returns that f32
  // [1] view (for AdamW::step's device clip). No host wait. With enable_grad_norm_fold, the
  // gradients folded this step contribute their slots instead of being read.
  Tensor grad_norm_squared_on_device(const Ctx& c);
  // The gradient norm folded into the products that write the gradients
  // (ParamBuffer::enable_grad_norm_fold; puts the model into its ParamBuffer first if
  // to_device was not called): grad_norm_squared_on_device then sums the experts' dW slots
  // instead of reading those gradients in each step where that is exact. The caller
  // vouches that nothing changes the gradients between the backward and the norm (no
  // all-reduce, no rescaling). Returns the number of parameters with slots.
  int64_t enable_grad_norm_fold(const Ctx& c);
  // Gradient elements whose squares the last grad_norm_squared_on_device took from slots.
  int64_t last_folded_elements() const { return last_folded_elements_; }
  struct StepStats {
    double lm_loss_sum = 0;        // over the step's micro-batches
    double grad_norm_squared = 0;  // as grad_norm_squared_on_device computed it
    double aux_loss = 0;           // over micro-batches and MoE blocks, unweighted
  };
  const StepStats& last_step_stats() const { return last_stats_; }
  // CUDA graphs of the step (train_moe): a replay runs none of the host code of the step
  // it recorded, so the host bookkeeping that end_step checks the device statistics
  // against (each MoE block's expected expert selections, device mode) is taken after the
  // captured step and added back for each replay.
  std::vector<int64_t> pending_selections() const;
  void add_pending_selections(const std::vector<int64_t>& per_moe_block);

  Embedding embedding;
  std::vector<std::unique_ptr<Block>> blocks;
  std::unique_ptr<LMHead> head;

 private:
  Tensor forward_blocks(const Ctx& c, const Tensor& ids, std::vector<Block::Saved>& saved,
                        MicroBatchStats* stats);
  ModelConfig cfg_;
  ParamBuffer buf_;  // to_device's (unbuilt: each Parameter holds tensors of its own)
  int64_t last_folded_elements_ = 0;
  // Device mode: [lm loss sum, grad norm^2, 2 pad | per MoE block: E counts, aux, pad to 4].
  Tensor stats_dev_;
  int64_t stats_stride_ = 0;
  StepStats last_stats_;
};

}  // namespace troupe::layers
