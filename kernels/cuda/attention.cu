// kernels/cuda/attention.cu — causal grouped-query attention, forward and backward,
// flash-style: scores live only in registers, tiles of K/V (or Q/dO) in shared memory,
// the softmax is computed online, and only the per-row log-sum-exp is saved. Nothing of
// size S x S ever touches device memory.
//
// Layout: q [B,S,Hq,Dh], k/v [B,S,Hkv,Dh], lse f32 [B,Hq,S]. Head dims up to 128.
// Four threads share one query (or key) row, each holding every fourth element of the
// head dimension in registers; dot products are finished with two warp shuffles.
// Backward is two kernels, neither with atomics: dK/dV (one block per key tile and kv
// head, looping over the query heads of its group) and dQ (one block per query tile),
// after a pre-pass computing D = rowsum(dO * O). The arithmetic here is fp32 FMA: it
// serves f32 tensors and head dims other than 64/128; bf16 with head dim 64 or 128 goes
// to the tensor-core kernels of attention_mma.cu (and on Hopper attention_hopper.cu).
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

// attention_mma.cu: the tensor-core kernels (bf16, head dim 64 or 128).
bool attention_mma_supported(const AttentionShape& s, DType t, std::initializer_list<const void*> ptrs);
void launch_attention_forward_mma(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                  const void* v, float scale, void* out, float* lse, int variant);
// Returns whether dq and dk were rotated back by the kernels (rope given, fused Hopper path).
bool launch_attention_backward_mma(const Env& env, const AttentionShape& s, const void* q, const void* k,
                                   const void* v, const void* out, const float* lse, const void* dout,
                                   float scale, void* dq, void* dk, void* dv, void* scratch, int variant,
                                   const AttentionRope* rope);

namespace {

constexpr int kTile = 32;
constexpr int kParts = 4;
constexpr int kAttnThreads = kTile * kParts;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Loads rows [r0, r0 + kTile) of a [B,S,H,Dh] tensor (batch b, head h) into smem [kTile][Dh]
// as floats; rows past S are zero.
template <typename T>
__device__ void load_rows(float* dst, const T* src, int64_t b, int64_t r0, int64_t h, const AttentionShape& s,
                          int64_t heads) {
  const int64_t dh = s.head_dim;
  for (int64_t e = threadIdx.x; e < kTile * dh; e += blockDim.x) {
    const int64_t r = r0 + e / dh, d = e % dh;
    dst[e] = r < s.seq ? to_float(src[((b * s.seq + r) * heads + h) * dh + d]) : 0.0f;
  }
}

template <typename T, int kPer>
__device__ void load_row_regs(float (&reg)[kPer], const T* src, int64_t dh, int part, float mul) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = part + kParts * j;
    reg[j] = d < dh ? to_float(src[d]) * mul : 0.0f;
  }
}

template <int kPer>
__device__ __forceinline__ float partial_dot(const float (&reg)[kPer], const float* row, int64_t dh, int part) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = part + kParts * j;
    if (d < dh) acc += reg[j] * row[d];
  }
  return acc;
}

template <int kPer>
__device__ __forceinline__ void axpy_row(float (&reg)[kPer], float a, const float* row, int64_t dh, int part) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = part + kParts * j;
    if (d < dh) reg[j] += a * row[d];
  }
}

template <typename T, int kPer>
__device__ void store_row_regs(T* dst, const float (&reg)[kPer], int64_t dh, int part, float mul) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = part + kParts * j;
    if (d < dh) dst[d] = from_float<T>(reg[j] * mul);
  }
}

// grid (ceil(S/kTile), Hq, B)
template <typename T, int kPer>
__global__ void __launch_bounds__(kAttnThreads) attention_forward_kernel(AttentionShape s, const T* q, const T* k,
                                                                         const T* v, float scale, T* out, float* lse) {
  pdl_wait();
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * s.head_dim;
  const int64_t dh = s.head_dim, b = blockIdx.z, h = blockIdx.y, hk = h / (s.q_heads / s.kv_heads);
  const int qi = threadIdx.x / kParts, part = threadIdx.x % kParts;
  const int64_t q0 = int64_t{blockIdx.x} * kTile, iq = q0 + qi;
  const bool valid = iq < s.seq;
  const int64_t row = ((b * s.seq + (valid ? iq : 0)) * s.q_heads + h) * dh;
  float qr[kPer], acc[kPer];
  load_row_regs<T, kPer>(qr, q + row, dh, part, scale * kLog2e);  // scores in log2 units
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t last_key = min64(s.seq - 1, q0 + kTile - 1);
  for (int64_t k0 = 0; k0 <= last_key; k0 += kTile) {
    __syncthreads();
    load_rows(ks, k, b, k0, hk, s, s.kv_heads);
    load_rows(vs, v, b, k0, hk, s, s.kv_heads);
    __syncthreads();
    const int n = static_cast<int>(min64(kTile, s.seq - k0));
    for (int j = 0; j < n; ++j) {
      const float sc = quad_sum(partial_dot(qr, ks + j * dh, dh, part));
      if (valid && k0 + j <= iq) {
        if (sc > m) {
          const float corr = exp2f(m - sc);
          l *= corr;
#pragma unroll
          for (int x = 0; x < kPer; ++x) acc[x] *= corr;
          m = sc;
        }
        const float p = exp2f(sc - m);
        l += p;
        axpy_row(acc, p, vs + j * dh, dh, part);
      }
    }
  }
  if (!valid) return;
  store_row_regs<T, kPer>(out + row, acc, dh, part, 1.0f / l);
  if (part == 0) lse[(b * s.q_heads + h) * s.seq + iq] = (m + log2f(l)) * kLn2;
}

