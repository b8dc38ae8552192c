// layers/autograd.h — defines Tape and Var: reverse-mode differentiation over Troupe's ops
// (kernels/ops.h) and layers, so that a model part is written as its forward alone (the
// transformer program base, training/app/transformer_program.h, runs each block of an
// app through one Tape per micro-batch).
//
//   layers::Tape t(ctx);
//   Var x = t.input(activations);
//   Var h = x + attention(rms_norm(x, norm1, eps));           // a hand-written layer inside
//   Var y = h + matmul(swiglu(matmul(rms_norm(h, norm2, eps), w1)), w2);
//   ... later, once per micro-batch:
//   Tensor dx = t.backward(y, dy, x);  // adds every parameter's gradient, returns dL/dx
//
// Each op computes its result at once, with the kernels a hand-written layer enqueues, and
// (while the tape records) keeps what its backward needs: what a layer's Saved would hold,
// per micro-batch, since a program makes one Tape per block and micro-batch. backward()
// runs the recorded ops in reverse, each with the op's backward from kernels/ops.h, and
// frees each op's saved tensors and its output's gradient as soon as it ran.
//
// Contracts:
// - No host reads and a fixed sequence of allocations: every op enqueues on the Ctx's
//   stream and allocates from its allocator in the same order for the same shapes, so a
//   step made of tapes can be captured as a CUDA graph and replayed. The tape's own
//   bookkeeping is host memory.
// - Gradients of values used more than once are summed. A gradient an op hands on
//   unchanged (add's, view's) is shared, never written in place; the first op that adds
//   to a shared gradient makes its own (no copy when that op can add in its own pass:
//   rms_norm takes the residual gradient as its `dres`, matmul adds into it with beta 1).
//   The gradient passed to backward() is only read.
// - Parameters follow layers/parameter.h: every op that produces a parameter's gradient
//   asks Parameter::accumulate_grad() whether to add or write, so a parameter may be used
//   by several ops and written gradients (overwrites_grad) stay correct.
// - A Var belongs to one Tape and lives while its value is needed; a Tape runs backward
//   once (call it with the Var returned by the forward and an input of the same tape).
// - Not recording (evaluation, or the forward of a recomputed block): ops only compute.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "layers/context.h"
#include "layers/parameter.h"

namespace troupe::layers {

class Tape;

// A value computed on a Tape: its tensor and, where a gradient can flow to it, its slot.
class Var {
 public:
  Var() = default;
  const Tensor& value() const { return value_; }
  const Shape& shape() const { return shape_; }
  int64_t size(int64_t d) const {  // negative d counts from the end
    return shape_[static_cast<size_t>(d < 0 ? d + static_cast<int64_t>(shape_.size()) : d)];
  }
  DType dtype() const { return dtype_; }
  bool defined() const { return tape_ != nullptr; }
  Tape& tape() const;
  // Whether a gradient flows to it (a recorded op's result, or an input of a recording tape).
  bool requires_grad() const { return id_ >= 0; }
  // Lets go of the value (the ops that need it hold their own reference); the Var still
  // names its gradient slot for Tape::backward. A program keeps a block's output Var for
  // the backward without keeping the activation alive.
  void release_value() { value_ = Tensor(); }

 private:
  friend class Tape;
  Tape* tape_ = nullptr;
  int id_ = -1;
  Tensor value_;
  Shape shape_;
  DType dtype_ = DType::kF32;
};

class Tape {
 public:
  // `record` false: ops compute only (evaluation, recomputation's first pass).
  explicit Tape(const Ctx& c, bool record = true) : c_(c), record_(record) {}
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  const Ctx& ctx() const { return c_; }
  bool recording() const { return record_; }
  // A leaf whose gradient backward() returns (a constant when the tape does not record).
  Var input(const Tensor& x);
  // A leaf without gradient.
  Var constant(const Tensor& x);

  // Runs every recorded op's backward, from `out` whose gradient is `dout` (out's shape;
  // only read), and returns the gradient of each leaf of `in` (zeros where nothing reached
  // it). Parameter gradients are added (or written) as each op's backward runs. Once per
  // tape.
  std::vector<Tensor> backward(const Var& out, const Tensor& dout, const std::vector<Var>& in);
  Tensor backward(const Var& out, const Tensor& dout, const Var& in) {
    return backward(out, dout, std::vector<Var>{in})[0];
  }
  // Recorded ops not yet run backward (tests: 0 after backward, as every saved tensor went).
  size_t pending_ops() const { return nodes_.size(); }

