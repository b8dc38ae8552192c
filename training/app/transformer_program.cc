// training/app/transformer_program.cc — the transformer program base: the StageProgram
// around an app's blocks, and transformer_main.
#include "training/app/transformer_program.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>

#include "layers/embedding.h"
#include "layers/lm_head.h"
#include "training/app/run_device.h"

namespace troupe::training {

using layers::Var;

// ---- block parts ------------------------------------------------------------------------

BlockNorm::BlockNorm(int64_t dim, float eps_) : eps(eps_) {
  weight.allocate({dim}, /*with_decay=*/false);
  layers::init_constant(weight.value, 1.0f);
  weight.overwrites_grad = true;  // the tape's norm asks accumulate_grad()
}

BlockAttention::BlockAttention(const layers::ModelConfig& m, int64_t batch, int64_t seq_local)
    : layer(m.d_model, m.n_heads, m.n_kv_heads, m.dh(), static_cast<float>(m.rope_theta)),
      batch_(batch),
      seq_local_(seq_local) {}

Var BlockAttention::operator()(const Var& x) {
  layers::Tape* t = &x.tape();
  if (shard_) {
    return layers::custom<AttentionShard::Saved>(
        x,
        [this, t](const Tensor& in, AttentionShard::Saved& s) {
          return shard_->forward(t->ctx(), in, batch_, seq_local_, s);
        },
        [this, t](const Tensor& dy, AttentionShard::Saved& s) { return shard_->backward(t->ctx(), dy, s); });
  }
  return layers::custom<layers::Attention::Saved>(
      x,
      [this, t](const Tensor& in, layers::Attention::Saved& s) {
        return layer.forward(t->ctx(), in, batch_, seq_local_, s);
      },
      [this, t](const Tensor& dy, layers::Attention::Saved& s) { return layer.backward(t->ctx(), dy, s); });
}

struct BlockBuilder::Parts {
  std::deque<layers::Parameter> params;
  std::deque<BlockNorm> norms;
  std::deque<BlockAttention> attentions;
};

BlockBuilder::BlockBuilder(const StageEnv& env, int64_t index)
    : env_(env), index_(index), parts_(std::make_unique<Parts>()) {}

BlockBuilder::~BlockBuilder() = default;

std::unique_ptr<BlockBuilder::Parts> BlockBuilder::take_parts() {
  return std::move(parts_);
}

layers::Parameter& BlockBuilder::tensor(const std::string& name, const Shape& shape, float std) {
  const std::string full = fmt::format("blocks.{}.{}", index_, name);
  for (const Made& m : made_) {
    TROUPE_CHECK(m.name != full, "BlockBuilder: block {} makes two parameters named {}", index_, full);
  }
  layers::Parameter& p = parts_->params.emplace_back();
  p.allocate(shape);
  layers::init_normal(p.value, env_.tc.train.seed, full, std);
  p.overwrites_grad = true;  // every tape op that makes a gradient asks accumulate_grad()
  made_.push_back({full, &p, ""});
  return p;
}

void BlockBuilder::add_parameter(const std::string& name, layers::Parameter& p, const std::string& role) {
  const std::string full = fmt::format("blocks.{}.{}", index_, name);
  for (const Made& m : made_) {
    TROUPE_CHECK(m.name != full && m.param != &p, "BlockBuilder: block {} adds {} twice", index_, full);
  }
  made_.push_back({full, &p, role});
}

layers::Parameter& BlockBuilder::weight(const std::string& name, const Shape& shape) {
  return tensor(name, shape, static_cast<float>(model().init_std));
}

layers::Parameter& BlockBuilder::output_weight(const std::string& name, const Shape& shape) {
  const float std = static_cast<float>(model().init_std);
  return tensor(name, shape, std / std::sqrt(2.0f * static_cast<float>(model().n_layers)));
}

BlockNorm& BlockBuilder::rms_norm(const std::string& name) {
  BlockNorm& n = parts_->norms.emplace_back(model().d_model, static_cast<float>(model().norm_eps));
  made_.push_back({fmt::format("blocks.{}.{}.weight", index_, name), &n.weight, ""});
  return n;
}

BlockAttention& BlockBuilder::attention(const std::string& name) {
  BlockAttention& a = parts_->attentions.emplace_back(model(), env_.batch, env_.seq_local);
  const std::string prefix = fmt::format("blocks.{}.{}", index_, name);
  const float std = static_cast<float>(model().init_std);
  a.layer.init(env_.tc.train.seed, prefix, std, std / std::sqrt(2.0f * static_cast<float>(model().n_layers)));
  std::vector<layers::NamedParameter> ps;
  a.layer.collect(prefix, ps);
  for (const auto& np : ps) made_.push_back({np.name, np.param, "attention"});
  // n > 1: Ulysses over the n-group, the same weights.
  if (env_.n_group != nullptr)
    a.shard_ =
        std::make_unique<AttentionShard>(a.layer, *env_.n_group, env_.time, env_.tc.parallel.overlap_a2a);
  return a;
}

// ---- the program ------------------------------------------------------------------------

namespace {

// One block and micro-batch: the tape of its forward (or, recomputed, only its input).
struct TapeSaved final : StageProgram::Saved {
  TapeSaved(const layers::Ctx& c, bool record) : tape(c, record) {}
  layers::Tape tape;
  Var in, out;
  Tensor x;  // train.recompute = "blocks": the block's input
};

class TransformerProgram final : public StageProgram {
 public:
  TransformerProgram(const StageEnv& env, const BlockFactory& make)
      : m_(env.tc.model), first_(env.first), last_(env.last), recompute_(env.tc.train.recompute_blocks) {
    const uint64_t seed = env.tc.train.seed;
    const float std = static_cast<float>(m_.init_std);
    // Stage p of pp: blocks [p * L / pp, (p + 1) * L / pp), nothing else of the model.
    const int64_t per_stage = m_.n_layers / env.pp;
    lo_ = env.coord.pp * per_stage;
    if (first_ || (last_ && m_.tie_embeddings)) {
      embedding_ = std::make_unique<layers::Embedding>(m_.vocab_size, m_.d_model);
      embedding_->init(seed, "embedding", std);
    }
    for (int64_t i = lo_; i < lo_ + per_stage; ++i) {
      BlockBuilder b(env, i);
      blocks_.push_back(make(b));
      TROUPE_CHECK(blocks_.back() != nullptr, "transformer program: the block factory returned nothing");
      made_.push_back(b.made());
      parts_.push_back(b.take_parts());
    }
    if (last_) {
      head_ = std::make_unique<layers::LMHead>(m_.vocab_size, m_.d_model, static_cast<float>(m_.norm_eps),
                                               m_.tie_embeddings ? &embedding_->weight : nullptr);
      head_->init(seed, std);
    }
  }

