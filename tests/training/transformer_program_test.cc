// tests/training/transformer_program_test.cc — the transformer program base and gradcheck,
// in process on the CPU: each stage of a pp=2 layout builds only its blocks, under global
// names, with the tied copy on the last stage, grad_ready per block and the attention
// role; its values are those one process draws; train.recompute = "blocks" gives the
// gradients of the recorded tape; gradcheck passes a block whose forward and backward
// agree, and fails — naming the parameter — a hand-written layer whose backward is off
// by 10%, or leaves a parameter's gradient out.
#include "training/app/transformer_program.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "training/app/gradcheck.h"

namespace troupe::training {
namespace {

using layers::Var;

layers::TrainConfig config(const std::vector<std::string>& overrides = {}) {
  auto c = ConfigTable::parse_string(
      "[model]\nvocab_size = 256\nd_model = 32\nn_layers = 4\nn_heads = 4\nn_kv_heads = 2\nffn_hidden = 48\n"
      "moe_every = 0\n[train]\nseq_len = 16\nmicro_batch_size = 2\n",
      "test.toml");
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  for (const auto& o : overrides) EXPECT_TRUE(c->set_from_string(o).ok()) << o;
  auto tc = layers::parse_train_config(*c);
  EXPECT_TRUE(tc.ok()) << tc.status().to_string();
  return *tc;
}

struct DenseBlock final : Block {
  explicit DenseBlock(BlockBuilder& b)
      : norm1(b.rms_norm("norm1")),
        attn(b.attention("attn")),
        norm2(b.rms_norm("norm2")),
        w1(b.weight("mlp.w1", {b.model().d_model, 2 * b.model().ffn_hidden})),
        w2(b.output_weight("mlp.w2", {b.model().ffn_hidden, b.model().d_model})) {}
  Var forward(const Var& x) override {
    const Var h = x + attn(norm1(x));
    return h + matmul(swiglu(matmul(norm2(h), w1)), w2);
  }
  BlockNorm& norm1;
  BlockAttention& attn;
  BlockNorm& norm2;
  layers::Parameter &w1, &w2;
};

// A block with a hand-written linear layer y = x @ w whose backward is `broken`:
// "scaled" returns dx 10% too large, "no_dw" leaves w's gradient out.
struct HandWrittenBlock final : Block {
  HandWrittenBlock(BlockBuilder& b, std::string broken_)
      : norm(b.rms_norm("norm")),
        w(b.weight("lin", {b.model().d_model, b.model().d_model})),
        broken(std::move(broken_)) {}
  struct Saved {
    Tensor x;
  };
  Var forward(const Var& x) override {
    const layers::Ctx c = x.tape().ctx();
    return x + layers::custom<Saved>(
                   norm(x),
                   [&, c](const Tensor& in, Saved& s) {
                     s.x = in;
                     Tensor y = c.empty(in.shape());
                     kernels::matmul(c.ex, in, w.w(), y);
                     return y;
                   },
                   [&, c](const Tensor& dy, Saved& s) {
                     Tensor dx = c.empty(s.x.shape());
                     kernels::matmul_backward(c.ex, s.x, w.w(), dy, &dx, nullptr);
                     if (broken != "no_dw")
                       kernels::matmul_backward(c.ex, s.x, w.w(), dy, nullptr, &w.grad, false, false,
                                                w.accumulate_grad());
                     if (broken == "scaled") kernels::scale(c.ex, dx, 1.1f);
                     return dx;
                   });
  }
  BlockNorm& norm;
  layers::Parameter& w;
  std::string broken;
};

struct Built {
  CommTime time;
  std::unique_ptr<StageProgram> program;
  std::vector<ProgramParam> params;
};

std::unique_ptr<Built> build(const layers::TrainConfig& tc, int pp, int stage, const BlockFactory& block) {
  auto b = std::make_unique<Built>();
  const StageEnv env{tc,   ParallelCoord{stage, 0, 0}, pp,      1,      1, stage == 0, stage == pp - 1, 2, 8,
                     1.0f, layers::Ctx::cpu(),         nullptr, b->time};
  auto p = transformer_program(block)(env);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  b->program = std::move(*p);
  b->params = b->program->parameters();
  return b;
}

TEST(TransformerProgram, EachStageBuildsItsBlocksUnderGlobalNames) {
  const layers::TrainConfig tc = config();
  auto one = build(tc, 1, 0, make_block<DenseBlock>());
  auto first = build(tc, 2, 0, make_block<DenseBlock>()), last = build(tc, 2, 1, make_block<DenseBlock>());
  EXPECT_EQ(first->program->num_blocks(), 2);
  EXPECT_EQ(last->program->num_blocks(), 2);
  EXPECT_EQ(last->program->block_name(0), "block 2");
  EXPECT_NE(first->program->embedding(), nullptr);
  EXPECT_EQ(first->program->head(), nullptr);
  EXPECT_EQ(last->program->embedding(), nullptr);
  EXPECT_NE(last->program->head(), nullptr);

  std::map<std::string, const ProgramParam*> by_name;
  for (const auto* b : {first.get(), last.get()})
    for (const auto& p : b->params) by_name[p.name] = &p;
  // The two stages hold one process's parameters (plus the tied copy), with its values.
  ASSERT_EQ(by_name.size(), one->params.size() + 1);
  for (const auto& p : one->params) {
    ASSERT_TRUE(by_name.count(p.name)) << p.name;
    const Tensor& a = p.param->value;
    const Tensor& b = by_name[p.name]->param->value;
    EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << p.name;
  }
  const ProgramParam* copy = by_name.at("embedding.weight[tied copy]");
  EXPECT_TRUE(copy->tied_copy);
  EXPECT_TRUE(by_name.at("embedding.weight")->tied);
  EXPECT_EQ(by_name.at("blocks.0.mlp.w1")->grad_ready, 0);
  EXPECT_EQ(by_name.at("blocks.3.norm2.weight")->grad_ready, 1);  // the last stage's second block
  EXPECT_EQ(by_name.at("blocks.2.attn.wq")->role, "attention");
  EXPECT_EQ(by_name.at("blocks.2.mlp.w2")->role, "");
  EXPECT_EQ(by_name.at("final_norm.weight")->grad_ready, kGradReadyAfterHead);
  EXPECT_FALSE(by_name.at("blocks.1.norm1.weight")->param->decay);
  // Untied: the head has its own weight and no stage holds a copy.
  auto untied = build(config({"model.tie_embeddings=false"}), 2, 1, make_block<DenseBlock>());
  bool has_head = false;
  for (const auto& p : untied->params) {
    EXPECT_NE(p.name, "embedding.weight[tied copy]");
    has_head |= p.name == "lm_head.weight";
  }
  EXPECT_TRUE(has_head);
}

TEST(TransformerProgram, RecomputedBlocksGiveTheRecordedGradients) {
  std::vector<std::vector<float>> grads[2];
  for (int recompute = 0; recompute < 2; ++recompute) {
    auto b = build(config({recompute ? "train.recompute=\"blocks\"" : "train.recompute=\"none\""}), 1, 0,
                   make_block<DenseBlock>());
    StageProgram& p = *b->program;
    const layers::Ctx c = layers::Ctx::cpu();
    std::vector<int32_t> ids(16);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7 + 3) % 64);
    const Tensor tid = Tensor::from_ints({16}, ids);
    Tensor x = p.embed(c, tid);
    std::vector<std::unique_ptr<StageProgram::Saved>> saved(4);
    for (int64_t i = 0; i < 4; ++i) x = p.block_forward(c, i, x, saved[static_cast<size_t>(i)], true);
    Tensor dx;
    p.head_forward_backward(c, x, tid, 1.0f, dx);
    for (int64_t i = 4; i-- > 0;) dx = p.block_backward(c, i, dx, *saved[static_cast<size_t>(i)]);
    p.embed_backward(c, tid, dx);
    for (const auto& q : b->params) grads[recompute].push_back(q.param->grad.to_floats());
  }
  EXPECT_EQ(grads[0], grads[1]);
}

