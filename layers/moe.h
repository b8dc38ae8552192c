// layers/moe.h — defines the MoE feed-forward layer: Router (scores, top-k, gates, the
// Switch load-balancing aux loss, the router z-loss, and DeepSeek-V3's aux-loss-free
// selection bias), ExpertDispatch (the separable "send each token to its experts and
// combine the results" step) with its one-process implementation LocalExpertDispatch
// (permute -> grouped GEMMs -> unpermute), and MoELayer, which chains them and adds the
// optional shared expert.
//
// Distributed code replaces the dispatch step: MoELayer::set_dispatch() takes any
// ExpertDispatch (e.g. one doing all-to-all to the ranks that own the experts), while the
// router, its losses and the shared expert stay the same.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layers/context.h"
#include "layers/mlp.h"
#include "layers/model_config.h"
#include "layers/parameter.h"

namespace troupe::layers {

// Sums a vector element-wise over the ranks that hold parts of the same micro-batch
// (e.g. a sequence-parallel group), in place. The router's balancing statistics go
// through it so that the aux loss and its gradient equal one process's over the whole
// micro-batch. Unset: one process (identity).
using GroupAllReduce = std::function<void(std::vector<double>&)>;
// The same sum for a device tensor (f32, in place, ordered on the compute stream), which
// returns the number of ranks summed: the statistics of Router::forward_device in a group
// never come back to the host.
using DeviceGroupAllReduce = std::function<int64_t(Tensor&)>;

class Router {
 public:
  struct Saved {
    Tensor x, logits, scores, topk_idx, gates;  // [T,D], [T,E], [T,E], i32 [T,k], [T,k]
    // Copies routed to each expert (before drops) over the whole micro-batch (summed over
    // the group), and that micro-batch's token count.
    std::vector<int64_t> selected;
    int64_t group_tokens = 0;
    // forward_device: the selection counts and score column sums (f32 [E] each) that stay
    // on the device for the aux-loss gradient (undefined in evaluation), and with a z-loss
    // each token's log-sum-exp of its logits (f32 [T]) for the z-loss gradient.
    Tensor counts, score_sums, lse;
  };
  Router(int64_t d_model, const MoEConfig& cfg);
  void init(uint64_t seed, const std::string& prefix, float std);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);

  // Fills s (topk_idx, gates, ...). Returns the auxiliary loss of this micro-batch:
  // aux_loss_coef * E * sum_e f_e * P_e + z_loss_coef * mean_t logsumexp(logits_t)^2, with
  // f_e = selected_e / (T*k) and P_e = mean_t scores[t,e], T and the sums taken over the
  // whole micro-batch (through the group all-reduce; every rank returns the same value).
  double forward(const Ctx& c, const Tensor& x, Saved& s) const;
  // The same routing with the statistics left on the device (the same routing as forward, and
  // its gradients up to the rounding of the f32 sums; the z-loss's log-sum-exps too): with acc (training),
  // f32 [E+1] on the device, acc[0:E] += the selection counts and acc[E] += this micro-batch's aux loss;
  // s.selected stays empty. In a group (set_device_group_all_reduce) the counts and score sums are summed
  // over the group on the device, and the group's token count is taken as the group's size times this
  // rank's (MoELayer::absorb_device_stats checks it against the summed counts). Without acc (evaluation) no
  // statistics are taken. No host wait either way.
  void forward_device(const Ctx& c, const Tensor& x, Saved& s, Tensor* acc) const;
  // Any Ctx (the CPU runs it too, which is how tests compare the two ways); the training
  // loop enables it on GPUs. A group needs the device all-reduce as well as the host one.
  bool device_stats_ok(const Ctx&) const { return !all_reduce_ || device_all_reduce_; }
  // dgates [T,k] from the experts; loss_weight is the weight of this micro-batch's aux
  // loss in the total loss. Adds the router's dx into `dx` (the experts' dx: its product
  // accumulates there, no separate add) and accumulates weight.grad.
  void backward(const Ctx& c, const Tensor& dgates, const Saved& s, float loss_weight, Tensor& dx);

  kernels::RouterConfig router_config() const;
  // coef * E / (T^2 k) for T tokens: the aux loss of T tokens is this times
  // sum_e counts_e * score_sums_e, and its gradient on the scores this times counts.
  double aux_scale(int64_t tokens) const;
  void set_group_all_reduce(GroupAllReduce f) { all_reduce_ = std::move(f); }
  // The device form of that sum for forward_device, over ranks that each route the same
  // number of tokens per micro-batch.
  void set_device_group_all_reduce(DeviceGroupAllReduce f) { device_all_reduce_ = std::move(f); }

  Parameter weight;  // [D, E]
  Tensor bias;       // f32 [E]: aux-loss-free selection bias (a buffer, no gradient)
  MoEConfig cfg;

 private:
  GroupAllReduce all_reduce_;
  DeviceGroupAllReduce device_all_reduce_;
};

// Opaque per-micro-batch state an ExpertDispatch keeps between forward and backward.
struct DispatchState {
  virtual ~DispatchState() = default;
};

class ExpertDispatch {
 public:
  virtual ~ExpertDispatch() = default;
  // x [T,D], topk_idx i32 [T,k], gates [T,k] -> y [T,D] with
  // y[t] = sum over kept copies j of gates[t,j] * expert_{topk_idx[t,j]}(x[t]).
  // kept: copies each expert processed (host, size E).
  virtual Tensor forward(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                         std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept) = 0;
  // forward, then residual [T,D] added to y (the block's residual stream). An implementation
  // may fold the add into its combine (LocalExpertDispatch: one pass over y instead of two).
  virtual Tensor forward_add(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                             std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept,
                             const Tensor& residual);
  // Returns dx; writes dgates [T,k]; accumulates the expert weight gradients.
  virtual Tensor backward(const Ctx& c, const Tensor& dy, DispatchState& state, Tensor& dgates) = 0;
};

