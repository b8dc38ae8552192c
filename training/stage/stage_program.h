// training/stage/stage_program.h — defines StageProgram, what a training app supplies:
// the model part of one pipeline stage (its parameters, the forward and backward of a
// micro-batch through its blocks, an optional embedding and head) — and StageEnv, what
// the framework hands the program when it builds it. docs/writing-an-app.md walks
// through one (apps/examples/dense_lm).
//
// The framework (Stage, stage.h) owns everything around the model: the data loader and
// the micro-batches, the 1F1B schedule and the pipeline send/recv, the flat parameter and
// gradient buffers, gradient synchronisation over the n-group, the tied pair and the
// data-parallel group (bucketed, overlapped with backward), ZeRO-1 AdamW, the gradient
// norm, the step metrics, state export/import under global names (checkpoints that
// reshard, recovery from a peer or a neighbour replica), and the actors, the Trainer and
// its failure handling. A program never calls a data-parallel or pipeline collective; it
// may use the n-group (e.g. Ulysses attention, expert dispatch) through StageEnv.
//
// Contract, per step: for each micro-batch the first stage calls embed(ids), every stage
// block_forward(i) for its blocks in order, the last stage head_forward_backward; then,
// in reverse, block_backward(i) and (first stage) embed_backward. By default embed and
// the head run the program's layers::Embedding and layers::LMHead. Every call adds its
// gradients to the Parameter::grad of the parameters it used (the framework zeroes them
// per step and rebinds every Parameter onto its flat buffers once, after parameters()).
// Values depend only on the seed and each parameter's global name, never on the layout,
// so every layout trains the same model.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/process_groups.h"
#include "core/check.h"
#include "core/parallel_layout.h"
#include "core/status.h"
#include "core/tensor.h"
#include "layers/context.h"
#include "layers/embedding.h"
#include "layers/lm_head.h"
#include "layers/parameter.h"
#include "training/parallel/group_ops.h"
#include "training/run_config.h"

