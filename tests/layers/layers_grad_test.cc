// tests/layers/layers_grad_test.cc — every layer's backward against central finite
// differences of its forward on tiny shapes (loss = <forward(x), R> for a fixed random R,
// plus the aux losses where the layer has them), and the layer-level contracts: routing
// counts, capacity drops, a replaced ExpertDispatch, deterministic named parameters,
// gradient accumulation, AdamW clipping.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "layers/model.h"
#include "layers/optimizer.h"
#include "tests/layers/grad_check.h"

namespace troupe::layers {
namespace {

const Ctx kC = Ctx::cpu();

using testing::check_grad;
using testing::dot;
using testing::random_tensor;

TEST(LayerGrad, RMSNorm) {
  RMSNorm norm(8, 1e-5f);
  norm.weight.value = random_tensor({8}, 1, 1.0f);
  Tensor x = random_tensor({5, 8}, 2), r = random_tensor({5, 8}, 3);
  RMSNorm::Saved s;
  norm.forward(kC, x, s);
  Tensor dx = norm.backward(kC, r, s);
  auto loss = [&] {
    RMSNorm::Saved t;
    return dot(norm.forward(kC, x, t), r);
  };
  check_grad("rmsnorm.x", x, dx, loss);
  check_grad("rmsnorm.w", norm.weight.value, norm.weight.grad, loss);
}

TEST(LayerGrad, Embedding) {
  Embedding emb(11, 6);
  emb.init(3, "embedding", 0.5f);
  Tensor ids = Tensor::from_ints({7}, std::vector<int32_t>{1, 4, 4, 0, 10, 3, 1});
  Tensor r = random_tensor({7, 6}, 4);
  emb.forward(kC, ids);
  emb.backward(kC, ids, r);
  check_grad("embedding.weight", emb.weight.value, emb.weight.grad, [&] { return dot(emb.forward(kC, ids), r); }, 30);
}

TEST(LayerGrad, AttentionGqaRope) {
  const int64_t b = 2, s = 5, d = 16;
  Attention attn(d, 4, 2, 4, 10000.0f);
  attn.init(7, "attn", 0.4f, 0.4f);
  Tensor x = random_tensor({b * s, d}, 5), r = random_tensor({b * s, d}, 6);
  Attention::Saved sv;
  attn.forward(kC, x, b, s, sv);
  Tensor dx = attn.backward(kC, r, sv);
  auto loss = [&] {
    Attention::Saved t;
    return dot(attn.forward(kC, x, b, s, t), r);
  };
  check_grad("attn.x", x, dx, loss);
  check_grad("attn.wq", attn.wq.value, attn.wq.grad, loss);
  check_grad("attn.wk", attn.wk.value, attn.wk.grad, loss);
  check_grad("attn.wv", attn.wv.value, attn.wv.grad, loss);
  check_grad("attn.wo", attn.wo.value, attn.wo.grad, loss);
}

TEST(LayerGrad, AttentionQkNormGqaRope) {
  // Qwen3's per-head RMSNorm of q and k before RoPE: every weight, the two norms' too.
  const int64_t b = 2, s = 5, d = 16;
  Attention attn(d, 4, 2, 6, 10000.0f, /*qk_norm=*/true, 1e-6f);
  attn.init(9, "attn", 0.4f, 0.4f);
  attn.q_norm->weight.value = random_tensor({6}, 11, 1.0f);
  attn.k_norm->weight.value = random_tensor({6}, 12, 1.0f);
  Tensor x = random_tensor({b * s, d}, 5), r = random_tensor({b * s, d}, 6);
  Attention::Saved sv;
  attn.forward(kC, x, b, s, sv);
  Tensor dx = attn.backward(kC, r, sv);
  auto loss = [&] {
    Attention::Saved t;
    return dot(attn.forward(kC, x, b, s, t), r);
  };
  check_grad("qknorm.x", x, dx, loss);
  check_grad("qknorm.wq", attn.wq.value, attn.wq.grad, loss);
  check_grad("qknorm.wk", attn.wk.value, attn.wk.grad, loss);
  check_grad("qknorm.wv", attn.wv.value, attn.wv.grad, loss);
  check_grad("qknorm.q_norm", attn.q_norm->weight.value, attn.q_norm->weight.grad, loss);
  check_grad("qknorm.k_norm", attn.k_norm->weight.value, attn.k_norm->weight.grad, loss);
  std::vector<NamedParameter> ps;
  attn.collect("attn", ps);
  ASSERT_EQ(ps.size(), 6u);
  EXPECT_EQ(ps[4].name, "attn.q_norm.weight");
  EXPECT_EQ(ps[5].name, "attn.k_norm.weight");
}

TEST(LayerGrad, AttentionIsCausal) {
  const int64_t s = 6, d = 16;
  Attention attn(d, 4, 4, 4, 10000.0f);
  attn.init(8, "attn", 0.4f, 0.4f);
  Tensor x = random_tensor({s, d}, 9);
  Attention::Saved sv;
  const std::vector<float> y0 = attn.forward(kC, x, 1, s, sv).to_floats();
  x.data<float>()[(s - 1) * d + 3] += 1.0f;  // change the last token only
  const std::vector<float> y1 = attn.forward(kC, x, 1, s, sv).to_floats();
  for (int64_t i = 0; i < (s - 1) * d; ++i) EXPECT_EQ(y0[static_cast<size_t>(i)], y1[static_cast<size_t>(i)]);
  bool last_changed = false;
  for (int64_t i = (s - 1) * d; i < s * d; ++i) last_changed |= y0[static_cast<size_t>(i)] != y1[static_cast<size_t>(i)];
  EXPECT_TRUE(last_changed);
}

TEST(LayerGrad, SwiGLUMLPWithAndWithoutRecompute) {
  for (bool rc : {false, true}) {
    SwiGLUMLP mlp(8, 12, rc);
    mlp.init(11, "mlp", 0.4f, 0.4f);
    Tensor x = random_tensor({6, 8}, 12), r = random_tensor({6, 8}, 13);
    SwiGLUMLP::Saved sv;
    mlp.forward(kC, x, sv);
    EXPECT_EQ(sv.a.defined(), !rc);
    Tensor dx = mlp.backward(kC, r, sv);
    auto loss = [&] {
      SwiGLUMLP::Saved t;
      return dot(mlp.forward(kC, x, t), r);
    };
    check_grad("mlp.x", x, dx, loss);
    check_grad("mlp.w1", mlp.w1.value, mlp.w1.grad, loss);
    check_grad("mlp.w2", mlp.w2.value, mlp.w2.grad, loss);
  }
}

TEST(LayerGrad, ExpertsGrouped) {
  Experts ex(3, 8, 6, false);
  ex.init(14, "experts", 0.4f, 0.4f);
  Tensor xp = random_tensor({7, 8}, 15), r = random_tensor({7, 8}, 16);
  Tensor offsets = Tensor::from_ints({4}, std::vector<int32_t>{0, 3, 3, 7});  // expert 1 is empty
  Experts::Saved sv;
  ex.forward(kC, xp, offsets, sv);
  Tensor dx = ex.backward(kC, r, sv);
  auto loss = [&] {
    Experts::Saved t;
    return dot(ex.forward(kC, xp, offsets, t), r);
  };
  check_grad("experts.x", xp, dx, loss);
  check_grad("experts.w1", ex.w1.value, ex.w1.grad, loss, 40);
  check_grad("experts.w2", ex.w2.value, ex.w2.grad, loss, 40);
  // The empty expert gets no gradient.
  EXPECT_EQ(ex.w1.grad.select(0, 1).to_floats(), std::vector<float>(8 * 12, 0.0f));
}

MoEConfig moe_config(kernels::RouterScore score) {
  MoEConfig m;
  m.num_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 6;
  m.score = score;
  m.aux_loss_coef = 0.5;  // large, so a wrong aux or z-loss gradient shows
  m.z_loss_coef = 0.5;
  return m;
}

void check_moe_layer(const std::string& name, const MoEConfig& cfg) {
  MoELayer moe(8, cfg, false);
  moe.init(21, "moe", 0.5f, 0.5f);
  Tensor x = random_tensor({9, 8}, 22), r = random_tensor({9, 8}, 23);
  const float lw = 0.5f;  // the layer's share of the loss
  MoELayer::Saved sv;
  MoELayer::Stats st;
  moe.forward(kC, x, sv, &st);
  Tensor dx = moe.backward(kC, r, sv, lw);
  auto loss = [&] {
    MoELayer::Saved t;
    MoELayer::Stats s2;
    const double y = dot(moe.forward(kC, x, t, &s2), r);
    return y + lw * s2.aux_loss;
  };
  check_grad(name + ".x", x, dx, loss, 16, 2e-3f);
  check_grad(name + ".router", moe.router.weight.value, moe.router.weight.grad, loss, 16, 2e-3f);
  check_grad(name + ".w1", moe.experts.w1.value, moe.experts.w1.grad, loss, 24, 2e-3f);
  check_grad(name + ".w2", moe.experts.w2.value, moe.experts.w2.grad, loss, 24, 2e-3f);
  if (moe.shared) check_grad(name + ".shared.w1", moe.shared->w1.value, moe.shared->w1.grad, loss, 16, 2e-3f);
}

TEST(LayerGrad, MoESoftmaxTop2AuxAndZLoss) { check_moe_layer("moe_softmax", moe_config(kernels::RouterScore::kSoftmax)); }

TEST(LayerGrad, MoESigmoidBiasSharedExpert) {
  MoEConfig cfg = moe_config(kernels::RouterScore::kSigmoid);
  cfg.bias_update_rate = 0.01;
  cfg.shared_experts = 1;
  check_moe_layer("moe_sigmoid", cfg);
}

TEST(LayerGrad, MoEWithCapacityDrops) {
  MoEConfig cfg = moe_config(kernels::RouterScore::kSoftmax);
  cfg.capacity_factor = 0.5;  // capacity ceil(0.5 * 9 * 2 / 4) = 3 copies per expert
  check_moe_layer("moe_capacity", cfg);
  MoELayer moe(8, cfg, false);
  moe.init(21, "moe", 0.5f, 0.5f);
  MoELayer::Saved sv;
  MoELayer::Stats st;
  moe.forward(kC, random_tensor({9, 8}, 22), sv, &st);
  int64_t sel = 0, kept = 0;
  for (size_t e = 0; e < 4; ++e) {
    EXPECT_LE(st.kept[e], 3);
    EXPECT_LE(st.kept[e], st.selected[e]);
    sel += st.selected[e];
    kept += st.kept[e];
  }
  EXPECT_EQ(sel, 18);
  EXPECT_LT(kept, 18);
}

TEST(MoE, CountsLoadAndBiasUpdate) {
  MoEConfig cfg = moe_config(kernels::RouterScore::kSigmoid);
  cfg.bias_update_rate = 0.01;
  MoELayer moe(8, cfg, false);
  moe.init(31, "moe", 0.5f, 0.5f);
  MoELayer::Saved sv;
  MoELayer::Stats st;
  moe.forward(kC, random_tensor({20, 8}, 32), sv, &st);
  EXPECT_EQ(st.selected, st.kept);  // dropless
  int64_t total = 0;
  for (int64_t v : st.selected) total += v;
  EXPECT_EQ(total, 40);
  EXPECT_EQ(moe.step_load(), st.selected);
  // Evaluation (no stats) does not count.
  MoELayer::Saved sv2;
  moe.forward(kC, random_tensor({20, 8}, 33), sv2, nullptr);
  EXPECT_EQ(moe.step_load(), st.selected);
  moe.update_bias(moe.step_load());
  for (size_t e = 0; e < 4; ++e) {
    const float b = moe.router.bias.data<float>()[e];
    const float want = st.selected[e] > 10 ? -0.01f : (st.selected[e] < 10 ? 0.01f : 0.0f);
    EXPECT_FLOAT_EQ(b, want) << "expert " << e << " load " << st.selected[e];
  }
  EXPECT_EQ(moe.step_load(), std::vector<int64_t>(4, 0));
}

// A stand-in for a distributed dispatch: delegates to the local one and counts calls.
class CountingDispatch final : public ExpertDispatch {
 public:
  explicit CountingDispatch(Experts& e) : inner_(e, 2, 0.0) {}
  Tensor forward(const Ctx& c, const Tensor& x, const Tensor& idx, const Tensor& gates,
                 std::unique_ptr<DispatchState>& st, std::vector<int64_t>& kept) override {
    ++forwards;
    return inner_.forward(c, x, idx, gates, st, kept);
  }
  Tensor backward(const Ctx& c, const Tensor& dy, DispatchState& st, Tensor& dgates) override {
    ++backwards;
    return inner_.backward(c, dy, st, dgates);
  }
  int forwards = 0, backwards = 0;

