// tests/layers/autograd_test.cc — layers::Tape: every differentiable op's backward against
// central finite differences of its forward (loss = <op(x...), R> for a fixed random R);
// a transformer block written as its forward on a tape gives bitwise the results of the
// same block written by hand with layers/ (forward, input gradient, every parameter
// gradient), and within rounding with its attention written in ops; gradients of a value
// used several times are summed without touching the gradient passed in; a parameter used
// twice, or whose gradient is stale (written, not added), gets the right gradient; a tape
// that does not record keeps nothing; recomputing a block gives its gradients.
#include "layers/autograd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/mlp.h"
#include "layers/residual.h"
#include "tests/layers/grad_check.h"

namespace troupe::layers {
namespace {

const Ctx kC = Ctx::cpu();

using testing::dot;
using testing::random_tensor;

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// Central differences at up to 12 entries of x against `analytic`.
void check_grad(const std::string& what, Tensor& x, const Tensor& analytic,
                const std::function<double()>& loss) {
  testing::check_grad(what, x, analytic, loss, /*samples=*/12);
}

// An op under test: builds its result from the tape's leaves (one per input tensor).
using OpFn = std::function<Var(Tape&, const std::vector<Var>&)>;

// Checks the gradient of every input and parameter of `f` by finite differences of
// loss = <f(inputs), R>.
void check_op(const std::string& what, std::vector<Tensor> inputs, const std::vector<Parameter*>& params,
              const OpFn& f) {
  for (Parameter* p : params) p->grad.fill(0.0f);
  Tape t(kC);
  std::vector<Var> leaves;
  for (const Tensor& x : inputs) leaves.push_back(t.input(x));
  const Var y = f(t, leaves);
  const Tensor r = random_tensor(y.shape(), 99);
  const std::vector<Tensor> grads = t.backward(y, r, leaves);
  EXPECT_EQ(t.pending_ops(), 0u) << what;
  auto loss = [&] {
    Tape e(kC, /*record=*/false);
    std::vector<Var> in;
    for (const Tensor& x : inputs) in.push_back(e.input(x));
    return dot(f(e, in).value(), r);
  };
  for (size_t i = 0; i < inputs.size(); ++i)
    check_grad(what + ".x" + std::to_string(i), inputs[i], grads[i], loss);
  for (size_t i = 0; i < params.size(); ++i)
    check_grad(what + ".w" + std::to_string(i), params[i]->value, params[i]->grad, loss);
}

Parameter param(const Shape& shape, uint32_t seed, float scale = 0.5f) {
  Parameter p;
  p.allocate(shape);
  p.value.copy_from(random_tensor(shape, seed, scale));
  return p;
}

TEST(Autograd, ElementwiseAndShapeOps) {
  const Tensor a = random_tensor({4, 6}, 1), b = random_tensor({4, 6}, 2);
  check_op("add", {a, b}, {}, [](Tape&, const std::vector<Var>& x) { return x[0] + x[1]; });
  check_op("add_same", {a}, {}, [](Tape&, const std::vector<Var>& x) { return x[0] + x[0]; });
  check_op("scale", {a}, {}, [](Tape&, const std::vector<Var>& x) { return 3.0f * x[0]; });
  check_op("axpby", {a, b}, {},
           [](Tape&, const std::vector<Var>& x) { return axpby(0.5f, x[0], -2.0f, x[1]); });
  check_op("view", {a}, {}, [](Tape&, const std::vector<Var>& x) {
    return view(x[0], {2, 12}) + view(x[0], {2, 12});
  });
  check_op("swiglu", {a}, {}, [](Tape&, const std::vector<Var>& x) { return swiglu(x[0]); });
  check_op("softmax", {a}, {}, [](Tape&, const std::vector<Var>& x) { return softmax(x[0]); });
  check_op("cast", {a}, {}, [](Tape&, const std::vector<Var>& x) { return cast(x[0], DType::kF32); });
}

TEST(Autograd, ProductsAndNorms) {
  const Tensor x = random_tensor({5, 6}, 3);
  Parameter w = param({6, 4}, 4), wt = param({4, 6}, 5), g = param({6}, 6, 1.0f);
  check_op("matmul_param", {x}, {&w}, [&](Tape&, const std::vector<Var>& v) { return matmul(v[0], w); });
  check_op("matmul_param_t", {x}, {&wt},
           [&](Tape&, const std::vector<Var>& v) { return matmul(v[0], wt, true); });
  check_op("matmul_3d", {random_tensor({2, 3, 6}, 7)}, {&w},
           [&](Tape&, const std::vector<Var>& v) { return matmul(v[0], w); });
  check_op("matmul_vars", {x, random_tensor({6, 3}, 8)}, {},
           [](Tape&, const std::vector<Var>& v) { return matmul(v[0], v[1]); });
  check_op("matmul_vars_tb", {x, random_tensor({3, 6}, 9)}, {},
           [](Tape&, const std::vector<Var>& v) { return matmul(v[0], v[1], false, true); });
  check_op("matmul_batched", {random_tensor({2, 3, 4}, 10), random_tensor({2, 4, 5}, 11)}, {},
           [](Tape&, const std::vector<Var>& v) { return matmul(v[0], v[1]); });
  check_op("rms_norm", {x}, {&g}, [&](Tape&, const std::vector<Var>& v) { return rms_norm(v[0], g, 1e-5f); });
  // A pre-norm residual: the norm adds the residual branch's gradient in its own pass.
  check_op("residual", {x}, {&g, &w}, [&](Tape&, const std::vector<Var>& v) {
    return view(matmul(v[0] + rms_norm(v[0], g, 1e-5f), w), {-1});
  });
  // A parameter used twice: both products add to its gradient.
  Parameter sq = param({6, 6}, 12, 0.4f);
  check_op("param_twice", {x}, {&sq},
           [&](Tape&, const std::vector<Var>& v) { return matmul(matmul(v[0], sq), sq); });
}

TEST(Autograd, AttentionRopeAndEmbedding) {
  const int64_t b = 2, s = 5, h = 4, kvh = 2, dh = 4;
  const Tensor pos = Attention::positions(b, s);
  check_op("rope", {random_tensor({b * s, h, dh}, 13)}, {},
           [&](Tape&, const std::vector<Var>& v) { return rope(v[0], pos, 10000.0f); });
  check_op("attention",
           {random_tensor({b, s, h, dh}, 14), random_tensor({b, s, kvh, dh}, 15),
            random_tensor({b, s, kvh, dh}, 16)},
           {}, [](Tape&, const std::vector<Var>& v) { return attention(v[0], v[1], v[2], 0.5f); });
  Parameter table = param({11, 6}, 17);
  const Tensor ids = Tensor::from_ints({7}, std::vector<int32_t>{1, 4, 4, 0, 10, 3, 1});
  check_op("embedding", {}, {&table},
           [&](Tape& t, const std::vector<Var>&) { return embedding(t, ids, table); });
}

TEST(Autograd, GroupedProductsAndTokenDispatch) {
  // 5 tokens, top-2 over 3 experts: rows grouped by expert, products per expert, combined.
  const Tensor topk = Tensor::from_ints({5, 2}, std::vector<int32_t>{0, 2, 1, 2, 0, 1, 2, 0, 1, 1});
  Tensor row_map = Tensor::empty({10}, DType::kI32), counts = Tensor::empty({3}, DType::kI32),
         offsets = Tensor::empty({4}, DType::kI32);
  kernels::moe_dispatch_plan(kC.ex, topk, 3, -1, row_map, counts, offsets);
  Parameter w = param({3, 6, 6}, 18);
  check_op("moe", {random_tensor({5, 6}, 19), random_tensor({5, 2}, 20)}, {&w},
           [&](Tape&, const std::vector<Var>& v) {
             const Var xp = moe_permute(v[0], row_map, 2, 10);
             return moe_unpermute(grouped_matmul(xp, w, offsets), row_map, v[1]);
           });
}

TEST(Autograd, HandWrittenLayerInsideATape) {
  SwiGLUMLP mlp(6, 8, false);
  mlp.init(21, "mlp", 0.4f, 0.4f);
  check_op(
      "custom_mlp", {random_tensor({5, 6}, 22)}, {&mlp.w1, &mlp.w2}, [&](Tape&, const std::vector<Var>& v) {
        return v[0] + custom<SwiGLUMLP::Saved>(
                          v[0], [&](const Tensor& x, SwiGLUMLP::Saved& s) { return mlp.forward(kC, x, s); },
                          [&](const Tensor& dy, SwiGLUMLP::Saved& s) { return mlp.backward(kC, dy, s); });
      });
}

TEST(Autograd, SharedGradientsAreSummedAndTheGivenOneIsOnlyRead) {
  // y = x + x + x: x's gradient is 3 dy, made from three shared copies of dy.
  const Tensor x = random_tensor({4, 5}, 23), dy = random_tensor({4, 5}, 24);
  const Tensor dy_before = dy.clone();
  Tape t(kC);
  const Var in = t.input(x);
  const Var y = in + in + in;
  const Tensor dx = t.backward(y, dy, in);
  EXPECT_TRUE(bitwise_equal(dy, dy_before)) << "backward wrote into the gradient it was given";
  const auto g = dx.to_floats(), d = dy.to_floats();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_FLOAT_EQ(g[i], 3.0f * d[i]);
  // A leaf nothing reached gets zeros; a value nothing depends on is not a leaf.
  Tape u(kC);
  const Var a = u.input(x), b = u.input(x);
  const std::vector<Tensor> ga = u.backward(2.0f * a, dy, {a, b});
  for (float v : ga[1].to_floats()) EXPECT_EQ(v, 0.0f);
}

TEST(Autograd, StaleGradientIsWrittenNotAdded) {
  // Parameter contract (layers/parameter.h): a gradient marked stale holds garbage that
  // the first product writes over; later products add.
  Parameter w = param({6, 4}, 25), g = param({6}, 28, 1.0f), e = param({9, 4}, 29);
  const Tensor x = random_tensor({5, 6}, 26), dy = random_tensor({5, 4}, 27);
  const Tensor ids = Tensor::from_ints({5}, std::vector<int32_t>{0, 3, 3, 8, 1});
  auto grads_of = [&](bool stale) {
    for (Parameter* p : {&w, &g, &e}) {
      p->grad.fill(stale ? 1e6f : 0.0f);
      p->grad_stale = stale;
    }
    Tape t(kC);
    const Var in = t.input(x);
    // Two products into w's gradient, one into the norm's, one into the table's.
    const Var y = matmul(rms_norm(in, g, 1e-5f), w) + matmul(in, w) + embedding(t, ids, e);
    t.backward(y, dy, in);
    return std::vector<Tensor>{w.grad.clone(), g.grad.clone(), e.grad.clone()};
  };
  const auto a = grads_of(true), b = grads_of(false);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "parameter " << i;
  EXPECT_FALSE(w.grad_stale || g.grad_stale || e.grad_stale);
}

// ---- a transformer block, by hand and on a tape -------------------------------------

struct BlockParams {
  BlockParams()
      : norm1(16, 1e-5f), norm2(16, 1e-5f), attn(16, 4, 2, 4, 10000.0f), mlp(16, 24, /*recompute=*/false) {
    norm1.weight.value.copy_from(random_tensor({16}, 30, 1.0f));
    norm2.weight.value.copy_from(random_tensor({16}, 31, 1.0f));
    attn.init(32, "attn", 0.3f, 0.2f);
    mlp.init(33, "mlp", 0.3f, 0.2f);
  }
  std::vector<Parameter*> all() {
    return {&norm1.weight, &attn.wq, &attn.wk, &attn.wv, &attn.wo, &norm2.weight, &mlp.w1, &mlp.w2};
  }
  RMSNorm norm1, norm2;
  Attention attn;
  SwiGLUMLP mlp;
};

constexpr int64_t kB = 2, kS = 6;

// dense_lm's block as written with layers/residual.h.
Tensor block_by_hand(BlockParams& p, const Tensor& x, const Tensor& dy, Tensor& y) {
  RMSNorm::Saved n1, n2;
  Attention::Saved a;
  SwiGLUMLP::Saved m;
  Tensor h =
      residual_forward(kC, x, p.norm1, n1, [&](const Tensor& n) { return p.attn.forward(kC, n, kB, kS, a); });
  y = residual_forward(kC, h, p.norm2, n2, [&](const Tensor& n) { return p.mlp.forward(kC, n, m); });
  Tensor dh =
      residual_backward(kC, dy, p.norm2, n2, [&](const Tensor& d) { return p.mlp.backward(kC, d, m); });
  return residual_backward(kC, dh, p.norm1, n1, [&](const Tensor& d) { return p.attn.backward(kC, d, a); });
}

// The same block as its forward on a tape: the attention layer as a hand-written op, the
// MLP in ops.
Var block_on_tape(BlockParams& p, const Var& x) {
  const Var h =
      x + custom<Attention::Saved>(
              rms_norm(x, p.norm1.weight, 1e-5f),
              [&](const Tensor& n, Attention::Saved& s) { return p.attn.forward(kC, n, kB, kS, s); },
              [&](const Tensor& d, Attention::Saved& s) { return p.attn.backward(kC, d, s); });
  return h + matmul(swiglu(matmul(rms_norm(h, p.norm2.weight, 1e-5f), p.mlp.w1)), p.mlp.w2);
}

// The attention too in ops: projections, RoPE, the attention core, the output projection.
Var block_all_ops(BlockParams& p, const Var& x) {
  const Tensor pos = Attention::positions(kB, kS);
  const Var n = rms_norm(x, p.norm1.weight, 1e-5f);
  const Var q = view(rope(view(matmul(n, p.attn.wq), {kB * kS, 4, 4}), pos, 10000.0f), {kB, kS, 4, 4});
  const Var k = view(rope(view(matmul(n, p.attn.wk), {kB * kS, 2, 4}), pos, 10000.0f), {kB, kS, 2, 4});
  const Var v = view(matmul(n, p.attn.wv), {kB, kS, 2, 4});
  const Var o = view(attention(q, k, v, 0.5f), {kB * kS, 16});
  const Var h = x + matmul(o, p.attn.wo);
  return h + matmul(swiglu(matmul(rms_norm(h, p.norm2.weight, 1e-5f), p.mlp.w1)), p.mlp.w2);
}

TEST(Autograd, TransformerBlockEqualsTheHandWrittenOneBitwise) {
  BlockParams hand, tape, ops;
  const Tensor x = random_tensor({kB * kS, 16}, 34), dy = random_tensor({kB * kS, 16}, 35);
  Tensor y_hand;
  const Tensor dx_hand = block_by_hand(hand, x, dy, y_hand);

  Tape t(kC);
  const Var in = t.input(x);
  const Var y = block_on_tape(tape, in);
  EXPECT_GT(t.pending_ops(), 0u);
  const Tensor dx = t.backward(y, dy, in);
  EXPECT_EQ(t.pending_ops(), 0u);
  EXPECT_TRUE(bitwise_equal(y.value(), y_hand));
  EXPECT_TRUE(bitwise_equal(dx, dx_hand));
  const auto ph = hand.all(), pt = tape.all();
  for (size_t i = 0; i < ph.size(); ++i)
    EXPECT_TRUE(bitwise_equal(ph[i]->grad, pt[i]->grad)) << "parameter " << i;

  // Attention in ops: the same numbers to rounding (its dx adds the three products in
  // another order).
  Tape u(kC);
  const Var in2 = u.input(x);
  const Var y2 = block_all_ops(ops, in2);
  const Tensor dx2 = u.backward(y2, dy, in2);
  auto close = [](const Tensor& a, const Tensor& b, const std::string& what) {
    const auto x = a.to_floats(), y = b.to_floats();
    ASSERT_EQ(x.size(), y.size()) << what;
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_NEAR(x[i], y[i], 1e-5f + 1e-4f * std::abs(y[i])) << what << "[" << i << "]";
  };
  close(y2.value(), y_hand, "y");
  close(dx2, dx_hand, "dx");
  const auto po = ops.all();
  for (size_t i = 0; i < ph.size(); ++i) close(po[i]->grad, ph[i]->grad, "parameter " + std::to_string(i));
}

TEST(Autograd, EvaluationKeepsNothingAndRecomputationGivesTheSameGradients) {
  BlockParams p, q;
  const Tensor x = random_tensor({kB * kS, 16}, 36), dy = random_tensor({kB * kS, 16}, 37);
  Tape eval(kC, /*record=*/false);
  const Var ye = block_on_tape(p, eval.input(x));
  EXPECT_EQ(eval.pending_ops(), 0u);
  EXPECT_FALSE(ye.requires_grad());

  Tape t(kC);
  const Var in = t.input(x);
  const Var y = block_on_tape(p, in);
  EXPECT_TRUE(bitwise_equal(ye.value(), y.value()));
  const Tensor dx = t.backward(y, dy, in);
  // Recomputation: a forward that keeps nothing, then the recorded one again at backward.
  Tape first(kC, false);
  (void)block_on_tape(q, first.input(x));
  Tape again(kC);
  const Var in2 = again.input(x);
  const Tensor dx2 = again.backward(block_on_tape(q, in2), dy, in2);
  EXPECT_TRUE(bitwise_equal(dx, dx2));
  const auto a = p.all(), b = q.all();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i]->grad, b[i]->grad)) << i;
}

TEST(AutogradDeathTest, MisuseIsNamed) {
  Tape t(kC);
  const Var x = t.input(random_tensor({3, 4}, 38));
  const Var y = 2.0f * x;
  EXPECT_DEATH((void)t.backward(y, random_tensor({4, 3}, 39), x), "backward with a gradient of shape");
  EXPECT_DEATH((void)t.backward(y, random_tensor({3, 4}, 39), y), "gradients of leaves");
  Tape u(kC);
  EXPECT_DEATH((void)(x + u.input(random_tensor({3, 4}, 40))), "mixes Vars of two tapes");
}

}  // namespace
}  // namespace troupe::layers
