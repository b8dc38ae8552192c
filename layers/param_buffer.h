// layers/param_buffer.h — defines ParamBuffer, the one flat home of a set of parameters
// that every training path uses: the Stage of every layout (one per rank) and
// layers::Model on a device. It holds their f32 master values, their gradients, the
// working copies the matrix products read, the split masters' low halves and the slots of
// the folded gradient norm, and answers the questions a step asks of them: what must be
// cleared before the backward, what the norm must read, which values are behind their
// split masters. One type because each of these is a property of where the parameters
// live, and two copies of this machinery (the Model's and the Stage's) had drifted into
// two feature sets.
//
// Layout: one flat index space [0, size()). Parameters take consecutive ranges in the
// order given, each rounded up to kAlign elements (so every tensor starts aligned for
// vectorised kernels); those with a bf16 gradient (below) come after all others, from
// low_begin(). size() = used() rounded up to a multiple of Options::shards (ZeRO-1: dp
// shard p is [p*L, (p+1)*L), L = size() / shards). Padding is zero and nothing writes it.
//  - values(): f32 [size()], every master value (Parameter::value is a view).
//  - grads(): f32 [low_begin()], the gradients of [0, low_begin()); low_grads(): bf16
//    [size() - low_begin()], those of [low_begin(), size()): Options::expert_grads = kBF16
//    gives one to each parameter whose every gradient product can write bf16
//    (Parameter::bf16_grad_ok: the experts' grouped dW, ~90% of an MoE model's gradient),
//    half the bytes for the products to write and for the norm, the reduction and AdamW to
//    read. Meant for one micro-batch per step (later micro-batches would add in bf16);
//    callers refuse more.
//  - working copies (Parameter::work, in c.act, of every matrix where c.act is not f32)
//    and the split masters' low halves (Parameter::work_lo) are packed per parameter in
//    one buffer each: only their owner reads them.
//
// Written gradients (Parameter's contract): zero_grad() marks the gradients whose
// backward can overwrite them stale and clears only the others (one fill per run of
// adjacent ones); settle_grads() zeroes any still stale once the products are done (a
// parameter the step did not touch). So a step clears what products add to, never the
// whole buffer.
//
// Folded norm (enable_grad_norm_fold): the parameters the caller names get slots their
// gradient product fills with its sum of squares; grad_norm_squared_into() then sums the
// slots of each gradient whose one product of the step wrote them
// (Parameter::grad_sum_squares_valid) and reads every other gradient element. The caller
// vouches that nothing changes a folded gradient between its product and the norm (no
// reduction over a group, no rescaling); wherever a step breaks that, the gradient is read:
// the norm never depends on the step's shape.
//
// Split masters (split_masters; on a device, bf16 working copies): each matrix whose
// products read only its working copy keeps its f32 master as that bf16 copy plus a
// 16-bit low half, exactly; an optimizer writing both (AdamW::write_working_copies) leaves
// the value behind (Parameter::value_stale) until sync_master_values() joins it.
//
// Threading: none; every call enqueues on c's stream (or runs on the CPU) in call order.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "layers/context.h"
#include "layers/parameter.h"

namespace troupe::layers {

class ParamBuffer {
 public:
  static constexpr int64_t kAlign = 64;  // elements: 256 bytes of f32, 128 of bf16
  struct Options {
    DType expert_grads = DType::kF32;  // kBF16: bf16 gradients where Parameter::bf16_grad_ok
    int64_t shards = 1;                // size() is a multiple of it
  };
  struct Slot {
    std::string name;
    Parameter* param = nullptr;
    int64_t offset = 0;  // in the flat index space
    bool low = false;    // gradient in low_grads()
    int64_t numel() const { return param->numel(); }
  };

  ParamBuffer() = default;
  ParamBuffer(const ParamBuffer&) = delete;
  ParamBuffer& operator=(const ParamBuffer&) = delete;
  ParamBuffer(ParamBuffer&&) = default;
  ParamBuffer& operator=(ParamBuffer&&) = default;

  // Lays `params` out (a parameter listed twice, e.g. a tied weight, counts once) on c's
  // device (host memory for a CPU Ctx), copies their current values in and rebinds every
  // Parameter's value, grad and work onto the buffers (gradients zeroed). Clears any
  // folding slots and split halves the parameters had.
  void build(const Ctx& c, const std::vector<NamedParameter>& params, const Options& o);
  void build(const Ctx& c, const std::vector<NamedParameter>& params) { build(c, params, Options{}); }
  bool built() const { return values_.defined(); }

  const std::vector<Slot>& slots() const { return slots_; }
  // The slot of `p`, or -1.
  int64_t slot_of(const Parameter* p) const;
  int64_t used() const { return used_; }  // end of the last parameter's padded range
  int64_t size() const { return size_; }
  int64_t low_begin() const { return low_begin_; }
  static int64_t padded(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  const Tensor& values() const { return values_; }
  const Tensor& grads() const { return grads_; }
  const Tensor& low_grads() const { return low_grads_; }
  // The gradient elements [lo, hi) of the flat index space: a view of grads() or of
  // low_grads() (the range must not straddle low_begin()).
  Tensor grad_range(int64_t lo, int64_t hi) const;

  // ---- gradients ----------------------------------------------------------------------
  void zero_grad(const Ctx& c);
  // Zeroes the gradients still stale (every slot, or the listed ones) and clears the marks.
  void settle_grads(const Ctx& c);
  void settle_grads(const Ctx& c, std::span<const size_t> slots);
  // Gives the slots for which `eligible[i]` holds (every slot when empty) and whose
  // parameter can fold (Parameter::grad_sum_squares_slots > 0) their norm slots. Returns
  // the number of parameters with slots.
  int64_t enable_grad_norm_fold(const Ctx& c, const std::vector<bool>& eligible = {});
  // out f32 [1] := the sum of squares of the gradients of the slots for which counted[i]
  // holds (every slot when empty): folded ones from their slots, the rest read. No host
  // wait. Returns the gradient elements taken from slots.
  int64_t grad_norm_squared_into(const Ctx& c, Tensor& out, const std::vector<bool>& counted = {}) const;
  // The same, read back (host wait).
  double grad_norm_squared(const Ctx& c, const std::vector<bool>& counted = {}) const;

  // ---- values, working copies and split masters ----------------------------------------
  // Working copies (and split halves) from the values: of every slot, or the listed ones.
  // A split master whose value is behind (value_stale) must be synced first (checked).
  void refresh_working_copies(const Ctx& c);
  void refresh_working_copies(const Ctx& c, std::span<const size_t> slots);
  // Splits every master that can be (a bf16 working copy, no product reading the value:
  // !Parameter::reads_value). Returns the number split.
  int64_t split_masters(const Ctx& c);
  bool split() const { return master_lo_.defined(); }
  // Joins every value that is behind its split master (exact); a no-op where none is.
  void sync_master_values(const Ctx& c);
  // The values were just overwritten (a restore, a checkpoint load): none is behind now.
  // Call refresh_working_copies next.
  void values_written();

  // Copies every value (synced) and gradient (f32) into host tensors of its own, rebinds
  // the parameters onto them (no working copies, no slots) and releases the buffers.
  void to_host(const Ctx& c);

 private:
  std::vector<Slot> slots_;
  int64_t used_ = 0, size_ = 0, low_begin_ = 0;
  Tensor values_, grads_, low_grads_, works_, master_lo_, fold_slots_;
  std::vector<int64_t> work_offsets_;  // per slot: offset in works_, or -1
  bool on_device_ = false;
};

}  // namespace troupe::layers