 private:
  LocalExpertDispatch inner_;
};

TEST(MoE, DispatchStepIsReplaceable) {
  MoEConfig cfg = moe_config(kernels::RouterScore::kSoftmax);
  MoELayer moe(8, cfg, false);
  moe.init(41, "moe", 0.5f, 0.5f);
  Tensor x = random_tensor({6, 8}, 42), r = random_tensor({6, 8}, 43);
  MoELayer::Saved a, b;
  const auto y0 = moe.forward(kC, x, a, nullptr).to_floats();
  const auto dx0 = moe.backward(kC, r, a, 1.0f).to_floats();
  CountingDispatch counting(moe.experts);
  moe.set_dispatch(&counting);
  const auto y1 = moe.forward(kC, x, b, nullptr).to_floats();
  const auto dx1 = moe.backward(kC, r, b, 1.0f).to_floats();
  EXPECT_EQ(y0, y1);
  EXPECT_EQ(dx0, dx1);
  EXPECT_EQ(counting.forwards, 1);
  EXPECT_EQ(counting.backwards, 1);
  moe.set_dispatch(nullptr);
}

// Two "ranks" (threads) each holding half of a micro-batch's tokens, their routers' statistics
// summed over the pair: the aux loss, the selections, the tokens' outputs and gradients and
// the summed weight gradients must equal one process over the whole micro-batch. `setup`
// connects a rank's layer to the pair before its forward; `stats` returns its aux loss and
// selections after its backward.
using HalfSetup = std::function<void(int rank, MoELayer&)>;
using HalfStats =
    std::function<std::pair<double, std::vector<int64_t>>(int rank, MoELayer&, const MoELayer::Stats&)>;
void check_halves_match_one_process(const MoEConfig& cfg, const HalfSetup& setup, const HalfStats& stats) {
  Tensor x = random_tensor({10, 8}, 91), r = random_tensor({10, 8}, 92);
  MoELayer whole(8, cfg, false);
  whole.init(93, "moe", 0.5f, 0.5f);
  MoELayer::Saved sv;
  MoELayer::Stats st;
  const auto y = whole.forward(kC, x, sv, &st).to_floats();
  const auto dx = whole.backward(kC, r, sv, 1.0f).to_floats();

  std::unique_ptr<MoELayer> part[2];
  std::vector<float> yp[2], dxp[2];
  std::pair<double, std::vector<int64_t>> got[2];
  auto run = [&](int rank) {
    part[rank] = std::make_unique<MoELayer>(8, cfg, false);
    part[rank]->init(93, "moe", 0.5f, 0.5f);
    setup(rank, *part[rank]);
    Tensor xr = x.narrow(0, 5 * rank, 5).contiguous(), rr = r.narrow(0, 5 * rank, 5).contiguous();
    MoELayer::Saved s2;
    MoELayer::Stats st2;
    yp[rank] = part[rank]->forward(kC, xr, s2, &st2).to_floats();
    dxp[rank] = part[rank]->backward(kC, rr, s2, 1.0f).to_floats();
    got[rank] = stats(rank, *part[rank], st2);
  };
  std::thread t1(run, 1);
  run(0);
  t1.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NEAR(got[rank].first, st.aux_loss, 1e-6 * st.aux_loss);
    EXPECT_EQ(got[rank].second, st.selected);
    for (size_t i = 0; i < yp[rank].size(); ++i) {
      ASSERT_NEAR(yp[rank][i], y[40 * rank + i], 1e-6);
      ASSERT_NEAR(dxp[rank][i], dx[40 * rank + i], 1e-5);
    }
  }
  auto summed = [](const Tensor& a, const Tensor& b) {
    auto va = a.to_floats(), vb = b.to_floats();
    for (size_t i = 0; i < va.size(); ++i) va[i] += vb[i];
    return va;
  };
  const auto gr = summed(part[0]->router.weight.grad, part[1]->router.weight.grad);
  const auto gw = whole.router.weight.grad.to_floats();
  for (size_t i = 0; i < gr.size(); ++i) ASSERT_NEAR(gr[i], gw[i], 1e-5 + 1e-4 * std::abs(gw[i]));
  const auto g1 = summed(part[0]->experts.w1.grad, part[1]->experts.w1.grad);
  const auto gw1 = whole.experts.w1.grad.to_floats();
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_NEAR(g1[i], gw1[i], 1e-5 + 1e-4 * std::abs(gw1[i]));
}

// The host statistics: GroupAllReduce over std::vector<double> (a thread barrier here).
TEST(MoE, GroupAllReduceMatchesOneProcess) {
  std::mutex mu;
  std::vector<double> sum;
  std::barrier sync(2);
  auto reducer = [&](int rank) {
    return [&, rank](std::vector<double>& v) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (sum.empty()) sum.assign(v.size(), 0.0);
        for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
      }
      sync.arrive_and_wait();
      v = sum;
      sync.arrive_and_wait();
      if (rank == 0) sum.clear();
      sync.arrive_and_wait();
    };
  };
  check_halves_match_one_process(
      moe_config(kernels::RouterScore::kSoftmax),
      [&](int rank, MoELayer& m) { m.router.set_group_all_reduce(reducer(rank)); },
      [](int, MoELayer&, const MoELayer::Stats& st) { return std::make_pair(st.aux_loss, st.selected); });
}