TEST(Gradcheck, PassesAMatchingBackwardAndNamesAWrongOne) {
  const layers::TrainConfig tc = config();
  auto ok = gradcheck(transformer_program(make_block<DenseBlock>()), tc);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->params.size(), 34u);
  EXPECT_LT(ok->worst, GradcheckOptions{}.tolerance) << ok->worst_param;
  std::printf("[gradcheck] dense block: %zu parameters, worst relative error %.2e (%s)\n", ok->params.size(),
              ok->worst, ok->worst_param.c_str());

  auto with = [](const std::string& broken) {
    return transformer_program(
        [broken](BlockBuilder& b) { return std::make_unique<HandWrittenBlock>(b, broken); });
  };
  auto fine = gradcheck(with("none"), tc);
  ASSERT_TRUE(fine.ok());
  EXPECT_LT(fine->worst, GradcheckOptions{}.tolerance) << fine->worst_param;
  // dx 10% too large: every parameter below the layer sees it.
  auto scaled = gradcheck(with("scaled"), tc);
  ASSERT_TRUE(scaled.ok());
  EXPECT_GT(scaled->worst, GradcheckOptions{}.tolerance);
  for (const auto& p : scaled->params) {
    if (p.name == "embedding.weight") {
      EXPECT_GT(p.worst, 0.05);
    }
  }
  // w's gradient left out: w's check fails outright, and run_gradcheck says so.
  auto no_dw = gradcheck(with("no_dw"), tc);
  ASSERT_TRUE(no_dw.ok());
  EXPECT_GT(no_dw->worst, 0.5);
  EXPECT_TRUE(no_dw->worst_param.ends_with(".lin")) << no_dw->worst_param;
  const Status st = run_gradcheck("test", with("no_dw"), tc);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("gradient of blocks."), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find(".lin is off by"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace troupe::training