  std::vector<ProgramParam> parameters() override {
    std::vector<ProgramParam> out;
    if (first_) {
      ProgramParam p{"embedding.weight", &embedding_->weight};
      p.tied = m_.tie_embeddings;
      out.push_back(p);
    }
    for (size_t i = 0; i < made_.size(); ++i) {
      for (const BlockBuilder::Made& mp : made_[i]) {
        ProgramParam p{mp.name, mp.param};
        p.grad_ready = static_cast<int64_t>(i);  // final once block i's backward is done
        p.role = mp.role;
        out.push_back(p);
      }
    }
    if (last_) {
      std::vector<layers::NamedParameter> ps;
      head_->collect(ps);
      for (const auto& np : ps) {
        ProgramParam p{np.name, np.param};
        p.grad_ready = kGradReadyAfterHead;
        out.push_back(p);
      }
      if (m_.tie_embeddings && !first_) {
        ProgramParam p{"embedding.weight[tied copy]", &embedding_->weight};
        p.tied_copy = true;
        out.push_back(p);
      }
    }
    return out;
  }

  int64_t activation_width() const override { return m_.d_model; }
  layers::Embedding* embedding() override { return first_ ? embedding_.get() : nullptr; }
  layers::LMHead* head() override { return head_.get(); }
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  std::string block_name(int64_t i) const override { return fmt::format("block {}", lo_ + i); }

