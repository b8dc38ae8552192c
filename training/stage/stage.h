// training/stage/stage.h — defines Stage, the framework's side of one rank of a
// pp x dp x n layout (docs/architecture.md): it runs an app's StageProgram
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
// - Overlap (bench.overlap_*; docs/parallelism.md "Overlap"): the dp reduce-scatter
//   runs per bucket (one block's replicated or sharded parameters, the head, the
//   embedding: ProgramParam::grad_ready), launched in backward as soon as the step's last
//   micro-batch has finished a block; the n-group sum of the replicated part then runs on
//   this rank's shard after the reduce-scatter (dp first, then n: the same order with or
//   without overlap). The parameter all-gather after the optimizer is launched per
//   bucket and each block waits for its own bucket in the next forward (state accessors
//   wait for all of it first).
// - Norm and metrics: the world's sum of [grad sum of squares (each value counted once:
//   replicated parts on n-rank 0 only, a tied copy on the first stage only), tokens, LM
//   loss of each micro-batch, ..., the program's statistics]; the optimizer clips by that
//   norm and the program's end_step gets the sums.
// - Parameters (layers/param_buffer.h, the one flat buffer type of every path): every
//   value in one flat f32 buffer, every gradient in one flat buffer (the experts' in a
//   bf16 tail with train.expert_grads = "bf16"), working copies and split masters beside
//   them; rank r's ZeRO-1 shard is [r*L, (r+1)*L) of it.
//
// Step engine (launch_step / finish_step): everything that makes one GPU fast is a
// property of the Stage, in every layout:
// - written gradients: a step clears only the gradients that products add to (the
//   embedding's), the others are written by their first product (ParamBuffer::zero_grad);
// - bf16 expert gradients (train.expert_grads): the dp reduce-scatter sends them as they
//   are (bf16 on the wire) and sums them in f32 into the f32 shard;
// - split masters (train.master_weights = "split"): AdamW updates the bf16 copy and low
//   half of its shard; with dp > 1 the shard's values are joined for the f32 all-gather
//   and each bucket's copies split again as it lands;
// - folded gradient norm (bench.fold_grad_norm) where exact: n-sharded gradients that no
//   dp reduction changes (dp == 1); elsewhere the norm reads the gradient;
// - statistics on the device (bench.device_stats, the default): the step's statistics
//   accumulate in one f32 buffer, are all-reduced over the world on the device, and leave
//   it by one asynchronous copy per step into pinned memory, read in finish_step: no host
//   read inside the step (StepReport::host_syncs counts any; the n-group's expert
//   all-to-all reads its token counts unless parallel.device_dispatch);
// - CUDA graph (bench.cuda_graph, GPUs): the whole step — every micro-batch's forward and
//   backward, the gradient synchronisation, the norm, the optimizer — captured at the
//   second step and replayed after, the batch copied into fixed device buffers outside
//   the graph; a step whose target counts differ from the captured step's runs op by op;
//   layouts whose step cannot be captured refuse it at creation, naming why;
// - launch-ahead (bench.launch_ahead): step k+1 may be launched before step k is
//   finished (can_launch_ahead), so the device runs on while the host reads, logs and
//   drives.
// - Device (create with a CUDA Ctx, e.g. one GPU per worker): NCCL communicators on the
//   Ctx's device, parameters, gradients and moments in device memory from the Ctx's
//   allocator, activations in the Ctx's dtype; collectives are ordered on the compute
//   stream (group_ops.h "Device mode"), the overlapped ones on a communication stream
//   ordered by events.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/reader.h"
#include "checkpoint/snapshot_segment.h"
#include "checkpoint/writer.h"
#include "comm/compression.h"
#include "comm/process_groups.h"
#include "data/token_data.h"
#include "layers/optimizer.h"
#include "layers/param_buffer.h"
#include "training/parallel/elastic_comm.h"
#include "training/parallel/group_ops.h"
#include "training/run_config.h"
#include "training/stage/stage_program.h"
#include "training/stage/stage_state.h"
#include "training/stage/step_graph.h"

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

  // ---- steps --------------------------------------------------------------------------
  // Enqueues step `step` (all its device work, its statistics copied out asynchronously)
  // and returns at once on a device; on the CPU it runs the whole step. Steps are
  // launched in order, at most two unfinished at a time. A step that cannot run behind the
  // one in flight (it runs op by op: the host's bookkeeping of the two would interleave)
  // first completes that one (its report is kept for its finish_step).
  void launch_step(int64_t step);
  // Waits for the launched step's statistics and returns its report (finish_step is
  // called in launch order). After it the step's device work is done.
  StepReport finish_step(int64_t step);
  // Whether the next step may be launched before finish_step of the last launched one
  // gains anything and keeps the step's meaning: false where something between two steps
  // needs the host (the program's updates_between_steps, e.g. a host-side router bias
  // update), before a step was captured as a graph on a device, or with
  // bench.launch_ahead = false. On the CPU a step runs whole in launch_step: true.
  bool can_launch_ahead() const;
  StepReport run_step(int64_t step) {
    launch_step(step);
    return finish_step(step);
  }
  // Validation loss (every rank returns the same value); eval batches split over dp.
  // Needs no step in flight.
  double evaluate();

  const ParallelCoord& coord() const { return coord_; }
  int rank() const { return rank_; }

  // ---- state, for checkpoints and recovery (training/stage/stage_state.cc) ----------
  // Call between steps (no step launched and not finished). The layout in checkpoint's terms (same rank
  // numbering).
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
  // ---- snapshots (training/stage/stage_snapshot.cc) ----------------------------------
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
  // time: a second call waits for the first. `before_copy` (may be empty) runs first, where
  // the copy into dst starts: on the copier thread (CPU), so that what must precede the
  // copy (the keeper's leave to overwrite dst) is off the step thread too; at once on a
  // GPU. It returns false to leave dst untouched (its caller then knows the snapshot failed).
  // `checksums` (may be null; its owner leaves it alone until snapshot_wait returns): on
  // the CPU, the copier leaves there the xxHash64 of each tensor's bytes in dst, hashed
  // chunk by chunk right after each chunk's copy while it is in cache (one pass over the
  // state instead of a copy and a second read to checksum it); left empty on a GPU, whose
  // caller hashes the host copy itself.
  Status snapshot_into(std::byte* dst, const std::vector<uint64_t>& offsets,
                       std::function<bool()> before_copy = {}, std::vector<uint64_t>* checksums = nullptr);
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
  // ---- elastic recovery (training/stage/stage_elastic.cc) ----------------------------
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
  // ---- step engine (stage_step.cc) ----
  struct HostBatch;  // a step's micro-batches as the loader gives them
  // A launched step until its finish_step.
  struct Launched {
    int64_t step = 0;
    double lr = 0;
    bool replay = false;  // a replay of the captured step
    bool done = false;    // completed: report holds its figures
    StepReport report;
    std::chrono::steady_clock::time_point launched_at;  // launch_step's start
    int64_t t0_ns = 0;                                  // the same, for the timeline
    int64_t host_syncs = 0;                             // device->host reads while it was enqueued
    int64_t upload_waits = 0;                           // host->device uploads that waited, likewise
    int64_t bytes0 = 0;                                 // the allocator's bytes in use at its launch
    double comm_s = 0;                                  // data-plane waits while it was enqueued
    std::map<std::string, double> comm_by_kind_s;
  };
  HostBatch read_batch(int64_t step) const;
  void upload(const HostBatch& b);  // into the fixed device inputs (inputs_)
  // All device work of a step (its batch uploaded first); `capturing`: recorded into the
  // graph, so nothing may be taken from the host that a replay would need afresh.
  void enqueue_step(int64_t step, bool capturing);
  void sync_grads();
  void host_metrics();  // host statistics: read and summed over the world (fp64) into host_stats_
  void measure_compression(
      int64_t step);  // bench.measure_compression (CPU): prints the bf16 exchange's error
  void optimizer_step(double lr);
  StepReport complete(Launched& l);  // takes its statistics; the program's end_step
  void complete_in_flight();         // completes every launched step (reports kept)
  void write_trace(int64_t step, int64_t t0_ns);
  Status setup_engine();
  // A step that cannot be captured (`why`): refused when the config set bench.cuda_graph =
  // true itself, else a note (rank 0) that it runs op by op (`when`: "" or " from now on").
  Status graph_blocked(std::string_view why, std::string_view when) const;
  // Makes ctx_'s device current on the calling thread (steps run on an actor thread).
  void bind_device() const;

  void load_eval(int64_t index, Micro& m) const;
  void inputs_for(int64_t index, Micro& m) const;  // a training micro-batch from inputs_
  Tensor blocks_forward(const layers::Ctx& c, Tensor x, Micro& m, bool train);
  Tensor blocks_backward(const layers::Ctx& c, Tensor dy, Micro& m);
  void forward(int64_t index, Micro& m);
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

  std::vector<Entry> entries_;  // in the buffer's slot order
  // Every parameter's value, gradient, working copy (entries_[i] is buf_'s slot i).
  // flat_size_: the end of the last parameter's range (ZeRO-1 placements divide it).
  layers::ParamBuffer buf_;
  int64_t flat_size_ = 0, rep_size_ = 0, shard_lo_ = 0, shard_len_ = 0;
  Tensor shard_grad_;                      // dp > 1: this rank's reduced f32 shard
  std::vector<layers::Parameter> pieces_;  // this dp rank's shard, one piece per parameter
  std::vector<bool> in_norm_;              // per entry: Entry::in_norm
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
  std::vector<int64_t> micro_tokens_;  // per micro-batch of the step enqueued: tokens with a target
  // Host statistics: [sum of squares, LM loss, tokens, comm seconds | the program's],
  // summed over the world.
  static constexpr size_t kHostOwn = 4;
  std::vector<double> host_stats_;
  double host_sumsq_ = 0;

  // ---- step engine ----
  // bench.device_stats: the step's statistics in stats_, f32 [kStatsOwn + grad_accum +
  // the program's] = [gradient sum of squares, tokens with a target, seconds this rank
  // waited on the data plane, 0 | each micro-batch's LM loss (already weighted by
  // loss_weight / its tokens) | the program's rows], summed over the world on the device.
  static constexpr int64_t kSumSq = 0, kTokens = 1, kCommSeconds = 2, kStatsOwn = 4;
  bool device_stats_ = false;
  Tensor stats_;
  int64_t program_stats_ = 0;  // the program's values at the end of stats_
  std::unique_ptr<StatsReadback> readback_;
  std::unique_ptr<DeviceMarks> marks_;  // device: per step, slot step % 3
  int64_t first_marked_step_ = -1;      // the first step this Stage marked
  // bench.cuda_graph on a device (graph_ null otherwise).
  std::unique_ptr<StepGraph> graph_;
  std::vector<int64_t> graph_tokens_;  // per micro-batch: the captured step's target counts
  size_t graph_peak_ = 0;              // the captured step's allocator high-water mark
  bool graph_mismatch_told_ = false;
  // A step ran op by op since graph_ was made or reset: what a program sets up in its
  // first step (buffers mapped, sizes learnt) is in place, so the next step may be captured.
  bool graph_warm_ = false;
  // The training micro-batches' device inputs, at fixed addresses (what a graph replays).
  struct Inputs {
    Tensor ids, targets;
  };
  std::vector<Inputs> inputs_;
  std::deque<std::unique_ptr<Launched>> launched_;
  int64_t steps_launched_ = 0;
  std::chrono::steady_clock::time_point last_finish_{};  // the last finish_step's return
};

}  // namespace troupe::training