// The statistics on the device (Router::forward_device with the device group all-reduce,
// MoELayer::set_device_stats; a CPU Ctx runs the same code): the counts, aux loss and
// gradients arrive as with the host statistics; ranks routing unequal token counts are
// refused when the step's statistics are read.
struct DeviceStatsGroup {
  std::mutex mu;
  std::vector<float> sum;
  std::barrier<> sync{2};
  // Sums f32 tensors of two threads in place, like the n-group's all-reduce on a device.
  DeviceGroupAllReduce reducer(int rank) {
    return [this, rank](Tensor& v) {
      {
        std::lock_guard<std::mutex> l(mu);
        const std::vector<float> f = v.to_floats();
        if (sum.empty()) sum.assign(f.size(), 0.0f);
        for (size_t i = 0; i < f.size(); ++i) sum[i] += f[i];
      }
      sync.arrive_and_wait();
      std::memcpy(v.data_ptr(), sum.data(), sum.size() * sizeof(float));
      sync.arrive_and_wait();
      if (rank == 0) sum.clear();
      sync.arrive_and_wait();
      return int64_t{2};
    };
  }
};

TEST(MoE, DeviceGroupStatsMatchOneProcess) {
  MoEConfig cfg = moe_config(kernels::RouterScore::kSoftmax);
  cfg.z_loss_coef = 0.0;  // the device form has no z-loss
  DeviceStatsGroup g;
  Tensor rows[2] = {Tensor::zeros({cfg.num_experts + 1}, DType::kF32),
                    Tensor::zeros({cfg.num_experts + 1}, DType::kF32)};
  check_halves_match_one_process(
      cfg,
      [&](int rank, MoELayer& m) {
        m.router.set_group_all_reduce([](std::vector<double>&) { FAIL() << "host statistics used"; });
        m.router.set_device_group_all_reduce(g.reducer(rank));
        ASSERT_TRUE(m.set_device_stats(kC, rows[rank]));
      },
      [&](int rank, MoELayer& m, const MoELayer::Stats& st) {
        EXPECT_EQ(st.aux_loss, 0.0);  // deferred to the step's read
        const double aux = m.absorb_device_stats(rows[rank].data<float>());
        return std::make_pair(aux, m.step_load());
      });
}

