// kernels/cpu/attention.cc — CPU reference of causal grouped-query attention, forward
// (saving the log-sum-exp of each score row) and backward (recomputing probabilities
// from that lse, as flash attention does).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels::cpu {
namespace {

struct AttnDims {
  int64_t batch, seq, hq, hkv, dh;
  // Offset of row (b, s, head) in a [B,S,H,Dh] tensor with `heads` heads.
  int64_t at(int64_t b, int64_t s, int64_t head, int64_t heads) const { return ((b * seq + s) * heads + head) * dh; }
};

AttnDims attn_dims(const Tensor& q, const Tensor& k) {
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
}

}  // namespace

void attention_forward(const Exec&, const Tensor& q, const Tensor& k, const Tensor& v, float scale, Tensor& out,
                       Tensor& lse) {
  const AttnDims d = attn_dims(q, k);
  const int64_t group = d.hq / d.hkv;
  F32In pq(q), pk(k), pv(v);
  F32Out po(out), plse(lse);
  std::vector<float> p(static_cast<size_t>(d.seq));
  std::vector<float> acc(static_cast<size_t>(d.dh));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t s = 0; s < d.seq; ++s) {
        const float* qr = pq.get() + d.at(b, s, h, d.hq);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t <= s; ++t) {
          const float* kr = pk.get() + d.at(b, t, hk, d.hkv);
          float dot = 0.0f;
          for (int64_t i = 0; i < d.dh; ++i) dot += qr[i] * kr[i];
          p[t] = dot * scale;
          mx = std::max(mx, p[t]);
        }
        double z = 0.0;
        for (int64_t t = 0; t <= s; ++t) {
          p[t] = std::exp(p[t] - mx);
          z += p[t];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t <= s; ++t) {
          const float* vr = pv.get() + d.at(b, t, hk, d.hkv);
          for (int64_t i = 0; i < d.dh; ++i) acc[i] += p[t] * vr[i];
        }
        const float inv = static_cast<float>(1.0 / z);
        float* orow = po.get() + d.at(b, s, h, d.hq);
        for (int64_t i = 0; i < d.dh; ++i) orow[i] = acc[i] * inv;
        plse[(b * d.hq + h) * d.seq + s] = static_cast<float>(static_cast<double>(mx) + std::log(z));
      }
    }
  }
}

// With P = exp(scale * q k^T - lse) (causal), D_s = dout_s . out_s:
//   dv_t += P_st dout_s;  dS_st = P_st (dout_s . v_t - D_s);
//   dq_s += scale dS_st k_t;  dk_t += scale dS_st q_s.
// Query heads of one group all add into their shared kv head's dk, dv.
void attention_backward(const Exec&, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, float scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const AttnDims d = attn_dims(q, k);
  const int64_t group = d.hq / d.hkv;
  F32In pq(q), pk(k), pv(v), po(out), plse(lse), pdo(dout);
  F32Out pdq(dq), pdk(dk), pdv(dv);
  std::fill(pdq.get(), pdq.get() + dq.numel(), 0.0f);
  std::fill(pdk.get(), pdk.get() + dk.numel(), 0.0f);
  std::fill(pdv.get(), pdv.get() + dv.numel(), 0.0f);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t s = 0; s < d.seq; ++s) {
        const float* qr = pq.get() + d.at(b, s, h, d.hq);
        const float* dor = pdo.get() + d.at(b, s, h, d.hq);
        const float* orow = po.get() + d.at(b, s, h, d.hq);
        float* dqr = pdq.get() + d.at(b, s, h, d.hq);
        const float l = plse[(b * d.hq + h) * d.seq + s];
        float delta = 0.0f;
        for (int64_t i = 0; i < d.dh; ++i) delta += dor[i] * orow[i];
        for (int64_t t = 0; t <= s; ++t) {
          const float* kr = pk.get() + d.at(b, t, hk, d.hkv);
          const float* vr = pv.get() + d.at(b, t, hk, d.hkv);
          float dot = 0.0f, dp = 0.0f;
          for (int64_t i = 0; i < d.dh; ++i) {
            dot += qr[i] * kr[i];
            dp += dor[i] * vr[i];
          }
          const float prob = std::exp(dot * scale - l);
          const float ds = prob * (dp - delta) * scale;
          float* dkr = pdk.get() + d.at(b, t, hk, d.hkv);
          float* dvr = pdv.get() + d.at(b, t, hk, d.hkv);
          for (int64_t i = 0; i < d.dh; ++i) {
            dvr[i] += prob * dor[i];
            dqr[i] += ds * kr[i];
            dkr[i] += ds * qr[i];
          }
        }
      }
    }
  }
}

}  // namespace troupe::kernels::cpu
