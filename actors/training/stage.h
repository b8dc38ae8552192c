// actors/training/stage.h — defines Stage, the framework's side of one rank of a
// pp x dp x n layout (DESIGN.md "Processes and actors"): it runs an app's StageProgram
// (stage_program.h: the model part of this pipeline stage) one optimizer step at a time,
// SPMD, when told to (run_step): no control message inside a step, only collectives and
// pipeline send/recv. The worker's stage, attention and expert actors (role_actors.h)
// front it.
//
// What a step does, and why the numbers equal one process running the whole model on
// the dp * grad_accum micro-batches of the step (fp32):
// - Data: replica d, micro-batch m reads the loader's samples (d*ga + m)*mb + i — the
//   samples one process reads as its micro-batch d*ga + m; every micro-batch has weight
//   1 / (dp * ga). Rank r of the n-group holds tokens [r*S/n, (r+1)*S/n) of each sequence.
// - Pipeline: 1F1B over the ga micro-batches; activations [B*S/n, width] forward,
//   gradients backward, by send/recv to the same n-rank of the neighbouring stage. The
//   first stage embeds, the last applies the program's head (grad scale = weight / tokens
//   of the whole micro-batch, counted from the full targets every rank loads).
// - Inside the n-group the program does what its model needs (train_moe: Ulysses
//   attention, experts split over the group, router statistics summed there).
// - Gradients: every parameter's value and gradient live in two flat buffers, the
//   n-replicated parameters first, then this rank's n-sharded ones. The replicated part is
//   all-reduced over the n-group; a tied parameter is all-reduced between the first and
//   last stage; then the whole buffer is reduce-scattered over dp (bf16 on the wire with
//   parallel.compression) and each dp rank runs AdamW on its 1/dp shard (ZeRO-1), then
//   the shards are all-gathered.
// - Overlap (parallel.overlap_*; docs/parallelism.md "Overlap"): the dp reduce-scatter
//   runs per bucket (one block's replicated or sharded parameters, the head, the
//   embedding: ProgramParam::grad_ready), launched in backward as soon as the step's last
//   micro-batch has finished a block; the n-group sum of the replicated part then runs on
//   this rank's shard after the reduce-scatter (dp first, then n: the same order with or
//   without overlap). The parameter all-gather after the optimizer is launched per
//   bucket and each block waits for its own bucket in the next forward (state accessors
//   wait for all of it first).
// - Norm and metrics: one fp64 sum over the world of [grad sum of squares (each value
//   counted once: replicated parts on n-rank 0 only, a tied copy on the first stage only),
//   LM loss, tokens, ..., the program's step_stats()]; the program's end_step gets the sums.
// - Device (create with a CUDA Ctx, e.g. one GPU per worker): NCCL communicators on the
//   Ctx's device, parameters/gradients/moments in device memory from the Ctx's allocator,
//   bf16 working copies of the matrices (refreshed after each update) and activations in
//   the Ctx's dtype; collectives are ordered on the compute stream (group_ops.h "Device
//   mode"), the overlapped ones on a communication stream ordered by events. With
//   train.device_stats (default) the step's loss and gradient norm stay on the device
//   until one read at its end (the program may keep its own statistics there too).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/training/elastic_comm.h"
#include "actors/training/group_ops.h"
#include "actors/training/stage_program.h"
#include "actors/training/stage_state.h"
#include "checkpoint/reader.h"
#include "checkpoint/snapshot_segment.h"
#include "checkpoint/writer.h"
#include "comm/compression.h"
#include "comm/process_groups.h"
#include "layers/optimizer.h"
#include "layers/token_data.h"
#include "layers/train_config.h"

namespace troupe::training {

class Stage {
 public:
  // Collective over the world: every rank calls it with the same config, program, store
  // and namespace. Builds the communicators (dp, n, pp groups, the world, the tied pair),
  // the program (this rank's model part) and the optimizer shard. Takes the data splits.
  // On `ctx`'s device (default: the CPU); its allocator and CudaContext must outlive the
  // Stage.
  static Result<std::unique_ptr<Stage>> create(const layers::TrainConfig& tc, int rank,
                                               const ProgramFactory& program, comm::RendezvousStore& store,
                                               const comm::StoreNamespace& ns, layers::TokenShards train,
                                               layers::TokenShards val,
                                               const layers::Ctx& ctx = layers::Ctx::cpu());
  ~Stage();

  StepReport run_step(int64_t step);
  // Validation loss (every rank returns the same value); eval batches split over dp.
  double evaluate();

  const ParallelCoord& coord() const { return coord_; }
  int rank() const { return rank_; }
  int64_t num_params_local() const { return static_cast<int64_t>(flat_size_); }