TEST(MoE, DeviceGroupStatsRefuseUnequalTokenCounts) {
  MoEConfig cfg = moe_config(kernels::RouterScore::kSoftmax);
  cfg.z_loss_coef = 0.0;
  Tensor x = random_tensor({10, 8}, 91);
  DeviceStatsGroup g;
  std::string err[2];
  auto run = [&](int rank) {
    MoELayer m(8, cfg, false);
    m.init(93, "moe", 0.5f, 0.5f);
    m.router.set_device_group_all_reduce(g.reducer(rank));
    Tensor row = Tensor::zeros({cfg.num_experts + 1}, DType::kF32);
    ASSERT_TRUE(m.set_device_stats(kC, row));
    Tensor xr = rank == 0 ? x.narrow(0, 0, 6).contiguous() : x.narrow(0, 6, 4).contiguous();
    MoELayer::Saved s;
    MoELayer::Stats st;
    m.forward(kC, xr, s, &st);
    try {
      m.absorb_device_stats(row.data<float>());
    } catch (const std::exception& e) {
      err[rank] = e.what();
    }
  };
  std::thread t1(run, 1);
  run(0);
  t1.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(err[rank].find("must route the same number of tokens"), std::string::npos) << err[rank];
  }
}

TEST(LayerGrad, TransformerBlocks) {
  ModelConfig cfg;
  cfg.d_model = 16;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.ffn_hidden = 12;
  cfg.n_layers = 2;
  cfg.init_std = 0.3;
  cfg.moe = moe_config(kernels::RouterScore::kSoftmax);
  for (bool is_moe : {false, true}) {
    Block blk(cfg, is_moe);
    blk.init(51, "blocks.0", cfg);
    Tensor x = random_tensor({8, 16}, 52), r = random_tensor({8, 16}, 53);
    Block::Saved sv;
    MoELayer::Stats st;
    blk.forward(kC, x, 2, 4, sv, &st);
    Tensor dx = blk.backward(kC, r, sv, 1.0f);
    auto loss = [&] {
      Block::Saved t;
      MoELayer::Stats s2;
      const double y = dot(blk.forward(kC, x, 2, 4, t, &s2), r);
      return y + s2.aux_loss;
    };
    const std::string n = is_moe ? "moe_block" : "dense_block";
    check_grad(n + ".x", x, dx, loss, 16, 2e-3f);
    check_grad(n + ".norm1", blk.norm1.weight.value, blk.norm1.weight.grad, loss, 16, 2e-3f);
    check_grad(n + ".attn.wk", blk.attn.wk.value, blk.attn.wk.grad, loss, 16, 2e-3f);
  }
}

