// layers/autograd.cc — Tape and the differentiable ops over kernels/ops.h.
#include "layers/autograd.h"

#include "core/check.h"

namespace troupe::layers {

Tape& Var::tape() const {
  TROUPE_CHECK(tape_ != nullptr, "autograd: an undefined Var was used");
  return *tape_;
}

Var Tape::input(const Tensor& x) {
  Var v = constant(x);
  if (record_) {
    v.id_ = next_id_++;
    grads_.push_back(Grad{.leaf = true});
  }
  return v;
}

Var Tape::constant(const Tensor& x) {
  Var v;
  v.tape_ = this;
  v.value_ = x;
  v.shape_ = x.shape();
  v.dtype_ = x.dtype();
  return v;
}

Var Tape::result(Tensor value, std::unique_ptr<Node> node) {
  Var v = constant(value);
  if (node == nullptr) return v;
  TROUPE_CHECK(record_ && !done_, "autograd: an op was recorded on a tape that {}",
               done_ ? "already ran backward" : "does not record");
  v.id_ = next_id_++;
  grads_.emplace_back();
  node->out = v.id_;
  nodes_.push_back(std::move(node));
  return v;
}

bool Tape::records(std::initializer_list<const Var*> inputs) const {
  if (!record_) return false;
  for (const Var* v : inputs) {
    TROUPE_CHECK(v->tape_ == this, "autograd: an op mixes Vars of two tapes");
    if (v->id_ >= 0) return true;
  }
  return false;
}

void Tape::add_grad(int id, Tensor g, bool owned) {
  if (id < 0 || !g.defined()) return;
  Grad& s = grads_[static_cast<size_t>(id)];
  if (!s.g.defined()) {
    s.g = std::move(g);
    s.owned = owned;
    return;
  }
  TROUPE_CHECK(s.g.shape() == g.shape(), "autograd: gradients of one value with shapes {} and {}",
               shape_to_string(s.g.shape()), shape_to_string(g.shape()));
  if (s.owned) {
    kernels::add(c_.ex, s.g, g, s.g);
  } else if (owned) {
    kernels::add(c_.ex, s.g, g, g);
    s.g = std::move(g);
    s.owned = true;
  } else {
    Tensor sum = c_.empty(g.shape(), g.dtype());
    kernels::add(c_.ex, s.g, g, sum);
    s.g = std::move(sum);
    s.owned = true;
  }
}

Tensor Tape::take_grad(int id, bool& owned) {
  owned = false;
  if (id < 0) return {};
  Grad& s = grads_[static_cast<size_t>(id)];
  owned = s.owned;
  Tensor g = std::move(s.g);
  s.g = Tensor();
  s.owned = false;
  return g;
}

std::vector<Tensor> Tape::backward(const Var& out, const Tensor& dout, const std::vector<Var>& in) {
  TROUPE_CHECK(record_, "autograd: backward on a tape that did not record");
  TROUPE_CHECK(!done_, "autograd: a tape runs backward once");
  TROUPE_CHECK(out.tape_ == this, "autograd: backward from a Var of another tape");
  for (const Var& v : in) {
    TROUPE_CHECK(v.tape_ == this, "autograd: backward to a Var of another tape");
    TROUPE_CHECK(v.id_ < 0 || grads_[static_cast<size_t>(v.id_)].leaf,
                 "autograd: backward returns the gradients of leaves (Tape::input), not of an op's result");
  }
  TROUPE_CHECK(dout.shape() == out.shape(),
               "autograd: backward with a gradient of shape {} for a value of {}",
               shape_to_string(dout.shape()), shape_to_string(out.shape()));
  done_ = true;
  add_grad(out.id_, dout, false);
  // Reverse recording order is a reverse topological order: an op's inputs were made
  // before it.
  for (size_t i = nodes_.size(); i-- > 0;) {
    Node& n = *nodes_[i];
    if (grads_[static_cast<size_t>(n.out)].g.defined()) n.backward(*this);
    grads_[static_cast<size_t>(n.out)].g = Tensor();
    nodes_[i].reset();  // its saved tensors go now, as a hand-written backward's locals do
  }
  nodes_.clear();
  std::vector<Tensor> out_grads;
  for (const Var& v : in) {
    Tensor g = v.id_ >= 0 ? grads_[static_cast<size_t>(v.id_)].g : Tensor();
    out_grads.push_back(g.defined() ? g : c_.zeros(v.shape(), v.dtype()));
  }
  grads_.clear();
  return out_grads;
}

namespace {

Tape& tape_of(const Var& a, const Var& b) {
  TROUPE_CHECK(&a.tape() == &b.tape(), "autograd: an op mixes Vars of two tapes");
  return a.tape();
}

struct AddNode final : Tape::Node {
  int a = -1, b = -1;
  void backward(Tape& t) override {
    // One input wanting it takes the gradient as it is; two share it.
    const bool both = a >= 0 && b >= 0;
    t.add_grad(a, t.out_grad(*this), !both && t.out_grad_owned(*this));
    t.add_grad(b, t.out_grad(*this), !both && t.out_grad_owned(*this));
  }
};

struct AxpbyNode final : Tape::Node {
  float alpha = 1, beta = 1;
  int x = -1, y = -1;
  void backward(Tape& t) override {
    const Tensor& g = t.out_grad(*this);
    for (auto [id, k] : {std::pair{x, alpha}, std::pair{y, beta}}) {
      if (id < 0) continue;
      Tensor d = t.ctx().empty(g.shape(), g.dtype());
      kernels::axpby(t.ctx().ex, k, g, 0.0f, d);
      t.add_grad(id, std::move(d), true);
    }
  }
};

struct ViewNode final : Tape::Node {
  int x = -1;
  Shape shape;
  void backward(Tape& t) override { t.add_grad(x, t.out_grad(*this).view(shape), t.out_grad_owned(*this)); }
};

struct CastNode final : Tape::Node {
  int x = -1;
  DType dtype = DType::kF32;
  void backward(Tape& t) override {
    const Tensor& g = t.out_grad(*this);
    Tensor d = t.ctx().empty(g.shape(), dtype);
    kernels::cast(t.ctx().ex, g, d);
    t.add_grad(x, std::move(d), true);
  }
};

// The result of op(x) @ w viewed back to x's leading dimensions.
Shape rows_then(const Shape& x, int64_t n) {
  Shape s = x;
  s.back() = n;
  return s;
}

struct MatmulParamNode final : Tape::Node {
  Tensor x;  // [T, K] (2-D view of the input)
  Shape x_shape;
  Parameter* w = nullptr;
  bool trans_w = false;
  int in = -1;
  void backward(Tape& t) override {
    const Ctx& c = t.ctx();
    const Tensor g = t.out_grad(*this).view({x.size(0), -1});
    if (in >= 0) {
      // dx is added into the gradient the input has so far when it owns one (beta 1).
      bool owned = false;
      Tensor prev = t.take_grad(in, owned);
      if (prev.defined() && owned) {
        Tensor d2 = prev.view(x.shape());
        kernels::matmul_backward(c.ex, x, w->w(), g, &d2, nullptr, false, trans_w, true);
        t.add_grad(in, std::move(prev), true);
      } else {
        Tensor dx = c.empty(x.shape());
        kernels::matmul_backward(c.ex, x, w->w(), g, &dx, nullptr, false, trans_w);
        t.add_grad(in, dx.view(x_shape), true);
        t.add_grad(in, std::move(prev), false);
      }
    }
    kernels::matmul_backward(c.ex, x, w->w(), g, nullptr, &w->grad, false, trans_w, w->accumulate_grad());
  }
};

struct MatmulNode final : Tape::Node {
  Tensor a, b;
  bool ta = false, tb = false;
  int ia = -1, ib = -1;
  void backward(Tape& t) override {
    const Ctx& c = t.ctx();
    const Tensor& g = t.out_grad(*this);
    if (ia >= 0) {
      Tensor da = c.empty(a.shape(), a.dtype());
      kernels::matmul_backward(c.ex, a, b, g, &da, nullptr, ta, tb);
      t.add_grad(ia, std::move(da), true);
    }
    if (ib >= 0) {
      Tensor db = c.empty(b.shape(), b.dtype());
      kernels::matmul_backward(c.ex, a, b, g, nullptr, &db, ta, tb);
      t.add_grad(ib, std::move(db), true);
    }
  }
};

struct GroupedMatmulNode final : Tape::Node {
  Tensor x, offsets;
  Parameter* w = nullptr;
  bool trans_w = false;
  int in = -1;
  void backward(Tape& t) override {
    const Ctx& c = t.ctx();
    Tensor dx;
    if (in >= 0) dx = c.empty(x.shape());
    const bool add = w->accumulate_grad();
    kernels::grouped_matmul_backward(c.ex, x, w->w(), offsets, t.out_grad(*this), in >= 0 ? &dx : nullptr,
                                     &w->grad, trans_w, add, w->grad_sum_squares_out(add));
    t.add_grad(in, std::move(dx), true);
  }
};

struct RmsNormNode final : Tape::Node {
  Tensor x, rstd;
  Parameter* w = nullptr;
  int in = -1;
  void backward(Tape& t) override {
    const Ctx& c = t.ctx();
    // The input's gradient so far (a pre-norm block's residual branch) is added in the
    // norm's own pass (dres), written over itself when it is this op's to write.
    bool owned = false;
    Tensor dres = t.take_grad(in, owned);
    Tensor dx = dres.defined() && owned ? dres : c.empty(x.shape());
    kernels::rmsnorm_backward(c.ex, t.out_grad(*this), x, w->value, rstd, dx, w->grad, w->accumulate_grad(),
                              dres.defined() ? &dres : nullptr);
    t.add_grad(in, std::move(dx), true);
  }
};

struct SwigluNode final : Tape::Node {
  Tensor h;
  int in = -1;
  void backward(Tape& t) override {
    Tensor dh = t.ctx().empty(h.shape());
    kernels::swiglu_backward(t.ctx().ex, h, t.out_grad(*this), dh);
    t.add_grad(in, std::move(dh), true);
  }
};

struct SoftmaxNode final : Tape::Node {
  Tensor y;
  int in = -1;
  void backward(Tape& t) override {
    Tensor dx = t.ctx().empty(y.shape());
    kernels::softmax_backward(t.ctx().ex, y, t.out_grad(*this), dx);
    t.add_grad(in, std::move(dx), true);
  }
};

struct RopeNode final : Tape::Node {
  Tensor pos;
  float theta = 0;
  int in = -1;
  void backward(Tape& t) override {
    const Tensor& g = t.out_grad(*this);
    // In place when the gradient is this op's to write (rope_backward allows dx = dout).
    Tensor dx = t.out_grad_owned(*this) ? g : t.ctx().empty(g.shape());
    kernels::rope_backward(t.ctx().ex, g, pos, theta, dx);
    t.add_grad(in, std::move(dx), true);
  }
};

struct AttentionNode final : Tape::Node {
  Tensor q, k, v, out, lse;
  float scale = 1;
  int iq = -1, ik = -1, iv = -1;
  void backward(Tape& t) override {
    const Ctx& c = t.ctx();
    Tensor dq = c.empty(q.shape()), dk = c.empty(k.shape()), dv = c.empty(v.shape());
    kernels::attention_backward(c.ex, q, k, v, out, lse, t.out_grad(*this), scale, dq, dk, dv);
    t.add_grad(iq, std::move(dq), true);
    t.add_grad(ik, std::move(dk), true);
    t.add_grad(iv, std::move(dv), true);
  }
};

struct EmbeddingNode final : Tape::Node {
  Tensor ids;
  Parameter* table = nullptr;
  void backward(Tape& t) override {
    // embedding_backward always adds: a gradient it may write is cleared first.
    if (!table->accumulate_grad()) kernels::fill(t.ctx().ex, table->grad, 0.0f);
    kernels::embedding_backward(t.ctx().ex, ids, t.out_grad(*this), table->grad);
  }
};

struct PermuteNode final : Tape::Node {
  Tensor row_map;
  int64_t top_k = 1, tokens = 0;
  int in = -1;
  void backward(Tape& t) override {
    const Tensor& g = t.out_grad(*this);
    Tensor dx = t.ctx().empty({tokens, g.size(1)});
    kernels::moe_permute_backward(t.ctx().ex, g, row_map, top_k, dx);
    t.add_grad(in, std::move(dx), true);
  }
};

struct UnpermuteNode final : Tape::Node {
  Tensor yp, row_map, gates;
  int iy = -1, ig = -1;
  void backward(Tape& t) override {
    const Ctx& c = t.ctx();
    Tensor dyp = c.empty(yp.shape()), dgates = c.empty(gates.shape(), DType::kF32);
    kernels::moe_unpermute_backward(c.ex, t.out_grad(*this), yp, row_map, gates, dyp, dgates);
    t.add_grad(iy, std::move(dyp), true);
    t.add_grad(ig, std::move(dgates), true);
  }
};

}  // namespace

Var add(const Var& a, const Var& b) {
  Tape& t = tape_of(a, b);
  const Ctx& c = t.ctx();
  TROUPE_CHECK(a.shape() == b.shape(), "autograd add: shapes {} and {}", shape_to_string(a.shape()),
               shape_to_string(b.shape()));
  Tensor out = c.empty(a.shape(), a.dtype());
  kernels::add(c.ex, a.value(), b.value(), out);
  if (!t.records({&a, &b})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<AddNode>();
  n->a = Tape::id_of(a);
  n->b = Tape::id_of(b);
  return t.result(std::move(out), std::move(n));
}

Var operator+(const Var& a, const Var& b) {
  return add(a, b);
}

Var axpby(float alpha, const Var& x, float beta, const Var& y) {
  Tape& t = tape_of(x, y);
  const Ctx& c = t.ctx();
  TROUPE_CHECK(x.shape() == y.shape(), "autograd axpby: shapes {} and {}", shape_to_string(x.shape()),
               shape_to_string(y.shape()));
  Tensor out = c.empty(y.shape(), y.dtype());
  kernels::axpby(c.ex, beta, y.value(), 0.0f, out);
  kernels::axpby(c.ex, alpha, x.value(), 1.0f, out);
  if (!t.records({&x, &y})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<AxpbyNode>();
  n->alpha = alpha;
  n->beta = beta;
  n->x = Tape::id_of(x);
  n->y = Tape::id_of(y);
  return t.result(std::move(out), std::move(n));
}

Var scale(const Var& x, float alpha) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  Tensor out = c.empty(x.shape(), x.dtype());
  kernels::axpby(c.ex, alpha, x.value(), 0.0f, out);
  if (!t.records({&x})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<AxpbyNode>();
  n->alpha = alpha;
  n->x = Tape::id_of(x);
  return t.result(std::move(out), std::move(n));
}

Var operator*(float alpha, const Var& x) {
  return scale(x, alpha);
}

Var view(const Var& x, const Shape& shape) {
  Tape& t = x.tape();
  Tensor out = x.value().view(shape);
  if (!t.records({&x})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<ViewNode>();
  n->x = Tape::id_of(x);
  n->shape = x.shape();
  return t.result(std::move(out), std::move(n));
}

Var cast(const Var& x, DType dtype) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  Tensor out = c.empty(x.shape(), dtype);
  kernels::cast(c.ex, x.value(), out);
  if (!t.records({&x})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<CastNode>();
  n->x = Tape::id_of(x);
  n->dtype = x.dtype();
  return t.result(std::move(out), std::move(n));
}

Var matmul(const Var& x, Parameter& w, bool trans_w) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  const Tensor& wv = w.w();
  TROUPE_CHECK(wv.dim() == 2 && x.value().dim() >= 2, "autograd matmul: x {} and w {}",
               shape_to_string(x.shape()), shape_to_string(wv.shape()));
  const int64_t k = x.size(-1), n_out = trans_w ? wv.size(0) : wv.size(1);
  const Tensor x2 = x.value().view({-1, k});
  Tensor out = c.empty({x2.size(0), n_out});
  kernels::matmul(c.ex, x2, wv, out, false, trans_w);
  Tensor y = out.view(rows_then(x.shape(), n_out));
  if (!t.recording()) return t.result(std::move(y), nullptr);
  auto n = std::make_unique<MatmulParamNode>();
  n->x = x2;
  n->x_shape = x.shape();
  n->w = &w;
  n->trans_w = trans_w;
  n->in = Tape::id_of(x);
  return t.result(std::move(y), std::move(n));
}

Var matmul(const Var& a, const Var& b, bool trans_a, bool trans_b) {
  Tape& t = tape_of(a, b);
  const Ctx& c = t.ctx();
  const Tensor &av = a.value(), &bv = b.value();
  TROUPE_CHECK(av.dim() >= 2 && bv.dim() >= 2, "autograd matmul: a {} and b {}", shape_to_string(av.shape()),
               shape_to_string(bv.shape()));
  const int64_t m = trans_a ? av.size(-1) : av.size(-2);
  const int64_t n_out = trans_b ? bv.size(-2) : bv.size(-1);
  Shape shape = av.dim() == 3 ? Shape{av.size(0), m, n_out}
                              : (bv.dim() == 3 ? Shape{bv.size(0), m, n_out} : Shape{m, n_out});
  Tensor out = c.empty(shape, av.dtype());
  kernels::matmul(c.ex, av, bv, out, trans_a, trans_b);
  if (!t.records({&a, &b})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<MatmulNode>();
  n->a = av;
  n->b = bv;
  n->ta = trans_a;
  n->tb = trans_b;
  n->ia = Tape::id_of(a);
  n->ib = Tape::id_of(b);
  return t.result(std::move(out), std::move(n));
}

Var grouped_matmul(const Var& x, Parameter& w, const Tensor& offsets, bool trans_w) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  const Tensor& wv = w.w();
  Tensor out = c.empty({x.size(0), trans_w ? wv.size(1) : wv.size(2)});
  kernels::grouped_matmul(c.ex, x.value(), wv, offsets, out, trans_w);
  if (!t.recording()) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<GroupedMatmulNode>();
  n->x = x.value();
  n->offsets = offsets;
  n->w = &w;
  n->trans_w = trans_w;
  n->in = Tape::id_of(x);
  return t.result(std::move(out), std::move(n));
}

Var rms_norm(const Var& x, Parameter& w, float eps) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  Tensor y = c.empty(x.shape(), x.dtype());
  Tensor rstd = c.empty({x.size(0)}, DType::kF32);
  kernels::rmsnorm_forward(c.ex, x.value(), w.value, eps, y, rstd);
  if (!t.recording()) return t.result(std::move(y), nullptr);
  auto n = std::make_unique<RmsNormNode>();
  n->x = x.value();
  n->rstd = std::move(rstd);
  n->w = &w;
  n->in = Tape::id_of(x);
  return t.result(std::move(y), std::move(n));
}

Var swiglu(const Var& h) {
  Tape& t = h.tape();
  const Ctx& c = t.ctx();
  TROUPE_CHECK(h.value().dim() == 2 && h.size(1) % 2 == 0, "autograd swiglu: h {} (want [T, 2F])",
               shape_to_string(h.shape()));
  Tensor out = c.empty({h.size(0), h.size(1) / 2}, h.dtype());
  kernels::swiglu_forward(c.ex, h.value(), out);
  if (!t.records({&h})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<SwigluNode>();
  n->h = h.value();
  n->in = Tape::id_of(h);
  return t.result(std::move(out), std::move(n));
}

Var softmax(const Var& x) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  Tensor y = c.empty(x.shape(), x.dtype());
  kernels::softmax_forward(c.ex, x.value(), y);
  if (!t.records({&x})) return t.result(std::move(y), nullptr);
  auto n = std::make_unique<SoftmaxNode>();
  n->y = y;
  n->in = Tape::id_of(x);
  return t.result(std::move(y), std::move(n));
}

Var rope(const Var& x, const Tensor& pos, float theta) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  Tensor out = c.empty(x.shape(), x.dtype());
  kernels::rope_forward(c.ex, x.value(), pos, theta, out);
  if (!t.records({&x})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<RopeNode>();
  n->pos = pos;
  n->theta = theta;
  n->in = Tape::id_of(x);
  return t.result(std::move(out), std::move(n));
}

Var attention(const Var& q, const Var& k, const Var& v, float scale) {
  Tape& t = tape_of(q, k);
  (void)tape_of(q, v);
  const Ctx& c = t.ctx();
  TROUPE_CHECK(q.value().dim() == 4, "autograd attention: q {} (want [B, S, H, Dh])",
               shape_to_string(q.shape()));
  Tensor out = c.empty(q.shape(), q.dtype());
  Tensor lse = c.empty({q.size(0), q.size(2), q.size(1)}, DType::kF32);
  kernels::attention_forward(c.ex, q.value(), k.value(), v.value(), scale, out, lse);
  if (!t.records({&q, &k, &v})) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<AttentionNode>();
  n->q = q.value();
  n->k = k.value();
  n->v = v.value();
  n->out = out;
  n->lse = std::move(lse);
  n->scale = scale;
  n->iq = Tape::id_of(q);
  n->ik = Tape::id_of(k);
  n->iv = Tape::id_of(v);
  return t.result(std::move(out), std::move(n));
}

Var embedding(Tape& t, const Tensor& ids, Parameter& table) {
  const Ctx& c = t.ctx();
  Tensor out = c.empty({ids.numel(), table.value.size(1)});
  kernels::embedding_forward(c.ex, ids, table.value, out);
  if (!t.recording()) return t.result(std::move(out), nullptr);
  auto n = std::make_unique<EmbeddingNode>();
  n->ids = ids;
  n->table = &table;
  return t.result(std::move(out), std::move(n));
}

Var moe_permute(const Var& x, const Tensor& row_map, int64_t top_k, int64_t rows) {
  Tape& t = x.tape();
  const Ctx& c = t.ctx();
  Tensor xp = c.empty({rows, x.size(1)}, x.dtype());
  kernels::moe_permute(c.ex, x.value(), row_map, top_k, xp);
  if (!t.records({&x})) return t.result(std::move(xp), nullptr);
  auto n = std::make_unique<PermuteNode>();
  n->row_map = row_map;
  n->top_k = top_k;
  n->tokens = x.size(0);
  n->in = Tape::id_of(x);
  return t.result(std::move(xp), std::move(n));
}

Var moe_unpermute(const Var& yp, const Tensor& row_map, const Var& gates) {
  Tape& t = tape_of(yp, gates);
  const Ctx& c = t.ctx();
  Tensor y = c.empty({gates.size(0), yp.size(1)}, yp.dtype());
  kernels::moe_unpermute(c.ex, yp.value(), row_map, gates.value(), y);
  if (!t.records({&yp, &gates})) return t.result(std::move(y), nullptr);
  auto n = std::make_unique<UnpermuteNode>();
  n->yp = yp.value();
  n->row_map = row_map;
  n->gates = gates.value();
  n->iy = Tape::id_of(yp);
  n->ig = Tape::id_of(gates);
  return t.result(std::move(y), std::move(n));
}

}  // namespace troupe::layers
