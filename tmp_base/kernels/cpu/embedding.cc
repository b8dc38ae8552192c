// kernels/cpu/embedding.cc — CPU reference of the token embedding (gather / scatter-add)
// and of rotary position embedding (RoPE, "rotate half"), forward and backward.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {

void embedding_forward(const Exec&, const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t tokens = ids.numel(), vocab = table.size(0), dim = table.size(1);
  const int32_t* pid = ids.data<int32_t>();
  F32In pt(table);
  F32Out po(out);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = pid[t];
    TROUPE_CHECK(id >= 0 && id < vocab, "embedding_forward: ids[{}] = {} outside [0, {})", t, id, vocab);
    const float* src = pt.get() + id * dim;
    float* dst = po.get() + t * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = src[d];
  }
}

void embedding_backward(const Exec&, const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const int64_t tokens = ids.numel(), vocab = dtable.size(0), dim = dtable.size(1);
  const int32_t* pid = ids.data<int32_t>();
  F32In pd(dout);
  F32Out pt(dtable, /*load=*/true);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = pid[t];
    TROUPE_CHECK(id >= 0 && id < vocab, "embedding_backward: ids[{}] = {} outside [0, {})", t, id, vocab);
    const float* src = pd.get() + t * dim;
    float* dst = pt.get() + id * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] += src[d];
  }
}

namespace {

// Rotates each pair (i, i + Dh/2) of every head of every token by sign * angle, angle =
// pos * theta^(-2i/Dh). The inverse rotation (sign = -1) is the backward.
void rope_rotate(const Tensor& x, const Tensor& pos, float theta, Tensor& out, double sign) {
  const int64_t tokens = x.size(0), heads = x.size(1), dh = x.size(2), half = dh / 2;
  const int32_t* pp = pos.data<int32_t>();
  F32In px(x);
  F32Out po(out);
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] =
        std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(dh));
  }
  std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pp[t]) * inv_freq[i];
      cos_t[i] = static_cast<float>(std::cos(angle));
      sin_t[i] = static_cast<float>(sign * std::sin(angle));
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = px.get() + (t * heads + h) * dh;
      float* dst = po.get() + (t * heads + h) * dh;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = src[i], x1 = src[i + half];
        dst[i] = x0 * cos_t[i] - x1 * sin_t[i];
        dst[i + half] = x0 * sin_t[i] + x1 * cos_t[i];
      }
    }
  }
}

}  // namespace

void rope_forward(const Exec&, const Tensor& x, const Tensor& pos, float theta, Tensor& out) {
  rope_rotate(x, pos, theta, out, 1.0);
}

void rope_backward(const Exec&, const Tensor& dout, const Tensor& pos, float theta, Tensor& dx) {
  rope_rotate(dout, pos, theta, dx, -1.0);
}

}  // namespace troupe::kernels::cpu