TEST(LayerGrad, LMHeadChunkedCrossEntropy) {
  for (bool tied : {false, true}) {
    Embedding emb(13, 8);
    emb.init(61, "embedding", 0.5f);
    LMHead head(13, 8, 1e-5f, tied ? &emb.weight : nullptr, /*chunk_rows=*/3);  // 7 rows: chunks 3+3+1
    head.init(62, 0.5f);
    Tensor x = random_tensor({7, 8}, 63);
    Tensor tg = Tensor::from_ints({7}, std::vector<int32_t>{1, 12, -1, 0, 5, 5, 7});
    Tensor dx;
    const double total = head.forward_backward(kC, x, tg, 1.0f / 6.0f, dx);
    EXPECT_NEAR(total, head.loss_sum(kC, x, tg), 1e-5);
    auto loss = [&] { return head.loss_sum(kC, x, tg) / 6.0; };
    check_grad("head.x", x, dx, loss);
    check_grad("head.weight", head.weight->value, head.weight->grad, loss, 30);
    check_grad("head.norm", head.norm.weight.value, head.norm.weight.grad, loss);
  }
}

ModelConfig small_model() {
  ModelConfig cfg;
  cfg.vocab_size = 23;
  cfg.d_model = 16;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.ffn_hidden = 12;
  cfg.n_layers = 3;
  cfg.moe_layers = {1, 2};
  cfg.init_std = 0.3;
  cfg.moe = moe_config(kernels::RouterScore::kSoftmax);
  return cfg;
}

TEST(Model, NamesAreStableAndInitIsDeterministic) {
  ModelConfig cfg = small_model();
  Model a(cfg, 5), b(cfg, 5), c(cfg, 6);
  auto pa = a.parameters(), pb = b.parameters(), pc = c.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  std::set<std::string> names;
  int64_t total = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(names.insert(pa[i].name).second) << "duplicate " << pa[i].name;
    EXPECT_EQ(pa[i].param->value.to_floats(), pb[i].param->value.to_floats()) << pa[i].name;
    total += pa[i].param->numel();
  }
  EXPECT_EQ(total, cfg.num_params());
  for (const char* n : {"embedding.weight", "blocks.0.mlp.w1", "blocks.1.moe.experts.w1", "blocks.2.moe.router.weight",
                        "blocks.0.attn.wq", "blocks.2.norm2.weight", "final_norm.weight"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_FALSE(names.count("lm_head.weight"));  // tied
  EXPECT_NE(pa[0].param->value.to_floats(), pc[0].param->value.to_floats());
  EXPECT_EQ(a.buffers().size(), 2u);
  EXPECT_EQ(a.buffers()[0].name, "blocks.1.moe.router.bias");
}

TEST(Init, SlicesEqualTheWholeTensor) {
  Tensor whole = Tensor::zeros({4, 3, 5}, DType::kF32);
  init_normal(whole, 9, "blocks.1.moe.experts.w1", 0.5f);
  // Expert-parallel shards: experts [0, 1) and [1, 4), initialised alone.
  Tensor a = Tensor::zeros({1, 3, 5}, DType::kF32), b = Tensor::zeros({3, 3, 5}, DType::kF32);
  init_normal(a, 9, "blocks.1.moe.experts.w1", 0.5f, 0);
  init_normal(b, 9, "blocks.1.moe.experts.w1", 0.5f, 15);  // odd offset: second half of a pair
  std::vector<float> joined = a.to_floats();
  for (float v : b.to_floats()) joined.push_back(v);
  EXPECT_EQ(joined, whole.to_floats());
  double sum = 0, sq = 0;
  Tensor big = Tensor::zeros({20000}, DType::kF32);
  init_normal(big, 1, "x", 2.0f);
  for (float v : big.to_floats()) sum += v, sq += static_cast<double>(v) * v;
  EXPECT_NEAR(sum / 20000, 0.0, 0.05);
  EXPECT_NEAR(std::sqrt(sq / 20000), 2.0, 0.05);
}

// A rank of an expert-parallel group of n builds its MoE blocks with its experts only
// (ExpertRange): every value, its experts' included, equals the whole model's bitwise.
TEST(Init, ABlockHoldingSomeExpertsEqualsThoseOfTheWholeModel) {
  const ModelConfig cfg = small_model();
  Model whole(cfg, 5);
  std::vector<NamedParameter> ref;
  whole.blocks[1]->collect("blocks.1", ref);
  const int64_t e = cfg.moe.num_experts;
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{4}}) {
    for (int64_t r = 0; r < n; ++r) {
      Block part(cfg, true, ExpertRange{r * e / n, e / n});
      part.init(5, "blocks.1", cfg);
      EXPECT_EQ(part.moe->first_expert(), r * e / n);
      std::vector<NamedParameter> got;
      part.collect("blocks.1", got);
      ASSERT_EQ(got.size(), ref.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].name, ref[i].name);
        Tensor want = ref[i].param->value;
        if (got[i].name.find(".moe.experts.") != std::string::npos) {
          want = want.narrow(0, r * e / n, e / n).contiguous();
        }
        EXPECT_EQ(got[i].param->value.shape(), want.shape()) << got[i].name;
        EXPECT_EQ(got[i].param->value.to_floats(), want.to_floats())
            << got[i].name << " n " << n << " rank " << r;
      }
    }
  }
}

// Without a dispatch that reaches the other experts, a layer holding some cannot run.
TEST(InitDeathTest, ALayerHoldingSomeExpertsNeedsADispatch) {
  const MoEConfig cfg = moe_config(kernels::RouterScore::kSoftmax);
  MoELayer part(8, cfg, false, ExpertRange{2, 2});
  part.init(3, "moe", 0.5f, 0.5f);
  MoELayer::Saved s;
  EXPECT_DEATH(part.forward(kC, random_tensor({4, 8}, 1), s, nullptr), "holds experts \\[2, 4\\) of 4");
  EXPECT_DEATH(MoELayer(8, cfg, false, ExpertRange{3, 2}),
               "experts \\[3, 5\\) are not a range of the block's 4");
}

