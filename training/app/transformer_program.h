// training/app/transformer_program.h — defines the transformer program base: for an
// app whose model is "token embedding, N blocks, final norm and LM head", the app writes
// its block — the parameters it makes through a BlockBuilder and its forward on a
// layers::Tape (layers/autograd.h) — and a main() of one call; the base is the rest of the
// StageProgram (stage_program.h):
// - the stage split: stage p of pp builds blocks [p*L/pp, (p+1)*L/pp) only, the first
//   stage the embedding, the last the final norm and LM head;
// - tying (model.tie_embeddings): the head reads the embedding's weight; with pp > 1 the
//   last stage holds it as the tied copy the framework sums with the first stage's;
// - global names ("blocks.<i>.<name>", "embedding.weight", "final_norm.weight",
//   "lm_head.weight"), values drawn from (seed, name), so every layout trains one model;
// - each parameter's grad_ready (its block) and actor role ("attention" for a block's
//   attention), for the overlapped gradient exchange and `troupe status --actors`;
// - the n > 1 attention: BlockAttention runs Ulysses over the n-group (AttentionShard)
//   with the same weights; the rest of a block is per token and needs nothing;
// - the backward: one Tape per block and micro-batch keeps what the block's backward
//   needs (train.recompute = "blocks": nothing but the block's input, the forward run
//   again in backward);
// - transformer_main(): the run options, --gradcheck (gradcheck.h), the device, run_app.
//
// An app (apps/examples/dense_lm/dense_lm.cc, docs/writing-an-app.md):
//
//   struct MyBlock final : training::Block {
//     explicit MyBlock(training::BlockBuilder& b)
//         : norm(b.rms_norm("norm")), attn(b.attention("attn")),
//           w1(b.weight("mlp.w1", {b.model().d_model, 2 * b.model().ffn_hidden})),
//           w2(b.output_weight("mlp.w2", {b.model().ffn_hidden, b.model().d_model})) {}
//     layers::Var forward(const layers::Var& x) override {
//       const layers::Var h = x + attn(norm(x));
//       return h + matmul(swiglu(matmul(norm(h), w1)), w2);
//     }
//     training::BlockNorm& norm;
//     training::BlockAttention& attn;
//     layers::Parameter &w1, &w2;
//   };
//   int main(int argc, char** argv) {
//     return training::transformer_main(argc, argv, {.name = "my_lm", .block =
//     training::make_block<MyBlock>()});
//   }
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layers/attention.h"
#include "layers/autograd.h"
#include "training/app/app.h"
#include "training/parallel/attention_shard.h"
#include "training/stage/stage_program.h"

namespace troupe::training {

// A block's RMSNorm: weight [d_model] (ones at init, no weight decay), eps = model.norm_eps.
class BlockNorm {
 public:
  BlockNorm(int64_t dim, float eps);
  layers::Var operator()(const layers::Var& x) { return layers::rms_norm(x, weight, eps); }
  layers::Parameter weight;
  float eps;
};

// A block's causal grouped-query attention with RoPE ([model]: n_heads, n_kv_heads,
// head_dim, rope_theta; layers/attention.h, its fused kernels and hand-written backward),
// over the n-group's Ulysses all-to-alls when n > 1. x [batch * seq_local, d_model].
class BlockAttention {
 public:
  BlockAttention(const layers::ModelConfig& m, int64_t batch, int64_t seq_local);
  layers::Var operator()(const layers::Var& x);
  layers::Attention layer;

 private:
  friend class BlockBuilder;
  std::unique_ptr<AttentionShard> shard_;  // n > 1
  int64_t batch_, seq_local_;
};

// What a block's constructor makes its parts with. Every parameter is named
// "blocks.<index>.<name>" and drawn from (seed, that name); normal(0, model.init_std)
// unless said otherwise.
class BlockBuilder {
 public:
  struct Made {
    std::string name;
    layers::Parameter* param;
    std::string role;
  };
  BlockBuilder(const StageEnv& env, int64_t index);

  const layers::ModelConfig& model() const { return env_.tc.model; }
  const layers::TrainConfig& config() const { return env_.tc; }
  int64_t index() const { return index_; }  // the block's global index, 0 .. n_layers - 1
  // The shape of the activations forward() gets: [batch() * seq_local(), d_model], each
  // sequence's seq_local() = seq_len / n consecutive tokens on this rank.
  int64_t batch() const { return env_.batch; }
  int64_t seq_local() const { return env_.seq_local; }

  // A matrix (or any tensor) read by the block's products.
  layers::Parameter& weight(const std::string& name, const Shape& shape);
  // A projection back into the residual stream: std init_std / sqrt(2 * n_layers) (GPT-2).
  layers::Parameter& output_weight(const std::string& name, const Shape& shape);
  // Parameters "<name>.weight"; "<name>.wq", ".wk", ".wv", ".wo" (role "attention").
  BlockNorm& rms_norm(const std::string& name);
  BlockAttention& attention(const std::string& name);
  // A parameter of a hand-written layer the block owns (layers::SwiGLUMLP, ...), named
  // "blocks.<index>.<name>" (the layer initialises it: from that name, for every layout to
  // hold the same values). It must live as long as the block.
  void add_parameter(const std::string& name, layers::Parameter& p, const std::string& role = "");

  // The parts made, in order (the base owns them; their addresses are stable).
  const std::vector<Made>& made() const { return made_; }
  struct Parts;
  std::unique_ptr<Parts> take_parts();
  ~BlockBuilder();

 private:
  layers::Parameter& tensor(const std::string& name, const Shape& shape, float std);
  const StageEnv& env_;
  int64_t index_;
  std::unique_ptr<Parts> parts_;
  std::vector<Made> made_;
};

// An app's block: built once per rank for each block of its stage; forward() runs on the
// Tape of one micro-batch (or a tape that does not record: evaluation), x and the result
// [batch * seq_local, d_model].
class Block {
 public:
  virtual ~Block() = default;
  virtual layers::Var forward(const layers::Var& x) = 0;
};
using BlockFactory = std::function<std::unique_ptr<Block>(BlockBuilder&)>;

template <class B>
BlockFactory make_block() {
  return [](BlockBuilder& b) { return std::unique_ptr<Block>(std::make_unique<B>(b)); };
}

// The StageProgram factory of a transformer of `block`s.
ProgramFactory transformer_program(BlockFactory block);

// What an app on the base hands transformer_main.
struct TransformerApp {
  std::string name;   // "dense_lm": log prefixes, the default run dir
  std::string about;  // the --help line
  BlockFactory block;
  // Refuses a config the block cannot train, naming the key. Default: a dense model (no
  // MoE block, no model.recompute_swiglu: the base recomputes whole blocks).
  std::function<Status(const layers::TrainConfig&)> check;
};

// The App of such a model (FLOPs per token: 6 x active parameters + causal attention's
// 6 * L * s * d).
App transformer_app(const TransformerApp& a);
// The whole main() of such an app: add_run_options (and --gradcheck), the config, the
// device, run_app. Exit status 0, 1 (an error, printed), 2 (usage).
int transformer_main(int argc, char** argv, const TransformerApp& a);
// The default check (TransformerApp::check).
Status check_dense_model(const layers::TrainConfig& tc, const std::string& app);

}  // namespace troupe::training
