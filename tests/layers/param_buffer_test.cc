// tests/layers/param_buffer_test.cc — ParamBuffer (layers/param_buffer.h) on the CPU: the
// layout (aligned ranges, the bf16 tail, shards, a parameter listed twice), written
// gradients (zero_grad clears only what products add to, settle_grads the rest), the
// folded norm against a full read, split masters through a bf16-activation Ctx (exact
// join, stale values, refresh refusing a value that is behind), and to_host.
#include "layers/param_buffer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace {

using namespace troupe;
using namespace troupe::layers;

const Ctx kC = Ctx::cpu();

void fill_random(Tensor t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (auto& x : v) x = nd(rng);
  if (t.dtype() == DType::kF32) {
    std::copy(v.begin(), v.end(), t.data<float>());
  } else {
    Tensor f = Tensor::empty(t.shape(), DType::kF32);
    std::copy(v.begin(), v.end(), f.data<float>());
    kernels::cast(kC.ex, f, t);
  }
}

double sum_squares(const Tensor& t) {
  return kernels::sum_squares(kC.ex, t);
}

struct Params {
  Parameter a, b, e1, e2, g;  // a, b: matrices; e1, e2: "expert" matrices; g: a gain
  Params() {
    a.allocate({3, 5});
    b.allocate({7, 2});
    e1.allocate({2, 4, 6});
    e2.allocate({2, 6, 4});
    g.allocate({5}, /*with_decay=*/false);
    for (Parameter* p : {&a, &b, &e1, &e2, &g}) fill_random(p->value, static_cast<uint32_t>(p->numel()));
    e1.bf16_grad_ok = e2.bf16_grad_ok = true;
    a.overwrites_grad = e1.overwrites_grad = e2.overwrites_grad = true;
  }
  std::vector<NamedParameter> named() {
    return {{"a", &a}, {"e1", &e1}, {"b", &b}, {"e2", &e2}, {"g", &g}, {"a again", &a}};
  }
};

TEST(ParamBuffer, LayoutAlignsRangesPutsBf16GradientsLastAndPadsToShards) {
  Params p;
  const std::vector<float> a0 = p.a.value.to_floats();
  ParamBuffer buf;
  ParamBuffer::Options o;
  o.expert_grads = DType::kBF16;
  o.shards = 3;
  buf.build(kC, p.named(), o);
  ASSERT_EQ(buf.slots().size(), 5u);  // "a again" is the same Parameter
  // f32 gradients first in the given order, then the bf16 ones.
  EXPECT_EQ(buf.slots()[0].param, &p.a);
  EXPECT_EQ(buf.slots()[1].param, &p.b);
  EXPECT_EQ(buf.slots()[2].param, &p.g);
  EXPECT_EQ(buf.slots()[3].param, &p.e1);
  EXPECT_EQ(buf.slots()[4].param, &p.e2);
  for (const auto& s : buf.slots()) {
    EXPECT_EQ(s.offset % ParamBuffer::kAlign, 0) << s.name;
    EXPECT_EQ(s.low, s.param == &p.e1 || s.param == &p.e2) << s.name;
    EXPECT_EQ(s.param->grad.dtype(), s.low ? DType::kBF16 : DType::kF32) << s.name;
    EXPECT_EQ(s.param->value.data_ptr(), buf.values().narrow(0, s.offset, 1).data_ptr()) << s.name;
  }
  EXPECT_EQ(buf.low_begin(), buf.slots()[3].offset);
  EXPECT_EQ(buf.used(), 5 * ParamBuffer::kAlign);
  EXPECT_EQ(buf.size() % 3, 0);
  EXPECT_GE(buf.size(), buf.used());
  EXPECT_EQ(p.a.value.to_floats(), a0);  // the values moved in
  EXPECT_EQ(buf.grad_range(buf.low_begin(), buf.size()).dtype(), DType::kBF16);
  EXPECT_EQ(buf.grad_range(0, buf.low_begin()).dtype(), DType::kF32);
  EXPECT_FALSE(p.a.work.defined());  // f32 activations: products read the values
}

TEST(ParamBuffer, ZeroGradClearsOnlyWhatProductsAddTo) {
  Params p;
  ParamBuffer buf;
  buf.build(kC, p.named());
  for (const auto& s : buf.slots()) fill_random(s.param->grad, 7);
  buf.zero_grad(kC);
  // Overwritten gradients are stale, untouched; the others are zero.
  EXPECT_TRUE(p.a.grad_stale);
  EXPECT_GT(sum_squares(p.a.grad), 0.0);
  EXPECT_GT(sum_squares(p.e1.grad), 0.0);
  EXPECT_FALSE(p.b.grad_stale);
  EXPECT_EQ(sum_squares(p.b.grad), 0.0);
  EXPECT_EQ(sum_squares(p.g.grad), 0.0);
  // A product writes e1 (the mark clears); settle zeroes the stale ones left.
  EXPECT_FALSE(p.e1.accumulate_grad());
  buf.settle_grads(kC);
  EXPECT_FALSE(p.a.grad_stale);
  EXPECT_EQ(sum_squares(p.a.grad), 0.0);
  EXPECT_GT(sum_squares(p.e1.grad), 0.0);
  EXPECT_EQ(sum_squares(p.e2.grad), 0.0);
  // The padding between gradients stays zero.
  EXPECT_NEAR(sum_squares(buf.grads()), sum_squares(p.e1.grad), 1e-9);
}