TEST(Model, FullModelGradientAndAccumulation) {
  ModelConfig cfg = small_model();
  Model m(cfg, 71);
  std::mt19937 rng(72);
  std::vector<int32_t> ids(12), tg(12);
  for (auto& v : ids) v = static_cast<int32_t>(rng() % 23);
  for (auto& v : tg) v = static_cast<int32_t>(rng() % 23);
  Tensor tids = Tensor::from_ints({2, 6}, ids), ttg = Tensor::from_ints({2, 6}, tg);
  m.zero_grad(kC);
  auto st = m.forward_backward(kC, tids, ttg, 1.0f);
  EXPECT_EQ(st.tokens, 12);
  EXPECT_EQ(st.moe.size(), 2u);
  EXPECT_GT(st.aux_loss, 0.0);
  auto loss = [&] {
    Model::MicroBatchStats s = m.forward_backward(kC, tids, ttg, 1.0f);  // grads unused here
    return s.lm_loss_sum / static_cast<double>(s.tokens) + s.aux_loss;
  };
  std::vector<std::pair<std::string, std::vector<float>>> grads;
  for (auto& p : m.parameters()) grads.emplace_back(p.name, p.param->grad.to_floats());
  for (auto& p : m.parameters()) {
    if (p.name != "embedding.weight" && p.name != "blocks.1.moe.router.weight" && p.name != "blocks.2.moe.experts.w2" &&
        p.name != "blocks.0.attn.wv") {
      continue;
    }
    Tensor g = Tensor::zeros(p.param->value.shape(), DType::kF32);
    for (auto& [n, v] : grads)
      if (n == p.name) g = Tensor::from_floats(p.param->value.shape(), v);
    check_grad("model." + p.name, p.param->value, g, loss, 12, 2e-3f);
  }
  // Two micro-batches with weight 1/2 each accumulate to the gradient of one.
  m.zero_grad(kC);
  m.forward_backward(kC, tids, ttg, 0.5f);
  m.forward_backward(kC, tids, ttg, 0.5f);
  for (auto& p : m.parameters()) {
    std::vector<float> ref;
    for (auto& [n, v] : grads)
      if (n == p.name) ref = v;
    const auto got = p.param->grad.to_floats();
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 1e-5 + 1e-4 * std::abs(ref[i])) << p.name;
  }
}

// zero_grad leaves the gradients that backward overwrites (all but the embedding's) stale
// instead of clearing them: stale values (NaN here) never reach a step's gradients,
// whether a micro-batch writes them, a second one adds to them, or an expert gets no token
// at all; and what the products write equals what they add to cleared gradients.
void stale_gradients_case(bool tied) {
  ModelConfig cfg = small_model();
  cfg.moe.num_experts = 8;  // 3 tokens x top-2 over 8 experts: some experts get no token
  cfg.tie_embeddings = tied;
  Model fresh(cfg, 73), reused(cfg, 73), cleared(cfg, 73);
  // `cleared` writes no gradient: zero_grad clears them all and every product adds.
  for (auto& p : cleared.parameters()) p.param->overwrites_grad = false;
  std::mt19937 rng(74);
  std::vector<int32_t> ids(3), tg(3);
  for (auto& v : ids) v = static_cast<int32_t>(rng() % 23);
  for (auto& v : tg) v = static_cast<int32_t>(rng() % 23);
  const Tensor tids = Tensor::from_ints({1, 3}, ids), ttg = Tensor::from_ints({1, 3}, tg);
  fresh.zero_grad(kC);
  const Model::MicroBatchStats st = fresh.forward_backward(kC, tids, ttg, 1.0f);
  bool empty_expert = false;
  for (const auto& m : st.moe)
    for (int64_t n : m.selected) empty_expert = empty_expert || n == 0;
  ASSERT_TRUE(empty_expert) << "the case needs an expert without tokens";

  auto poison = [](Model& m) {
    for (auto& p : m.parameters())
      for (int64_t i = 0; i < p.param->numel(); ++i) p.param->grad.data<float>()[i] = std::nanf("");
  };
  int64_t stale = 0;
  poison(reused);
  reused.zero_grad(kC);
  for (auto& p : reused.parameters()) {
    EXPECT_EQ(p.param->grad_stale, p.param->overwrites_grad) << p.name;
    stale += p.param->grad_stale ? 1 : 0;
    if (!p.param->grad_stale) {
      EXPECT_EQ(p.param->grad.to_floats(), std::vector<float>(p.param->numel(), 0.0f)) << p.name;
    }
  }
  // w1 and w2 of block 0's MLP and of the experts of MoE blocks 1 and 2 (6), the attention's
  // four matrices (12) and two norms (6) of each of the 3 blocks, the 2 routers, the final
  // norm, and the LM head's own matrix where it is untied.
  EXPECT_EQ(stale, tied ? 27 : 28);
  reused.forward_backward(kC, tids, ttg, 1.0f);
  poison(cleared);
  cleared.zero_grad(kC);
  cleared.forward_backward(kC, tids, ttg, 1.0f);
  auto pf = fresh.parameters(), pr = reused.parameters(), pc = cleared.parameters();
  ASSERT_EQ(pf.size(), pc.size());
  for (size_t i = 0; i < pf.size(); ++i) {
    EXPECT_FALSE(pr[i].param->grad_stale) << pr[i].name;
    EXPECT_EQ(pr[i].param->grad.to_floats(), pf[i].param->grad.to_floats()) << pr[i].name;
    // Written, or added to zeros: the same values.
    EXPECT_EQ(pc[i].param->grad.to_floats(), pf[i].param->grad.to_floats()) << pc[i].name;
  }
  // Two half-weight micro-batches after stale values: the first writes, the second adds.
  poison(reused);
  reused.zero_grad(kC);
  reused.forward_backward(kC, tids, ttg, 0.5f);
  reused.forward_backward(kC, tids, ttg, 0.5f);
  for (size_t i = 0; i < pf.size(); ++i) {
    const auto want = pf[i].param->grad.to_floats(), got = pr[i].param->grad.to_floats();
    for (size_t j = 0; j < want.size(); ++j)
      ASSERT_NEAR(got[j], want[j], 1e-6 + 1e-5 * std::abs(want[j])) << pr[i].name << " element " << j;
  }
}