// All experts in this process: moe_dispatch_plan -> moe_permute -> Experts -> moe_unpermute.
class LocalExpertDispatch final : public ExpertDispatch {
 public:
  // capacity_factor <= 0: dropless.
  LocalExpertDispatch(Experts& experts, int64_t top_k, double capacity_factor);
  Tensor forward(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                 std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept) override;
  // The residual joins moe_unpermute's sum (no pass of its own).
  Tensor forward_add(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                     std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept,
                     const Tensor& residual) override;
  Tensor backward(const Ctx& c, const Tensor& dy, DispatchState& state, Tensor& dgates) override;
  // Dropless only: size the permuted rows as T*k without reading the expert counts back
  // (the grouped GEMMs take the offsets on the device); `kept` is then left empty.
  void set_defer_counts(bool on) { defer_counts_ = on; }

 private:
  Experts& experts_;
  int64_t top_k_;
  double capacity_factor_;
  bool defer_counts_ = false;
  // forward and forward_add: permute, experts, then the gated combine (+ residual).
  Tensor combine(const Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                 std::unique_ptr<DispatchState>& state, std::vector<int64_t>& kept, const Tensor* residual);
};

// The experts of a MoE block that one MoELayer holds: [first, first + count) of the
// config's num_experts (rank r of an expert-parallel group of n: [r*E/n, (r+1)*E/n)).
// count < 0, the default: all of them.
struct ExpertRange {
  int64_t first = 0;
  int64_t count = -1;
};

class MoELayer {
 public:
  struct Saved {
    Router::Saved router;
    std::unique_ptr<DispatchState> dispatch;
    SwiGLUMLP::Saved shared;
  };
  struct Stats {
    double aux_loss = 0;
    std::vector<int64_t> selected;  // per expert, before capacity drops
    std::vector<int64_t> kept;      // per expert, processed
  };
  // `held`: the experts this layer creates and initialises (the router always scores all
  // cfg.num_experts). A layer holding only some runs only once a dispatch that reaches
  // the others is set (set_dispatch); its forward refuses before that.
  MoELayer(int64_t d_model, const MoEConfig& cfg, bool recompute, ExpertRange held = {});
  void init(uint64_t seed, const std::string& prefix, float std, float out_std);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);
  void collect_buffers(const std::string& prefix, std::vector<NamedBuffer>& out);

  // x [T,D] (normed) -> [T,D]. With stats (training), fills them and adds this
  // micro-batch's selections to step_load(); without (evaluation, sampling), counts nothing.
  // residual [T,D] (optional; the block's residual stream) is added to the output, inside
  // the dispatch's combine where it can (ExpertDispatch::forward_add).
  Tensor forward(const Ctx& c, const Tensor& x, Saved& s, Stats* stats, const Tensor* residual = nullptr);
  Tensor backward(const Ctx& c, const Tensor& dy, Saved& s, float loss_weight);

  // Replaces the dispatch step (not owned; must outlive the layer's use). nullptr restores
  // the local one (none when the layer holds only some experts).
  void set_dispatch(ExpertDispatch* d) { dispatch_ = d ? d : local_.get(); }
  // The experts `experts` holds: [first_expert(), first_expert() + experts.w1 rows).
  int64_t first_expert() const { return first_expert_; }

  // Selections per expert since the last update_bias (summed over micro-batches).
  const std::vector<int64_t>& step_load() const { return step_load_; }
  // Aux-loss-free balancing, after the optimizer step: bias_e += rate * sign(mean - load_e)
  // with `load` the step's selections (all ranks' when distributed); clears step_load().
  void update_bias(const std::vector<int64_t>& load);  // host bias (CPU Exec)
  void update_bias(const Ctx& c, const std::vector<int64_t>& load);

  // Device-resident statistics (GPUs; in a group with the router's device all-reduce):
  // `row` f32 [E+1] on the device,
  // which forward with stats accumulates into (selection counts, then the aux loss; see
  // Router::forward_device), and the local dispatch stops reading the counts back. Returns
  // false (nothing changes) where the router cannot (Router::device_stats_ok).
  bool set_device_stats(const Ctx& c, Tensor row);
  bool device_stats() const { return device_stats_.defined(); }
  // Takes a host copy of that row after a step: step_load() := its counts; returns its aux
  // loss sum (over micro-batches, unweighted). Throws when the counts do not add up to top_k
  // copies of the tokens the router assumed (a group whose members routed unequal token
  // counts: the aux loss and its gradient would have been scaled wrongly). `replicas`: the
  // number of copies of this layer whose rows were summed into `row` (data-parallel
  // replicas, each routing the same token count): the counts then add up to that many
  // times this layer's own selections.
  double absorb_device_stats(const float* row, int64_t replicas = 1);
  // The selections absorb_device_stats will expect (device mode), and an addition to them
  // for a replayed step (Model::add_pending_selections).
  int64_t pending_selections() const { return device_selections_; }
  void add_pending_selections(int64_t n) { device_selections_ += n; }

  Router router;
  Experts experts;
  std::unique_ptr<SwiGLUMLP> shared;  // null without shared experts

 private:
  int64_t first_expert_ = 0;
  std::unique_ptr<LocalExpertDispatch> local_;  // null when the layer holds only some experts
  ExpertDispatch* dispatch_;
  std::vector<int64_t> step_load_;
  Tensor device_stats_;
  int64_t device_selections_ = 0;  // copies the device counts must add up to since the last read
};

}  // namespace troupe::layers