  Tensor block_forward(const layers::Ctx& c, int64_t i, const Tensor& x, std::unique_ptr<Saved>& saved,
                       bool train) override {
    auto s = std::make_unique<TapeSaved>(c, train && !recompute_);
    s->in = s->tape.input(x);
    s->out = blocks_[static_cast<size_t>(i)]->forward(s->in);
    Tensor y = s->out.value();
    if (train) {
      if (recompute_) {
        s->in = s->out = Var();  // keeps nothing but the input
        s->x = x;
      }
      // The output goes on to the next block or the head; the tape needs only its slot.
      s->out.release_value();
      saved = std::move(s);
    }
    return y;
  }

  Tensor block_backward(const layers::Ctx& c, int64_t i, const Tensor& dy, Saved& saved) override {
    auto& s = static_cast<TapeSaved&>(saved);
    if (!recompute_) return s.tape.backward(s.out, dy, s.in);
    layers::Tape t(c);
    const Var in = t.input(s.x);
    const Var out = blocks_[static_cast<size_t>(i)]->forward(in);
    return t.backward(out, dy, in);
  }

 private:
  const layers::ModelConfig m_;
  bool first_, last_, recompute_;
  int64_t lo_ = 0;
  std::unique_ptr<layers::Embedding> embedding_;
  std::vector<std::unique_ptr<BlockBuilder::Parts>> parts_;  // own the blocks' parameters
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<std::vector<BlockBuilder::Made>> made_;
  std::unique_ptr<layers::LMHead> head_;
};

}  // namespace

ProgramFactory transformer_program(BlockFactory block) {
  return [block = std::move(block)](const StageEnv& env) -> Result<std::unique_ptr<StageProgram>> {
    if (!block) return invalid_argument("transformer program: no block factory given");
    return std::unique_ptr<StageProgram>(std::make_unique<TransformerProgram>(env, block));
  };
}

Status check_dense_model(const layers::TrainConfig& tc, const std::string& app) {
  if (!tc.model.moe_layers.empty() || tc.model.moe_every != 0) {
    return invalid_argument(
        "{}: {} trains a dense model, but [model] makes MoE blocks (moe_every = {}, moe_layers has {}); set "
        "model.moe_every = 0",
        tc.source, app, tc.model.moe_every, tc.model.moe_layers.size());
  }
  if (tc.model.recompute_swiglu) {
    return invalid_argument(
        "{}: model.recompute_swiglu applies to train_moe's layers; {} recomputes whole blocks with "
        "train.recompute = \"blocks\"",
        tc.source, app);
  }
  return ok_status();
}

App transformer_app(const TransformerApp& a) {
  App app;
  app.name = a.name;
  app.program = transformer_program(a.block);
  app.check = a.check ? a.check : [name = a.name](const layers::TrainConfig& tc) {
    return check_dense_model(tc, name);
  };
  app.recomputes_blocks = true;
  return app;
}

int transformer_main(int argc, char** argv, const TransformerApp& a) {
  CLI::App cli{a.about.empty() ? a.name + ": a transformer language model trained with Troupe" : a.about};
  RunOptions o;
  add_run_options(cli, o);
  CLI11_PARSE(cli, argc, argv);
  o.argv.assign(argv, argv + argc);
  if (o.config.empty()) {
    fmt::print(stderr, "{}: give --config <file>\n{}", a.name, cli.help());
    return 2;
  }
  const Status st = [&]() -> Status {
    TROUPE_RETURN_IF_ERROR(adopt_job_flags(o));  // troupe run's --backend and --layout
    // The device for training; --gradcheck runs on the CPU whatever --backend says.
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<RunDevice> dev,
                            RunDevice::create(o.gradcheck ? "cpu" : o.backend));
    TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, load_run_config(o));
    dev->set_attention_fused_dq(tc.train.attention_fused_dq);
    dev->set_pdl(tc.train.pdl);
    return run_app(transformer_app(a), o, dev->ctx());
  }();
  if (!st.ok()) {
    fmt::print(stderr, "{}: error: {}\n", a.name, st.to_string());
    return 1;
  }
  return 0;
}

}  // namespace troupe::training