TEST(Model, StaleGradientsNeverLeakIntoTheStep) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "LM head tied to the embedding" : "LM head untied");
    stale_gradients_case(tied);
  }
}

TEST(AdamW, ClipsByTheGlobalNormAndSkipsDecayOnNorms) {
  auto make = [](float scale) {
    auto m = std::make_unique<Model>(small_model(), 81);
    for (auto& p : m->parameters()) {
      const auto v = p.param->value.to_floats();
      for (int64_t i = 0; i < p.param->numel(); ++i) p.param->grad.data<float>()[i] = scale * (v[static_cast<size_t>(i)] + 0.01f);
    }
    return m;
  };
  auto a = make(1.0f), b = make(10.0f);
  AdamWOptions o;
  o.grad_clip = 0.5;
  o.weight_decay = 0.0;
  AdamW oa(a->parameters(), o), ob(b->parameters(), o);
  const double na = std::sqrt(oa.grad_norm_squared(kC)), nb = std::sqrt(ob.grad_norm_squared(kC));
  EXPECT_NEAR(nb, 10 * na, 1e-3 * nb);
  oa.step(kC, 1e-2, na);
  ob.step(kC, 1e-2, nb);
  // Both clipped to norm 0.5, so identical updates.
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto va = pa[i].param->value.to_floats(), vb = pb[i].param->value.to_floats();
    for (size_t j = 0; j < va.size(); ++j) ASSERT_NEAR(va[j], vb[j], 1e-6) << pa[i].name;
  }
  EXPECT_EQ(oa.steps_done(), 1);
  EXPECT_EQ(oa.state().size(), 2 * pa.size());
  for (auto& p : pa) EXPECT_EQ(p.param->decay, p.name.find("norm") == std::string::npos) << p.name;
}

// The schedule read from a tensor (AdamW::use_device_schedule, for CUDA graphs of the
// step) gives the same parameters and moments as the launch's own lr and step, across
// steps of a changing learning rate, whether split into prepare_step + enqueue_update or
// taken by step(); the device-held clip applies the same.
TEST(AdamW, DeviceScheduleEqualsTheLaunchArguments) {
  auto make = [] {
    auto m = std::make_unique<Model>(small_model(), 83);
    for (auto& p : m->parameters()) {
      const auto v = p.param->value.to_floats();
      for (int64_t i = 0; i < p.param->numel(); ++i)
        p.param->grad.data<float>()[i] = 0.3f * v[static_cast<size_t>(i)] - 0.01f;
    }
    return m;
  };
  auto a = make(), b = make();
  AdamWOptions o;
  o.grad_clip = 0.5;
  AdamW oa(a->parameters(), o), ob(b->parameters(), o);
  ob.use_device_schedule(kC);
  EXPECT_TRUE(ob.device_schedule());
  Tensor norm_sq = Tensor::zeros({1}, DType::kF32);
  norm_sq.data<float>()[0] = static_cast<float>(oa.grad_norm_squared(kC));
  const double lrs[] = {1e-3, 3e-3, 2e-3, 5e-4};
  for (int s = 0; s < 4; ++s) {
    oa.step(kC, lrs[s], norm_sq);
    if (s % 2 == 0) {
      ob.prepare_step(kC, lrs[s]);
      ob.enqueue_update(kC, norm_sq);
    } else {
      ob.step(kC, lrs[s], norm_sq);
    }
  }
  EXPECT_EQ(ob.steps_done(), 4);
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].param->value.to_floats(), pb[i].param->value.to_floats()) << pa[i].name;
  }
  auto sa = oa.state(), sb = ob.state();
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_EQ(sa[i].tensor->to_floats(), sb[i].tensor->to_floats()) << sa[i].name;
  AdamW oc(a->parameters(), o);
  EXPECT_DEATH(oc.prepare_step(kC, 1e-3), "use_device_schedule");
}

