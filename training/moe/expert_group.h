// training/moe/expert_group.h — defines the expert-parallel role of one rank of an
// n-group: ExpertGroup runs E/n whole experts of one MoE block (rank r: experts
// [r*E/n, (r+1)*E/n), which the rank's layers::MoELayer alone creates and initialises:
// MoELayer's ExpertRange) and is plugged into that layer as its ExpertDispatch, in one
// of two modes:
//
//   kAllToAll:  local dispatch plan -> permute -> all_to_all_v of the rows to the ranks
//               owning their experts (counts exchanged first) -> regroup by local expert
//               -> grouped GEMMs -> back the same way -> weighted unpermute.
//               The tokens are split into Options::chunks chunks (plans, counts and
//               transfers per chunk; the counts of all chunks travel in one all_to_all,
//               one host read per layer). With Options::overlap every chunk's dispatch is
//               launched at once and chunk c's expert GEMMs run while chunks c+1.. are
//               still moving and chunk c-1 is being combined (communication on the
//               communicator's thread / the communication stream, CommTime::launch);
//               without it each transfer is waited for as soon as it is launched. The
//               arithmetic is the same either way (bitwise). Options::fp8 sends the
//               dispatched rows as fp8 e4m3 with one fp32 scale per row
//               (comm/compression.h); the combine keeps the activation dtype.
//   kAllGather: all-gather of tokens, expert ids and gates -> local scatter of the rows
//               routed to local experts -> grouped GEMMs -> local weighted gather into a
//               [n*T, D] partial -> reduce-scatter (MegaScale-MoE's path for large top-k).
//               Needs the same token count on every rank (true under Ulysses).
//
// Both give every token y[t] = sum_j gates[t,j] * expert_{idx[t,j]}(x[t]) exactly as
// LocalExpertDispatch does (dropless), up to fp32 summation order. (The router's
// load-balancing statistics are summed over the same group through
// Router::set_group_all_reduce, wired by the Stage.)
#pragma once

#include <memory>
#include <vector>

#include "layers/moe.h"
#include "training/moe/peer_rows.h"
#include "training/parallel/group_ops.h"

namespace troupe::training {

enum class DispatchMode { kAllToAll, kAllGather };

class ExpertGroup final : public layers::ExpertDispatch {
 public:
  struct Options {
    int64_t chunks = 1;    // token chunks of the all-to-all path
    bool overlap = false;  // transfers in flight behind the expert GEMMs
    bool fp8 = false;      // fp8 e4m3 token dispatch (kernels::moe_permute_fp8)
    // Device-driven dispatch (parallel.device_dispatch; kAllToAll on a GPU whose n-group
    // sits on one host): rows move through the group's mapped buffers, every index
    // computed on the device; no count reaches the host. Shared by the stage's blocks.
    std::shared_ptr<PeerRows> peer;
  };
  // Runs `moe`'s experts, which must be this rank's [rank*E/n, (rank+1)*E/n) of the
  // block's E (a MoELayer built with that ExpertRange); top_k as in its router. `moe`
  // keeps owning them and must outlive the group.
  ExpertGroup(layers::MoELayer& moe, comm::Communicator& group, CommTime& time, DispatchMode mode,
              Options options);

  Tensor forward(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                 std::unique_ptr<layers::DispatchState>& state, std::vector<int64_t>& kept) override;
  Tensor backward(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state,
                  Tensor& dgates) override;

 private:
  Tensor forward_a2a(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                     std::unique_ptr<layers::DispatchState>& state, std::vector<int64_t>& kept);
  Tensor backward_a2a(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state, Tensor& dgates);
  Tensor forward_peer(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                      std::unique_ptr<layers::DispatchState>& state);
  Tensor backward_peer(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state, Tensor& dgates);
  Tensor forward_ag(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                    std::unique_ptr<layers::DispatchState>& state, std::vector<int64_t>& kept);
  Tensor backward_ag(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state, Tensor& dgates);

  layers::Experts& local_;  // the MoE layer's: this rank's experts
  int64_t num_experts_, local_experts_, first_, top_k_;
  comm::Communicator& group_;
  CommTime& time_;
  DispatchMode mode_;
  Options options_;
};

}  // namespace troupe::training