  // ---- for ops (autograd.cc; a custom op the same way) ---------------------------------
  struct Node {
    virtual ~Node() = default;
    // Reads the gradient of its result (Tape::out_grad) and hands its inputs theirs
    // (Tape::add_grad / take_grad).
    virtual void backward(Tape& t) = 0;
    int out = -1;
  };
  // The result of an op: `node` (null: nothing to differentiate) is recorded with it.
  Var result(Tensor value, std::unique_ptr<Node> node);
  // Whether an op with these inputs records (the tape records and one needs a gradient).
  bool records(std::initializer_list<const Var*> inputs) const;
  // The gradient of a node's result, and whether the node may write into it.
  const Tensor& out_grad(const Node& n) const { return grads_[static_cast<size_t>(n.out)].g; }
  bool out_grad_owned(const Node& n) const { return grads_[static_cast<size_t>(n.out)].owned; }
  // Adds g to var `id`'s gradient. owned: g is the caller's to give (it may be written in
  // place later); else it is shared with another gradient and only read. No-op for id < 0.
  void add_grad(int id, Tensor g, bool owned);
  // Takes var `id`'s gradient so far out of its slot (undefined if none), for an op that
  // adds it in its own pass and then add_grad()s the sum; `owned` says whether it may be
  // written.
  Tensor take_grad(int id, bool& owned);
  static int id_of(const Var& v) { return v.id_; }

 private:
  struct Grad {
    Tensor g;
    bool owned = false;
    bool leaf = false;  // Tape::input
  };
  Ctx c_;
  bool record_;
  bool done_ = false;
  int next_id_ = 0;
  std::vector<Grad> grads_;                   // by var id
  std::vector<std::unique_ptr<Node>> nodes_;  // in recording order
};

// ---- ops ------------------------------------------------------------------------------
// Shapes as in kernels/ops.h; results in the Ctx's activation dtype unless said otherwise.
Var operator+(const Var& a, const Var& b);
Var add(const Var& a, const Var& b);
Var scale(const Var& x, float alpha);  // alpha * x
Var operator*(float alpha, const Var& x);
Var axpby(float alpha, const Var& x, float beta, const Var& y);  // alpha * x + beta * y
Var view(const Var& x, const Shape& shape);                      // contiguous x; one -1 allowed
Var cast(const Var& x, DType dtype);
// x [..., K] @ w [K, N] -> [..., N] (w's working copy where it has one; trans_w: w [N, K]).
Var matmul(const Var& x, Parameter& w, bool trans_w = false);
// a @ b for two values (2-D, or batched as kernels::matmul takes them).
Var matmul(const Var& a, const Var& b, bool trans_a = false, bool trans_b = false);
// Grouped by expert: rows offsets[e]..offsets[e+1] of x [T, K] times w [E, K, N] (offsets
// i32 [E+1] on the Ctx's device, not differentiated).
Var grouped_matmul(const Var& x, Parameter& w, const Tensor& offsets, bool trans_w = false);
// x [T, D] normalised by its rms and scaled by w [D] (f32); rstd f32 [T] kept for backward.
Var rms_norm(const Var& x, Parameter& w, float eps);
// h [T, 2F] = [gate | up] -> silu(gate) * up [T, F].
Var swiglu(const Var& h);
// Row softmax of x [R, C].
Var softmax(const Var& x);
// Rotary embedding of x [T, H, Dh] at positions pos (i32 [T], on the Ctx's device).
Var rope(const Var& x, const Tensor& pos, float theta);
// Causal grouped-query attention: q [B, S, Hq, Dh], k, v [B, S, Hkv, Dh] -> [B, S, Hq, Dh].
Var attention(const Var& q, const Var& k, const Var& v, float scale);
// table [V, D] rows at ids (i32 [T]) -> [T, D]. The table's gradient is f32; the gather
// reads its f32 value.
Var embedding(Tape& t, const Tensor& ids, Parameter& table);
// Token dispatch by expert (kernels::moe_permute / moe_unpermute; row_map and top_k from
// moe_dispatch_plan, not differentiated): x [T, D] -> rows grouped by expert; and back,
// weighted by gates [T, k] (f32, differentiated).
Var moe_permute(const Var& x, const Tensor& row_map, int64_t top_k, int64_t rows);
Var moe_unpermute(const Var& yp, const Tensor& row_map, const Var& gates);

// A hand-written layer inside a recorded pass (its own kernels and backward, e.g. a fused
// attention or an MoE layer): forward(x, saved) returns y and fills `saved`; backward(dy,
// saved) adds the layer's parameter gradients and returns dx. `saved` lives per call (one
// per micro-batch) until the backward ran.
template <class S>
Var custom(const Var& x, const std::function<Tensor(const Tensor&, S&)>& forward,
           const std::function<Tensor(const Tensor&, S&)>& backward) {
  struct CustomNode final : Tape::Node {
    std::function<Tensor(const Tensor&, S&)> bwd;
    S saved;
    int in = -1;
    void backward(Tape& t) override { t.add_grad(in, bwd(t.out_grad(*this), saved), true); }
  };
  Tape& t = x.tape();
  if (!t.recording()) {
    S saved;
    return t.result(forward(x.value(), saved), nullptr);
  }
  auto n = std::make_unique<CustomNode>();
  Tensor y = forward(x.value(), n->saved);
  n->bwd = backward;
  n->in = Tape::id_of(x);
  return t.result(std::move(y), std::move(n));
}

}  // namespace troupe::layers