// a step with the statistics kept on the device (Model::enable_device_stats: the
// router's RouterStats, the clip inside AdamW) equals the host-statistics step: the same
// losses, aux loss, gradient norm, loads, router-bias update and parameters after AdamW.
void check_device_stats_step(MoEConfig moe) {
  ModelConfig cfg = small_model();
  cfg.moe = moe;
  Model a(cfg, 91), b(cfg, 91);
  ASSERT_TRUE(b.enable_device_stats(kC));
  // The updated parameters: AdamW divides each gradient by its own magnitude, and the small
  // clip (0.05) brings some near eps, where a rounding-level difference in the gradient
  // (the z-loss's, above) moves the update by up to ~1e-5 of lr = 1e-2's step.
  const double param_tol = moe.z_loss_coef > 0 ? 1e-4 : 1e-6;
  EXPECT_FALSE(a.device_stats());
  AdamWOptions o;
  o.grad_clip = 0.05;  // small: the clip applies
  AdamW oa(a.parameters(), o), ob(b.parameters(), o);
  std::mt19937 rng(92);
  for (int step = 1; step <= 2; ++step) {
    a.zero_grad(kC);
    b.zero_grad(kC);
    double lm_a = 0, aux_a = 0;
    int64_t tokens = 0;
    for (int micro = 0; micro < 2; ++micro) {
      std::vector<int32_t> ids(12), tg(12);
      for (auto& v : ids) v = static_cast<int32_t>(rng() % 23);
      for (auto& v : tg) v = static_cast<int32_t>(rng() % 23);
      const Tensor tids = Tensor::from_ints({2, 6}, ids), ttg = Tensor::from_ints({2, 6}, tg);
      const auto sa = a.forward_backward(kC, tids, ttg, 0.5f);
      const auto sb = b.forward_backward(kC, tids, ttg, 0.5f);
      lm_a += sa.lm_loss_sum;
      aux_a += sa.aux_loss * 0.5;
      tokens += sa.tokens;
      EXPECT_EQ(sb.aux_loss, 0.0);  // deferred to end_step
      EXPECT_EQ(sb.lm_loss_sum, 0.0);
    }
    if (step == 1) {
      // The first step's gradients (from equal parameters): the same kernels without a
      // z-loss; with one, the device form's f32 log-sum-exps against the host's fp64 ones,
      // equal to f32 rounding.
      auto pa = a.parameters(), pb = b.parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        const auto ga = pa[i].param->grad.to_floats(), gb = pb[i].param->grad.to_floats();
        double diff = 0, scale = 0;
        for (size_t j = 0; j < ga.size(); ++j) {
          diff = std::max(diff, static_cast<double>(std::abs(ga[j] - gb[j])));
          scale = std::max(scale, static_cast<double>(std::abs(ga[j])));
        }
        EXPECT_LE(diff, 1e-6 * scale) << pa[i].name << " step " << step;
      }
    }
    const double gn_a = std::sqrt(oa.grad_norm_squared(kC));
    oa.step(kC, 1e-2, gn_a);
    ob.step(kC, 1e-2, b.grad_norm_squared_on_device(kC));
    const auto load_a = a.end_step(kC), load_b = b.end_step(kC);
    const Model::StepStats& ss = b.last_step_stats();
    EXPECT_NEAR(ss.lm_loss_sum, lm_a, 1e-4 * std::abs(lm_a)) << "step " << step;
    EXPECT_NEAR(ss.aux_loss * 0.5, aux_a, 1e-5 + 1e-4 * aux_a) << "step " << step;
    EXPECT_GT(ss.aux_loss, 0.0);
    EXPECT_NEAR(std::sqrt(ss.grad_norm_squared), gn_a, 1e-4 * gn_a) << "step " << step;
    EXPECT_GT(gn_a, o.grad_clip);
    EXPECT_EQ(load_a, load_b) << "step " << step;
    int64_t total = 0;
    for (int64_t v : load_b.at(0)) total += v;
    EXPECT_EQ(total, tokens * moe.top_k);
    auto pa = a.parameters(), pb = b.parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      const auto va = pa[i].param->value.to_floats(), vb = pb[i].param->value.to_floats();
      for (size_t j = 0; j < va.size(); ++j)
        ASSERT_NEAR(va[j], vb[j], param_tol) << pa[i].name << " step " << step;
    }
    auto ba = a.buffers(), bb = b.buffers();
    for (size_t i = 0; i < ba.size(); ++i)
      EXPECT_EQ(ba[i].tensor->to_floats(), bb[i].tensor->to_floats()) << ba[i].name;
  }
}

TEST(Model, DeviceStatsStepEqualsHostStatsSoftmaxAux) {
  MoEConfig moe = moe_config(kernels::RouterScore::kSoftmax);
  moe.z_loss_coef = 0.0;
  check_device_stats_step(moe);
}

// The z-loss on the device (logsumexp_forward, its squares summed into the aux loss;
// logsumexp_backward for its gradient) against the host's fp64 loops: moe_config's
// coefficients are large, so a wrong z-loss value or gradient shows in the aux loss, the
// norm and the updated parameters.
TEST(Model, DeviceStatsStepEqualsHostStatsWithZLoss) {
  check_device_stats_step(moe_config(kernels::RouterScore::kSoftmax));
}

TEST(Model, DeviceStatsStepEqualsHostStatsSigmoidBias) {
  MoEConfig moe = moe_config(kernels::RouterScore::kSigmoid);
  moe.bias_update_rate = 0.01;
  moe.z_loss_coef = 0.0;
  check_device_stats_step(moe);
}

// with Model::enable_grad_norm_fold the experts' dW products leave their sums of
// squares in slots, and grad_norm_squared_on_device reads the other gradients and sums the
// slots. It equals the full pass over every gradient; in a step of two micro-batches (the
// second adds to the dW) it reads every gradient instead, and the next one-micro-batch
// step folds again.
TEST(Model, FoldedGradNormEqualsTheFullPass) {
  ModelConfig cfg = small_model();
  cfg.moe.z_loss_coef = 0.0;  // device statistics
  Model m(cfg, 95);
  ASSERT_TRUE(m.enable_device_stats(kC));
  EXPECT_EQ(m.enable_grad_norm_fold(kC), 2 * m.num_moe_blocks());
  int64_t expert_elements = 0;
  std::vector<const Tensor*> grads;
  for (const auto& p : m.parameters()) {
    grads.push_back(&p.param->grad);
    if (p.name.find(".experts.") != std::string::npos) expert_elements += p.param->numel();
  }
  ASSERT_GT(expert_elements, 0);
  std::mt19937 rng(96);
  for (int accum : {1, 2, 1}) {
    m.zero_grad(kC);
    for (int micro = 0; micro < accum; ++micro) {
      std::vector<int32_t> ids(12), tg(12);
      for (auto& v : ids) v = static_cast<int32_t>(rng() % 23);
      for (auto& v : tg) v = static_cast<int32_t>(rng() % 23);
      m.forward_backward(kC, Tensor::from_ints({2, 6}, ids), Tensor::from_ints({2, 6}, tg), 1.0f / accum);
    }
    const double got = m.grad_norm_squared_on_device(kC).to_floats().at(0);
    const double want = kernels::sum_squares_multi(kC.ex, grads);
    EXPECT_EQ(m.last_folded_elements(), accum == 1 ? expert_elements : 0) << "grad_accum " << accum;
    EXPECT_NEAR(got, want, 1e-6 * want) << "grad_accum " << accum;
    // The experts' share is large enough that leaving it out (or counting it twice) shows.
    double experts_only = 0;
    for (const auto& p : m.parameters())
      if (p.name.find(".experts.") != std::string::npos)
        experts_only += kernels::sum_squares(kC.ex, p.param->grad);
    EXPECT_GT(experts_only, 1e-3 * want);
    m.end_step(kC);
  }
}

}  // namespace
}  // namespace troupe::layers
