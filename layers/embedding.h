// layers/embedding.h — defines Embedding (token ids -> vectors) and RMSNorm, the two
// per-token layers with one parameter each.
#pragma once

#include <string>
#include <vector>

#include "layers/context.h"
#include "layers/parameter.h"

namespace troupe::layers {

class Embedding {
 public:
  Embedding(int64_t vocab, int64_t dim);
  void init(uint64_t seed, const std::string& prefix, float std);
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);

  // ids i32 [T] -> [T, D].
  Tensor forward(const Ctx& c, const Tensor& ids) const;
  // Adds the gradient of dout [T, D] into weight.grad.
  void backward(const Ctx& c, const Tensor& ids, const Tensor& dout);

  Parameter weight;  // [V, D]
};

class RMSNorm {
 public:
  struct Saved {
    Tensor x, rstd;
  };
  RMSNorm(int64_t dim, float eps);
  void init();
  void collect(const std::string& prefix, std::vector<NamedParameter>& out);

  Tensor forward(const Ctx& c, const Tensor& x, Saved& s) const;  // x [T, D]
  // The residual add before the norm in the same pass: h = x + r (returned in h), and the
  // norm of h is returned.
  Tensor forward_add(const Ctx& c, const Tensor& x, const Tensor& r, Tensor& h, Saved& s) const;
  // Returns dx (+ dres when given: the residual branch's gradient, added in the same
  // pass); accumulates weight.grad.
  Tensor backward(const Ctx& c, const Tensor& dy, const Saved& s, const Tensor* dres = nullptr);

  Parameter weight;  // [D]
  float eps;
};

}  // namespace troupe::layers