namespace troupe::training {

// What one rank reports after a step (the Trainer's metrics record).
struct StepReport {
  int64_t step = 0;
  double loss = 0, lm_loss = 0, aux_loss = 0, grad_norm = 0, lr = 0;
  int64_t tokens = 0;                             // tokens with a target in the whole step (all replicas)
  std::vector<std::vector<int64_t>> expert_load;  // per MoE block, per expert (whole step); empty for dense
  // Wall time of this rank: the step, the part spent waiting on the data plane, and the
  // world mean of the latter (measured up to the metrics reduction).
  double step_ms = 0, comm_ms = 0, compute_ms = 0, comm_ms_mean = 0;
  std::map<std::string, double> comm_by_kind_ms;  // this rank's comm_ms split by kind
  // Device runs: this rank's allocator high-water mark in the step (bytes); -1 on the CPU.
  int64_t peak_bytes = -1;
  // Device runs: this rank's device->host reads while the step was enqueued (the one
  // asynchronous read of its statistics is not one); -1 on the CPU.
  int64_t host_syncs = -1;
  // This rank's process: its peak resident host memory so far (peak_resident_bytes; -1
  // where unknown). What a layout costs a process's RAM (docs/parallelism.md, "Memory
  // per rank").
  int64_t rss_peak_bytes = -1;
  // Device runs: host->device uploads that waited for their copy, and the allocator's
  // high-water mark above what was in use when the step began (activations and
  // temporaries); -1 on the CPU.
  int64_t upload_waits = -1, activation_bytes = -1;
  // Device runs: the step's device time (its first enqueued op to its last), and how long
  // the device sat idle between the previous step's last op and this step's first: the
  // host's and the driver's share between steps (~0 when the step was launched ahead).
  // -1 where not known (the CPU; the first step).
  double device_ms = -1, device_gap_ms = -1;
};

// When a parameter's gradient is final within a step's backward, i.e. which bucket of
// the data-parallel gradient exchange it joins: a block index of the program (its
// block_backward of the step's last micro-batch finished it), or one of these.
inline constexpr int64_t kGradReadyAtEnd = -1;      // after the whole backward (e.g. the embedding)
inline constexpr int64_t kGradReadyAfterHead = -2;  // after the head (last stage)

struct ProgramParam {
  // The global, layout-independent name ("blocks.3.attn.wq"). A "[...]" suffix marks a
  // local view of the global tensor named without it: "[local]" for this rank's block of
  // a tensor split over the n-group, "[tied copy]" for a copy of a parameter another
  // stage owns.
  std::string name;
  layers::Parameter* param = nullptr;
  // Split over the n-group along dim 0 (e.g. experts: rank k holds rows [k*R, (k+1)*R) of
  // the global [n*R, ...] tensor): its gradient is not summed over the n-group.
  // Otherwise the parameter is replicated over the n-group and its gradient summed there.
  bool sharded = false;
  // Tied parameters, shared by the first and the last stage (an embedding used by the LM
  // head): the first stage's is `tied`, the last stage's copy `tied_copy`; with pp > 1
  // their gradients are summed between the two stages, and the copy is neither saved nor
  // counted in the gradient norm. At most one of each per stage, and both or neither.
  bool tied = false, tied_copy = false;
  int64_t grad_ready = kGradReadyAtEnd;
  // The actor role owning it, for `troupe status --actors` ("attention", "experts"; any
  // other counts only under "stage").
  std::string role;
};

// A non-parameter tensor of the state (e.g. a router's balancing bias): replicated over
// dp and n, exported and imported under `name`, committed and restored with the
// parameters, updated by the program itself (end_step).
struct ProgramBuffer {
  std::string name;
  Tensor* tensor = nullptr;
};

// What the framework gives a program when it builds it.
struct StageEnv {
  const layers::TrainConfig& tc;
  ParallelCoord coord;                    // this rank's (pp, dp, n)
  int pp = 1, dp = 1, n = 1;              // the layout
  bool first = true, last = true;         // first / last pipeline stage
  int64_t batch = 0;                      // sequences per micro-batch
  int64_t seq_local = 0;                  // tokens of each sequence on this rank (seq_len / n)
  float loss_weight = 1.0f;               // weight of one micro-batch in the step: 1 / (dp * grad_accum)
  const layers::Ctx& ctx;                 // the CPU, or this worker's GPU
  comm::Communicator* n_group = nullptr;  // the n-group (null when n = 1)
  CommTime& time;                         // data-plane time of the Stage: collectives the program waits on
};

class StageProgram {
 public:
  // What a block's forward keeps for its backward (one per block and micro-batch).
  struct Saved {
    virtual ~Saved() = default;
  };
  virtual ~StageProgram() = default;

  // Every parameter this rank holds, in a fixed order (the same on every rank of a
  // (pp, n) coordinate). Called once, after construction.
  virtual std::vector<ProgramParam> parameters() = 0;
  // Non-parameter state (default: none).
  virtual std::vector<ProgramBuffer> buffers() { return {}; }
  // Width of the activations passed between stages: [batch * seq_local, width].
  virtual int64_t activation_width() const = 0;

  // The first stage's token embedding and the last stage's LM head (final norm,
  // projection, cross-entropy), whose forward and backward the framework calls. A program
  // with another input or loss overrides embed ... head_loss_sum below instead.
  virtual layers::Embedding* embedding() { return nullptr; }
  virtual layers::LMHead* head() { return nullptr; }
  // First stage: token ids i32 [batch * seq_local] -> activations.
  virtual Tensor embed(const layers::Ctx& c, const Tensor& ids) {
    return need(embedding(), "embedding")->forward(c, ids);
  }
  virtual void embed_backward(const layers::Ctx& c, const Tensor& ids, const Tensor& dx) {
    need(embedding(), "embedding")->backward(c, ids, dx);
  }
  // This stage's blocks, 0 .. num_blocks() - 1. `train` false: evaluation (no backward).
  virtual int64_t num_blocks() const = 0;
  virtual std::string block_name(int64_t i) const { return "block " + std::to_string(i); }
  virtual Tensor block_forward(const layers::Ctx& c, int64_t i, const Tensor& x,
                               std::unique_ptr<Saved>& saved, bool train) = 0;
  virtual Tensor block_backward(const layers::Ctx& c, int64_t i, const Tensor& dy, Saved& saved) = 0;
  // Last stage: the loss of the micro-batch. Returns the sum of token losses, adds
  // scale * d(sum)/d(params) to the head's gradients and sets dx = scale * d(sum)/dx.
  virtual double head_forward_backward(const layers::Ctx& c, const Tensor& x, const Tensor& targets,
                                       float scale, Tensor& dx) {
    return need(head(), "head")->forward_backward(c, x, targets, scale, dx);
  }
  virtual double head_loss_sum(const layers::Ctx& c, const Tensor& x, const Tensor& targets) {
    return need(head(), "head")->loss_sum(c, x, targets);
  }
  // On a device: head_forward_backward with the token losses left on the device (f32 [T]),
  // so the step reads its loss once at its end. Default: head()'s; an undefined Tensor
  // (e.g. no head(): a program overriding head_forward_backward) makes the framework call
  // head_forward_backward instead.
  virtual Tensor head_losses(const layers::Ctx& c, const Tensor& x, const Tensor& targets, float scale,
                             Tensor& dx) {
    return head() != nullptr ? head()->forward_backward_losses(c, x, targets, scale, dx) : Tensor();
  }

