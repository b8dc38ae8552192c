// layers/mlp.h — defines SwiGLUMLP (dense feed-forward: x @ w1 -> [gate | up] ->
// silu(gate) * up -> @ w2) and Experts (the same computation for E experts at once over
// rows grouped by expert, as two grouped matmuls).
//
// Selective recomputation: with `recompute`, the SwiGLU output (the second GEMM's input)
// is not kept; backward recomputes it from the saved first-GEMM output.
#pragma once

#include <string>
#include <vector>

#include "layers/context.h"
#include "layers/parameter.h"

namespace troupe::layers {

class SwiGLUMLP {
 public:
  struct Saved {
    Tensor x, h, a;  // input [T,D], x@w1 [T,2F], swiglu(h) [T,F] (undefined when recomputed)
  };
  SwiGLUMLP(int64_t d_model, int64_t hidden, bool recompute);
  void init(uint64_t seed, const std::string& prefix, float std, float out_std);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);

  Tensor forward(const Ctx& c, const Tensor& x, Saved& s) const;
  Tensor backward(const Ctx& c, const Tensor& dy, const Saved& s);  // returns dx

  Parameter w1, w2;  // [D, 2F], [F, D]
  bool recompute;
};

class Experts {
 public:
  struct Saved {
    Tensor xp, offsets, h, a;  // permuted rows [R,D], i32 [E+1], [R,2F], [R,F] (or undefined)
  };
  // num_experts: the experts this object holds (an expert-parallel rank: its share).
  Experts(int64_t num_experts, int64_t d_model, int64_t hidden, bool recompute);
  // Draws experts [first_expert, first_expert + num_experts) of the block's global
  // [E, D, 2F] / [E, F, D] tensors (init_normal_rows), so a rank's share equals those
  // experts of the whole tensors bitwise.
  void init(uint64_t seed, const std::string& prefix, float std, float out_std, int64_t first_expert = 0);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);

  // xp [R, D] rows grouped by expert per offsets (i32 [E+1]) -> yp [R, D].
  Tensor forward(const Ctx& c, const Tensor& xp, const Tensor& offsets, Saved& s) const;
  Tensor backward(const Ctx& c, const Tensor& dyp, const Saved& s);  // returns dxp

  Parameter w1, w2;  // [E, D, 2F], [E, F, D]
  bool recompute;
};

}  // namespace troupe::layers
