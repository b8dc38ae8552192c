// bench/autograd/dense_handwritten.cc — dense_lm's model with its backward written by hand:
// the stage program dense_lm was before the transformer program base (a StageProgram with
// Saved structs, residual_forward/backward, explicit parameter names, grad_ready, roles,
// tied copies and the n > 1 switch). The autograd bench (bench/autograd/run.sh) trains it
// and apps/examples/dense_lm (the same parameters, names and values, its backward derived
// by layers/autograd.h) on one config and compares tokens/s.
//
//   dense_handwritten --config apps/examples/dense_lm/dense_lm.toml [--parallel ...] [--backend cuda]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <memory>
#include <vector>

#include "layers/attention.h"
#include "layers/embedding.h"
#include "layers/lm_head.h"
#include "layers/mlp.h"
#include "layers/residual.h"
#include "training/app/app.h"
#include "training/app/run_device.h"
#include "training/parallel/attention_shard.h"

namespace dense_handwritten {

using namespace troupe;
using training::ProgramParam;

// The model: token embedding -> n_layers pre-norm blocks (x + attn(norm1(x)), then
// h + mlp(norm2(h))) -> final norm and LM head, tied to the embedding when
// model.tie_embeddings. Its sizes come from the [model] table (layers/model_config.h),
// which must describe no MoE block (moe_every = 0).
class DenseStage final : public training::StageProgram {
 public:
  explicit DenseStage(const training::StageEnv& env)
      : cfg_(env.tc.model), first_(env.first), last_(env.last), batch_(env.batch), seq_local_(env.seq_local) {
    const uint64_t seed = env.tc.train.seed;
    const float std = static_cast<float>(cfg_.init_std);
    const float out_std = std / std::sqrt(2.0f * static_cast<float>(cfg_.n_layers));
    // Stage p of pp runs blocks [p * L / pp, (p + 1) * L / pp). Every value is drawn
    // from (seed, parameter name), so each layout trains the same model.
    const int64_t per_stage = cfg_.n_layers / env.pp;
    lo_ = env.coord.pp * per_stage;
    // The embedding lives on the first stage; the last stage keeps a copy when tied.
    if (first_ || (last_ && cfg_.tie_embeddings)) {
      embedding_ = std::make_unique<layers::Embedding>(cfg_.vocab_size, cfg_.d_model);
      embedding_->init(seed, "embedding", std);
    }
    for (int64_t i = lo_; i < lo_ + per_stage; ++i) {
      auto b = std::make_unique<Block>(cfg_);
      const std::string prefix = fmt::format("blocks.{}", i);
      b->norm1.init();
      b->norm2.init();
      b->attn.init(seed, prefix + ".attn", std, out_std);
      b->mlp.init(seed, prefix + ".mlp", std, out_std);
      // n > 1: Ulysses sequence parallelism over the n-group (the framework's AttentionShard).
      if (env.n_group != nullptr)
        b->shard = std::make_unique<training::AttentionShard>(b->attn, *env.n_group, env.time,
                                                              env.tc.parallel.overlap_a2a);
      blocks_.push_back(std::move(b));
    }
    if (last_) {
      head_ =
          std::make_unique<layers::LMHead>(cfg_.vocab_size, cfg_.d_model, static_cast<float>(cfg_.norm_eps),
                                           cfg_.tie_embeddings ? &embedding_->weight : nullptr);
      head_->init(seed, std);
    }
  }

  // Every parameter under its global name, with the bucket its gradient joins.
  std::vector<ProgramParam> parameters() override {
    std::vector<ProgramParam> out;
    if (first_) {
      ProgramParam p{"embedding.weight", &embedding_->weight};
      p.tied = cfg_.tie_embeddings;
      out.push_back(p);
    }
    for (size_t i = 0; i < blocks_.size(); ++i) {
      std::vector<layers::NamedParameter> ps;
      const std::string prefix = fmt::format("blocks.{}", lo_ + static_cast<int64_t>(i));
      blocks_[i]->norm1.collect(prefix + ".norm1", ps);
      blocks_[i]->attn.collect(prefix + ".attn", ps);
      blocks_[i]->norm2.collect(prefix + ".norm2", ps);
      blocks_[i]->mlp.collect(prefix + ".mlp", ps);
      for (const auto& np : ps) {
        ProgramParam p{np.name, np.param};
        p.grad_ready = static_cast<int64_t>(i);  // final once block i's backward is done
        if (np.name.find(".attn.") != std::string::npos) p.role = "attention";
        out.push_back(p);
      }
    }
    if (last_) {
      std::vector<layers::NamedParameter> ps;
      head_->collect(ps);
      for (const auto& np : ps) {
        ProgramParam p{np.name, np.param};
        p.grad_ready = training::kGradReadyAfterHead;
        out.push_back(p);
      }
      if (cfg_.tie_embeddings && !first_) {
        ProgramParam p{"embedding.weight[tied copy]", &embedding_->weight};
        p.tied_copy = true;
        out.push_back(p);
      }
    }
    return out;
  }

  int64_t activation_width() const override { return cfg_.d_model; }

