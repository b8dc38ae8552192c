// tests/layers/autograd_cuda_test.cc — layers::Tape on CUDA (label gpu; exits 77 where
// the build has no CUDA or no GPU is visible): dense_lm's block (bf16 activations, bf16
// working copies of f32 masters, the Hopper attention at head dim 64) written as its
// forward on a tape gives bitwise the hand-written block's output, input gradient and
// parameter gradients; recorded into a CUDA graph (the caching allocator's graph pool,
// no host read) and replayed, forward and backward give bitwise the launch-by-launch
// results, again after the input changes in place; and within bf16 rounding of the CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "layers/attention.h"
#include "layers/autograd.h"
#include "layers/embedding.h"
#include "layers/mlp.h"
#include "layers/residual.h"
#include "training/app/run_device.h"
#include "training/stage/step_graph.h"

namespace troupe::layers {
namespace {

constexpr int64_t kB = 2, kS = 128, kD = 256, kF = 512, kHeads = 4, kKv = 2;

Tensor random_host(const Shape& shape, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (auto& x : v) x = n(rng);
  return Tensor::from_floats(shape, v);
}

struct Block {
  Block()
      : norm1(kD, 1e-5f), norm2(kD, 1e-5f), attn(kD, kHeads, kKv, kD / kHeads, 10000.0f), mlp(kD, kF, false) {
    norm1.init();
    norm2.init();
    attn.init(7, "attn", 0.05f, 0.03f);
    mlp.init(8, "mlp", 0.05f, 0.03f);
  }
  std::vector<Parameter*> params() {
    return {&norm1.weight, &attn.wq, &attn.wk, &attn.wv, &attn.wo, &norm2.weight, &mlp.w1, &mlp.w2};
  }
  // As the Stage holds them on a device: f32 masters and gradients, bf16 working copies
  // of the matrices.
  void to_device(const Ctx& c) {
    for (Parameter* p : params()) {
      p->value = c.to_device(p->value);
      p->grad = c.zeros(p->value.shape(), DType::kF32);
      if (p->value.dim() >= 2) {
        p->work = c.empty(p->value.shape(), c.act);
        kernels::cast(c.ex, p->value, p->work);
      }
    }
  }
  void zero_grads(const Ctx& c) {
    for (Parameter* p : params()) kernels::fill(c.ex, p->grad, 0.0f);
  }
  RMSNorm norm1, norm2;
  Attention attn;
  SwiGLUMLP mlp;
};

Var on_tape(Block& p, const Var& x) {
  const Ctx c = x.tape().ctx();
  const Var h =
      x + custom<Attention::Saved>(
              rms_norm(x, p.norm1.weight, 1e-5f),
              [&p, c](const Tensor& n, Attention::Saved& s) { return p.attn.forward(c, n, kB, kS, s); },
              [&p, c](const Tensor& d, Attention::Saved& s) { return p.attn.backward(c, d, s); });
  return h + matmul(swiglu(matmul(rms_norm(h, p.norm2.weight, 1e-5f), p.mlp.w1)), p.mlp.w2);
}

Tensor by_hand(Block& p, const Ctx& c, const Tensor& x, const Tensor& dy, Tensor& y) {
  RMSNorm::Saved n1, n2;
  Attention::Saved a;
  SwiGLUMLP::Saved m;
  Tensor h =
      residual_forward(c, x, p.norm1, n1, [&](const Tensor& n) { return p.attn.forward(c, n, kB, kS, a); });
  y = residual_forward(c, h, p.norm2, n2, [&](const Tensor& n) { return p.mlp.forward(c, n, m); });
  Tensor dh = residual_backward(c, dy, p.norm2, n2, [&](const Tensor& d) { return p.mlp.backward(c, d, m); });
  return residual_backward(c, dh, p.norm1, n1, [&](const Tensor& d) { return p.attn.backward(c, d, a); });
}

bool same_bits(const Ctx& c, const Tensor& a, const Tensor& b) {
  const Tensor x = c.to_host(a), y = c.to_host(b);
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

TEST(AutogradCuda, TapeEqualsTheHandWrittenBlockAndReplaysAsACudaGraph) {
  auto dev = training::RunDevice::create("cuda");
  if (!dev.ok()) {
    std::printf("skipping: %s\n", dev.status().to_string().c_str());
    std::exit(77);
  }
  training::RunDevice& d = **dev;
  d.set_attention_fused_dq(false);  // dQ in a fixed order: runs are bitwise repeatable
  const Ctx& c = d.ctx();
  Block hand, tape;
  hand.to_device(c);
  tape.to_device(c);
  const Tensor x_host = random_host({kB * kS, kD}, 1), dy_host = random_host({kB * kS, kD}, 2);
  Tensor x = c.empty({kB * kS, kD}), dy = c.empty({kB * kS, kD});
  kernels::cast(c.ex, c.to_device(x_host), x);
  kernels::cast(c.ex, c.to_device(dy_host), dy);

  // Launch by launch: the tape against the hand-written block.
  Tensor y_hand;
  const Tensor dx_hand = by_hand(hand, c, x, dy, y_hand);
  Tensor y_eager, dx_eager;
  {
    Tape t(c);
    const Var in = t.input(x);
    const Var y = on_tape(tape, in);
    dx_eager = t.backward(y, dy, in);
    y_eager = y.value();
  }
  d.synchronize();
  EXPECT_TRUE(same_bits(c, y_eager, y_hand));
  EXPECT_TRUE(same_bits(c, dx_eager, dx_hand));
  std::vector<Tensor> grads_eager;
  for (size_t i = 0; i < tape.params().size(); ++i) {
    EXPECT_TRUE(same_bits(c, tape.params()[i]->grad, hand.params()[i]->grad)) << "parameter " << i;
    grads_eager.push_back(c.to_host(tape.params()[i]->grad));
  }

  // The same forward and backward recorded into a CUDA graph, then replayed.
  tape.zero_grads(c);
  Tensor y_graph, dx_graph;
  training::StepGraph graph(c);  // the Stage's step graph
  ASSERT_TRUE(graph.begin_capture().ok());
  {
    Tape t(c);
    const Var in = t.input(x);
    const Var y = on_tape(tape, in);
    dx_graph = t.backward(y, dy, in);
    y_graph = y.value();
  }
  ASSERT_TRUE(graph.end_capture().ok());
  graph.replay();
  d.synchronize();
  EXPECT_TRUE(same_bits(c, y_graph, y_eager));
  EXPECT_TRUE(same_bits(c, dx_graph, dx_eager));
  for (size_t i = 0; i < tape.params().size(); ++i) {
    const Tensor g = c.to_host(tape.params()[i]->grad);
    EXPECT_EQ(std::memcmp(g.data_ptr(), grads_eager[i].data_ptr(), g.nbytes()), 0) << "parameter " << i;
  }

  // A new input written into the graph's input buffer: the replay equals a fresh eager run.
  kernels::cast(c.ex, c.to_device(random_host({kB * kS, kD}, 3)), x);
  tape.zero_grads(c);
  graph.replay();
  hand.zero_grads(c);
  Tensor y2;
  const Tensor dx2 = by_hand(hand, c, x, dy, y2);
  d.synchronize();
  EXPECT_TRUE(same_bits(c, y_graph, y2));
  EXPECT_TRUE(same_bits(c, dx_graph, dx2));
  for (size_t i = 0; i < tape.params().size(); ++i)
    EXPECT_TRUE(same_bits(c, tape.params()[i]->grad, hand.params()[i]->grad)) << "parameter " << i;

  // Against the CPU (f32): bf16 rounding only.
  Block cpu;
  Tape t(Ctx::cpu());
  const Var in = t.input(c.to_host(x).to_dtype(DType::kF32));
  const Var y = on_tape(cpu, in);
  const Tensor dx_cpu = t.backward(y, c.to_host(dy).to_dtype(DType::kF32), in);
  const std::vector<float> a = c.to_host(dx_graph).to_floats(), b = dx_cpu.to_floats();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  const double rel = std::sqrt(num / den);
  EXPECT_LT(rel, 2e-2) << "dx against the CPU";
  std::printf(
      "[autograd cuda] tape == hand-written (bitwise), CUDA graph replay == launch by launch (bitwise), "
      "dx vs CPU: relative L2 %.2e\n",
      rel);
}

}  // namespace
}  // namespace troupe::layers
