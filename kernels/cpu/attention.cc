// kernels/cpu/attention.cc — CPU reference of causal grouped-query attention, forward
// (saving the log-sum-exp of each score row) and backward (recomputing probabilities
// from that lse, as flash attention does).
//
// For each (batch, kv head) the keys and values are first copied to [Dh, S] layout, so
// that a query row's scores (and, in backward, its dout . v products) are accumulated as
// contiguous axpy loops over key positions, which the compiler vectorises; the other
// products are axpy loops over Dh. Accumulation is f32, the softmax sum f64.
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
  int64_t at(int64_t b, int64_t s, int64_t head, int64_t heads) const {
    return ((b * seq + s) * heads + head) * dh;
  }
};

AttnDims attn_dims(const Tensor& q, const Tensor& k) {
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
}

// dst [Dh, S] = rows (b, 0..S-1, head) of src [B,S,H,Dh], transposed.
void gather_transposed(const float* src, const AttnDims& d, int64_t b, int64_t head,
                       std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(d.dh * d.seq));
  for (int64_t t = 0; t < d.seq; ++t) {
    const float* row = src + d.at(b, t, head, d.hkv);
    for (int64_t i = 0; i < d.dh; ++i) dst[i * d.seq + t] = row[i];
  }
}

// scores[t] = scale * (q . k_t) for t in [0, n), from kT [Dh, S].
void row_scores(const float* q, const std::vector<float>& kt, int64_t dh, int64_t seq, int64_t n, float scale,
                float* scores) {
  for (int64_t t = 0; t < n; ++t) scores[t] = 0.0f;
  for (int64_t i = 0; i < dh; ++i) {
    const float qi = q[i] * scale;
    const float* krow = kt.data() + i * seq;
    for (int64_t t = 0; t < n; ++t) scores[t] += qi * krow[t];
  }
}

}  // namespace

void attention_forward(const Exec&, const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                       Tensor& out, Tensor& lse) {
  const AttnDims d = attn_dims(q, k);
  const int64_t group = d.hq / d.hkv;
  F32In pq(q), pk(k), pv(v);
  F32Out po(out), plse(lse);
  std::vector<float> kt, p(static_cast<size_t>(d.seq)), acc(static_cast<size_t>(d.dh));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t hk = 0; hk < d.hkv; ++hk) {
      gather_transposed(pk.get(), d, b, hk, kt);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t s = 0; s < d.seq; ++s) {
          const int64_t n = s + 1;  // causal: keys 0..s
          row_scores(pq.get() + d.at(b, s, h, d.hq), kt, d.dh, d.seq, n, scale, p.data());
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) mx = std::max(mx, p[t]);
          double z = 0.0;
          for (int64_t t = 0; t < n; ++t) {
            p[t] = std::exp(p[t] - mx);
            z += p[t];
          }
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t t = 0; t < n; ++t) {
            const float* vr = pv.get() + d.at(b, t, hk, d.hkv);
            const float pt = p[t];
            for (int64_t i = 0; i < d.dh; ++i) acc[i] += pt * vr[i];
          }
          const float inv = static_cast<float>(1.0 / z);
          float* orow = po.get() + d.at(b, s, h, d.hq);
          for (int64_t i = 0; i < d.dh; ++i) orow[i] = acc[i] * inv;
          plse[(b * d.hq + h) * d.seq + s] = static_cast<float>(static_cast<double>(mx) + std::log(z));
        }
      }
    }
  }
}

namespace {
// With P = exp(scale * q k^T - lse) (causal), D_s = dout_s . out_s:
//   dv_t += P_st dout_s;  dS_st = P_st (dout_s . v_t - D_s);
//   dq_s += scale dS_st k_t;  dk_t += scale dS_st q_s.
// Query heads of one group all add into their shared kv head's dk, dv.
void attention_backward_core(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& lse, const Tensor& dout, float scale, Tensor& dq, Tensor& dk,
                             Tensor& dv) {
  const AttnDims d = attn_dims(q, k);
  const int64_t group = d.hq / d.hkv;
  F32In pq(q), pk(k), pv(v), po(out), plse(lse), pdo(dout);
  F32Out pdq(dq), pdk(dk), pdv(dv);
  std::fill(pdq.get(), pdq.get() + dq.numel(), 0.0f);
  std::fill(pdk.get(), pdk.get() + dk.numel(), 0.0f);
  std::fill(pdv.get(), pdv.get() + dv.numel(), 0.0f);
  std::vector<float> kt, vt, p(static_cast<size_t>(d.seq)), dp(static_cast<size_t>(d.seq));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t hk = 0; hk < d.hkv; ++hk) {
      gather_transposed(pk.get(), d, b, hk, kt);
      gather_transposed(pv.get(), d, b, hk, vt);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t s = 0; s < d.seq; ++s) {
          const int64_t n = s + 1;
          const float* qr = pq.get() + d.at(b, s, h, d.hq);
          const float* dor = pdo.get() + d.at(b, s, h, d.hq);
          const float* orow = po.get() + d.at(b, s, h, d.hq);
          float* dqr = pdq.get() + d.at(b, s, h, d.hq);
          const float l = plse[(b * d.hq + h) * d.seq + s];
          float delta = 0.0f;
          for (int64_t i = 0; i < d.dh; ++i) delta += dor[i] * orow[i];
          row_scores(qr, kt, d.dh, d.seq, n, scale, p.data());
          row_scores(dor, vt, d.dh, d.seq, n, 1.0f, dp.data());
          for (int64_t t = 0; t < n; ++t) {
            const float prob = std::exp(p[t] - l);
            const float ds = prob * (dp[t] - delta) * scale;
            const float* kr = pk.get() + d.at(b, t, hk, d.hkv);
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
}
}  // namespace

// The same, then rope_backward on dq and dk where the RoPE that made q and k is given.
void attention_backward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, float scale, Tensor& dq, Tensor& dk,
                        Tensor& dv, const RopeArgs* rope) {
  attention_backward_core(q, k, v, out, lse, dout, scale, dq, dk, dv);
  if (rope == nullptr) return;
  const int64_t tokens = q.size(0) * q.size(1);
  Tensor dq3 = dq.view({tokens, q.size(2), q.size(3)}), dk3 = dk.view({tokens, k.size(2), k.size(3)});
  cpu::rope_backward(ex, dq3, *rope->pos, rope->theta, dq3);
  cpu::rope_backward(ex, dk3, *rope->pos, rope->theta, dk3);
}

}  // namespace troupe::kernels::cpu
