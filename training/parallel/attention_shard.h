// training/parallel/attention_shard.h — defines AttentionShard, the attention role of one
// GPU (CPU slot) of an n-group: Ulysses sequence parallelism over layers::Attention.
//
// Each rank holds S/n consecutive tokens of every sequence of the micro-batch (rank r:
// positions [r*S/n, (r+1)*S/n)). Forward: project q, k, v for the local tokens (RoPE at
// their global positions) -> all-to-all to head-sharded (every token, H/n query heads and
// Hkv/n kv heads: with Hq/Hkv = g, local query head j maps to local kv head j/g, as in
// one process) -> attention core -> all-to-all back to sequence-sharded -> output
// projection. Backward runs the duals (an all-to-all is its own dual with the roles of
// the two layouts swapped). The attention weights are replicated: their gradients here
// cover the local tokens only, and the Stage sums them over the n-group.
//
// Overlap (constructor flag): the all-to-alls of q, k and v (forward) and of dq, dk and
// dv (backward) are launched back to back (CommTime::launch), so k is packed while q
// moves and q is unpacked while v moves; without it each is waited for when launched.
// Pure data movement: the result is bitwise the same either way.
#pragma once

#include "layers/attention.h"
#include "training/parallel/group_ops.h"

namespace troupe::training {

class AttentionShard {
 public:
  struct Saved {
    Tensor x, pos;    // local input [B*Sl, D], positions i32 [B*Sl]
    Tensor q, k, v;   // head-sharded [B, S, H/n, Dh]
    Tensor out, lse;  // head-sharded core output, lse [B, H/n, S]
    Tensor out_seq;   // sequence-sharded core output [B, Sl, H, Dh]
    layers::Attention::QkNormSaved qk_norm;  // the q/k norm's state (local tokens)
  };
  // `attn` and `group` must outlive the shard.
  AttentionShard(layers::Attention& attn, comm::Communicator& group, CommTime& time, bool overlap = false);

  // x [B*Sl, D] -> [B*Sl, D]; seq_local = Sl = S/n.
  Tensor forward(const layers::Ctx& c, const Tensor& x, int64_t batch, int64_t seq_local, Saved& s);
  Tensor backward(const layers::Ctx& c, const Tensor& dy, const Saved& s);

  // The two layout switches (collective over the group).
  Tensor seq_to_head(const Tensor& x);  // [B, Sl, H, Dh] -> [B, n*Sl, H/n, Dh]
  Tensor head_to_seq(const Tensor& y);  // [B, S, Hl, Dh] -> [B, S/n, Hl*n, Dh]

  // A layout switch in flight: launch() packs and launches, finish() awaits and unpacks.
  struct Switch {
    bool to_head = true;
    int64_t b = 0, s = 0, h = 0, dh = 0;  // the input's shape
    DType dtype = DType::kF32;
    Tensor send, recv;
    CommOp op;
  };
  Switch launch(const Tensor& x, bool to_head);
  Tensor finish(Switch& sw);

 private:
  // Several switches: launched together with overlap, else one after the other.
  std::vector<Tensor> switch_all(const std::vector<Tensor>& xs, bool to_head);

  layers::Attention& attn_;
  comm::Communicator& group_;
  CommTime& time_;
  bool overlap_;
};

}  // namespace troupe::training