  // The framework runs the embedding (first stage) and the head (last stage) itself.
  layers::Embedding* embedding() override { return first_ ? embedding_.get() : nullptr; }
  layers::LMHead* head() override { return head_.get(); }

  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  std::string block_name(int64_t i) const override { return fmt::format("block {}", lo_ + i); }

  // x + attn(norm1(x)), then h + mlp(norm2(h)) (layers/residual.h).
  Tensor block_forward(const layers::Ctx& c, int64_t i, const Tensor& x, std::unique_ptr<Saved>& saved,
                       bool /*train*/) override {
    Block& b = *blocks_[static_cast<size_t>(i)];
    auto s = std::make_unique<BlockSaved>();
    Tensor h = layers::residual_forward(c, x, b.norm1, s->norm1, [&](const Tensor& n) {
      return b.shard ? b.shard->forward(c, n, batch_, seq_local_, s->attn_sp)
                     : b.attn.forward(c, n, batch_, seq_local_, s->attn);
    });
    Tensor y = layers::residual_forward(c, h, b.norm2, s->norm2,
                                        [&](const Tensor& n) { return b.mlp.forward(c, n, s->mlp); });
    saved = std::move(s);
    return y;
  }

  Tensor block_backward(const layers::Ctx& c, int64_t i, const Tensor& dy, Saved& saved) override {
    Block& b = *blocks_[static_cast<size_t>(i)];
    auto& s = static_cast<BlockSaved&>(saved);
    Tensor dh = layers::residual_backward(c, dy, b.norm2, s.norm2,
                                          [&](const Tensor& d) { return b.mlp.backward(c, d, s.mlp); });
    return layers::residual_backward(c, dh, b.norm1, s.norm1, [&](const Tensor& d) {
      return b.shard ? b.shard->backward(c, d, s.attn_sp) : b.attn.backward(c, d, s.attn);
    });
  }

 private:
  struct Block {
    explicit Block(const layers::ModelConfig& m)
        : norm1(m.d_model, static_cast<float>(m.norm_eps)),
          norm2(m.d_model, static_cast<float>(m.norm_eps)),
          attn(m.d_model, m.n_heads, m.n_kv_heads, m.dh(), static_cast<float>(m.rope_theta)),
          mlp(m.d_model, m.ffn_hidden, m.recompute_swiglu) {}
    layers::RMSNorm norm1, norm2;
    layers::Attention attn;
    layers::SwiGLUMLP mlp;
    std::unique_ptr<training::AttentionShard> shard;  // n > 1
  };
  struct BlockSaved final : Saved {
    layers::RMSNorm::Saved norm1, norm2;
    layers::Attention::Saved attn;
    training::AttentionShard::Saved attn_sp;
    layers::SwiGLUMLP::Saved mlp;
  };

  const layers::ModelConfig cfg_;
  bool first_, last_;
  int64_t batch_, seq_local_, lo_ = 0;
  std::unique_ptr<layers::Embedding> embedding_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::unique_ptr<layers::LMHead> head_;
};

// The [model] table must describe a dense model.
Status check_dense(const layers::TrainConfig& tc) {
  if (!tc.model.moe_layers.empty() || tc.model.moe_every != 0) {
    return invalid_argument(
        "{}: dense_handwritten trains a dense model, but [model] makes MoE blocks (moe_every = {}, "
        "moe_layers has {}); set model.moe_every = 0",
        tc.source, tc.model.moe_every, tc.model.moe_layers.size());
  }
  return ok_status();
}

training::App app() {
  training::App a;
  a.name = "dense_handwritten";
  a.program = [](const training::StageEnv& env) -> Result<std::unique_ptr<training::StageProgram>> {
    TROUPE_RETURN_IF_ERROR(check_dense(env.tc));
    return std::unique_ptr<training::StageProgram>(std::make_unique<DenseStage>(env));
  };
  return a;
}

}  // namespace dense_handwritten

int main(int argc, char** argv) {
  using namespace troupe;
  CLI::App cli{"dense_handwritten: dense_lm's model with a hand-written backward (the autograd bench)"};
  training::RunOptions o;
  training::add_run_options(cli, o);
  CLI11_PARSE(cli, argc, argv);
  o.argv.assign(argv, argv + argc);
  if (o.config.empty()) {
    fmt::print(stderr,
               "dense_handwritten: give --config <file> (e.g. apps/examples/dense_lm/dense_lm.toml)\n{}",
               cli.help());
    return 2;
  }
  Status st = [&]() -> Status {
    TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, training::load_run_config(o));
    TROUPE_RETURN_IF_ERROR(dense_handwritten::check_dense(tc));
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<training::RunDevice> dev, training::RunDevice::create(o.backend));
    dev->set_attention_fused_dq(tc.train.attention_fused_dq);
    dev->set_pdl(tc.train.pdl);
    return training::run_app(dense_handwritten::app(), o, dev->ctx());
  }();
  if (!st.ok()) {
    fmt::print(stderr, "dense_handwritten: error: {}\n", st.to_string());
    return 1;
  }
  return 0;
}