// D[b,h,i] = sum_d dO * O, one warp per row.
template <typename T>
__global__ void attention_rowdot_kernel(AttentionShape s, const T* out, const T* dout, float* dsum) {
  pdl_wait();
  const int64_t rows = s.batch * s.seq * s.q_heads;
  const int64_t r = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float acc = 0.0f;
  for (int64_t d = lane; d < s.head_dim; d += 32) acc += to_float(out[r * s.head_dim + d]) * to_float(dout[r * s.head_dim + d]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = r % s.q_heads, bi = r / s.q_heads, b = bi / s.seq, i = bi % s.seq;
    dsum[(b * s.q_heads + h) * s.seq + i] = acc;
  }
}

// The same with 16-byte packs (head_dim a multiple of 8, rows 16-byte aligned): kRowLanes
// lanes per row, each a pack of out and dout at a time.
constexpr int kRowLanes = 8;
template <typename T>
__global__ void attention_rowdot_packed_kernel(AttentionShape s, const T* out, const T* dout, float* dsum) {
  pdl_wait();
  const int64_t rows = s.batch * s.seq * s.q_heads;
  const int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t r = t / kRowLanes;
  const int part = static_cast<int>(t % kRowLanes);
  float acc = 0.0f;
  if (r < rows) {
    for (int64_t d = part * 8; d < s.head_dim; d += kRowLanes * 8) {
      float o[8], g[8];
      load_floats<8>(out + r * s.head_dim + d, o);
      load_floats<8>(dout + r * s.head_dim + d, g);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc += o[j] * g[j];
    }
  }
#pragma unroll
  for (int o = kRowLanes / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);  // whole warps
  if (r < rows && part == 0) {
    const int64_t h = r % s.q_heads, bi = r / s.q_heads, b = bi / s.seq, i = bi % s.seq;
    dsum[(b * s.q_heads + h) * s.seq + i] = acc;
  }
}

// grid (ceil(S/kTile), Hkv, B): dK, dV for one key tile, summed over the group's heads.
template <typename T, int kPer>
__global__ void __launch_bounds__(kAttnThreads) attention_dkdv_kernel(AttentionShape s, const T* q, const T* k,
                                                                      const T* v, const float* lse, const T* dout,
                                                                      const float* dsum, float scale, T* dk, T* dv) {
  pdl_wait();
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = smem + kTile * s.head_dim;
  float* lse2 = dos + kTile * s.head_dim;
  float* ds_row = lse2 + kTile;
  const int64_t dh = s.head_dim, b = blockIdx.z, hk = blockIdx.y, group = s.q_heads / s.kv_heads;
  const int ki = threadIdx.x / kParts, part = threadIdx.x % kParts;
  const int64_t k0 = int64_t{blockIdx.x} * kTile, ik = k0 + ki;
  const bool valid = ik < s.seq;
  const int64_t row = ((b * s.seq + (valid ? ik : 0)) * s.kv_heads + hk) * dh;
  float kr[kPer], vr[kPer], dkr[kPer], dvr[kPer];
  load_row_regs<T, kPer>(kr, k + row, dh, part, scale * kLog2e);
  load_row_regs<T, kPer>(vr, v + row, dh, part, 1.0f);
#pragma unroll
  for (int j = 0; j < kPer; ++j) dkr[j] = dvr[j] = 0.0f;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    for (int64_t q0 = k0; q0 < s.seq; q0 += kTile) {
      __syncthreads();
      load_rows(qs, q, b, q0, h, s, s.q_heads);
      load_rows(dos, dout, b, q0, h, s, s.q_heads);
      for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
        const int64_t iq = q0 + i;
        lse2[i] = iq < s.seq ? lse[(b * s.q_heads + h) * s.seq + iq] * kLog2e : 0.0f;
        ds_row[i] = iq < s.seq ? dsum[(b * s.q_heads + h) * s.seq + iq] : 0.0f;
      }
      __syncthreads();
      const int n = static_cast<int>(min64(kTile, s.seq - q0));
      for (int i = 0; i < n; ++i) {
        const float sc = quad_sum(partial_dot(kr, qs + i * dh, dh, part));
        const float dp = quad_sum(partial_dot(vr, dos + i * dh, dh, part));
        if (valid && ik <= q0 + i) {
          const float p = exp2f(sc - lse2[i]);
          axpy_row(dvr, p, dos + i * dh, dh, part);
          axpy_row(dkr, p * (dp - ds_row[i]), qs + i * dh, dh, part);
        }
      }
    }
  }
  if (!valid) return;
  store_row_regs<T, kPer>(dk + row, dkr, dh, part, scale);
  store_row_regs<T, kPer>(dv + row, dvr, dh, part, 1.0f);
}

