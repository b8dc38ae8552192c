// layers/parameter.h — defines Parameter (an fp32 master value and its gradient),
// NamedParameter / NamedBuffer (the stable names checkpoints and distributed code use,
// e.g. "blocks.3.moe.experts.w1") and the deterministic initialisers every layer uses.
//
// Contract: gradients accumulate. Every backward adds into Parameter::grad, so several
// micro-batches can run before one optimizer step; Model::zero_grad() clears them. A layer
// whose backward can write its gradient instead of adding (overwrites_grad) lets
// zero_grad skip clearing it: zero_grad marks it grad_stale, the first backward of the
// step then writes the gradient (accumulate_grad() returns false and clears the mark), and
// the later micro-batches add as usual.
//
// Gradient-norm folding: a product that writes a gradient can also leave its
// sum of squares in slots (grad_sum_squares), so that the step's norm need not read that
// gradient again. The slots hold the gradient's sum of squares only while exactly one
// product produced the gradient since zero_grad and that product wrote it with the slots
// (grad_sum_squares_valid()); every accumulate_grad() call counts as a product.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace troupe::layers {

struct Parameter {
  Tensor value;  // f32 master weights
  Tensor grad;   // f32, same shape as value
  // Compute-dtype copy of value (bf16 on CUDA) that matrix products read; undefined when
  // products read value itself (CPU). Refreshed from value after every optimizer step.
  Tensor work;
  // The split master (train.master_weights = "split", Model::split_masters): i16 of
  // value's shape beside a bf16 work, which then holds value's upper half rounded
  // (kernels/master_bits.h); the f32 master is the pair, exactly. The optimizer updates the
  // pair and leaves value behind (value_stale) until Model::sync_master_values. Undefined
  // otherwise.
  Tensor work_lo;
  bool value_stale = false;
  // Set by the owning layer when its products read value itself on a device (the
  // embedding's gather): such a master is never split.
  bool reads_value = false;
  // False for gains of norms (AdamW's decoupled weight decay is not applied to them).
  bool decay = true;
  // Set by the owning layer when its backward takes the accumulate flag from
  // accumulate_grad(): a gradient product that writes every element, empty expert
  // segments included (zeros), when told not to accumulate.
  bool overwrites_grad = false;
  // grad holds stale values that count as zero (see the contract above).
  bool grad_stale = false;
  // Set by the owning layer when every product that writes or adds grad can do so in bf16
  // (the experts' grouped dW): Model::to_device then gives it a bf16 gradient when asked
  // (train.expert_grads = "bf16").
  bool bf16_grad_ok = false;
  // Set by the owning layer when its gradient product can fold the sum of squares (see
  // above): the size of grad_sum_squares (kernels::grouped_matmul_dw_sum_squares_slots).
  int64_t grad_sum_squares_slots = 0;
  // f32 [grad_sum_squares_slots] on grad's device when folding is on
  // (Model::enable_grad_norm_fold), else undefined: the product's partial sums of squares.
  Tensor grad_sum_squares;
  // Since zero_grad: gradient products (accumulate_grad calls), and whether one of them
  // wrote grad_sum_squares.
  int64_t grad_products = 0;
  bool grad_sum_squares_written = false;

  // Allocates value and a zeroed grad of `shape` (host, f32).
  void allocate(const Shape& shape, bool with_decay = true);
  int64_t numel() const { return value.numel(); }
  // The tensor matrix products use: the working copy when there is one, else value.
  const Tensor& w() const { return work.defined() ? work : value; }
  // For a backward about to produce this parameter's gradient: whether to add into grad
  // (false while grad is stale: the product writes it). Clears the stale mark.
  bool accumulate_grad() {
    const bool add = !grad_stale;
    grad_stale = false;
    ++grad_products;
    return add;
  }
  // For the product that accumulate_grad() just answered `add` for: the slots it fills with
  // the sum of squares of what it writes, or null (it adds, or this gradient is not folded).
  Tensor* grad_sum_squares_out(bool add) {
    if (add || !grad_sum_squares.defined()) return nullptr;
    grad_sum_squares_written = true;
    return &grad_sum_squares;
  }
  // Whether the sum of grad_sum_squares is grad's sum of squares: one product since
  // zero_grad, and it wrote grad together with the slots.
  bool grad_sum_squares_valid() const {
    return grad_sum_squares.defined() && grad_products == 1 && grad_sum_squares_written;
  }
  // zero_grad's part of the above: a new step has no products yet.
  void reset_grad_products() {
    grad_products = 0;
    grad_sum_squares_written = false;
  }
};

struct NamedParameter {
  std::string name;
  Parameter* param;
};

// State that is saved with the model but has no gradient (the router's balancing bias).
struct NamedBuffer {
  std::string name;
  Tensor* tensor;
};

// Deterministic initialisation keyed by (seed, parameter name): the same name gets the
// same values whatever the order of construction or the parallel layout. The generator
// is counter-based (element i of the flattened global tensor depends only on seed, name
// and i), so a sharded run initialises its contiguous slice alone by passing the slice's
// first element index in `first_element` and still equals one process.
void init_normal(Tensor& t, uint64_t seed, const std::string& name, float std, int64_t first_element = 0);
// The slice of the global tensor `name` that a rank holding some of its dim-0 rows owns:
// t holds rows [first_row, first_row + t.size(0)) of a global tensor whose other dims are
// t's (an expert-parallel rank's experts of [E, D, 2F]). Bitwise the rows that
// init_normal of the whole tensor draws, without making the others: a rank's
// initialisation costs time and memory for its part only.
void init_normal_rows(Tensor& t, uint64_t seed, const std::string& name, float std, int64_t first_row);
void init_constant(Tensor& t, float value);

// splitmix64: the mixing function behind initialisation and the data loader.
uint64_t mix64(uint64_t x);
uint64_t hash_string(const std::string& s);

}  // namespace troupe::layers