  // ---- state, for checkpoints and recovery (actors/training/stage_state.cc) ----------
  // Call between steps. The layout in checkpoint's terms (same rank numbering).
  ParallelLayout state_layout() const;
  int64_t steps_done() const;  // optimizer steps applied
  // This rank's parameters, router biases and ZeRO-1 moments as named global slices (see
  // stage_state.h). copy = false: views of the live host buffers, valid until the next
  // run_step (CheckpointWriter::save copies them); copy = true: host copies. A device
  // Stage always returns host copies, and import_state copies up and refreshes the bf16
  // working copies.
  Result<StageState> export_state(StateScope scope, bool copy) const;
  // Overwrites everything this rank holds from `source` (any saved layout: each slice is
  // asked for by global name and box) and sets the optimizer's step count. The next
  // run_step(steps_done + 1) then continues the saved run.
  Status import_state(const SliceSource& source, int64_t steps_done);
  // import_state from a checkpoint (its step; checksums verified on every slice read).
  Status load_checkpoint(const checkpoint::CheckpointReader& reader);
  // The rank's scalar state after the last step, as a checkpoint records it: {"step",
  // "adam_steps", "data": {...}, "rng": {...}} (the loader is a function of the step).
  nlohmann::json rank_state() const;
  // ---- snapshots (actors/training/stage_snapshot.cc) ----------------------------------
  // A snapshot holds every tensor this rank holds (StateScope::kHeld), so a rank restores
  // from its own part alone; `saved` marks those a checkpoint keeps from this rank
  // (StateScope::kSave: each element once over the job), listed first. The tensors are
  // live views on the Stage's device. Call between steps.
  struct SnapshotTensor {
    checkpoint::SaveEntry entry;
    bool saved = false;
  };
  Result<std::vector<SnapshotTensor>> snapshot_tensors() const;
  // Starts copying the state after the last completed step into host memory: tensor i of
  // snapshot_tensors() to dst + offsets[i]. GPU: onto a device staging buffer on the
  // compute stream (ordered after the step), then device -> host on a snapshot stream
  // (dst should be pinned: pin_host); CPU: on a copier thread. Returns at once; the next
  // run_step's optimizer waits for a CPU copy before it writes the state. One copy at a
  // time: a second call waits for the first.
  Status snapshot_into(std::byte* dst, const std::vector<uint64_t>& offsets);
  // Waits until that copy is in host memory (any thread).
  Status snapshot_wait();
  // Page-locks host memory device copies go to (no-ops on the CPU); unpin before unmapping.
  // Any thread (a large region takes a while: the snapshot thread does it).
  void pin_host(void* p, size_t bytes);
  void unpin_host(void* p);
  // Clears what an interrupted step left behind and imports everything this rank holds
  // from `source` (a snapshot's parts or a checkpoint, any layout); the next
  // run_step(steps_done + 1) continues the run.
  Status restore(const SliceSource& source, int64_t steps_done);
  // The same from this rank's own snapshot part (made in this layout): each tensor's bytes
  // go straight from the part into the live buffer (host -> device on a GPU), no
  // intermediate copy. Fails (nothing changed) when the part does not describe exactly
  // what snapshot_tensors() holds.
  Status restore_own_part(const checkpoint::SnapshotPart& part, int64_t steps_done);
  // ---- elastic recovery (actors/training/stage_elastic.cc) ----------------------------
  // Every communicator of the Stage is an ElasticComm (created in order: dp, n, pp groups,
  // world, tied pair). The worker loop (elastic.h) calls these between steps.
  // Aborts every communicator (any thread; pending operations fail at once).
  void abort_comms(std::string_view reason);
  // Recreates every communicator in namespace `ns` (collective with the ranks of the new
  // epoch, which create theirs in the same order).
  Status rebuild_comms(const comm::StoreNamespace& ns);
  // Drops what an interrupted step left behind (sends, the program's accumulators), so a
  // rank that keeps its state continues from the last completed step.
  void clear_interrupted_step();
  // Parameters this rank owns, by the actor role that owns them (ProgramParam::role:
  // "attention", "experts"), and "stage" (all it holds).
  std::map<std::string, int64_t> params_by_role() const;

 private:
  struct StateTensor;
  Result<std::vector<StateTensor>> state_tensors() const;

  struct Micro;
  struct Entry {
    std::string name;
    layers::Parameter* param;
    bool expert;   // n-sharded (ProgramParam::sharded): not replicated over the n-group
    bool in_norm;  // counted in the gradient norm on this rank
    int64_t ready = kGradReadyAtEnd;  // ProgramParam::grad_ready: its dp bucket
    std::string role;
    int64_t offset = 0;
  };