// grid (ceil(S/kTile), Hq, B)
template <typename T, int kPer>
__global__ void __launch_bounds__(kAttnThreads) attention_dq_kernel(AttentionShape s, const T* q, const T* k,
                                                                    const T* v, const float* lse, const T* dout,
                                                                    const float* dsum, float scale, T* dq) {
  pdl_wait();
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * s.head_dim;
  const int64_t dh = s.head_dim, b = blockIdx.z, h = blockIdx.y, hk = h / (s.q_heads / s.kv_heads);
  const int qi = threadIdx.x / kParts, part = threadIdx.x % kParts;
  const int64_t q0 = int64_t{blockIdx.x} * kTile, iq = q0 + qi;
  const bool valid = iq < s.seq;
  const int64_t row = ((b * s.seq + (valid ? iq : 0)) * s.q_heads + h) * dh;
  float qr[kPer], dor[kPer], dqr[kPer];
  load_row_regs<T, kPer>(qr, q + row, dh, part, scale * kLog2e);
  load_row_regs<T, kPer>(dor, dout + row, dh, part, 1.0f);
#pragma unroll
  for (int j = 0; j < kPer; ++j) dqr[j] = 0.0f;
  const int64_t stat = (b * s.q_heads + h) * s.seq + (valid ? iq : 0);
  const float l2 = lse[stat] * kLog2e, di = dsum[stat];
  const int64_t last_key = min64(s.seq - 1, q0 + kTile - 1);
  for (int64_t k0 = 0; k0 <= last_key; k0 += kTile) {
    __syncthreads();
    load_rows(ks, k, b, k0, hk, s, s.kv_heads);
    load_rows(vs, v, b, k0, hk, s, s.kv_heads);
    __syncthreads();
    const int n = static_cast<int>(min64(kTile, s.seq - k0));
    for (int j = 0; j < n; ++j) {
      const float sc = quad_sum(partial_dot(qr, ks + j * dh, dh, part));
      const float dp = quad_sum(partial_dot(dor, vs + j * dh, dh, part));
      if (valid && k0 + j <= iq) axpy_row(dqr, exp2f(sc - l2) * (dp - di), ks + j * dh, dh, part);
    }
  }
  if (!valid) return;
  store_row_regs<T, kPer>(dq + row, dqr, dh, part, scale);
}

template <typename F>
void dispatch_head_dim(int64_t dh, F&& f) {
  TROUPE_CHECK(dh > 0 && dh <= 128, "attention on cuda supports head dims 1..128, got {}", dh);
  if (dh <= 32) {
    f(std::integral_constant<int, 8>{});
  } else if (dh <= 64) {
    f(std::integral_constant<int, 16>{});
  } else {
    f(std::integral_constant<int, 32>{});
  }
}

dim3 attention_grid(const AttentionShape& s, int64_t heads) {
  return dim3(static_cast<unsigned>(ceil_div(s.seq, kTile)), static_cast<unsigned>(heads),
              static_cast<unsigned>(s.batch));
}

}  // namespace