  // Step statistics of the program beyond the LM loss (e.g. an auxiliary loss, expert
  // loads), summed over the world by the framework with its own metrics and handed to
  // end_step (after the optimizer update), which may fill `report` (aux_loss,
  // expert_load) and update buffers. They live in one of two places, as the Stage's own:
  // - on the device (bench.device_stats, the default; device_stats_size() >= 0): the
  //   Stage gives the program a zeroed f32 view of device_stats_size() values of its
  //   statistics buffer (bind_device_stats, once) that the program's forward and backward
  //   accumulate into — no host read inside a step; the Stage clears it at each step's
  //   start, calls finish_device_stats() once the step's micro-batches are done (e.g. to
  //   zero what another rank already counts), all-reduces the buffer over the world on the
  //   device and reads it once, asynchronously; end_step gets those sums. The layout is the
  //   program's and must be the same on every rank (e.g. indexed by global block).
  // - on the host (device_stats_size() < 0, or bench.device_stats = false): step_stats()
  //   returns this rank's contribution, read after the step; end_step gets the fp64 sums.
  // end_step knows which it gets from device_stats_bound(). Default: none (size 0).
  // Whether the size is >= 0 must be the same on every rank of the world, decided from the
  // model's config rather than this stage's part: the statistics are one collective.
  virtual int64_t device_stats_size() const { return 0; }
  virtual void bind_device_stats(const Tensor& rows) { (void)rows; }
  virtual void finish_device_stats(const layers::Ctx& c) { (void)c; }
  virtual std::vector<double> step_stats() { return {}; }
  virtual void end_step(const layers::Ctx& c, const std::vector<double>& summed, StepReport& report) {
    (void)c, (void)summed, (void)report;
  }
  // Whether end_step changes what the next step computes (e.g. a router's balancing bias
  // updated on the host from the step's loads): then the Stage never launches a step
  // before the previous one's end_step (Stage::can_launch_ahead).
  virtual bool updates_between_steps() const { return false; }
  // A step was interrupted (a failure unwound it): drop what it accumulated.
  virtual void discard_step() {}

  // CUDA graphs (bench.cuda_graph): the Stage captures one whole step and replays it; a
  // replay runs none of the program's host code. graph_blocker() names what in the
  // program's step cannot be captured (e.g. token counts read on the host), or is empty.
  // step_captured() is called right after the captured step was enqueued, step_replayed()
  // before a replayed step's statistics reach end_step: the program redoes there the host
  // bookkeeping the replay skipped.
  virtual std::string graph_blocker() const { return ""; }
  virtual void step_captured() {}
  virtual void step_replayed() {}

 private:
  template <class T>
  static T* need(T* p, const char* what) {
    TROUPE_CHECK(p != nullptr,
                 "stage program: the framework needs its {} on this stage (override {}() or the "
                 "calls that use it)",
                 what, what);
    return p;
  }
};

using ProgramFactory = std::function<Result<std::unique_ptr<StageProgram>>(const StageEnv&)>;

}  // namespace troupe::training
