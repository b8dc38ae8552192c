// apps/examples/dense_lm/dense_lm.cc — dense_lm, the app API's example: a dense
// transformer language model (no MoE), trained under any pp x dp x n layout. Everything
// this app writes is below: its block, as its forward on a tape (the backward is derived,
// layers/autograd.h), and main(). The embedding, the stage split, tying, the LM head,
// parameter names, the n > 1 attention (training::BlockAttention), the Trainer, the
// workers, the schedule, gradient synchronisation, checkpoints, recovery, launch and
// metrics are Troupe's (training/app/transformer_program.h). docs/writing-an-app.md
// walks through this file.
//
//   dense_lm --config apps/examples/dense_lm/dense_lm.toml [--parallel pp=2,dp=2] [--set k=v]
//   dense_lm --config apps/examples/dense_lm/dense_lm.toml --gradcheck
//   troupe run --nproc 4 -- dense_lm --config apps/examples/dense_lm/dense_lm.toml --parallel pp=2,dp=2
#include "training/app/transformer_program.h"

using namespace troupe;
using layers::Var;

// The Llama block: x + attn(norm1(x)), then h + mlp(norm2(h)), the MLP a SwiGLU of
// model.ffn_hidden (w1 [d, 2f] = [gate | up], w2 [f, d]).
struct DenseBlock final : training::Block {
  explicit DenseBlock(training::BlockBuilder& b)
      : norm1(b.rms_norm("norm1")),
        attn(b.attention("attn")),
        norm2(b.rms_norm("norm2")),
        w1(b.weight("mlp.w1", {b.model().d_model, 2 * b.model().ffn_hidden})),
        w2(b.output_weight("mlp.w2", {b.model().ffn_hidden, b.model().d_model})) {}

  Var forward(const Var& x) override {
    const Var h = x + attn(norm1(x));
    return h + matmul(swiglu(matmul(norm2(h), w1)), w2);
  }

  training::BlockNorm& norm1;
  training::BlockAttention& attn;
  training::BlockNorm& norm2;
  layers::Parameter &w1, &w2;
};

int main(int argc, char** argv) {
  return training::transformer_main(
      argc, argv,
      {.name = "dense_lm",
       .about = "dense_lm: a dense transformer language model trained with Troupe (the app API's example)",
       .block = training::make_block<DenseBlock>()});
}