  Stage(const layers::TrainConfig& tc, int rank, layers::TokenShards train, layers::TokenShards val);
  Status build(const ProgramFactory& program, comm::RendezvousStore& store, const comm::StoreNamespace& ns);
  Status setup_params(const std::vector<ProgramParam>& params);
  double grad_sum_squares() const;  // this rank's share of the gradient norm
  void refresh_working_copies();
  // ---- bucketed dp synchronisation ----
  static constexpr int64_t kHeadBucket = kGradReadyAfterHead, kEndBucket = kGradReadyAtEnd;  // readiness keys
  struct SyncBucket {
    int64_t lo = 0, hi = 0;
    int64_t ready = 0;  // role index whose backward completes it, kHeadBucket or kEndBucket
    std::vector<size_t> entries;
    Bucket grad, param;
    bool grad_launched = false;
  };
  void setup_buckets();
  void launch_grad_buckets(int64_t ready);
  void await_params(int64_t ready);
  // Waits for the parameter all-gather still in flight from the last step (call before
  // reading or writing parameter values outside run_step).
  void settle();
  void synchronize() const;  // waits for ctx_'s stream (no-op on the CPU)
  // Makes ctx_'s device current on the calling thread (steps run on an actor thread).
  void bind_device() const;

  void load(bool eval, int64_t step, int64_t index, Micro& m) const;
  Tensor blocks_forward(const layers::Ctx& c, Tensor x, Micro& m, bool train);
  Tensor blocks_backward(const layers::Ctx& c, Tensor dy, Micro& m);
  void forward(int64_t step, int64_t index, Micro& m);
  void backward(Micro& m);
  // Pipeline p2p. Host: pp group, sends kept in pending_sends_. Device: activations on the
  // pp group, gradients on pp_back_ (one communicator per direction, each on its own
  // stream, so 1F1B's crossing send/recv pairs never queue behind each other).
  Tensor recv_from(int peer_pp, bool grad);
  void send_to(const Tensor& t, int peer_pp, bool grad);
  void await_sends();

  layers::TrainConfig tc_;
  int rank_;
  ParallelCoord coord_;
  layers::TokenShards train_data_, val_data_;
  std::unique_ptr<layers::DataLoader> loader_, val_loader_;
  std::unique_ptr<ParallelLayout> layout_;
  comm::ProcessGroups groups_;
  std::unique_ptr<comm::Communicator> world_, tied_;
  std::unique_ptr<comm::Communicator> pp_back_;  // device, pp > 1: gradients backward
  void* p2p_streams_[2] = {nullptr, nullptr};    // device, pp > 1: activations, gradients (owned)
  std::vector<CommOp> pending_send_ops_;         // device sends
  CommTime time_;
  std::vector<SyncBucket> buckets_;
  std::vector<size_t> param_order_;  // bucket indices in forward order
  bool last_micro_ = false;          // in the backward of the step's last micro-batch
  bool params_pending_ = false;      // parameter all-gather in flight
  void* comm_stream_ = nullptr;      // device: the communication stream (owned)

  layers::Ctx ctx_;
  // The app's model part (destroyed before the communicators and CommTime it uses).
  std::unique_ptr<StageProgram> program_;
  int64_t num_blocks_ = 0;
  std::vector<layers::Parameter*> tied_params_;  // the tied parameter or copy (pp > 1)
  bool first_ = false, last_ = false;
  int64_t batch_ = 0, seq_local_ = 0;
  float loss_weight_ = 1.0f;

  std::vector<Entry> entries_;
  int64_t flat_size_ = 0, rep_size_ = 0, shard_lo_ = 0, shard_len_ = 0;
  Tensor flat_value_, flat_grad_, shard_grad_;
  std::vector<layers::Parameter> pieces_;  // this dp rank's shard, one piece per parameter
  // ---- elastic (stage_elastic.cc) ----
  comm::CommFactory elastic_factory(comm::CommFactory inner);
  std::vector<ElasticComm*> elastic_comms_;  // creation order
  // ---- snapshots (stage_snapshot.cc) ----
  // What a snapshot's copy needs between calls (staging buffer, stream, copier thread).
  struct SnapshotCopy;
  struct SnapshotCopyDeleter {
    void operator()(SnapshotCopy* c) const;
  };
  std::unique_ptr<SnapshotCopy, SnapshotCopyDeleter> snap_;  // made by create(): never null
  void init_snapshot_copy();
  // Waits for a CPU snapshot copy still reading the state (run_step, before the optimizer).
  void snapshot_fence();
  std::vector<bool> piece_in_norm_;
  std::unique_ptr<layers::AdamW> opt_;

  // Per-step accumulators.
  std::vector<comm::WorkPtr> pending_sends_;
  double lm_acc_ = 0, tokens_acc_ = 0;
  // Device: the step's statistics stay on the device until one read at its end (no host
  // wait per micro-batch): f32 [1 + grad_accum] = [gradient sum of squares | the token
  // loss sum of each micro-batch]; the token counts and weights are the host's.
  Tensor stats_dev_;
  std::vector<int64_t> micro_tokens_;  // per micro-batch: tokens with a target (last stage)
};

}  // namespace troupe::training