TEST(ParamBuffer, FoldedNormEqualsTheFullRead) {
  Params p;
  p.e1.grad_sum_squares_slots = 3;
  p.e2.grad_sum_squares_slots = 2;
  ParamBuffer buf;
  ParamBuffer::Options o;
  o.expert_grads = DType::kBF16;
  buf.build(kC, p.named(), o);
  // Only e1 may fold (the caller's choice, e.g. what no reduction changes).
  std::vector<bool> eligible(buf.slots().size(), false);
  eligible[static_cast<size_t>(buf.slot_of(&p.e1))] = true;
  EXPECT_EQ(buf.enable_grad_norm_fold(kC, eligible), 1);
  EXPECT_TRUE(p.e1.grad_sum_squares.defined());
  EXPECT_FALSE(p.e2.grad_sum_squares.defined());
  buf.zero_grad(kC);
  for (const auto& s : buf.slots()) {
    const bool add = s.param->accumulate_grad();  // one product each
    fill_random(s.param->grad, static_cast<uint32_t>(s.offset + 3));
    if (Tensor* slots = s.param->grad_sum_squares_out(add)) {
      // What the product leaves: its sum of squares, spread over the slots.
      Tensor t = *slots;
      t.data<float>()[0] = static_cast<float>(sum_squares(s.param->grad) / 2);
      t.data<float>()[1] = static_cast<float>(sum_squares(s.param->grad) / 2);
      t.data<float>()[2] = 0.0f;
    }
  }
  double want = 0;
  for (const auto& s : buf.slots()) want += sum_squares(s.param->grad);
  Tensor out = Tensor::zeros({1}, DType::kF32);
  EXPECT_EQ(buf.grad_norm_squared_into(kC, out), p.e1.numel());
  EXPECT_NEAR(out.to_floats()[0], want, 1e-5 * want);
  // Counted slots only.
  std::vector<bool> counted(buf.slots().size(), true);
  counted[static_cast<size_t>(buf.slot_of(&p.b))] = false;
  EXPECT_NEAR(buf.grad_norm_squared(kC, counted), want - sum_squares(p.b.grad), 1e-5 * want);
  // A second product on e1 (a later micro-batch adds): its slots no longer hold its sum.
  EXPECT_TRUE(p.e1.accumulate_grad());
  EXPECT_FALSE(p.e1.grad_sum_squares_valid());
  fill_random(p.e1.grad, 99);
  double want2 = 0;
  for (const auto& s : buf.slots()) want2 += sum_squares(s.param->grad);
  EXPECT_EQ(buf.grad_norm_squared_into(kC, out), 0);
  EXPECT_NEAR(out.to_floats()[0], want2, 1e-5 * want2);
}

TEST(ParamBuffer, SplitMastersAreExactAndValuesBehindAreRefused) {
  Params p;
  p.g.reads_value = true;  // never split (and 1-D: no working copy anyway)
  Ctx c = kC;
  c.act = DType::kBF16;  // bf16 working copies on the CPU
  ParamBuffer buf;
  buf.build(c, p.named());
  ASSERT_TRUE(p.a.work.defined());
  EXPECT_EQ(p.a.work.dtype(), DType::kBF16);
  EXPECT_FALSE(p.g.work.defined());
  const std::vector<float> a0 = p.a.value.to_floats();
  EXPECT_EQ(buf.split_masters(c), 4);
  EXPECT_TRUE(buf.split());
  // As an optimizer writing the halves does: the value falls behind, then is joined exactly.
  fill_random(p.a.value, 5);
  p.a.value_stale = true;
  EXPECT_DEATH(buf.refresh_working_copies(c), "behind its split master");
  buf.sync_master_values(c);
  EXPECT_FALSE(p.a.value_stale);
  EXPECT_EQ(p.a.value.to_floats(), a0);
  // A restore writes the values: values_written, then the halves from them.
  fill_random(p.a.value, 6);
  const std::vector<float> a1 = p.a.value.to_floats();
  buf.values_written();
  buf.refresh_working_copies(c);
  fill_random(p.a.value, 8);
  p.a.value_stale = true;
  buf.sync_master_values(c);
  EXPECT_EQ(p.a.value.to_floats(), a1);
}

TEST(ParamBuffer, ToHostGivesEveryParameterItsOwnTensors) {
  Params p;
  ParamBuffer buf;
  ParamBuffer::Options o;
  o.expert_grads = DType::kBF16;
  buf.build(kC, p.named(), o);
  fill_random(p.e1.grad, 4);
  const std::vector<float> v = p.b.value.to_floats();
  buf.to_host(kC);
  EXPECT_FALSE(buf.built());
  EXPECT_EQ(p.b.value.to_floats(), v);
  EXPECT_EQ(p.e1.grad.dtype(), DType::kF32);
  EXPECT_GT(sum_squares(p.e1.grad), 0.0);
  EXPECT_EQ(p.b.value.numel(), 14);
}

}  // namespace
