// apps/examples/parallel_lm/parallel_lm.cc — parallel_lm: the GPT-J / PaLM "parallel"
// transformer block, y = x + attn(norm(x)) + mlp(norm(x)) (one norm; the attention and
// the MLP read the same normalised input, so a block is one residual step instead of
// two). Written as dense_lm is (docs/writing-an-app.md): the block's forward on a tape and
// main(); Troupe derives the backward and does the rest. It also builds out of tree
// against an installed Troupe (CMakeLists.txt; docs/writing-an-app.md "Building an app").
//
//   parallel_lm --config apps/examples/parallel_lm/parallel_lm.toml [--parallel pp=2,dp=2]
//   parallel_lm --config apps/examples/parallel_lm/parallel_lm.toml --gradcheck
#include "training/app/transformer_program.h"

using namespace troupe;
using layers::Var;

struct ParallelBlock final : training::Block {
  explicit ParallelBlock(training::BlockBuilder& b)
      : norm(b.rms_norm("norm")),
        attn(b.attention("attn")),
        w1(b.weight("mlp.w1", {b.model().d_model, 2 * b.model().ffn_hidden})),
        w2(b.output_weight("mlp.w2", {b.model().ffn_hidden, b.model().d_model})) {}

  Var forward(const Var& x) override {
    const Var n = norm(x);
    return x + attn(n) + matmul(swiglu(matmul(n, w1)), w2);
  }

  training::BlockNorm& norm;
  training::BlockAttention& attn;
  layers::Parameter &w1, &w2;
};

int main(int argc, char** argv) {
  return training::transformer_main(
      argc, argv,
      {.name = "parallel_lm",
       .about =
           "parallel_lm: a transformer language model of parallel blocks (GPT-J, PaLM) trained with Troupe",
       .block = training::make_block<ParallelBlock>()});
}