void launch_attention_forward(const Env& env, const AttentionShape& s, const void* q, const void* k,
                              const void* v, float scale, void* out, float* lse, DType t, int variant) {
  if (s.batch * s.seq * s.q_heads == 0) return;
  if (attention_mma_supported(s, t, {q, k, v, out})) {
    launch_attention_forward_mma(env, s, q, k, v, scale, out, lse, variant);
    return;
  }
  const size_t smem = 2 * kTile * s.head_dim * sizeof(float);
  dispatch_head_dim(s.head_dim, [&](auto per) {
    TROUPE_DISPATCH_FLOAT(t, T, "attention_forward", {
      launch(env, attention_forward_kernel<T, per()>, attention_grid(s, s.q_heads), kAttnThreads, smem, s,
             static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), scale,
             static_cast<T*>(out), lse);
    });
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_attention_rowdot(const Env& env, const AttentionShape& s, const void* out, const void* dout, float* dsum,
                             DType t) {
  const int64_t rows = s.batch * s.seq * s.q_heads;
  TROUPE_DISPATCH_FLOAT(t, T, "attention_backward", {
    if (s.head_dim % 8 == 0 && aligned_to(out, 8 * sizeof(T)) && aligned_to(dout, 8 * sizeof(T))) {
      launch(env, attention_rowdot_packed_kernel<T>, static_cast<unsigned>(ceil_div(rows * kRowLanes, 256)),
             256, 0, s, static_cast<const T*>(out), static_cast<const T*>(dout), dsum);
    } else {
      launch(env, attention_rowdot_kernel<T>, static_cast<unsigned>(ceil_div(rows * 32, 256)), 256, 0, s,
             static_cast<const T*>(out), static_cast<const T*>(dout), dsum);
    }
  });
  TROUPE_CUDA_LAUNCH_CHECK();
}

size_t attention_dsum_floats(const AttentionShape& s) {
  return static_cast<size_t>(ceil_div(s.batch * s.q_heads * s.seq, 64) * 64);  // 256-byte multiple
}

namespace {
bool fused_hopper_backward(const AttentionShape& s, bool fused_dq) {
  return fused_dq && attention_hopper_available(s);
}
}  // namespace

size_t attention_rope_bytes(const AttentionShape& s, bool fused_dq) {
  return fused_hopper_backward(s, fused_dq)
             ? static_cast<size_t>(s.batch * s.seq * (s.head_dim / 2)) * sizeof(float2)
             : 0;
}

size_t attention_backward_scratch_bytes(const AttentionShape& s, bool fused_dq, bool rope) {
  // The fused Hopper backward also adds dQ into an f32 buffer after D (and with rope reads
  // its rotation table after that).
  const bool fused = fused_hopper_backward(s, fused_dq);
  return attention_dsum_floats(s) * sizeof(float) + (fused ? attention_fused_dq_bytes(s) : 0) +
         (rope ? attention_rope_bytes(s, fused_dq) : 0);
}

void launch_attention_backward(const Env& env, const AttentionShape& s, const void* q, const void* k,
                               const void* v, const void* out, const float* lse, const void* dout,
                               float scale, void* dq, void* dk, void* dv, DType t, void* scratch, int variant,
                               const AttentionRope* rope) {
  if (s.batch * s.seq * s.q_heads == 0) return;
  // Where the kernels did not rotate dq and dk back themselves: launch_rope, inverse.
  const auto rope_after = [&] {
    if (rope == nullptr) return;
    const int64_t tokens = s.batch * s.seq;
    launch_rope(env, dq, rope->pos, rope->theta, tokens, s.q_heads, s.head_dim, dq, t, /*inverse=*/true);
    launch_rope(env, dk, rope->pos, rope->theta, tokens, s.kv_heads, s.head_dim, dk, t, /*inverse=*/true);
  };
  if (attention_mma_supported(s, t, {q, k, v, out, dout, dq, dk, dv})) {
    if (!launch_attention_backward_mma(env, s, q, k, v, out, lse, dout, scale, dq, dk, dv, scratch, variant,
                                       rope)) {
      rope_after();
    }
    return;
  }
  float* dsum = static_cast<float*>(scratch);
  const size_t smem_kv = 2 * kTile * s.head_dim * sizeof(float);
  const size_t smem_q = smem_kv + 2 * kTile * sizeof(float);
  dispatch_head_dim(s.head_dim, [&](auto per) {
    TROUPE_DISPATCH_FLOAT(t, T, "attention_backward", {
      const T* qp = static_cast<const T*>(q);
      const T* kp = static_cast<const T*>(k);
      const T* vp = static_cast<const T*>(v);
      const T* dop = static_cast<const T*>(dout);
      launch_attention_rowdot(env, s, out, dout, dsum, t);
      launch(env, attention_dkdv_kernel<T, per()>, attention_grid(s, s.kv_heads), kAttnThreads, smem_q, s, qp,
             kp, vp, lse, dop, dsum, scale, static_cast<T*>(dk), static_cast<T*>(dv));
      TROUPE_CUDA_LAUNCH_CHECK();
      launch(env, attention_dq_kernel<T, per()>, attention_grid(s, s.q_heads), kAttnThreads, smem_kv, s, qp,
             kp, vp, lse, dop, dsum, scale, static_cast<T*>(dq));
    });
  });
  TROUPE_CUDA_LAUNCH_CHECK();
  rope_after();
}

}  // namespace troupe::kernels::gpu
