// layers/lm_head.h — defines LMHead: final RMSNorm, vocabulary projection (weight [V, D],
// its own or the token embedding's when tied) and the mean cross-entropy loss.
//
// The projection and loss run over row chunks (`chunk_rows` tokens at a time) and the
// backward of each chunk follows its forward at once, so fp32 logits are never held for
// the whole batch (at bench_1b's 16k tokens x 32k vocab that would be 2 GiB). 4096 rows:
// at 1024 each chunk's dW product re-read and re-wrote the f32 [V, D] gradient (134 MB
// on bench_1b, 16 times a step) and its dx product had 1024 x D outputs to spread over
// the GPU; 4096 made bench_1b 1.9% faster on an H100 (16384: 2.0%, 0.5 GiB more) with
// the same peak memory (bf16 logits of a chunk: 256 MiB).
#pragma once

#include <string>
#include <vector>

#include "layers/embedding.h"

namespace troupe::layers {

class LMHead {
 public:
  // tied_to: the embedding's weight when tied, else nullptr (the head owns a [V, D] weight).
  LMHead(int64_t vocab, int64_t d_model, float eps, Parameter* tied_to, int64_t chunk_rows = 4096);
  void init(uint64_t seed, float std);
  void collect(std::vector<NamedParameter>& out);  // "final_norm.weight", "lm_head.weight"

  // x [T, D], targets i32 [T] (-1 = ignored). Gradient of grad_scale * sum_t loss_t is
  // written to dx and accumulated into the weights. Returns sum_t loss_t (fp64).
  double forward_backward(const Ctx& c, const Tensor& x, const Tensor& targets, float grad_scale, Tensor& dx);
  // The same, returning the token losses f32 [T] on the Exec's device instead of their
  // sum, so that a caller can read the loss back once, after the backward is enqueued.
  Tensor forward_backward_losses(const Ctx& c, const Tensor& x, const Tensor& targets, float grad_scale,
                                 Tensor& dx);
  // Loss sum only (evaluation).
  double loss_sum(const Ctx& c, const Tensor& x, const Tensor& targets) const;
  // Logits [T, V] of every row of x (sampling; small T).
  Tensor logits(const Ctx& c, const Tensor& x) const;

  RMSNorm norm;
  Parameter* weight;  // [V, D]
  bool tied;

 private:
  Parameter own_;
  int64_t chunk_rows_;
};

}  // namespace troupe::layers
