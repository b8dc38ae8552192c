// kernels/cuda/multi_tensor.cu — multi-tensor kernels: one AdamW step over a list of
// parameter tensors (optionally clipped by a norm held on the device), and the sum of
// squares over a list of tensors (the squared global gradient norm used for clipping),
// each as one launch per kMultiTensorMax tensors, returned to the host or left on the
// device; and the per-expert selection counts of the router statistics.
//
// The tensor list travels in the kernel's parameter block (__grid_constant__, ~14 KB; CUDA
// 12.1+ allows 32 KB), so no host-to-device copy precedes the launch. The tensors are seen
// as one virtual concatenation of 4-element groups; a thread finds the tensor of its group
// by binary search over the groups' prefix sums (threads of a warp mostly share a tensor,
// so the parameter-space reads broadcast).
#include <algorithm>

#include "core/cuda/host_wait.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/master_bits.h"

namespace troupe::kernels::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int kMultiReduceBlocks = 1024;

struct AdamWMultiParams {
  AdamWArgs a;
  int count;
  int64_t group_start[kMultiTensorMax + 1];  // prefix sums of ceil(numel / 4)
  int64_t numel[kMultiTensorMax];
  float* param[kMultiTensorMax];
  const void* grad[kMultiTensorMax];
  float* m[kMultiTensorMax];
  float* v[kMultiTensorMax];
  float weight_decay[kMultiTensorMax];
  uint8_t grad_bf16[kMultiTensorMax];
  uint8_t vec_ok[kMultiTensorMax];  // every base pointer aligned for 4-element vector access
  void* work[kMultiTensorMax];      // the working copy written after the update (or nullptr)
  uint8_t work_bf16[kMultiTensorMax];
  // The split master's low halves (or nullptr): the master is (work, work_lo), not param.
  uint16_t* work_lo[kMultiTensorMax];
};

struct SumSquaresMultiParams {
  int count;
  int64_t group_start[kMultiTensorMax + 1];
  int64_t numel[kMultiTensorMax];
  const void* x[kMultiTensorMax];
  uint8_t bf16[kMultiTensorMax];
  uint8_t vec_ok[kMultiTensorMax];  // base pointer aligned for 4-element vector access
  uint8_t plain[kMultiTensorMax];   // sum the elements, not their squares
};

// The last tensor t with group_start[t] <= u (empty tensors are skipped: they share their
// start with the next tensor, and the search returns the largest such index).
__device__ __forceinline__ int tensor_of(const int64_t* group_start, int count, int64_t u) {
  int lo = 0, hi = count;  // group_start[lo] <= u < group_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (group_start[mid] <= u) lo = mid; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ void load4_grad(const void* g, bool bf16, int64_t i, float (&out)[4]) {
  if (bf16) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(g) + i);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    out[0] = __low2float(lo);
    out[1] = __high2float(lo);
    out[2] = __low2float(hi);
    out[3] = __high2float(hi);
  } else {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(g) + i);
    out[0] = f.x;
    out[1] = f.y;
    out[2] = f.z;
    out[3] = f.w;
  }
}

__device__ __forceinline__ float grad_at(const void* g, bool bf16, int64_t i) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(g)[i]) : static_cast<const float*>(g)[i];
}

// The update of one element (same arithmetic as the single-tensor AdamWOp).
__device__ __forceinline__ void adamw_elem(const AdamWArgs& a, float wd, float g, float& p, float& m, float& v) {
  g *= a.grad_scale;
  m = a.beta1 * m + (1.0f - a.beta1) * g;
  v = a.beta2 * v + (1.0f - a.beta2) * g * g;
  const float mhat = m / a.bias_correction1;
  const float vhat = v / a.bias_correction2;
  p -= a.lr * (mhat / (sqrtf(vhat) + a.eps) + wd * p);
}

__global__ void __launch_bounds__(kThreads) adamw_multi_kernel(const __grid_constant__ AdamWMultiParams p) {
  pdl_wait();
  AdamWArgs a = p.a;
  if (a.schedule != nullptr) {  // the step's schedule from the device (CUDA graphs of the step)
    a.lr = a.schedule[0];
    a.bias_correction1 = a.schedule[1];
    a.bias_correction2 = a.schedule[2];
  }
  if (a.clip_sum_squares != nullptr) {  // clipping from a norm that never left the device
    const float n = sqrtf(*a.clip_sum_squares);
    if (a.clip_max_norm > 0.0f && n > a.clip_max_norm) a.grad_scale *= a.clip_max_norm / n;
  }
  const int64_t total = p.group_start[p.count];
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t u = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < total; u += stride) {
    const int t = tensor_of(p.group_start, p.count, u);
    const int64_t i0 = (u - p.group_start[t]) * 4, n = p.numel[t];
    float* pp = p.param[t];
    float* pm = p.m[t];
    float* pv = p.v[t];
    const float wd = p.weight_decay[t];
    const bool bf16 = p.grad_bf16[t] != 0;
    if (uint16_t* lo = p.work_lo[t]; lo != nullptr) {  // the split master (work bf16, vec_ok: 8 B)
      uint16_t* hi = static_cast<uint16_t*>(p.work[t]);
      if (p.vec_ok[t] && i0 + 4 <= n) {
        float g[4];
        load4_grad(p.grad[t], bf16, i0, g);
        const uint2 hw = *reinterpret_cast<const uint2*>(hi + i0),
                    lw = *reinterpret_cast<const uint2*>(lo + i0);
        const uint32_t hs[4] = {hw.x & 0xFFFFu, hw.x >> 16, hw.y & 0xFFFFu, hw.y >> 16};
        const uint32_t ls[4] = {lw.x & 0xFFFFu, lw.x >> 16, lw.y & 0xFFFFu, lw.y >> 16};
        float4 mw = *reinterpret_cast<float4*>(pm + i0);
        float4 vw = *reinterpret_cast<float4*>(pv + i0);
        float* mv[4] = {&mw.x, &mw.y, &mw.z, &mw.w};
        float* vv[4] = {&vw.x, &vw.y, &vw.z, &vw.w};
        uint16_t ho[4], lo4[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float x =
              __uint_as_float(master_join_bits(static_cast<uint16_t>(hs[j]), static_cast<uint16_t>(ls[j])));
          adamw_elem(a, wd, g[j], x, *mv[j], *vv[j]);
          master_split_bits(__float_as_uint(x), ho[j], lo4[j]);
        }
        *reinterpret_cast<float4*>(pm + i0) = mw;
        *reinterpret_cast<float4*>(pv + i0) = vw;
        *reinterpret_cast<uint2*>(hi + i0) =
            make_uint2(ho[0] | (uint32_t{ho[1]} << 16), ho[2] | (uint32_t{ho[3]} << 16));
        *reinterpret_cast<uint2*>(lo + i0) =
            make_uint2(lo4[0] | (uint32_t{lo4[1]} << 16), lo4[2] | (uint32_t{lo4[3]} << 16));
      } else {
        for (int64_t i = i0; i < min64(n, i0 + 4); ++i) {
          float x = __uint_as_float(master_join_bits(hi[i], lo[i]));
          adamw_elem(a, wd, grad_at(p.grad[t], bf16, i), x, pm[i], pv[i]);
          master_split_bits(__float_as_uint(x), hi[i], lo[i]);
        }
      }
      continue;
    }
    if (p.vec_ok[t] && i0 + 4 <= n) {
      float g[4];
      load4_grad(p.grad[t], bf16, i0, g);
      float4 pw = *reinterpret_cast<float4*>(pp + i0);
      float4 mw = *reinterpret_cast<float4*>(pm + i0);
      float4 vw = *reinterpret_cast<float4*>(pv + i0);
      adamw_elem(a, wd, g[0], pw.x, mw.x, vw.x);
      adamw_elem(a, wd, g[1], pw.y, mw.y, vw.y);
      adamw_elem(a, wd, g[2], pw.z, mw.z, vw.z);
      adamw_elem(a, wd, g[3], pw.w, mw.w, vw.w);
      *reinterpret_cast<float4*>(pp + i0) = pw;
      *reinterpret_cast<float4*>(pm + i0) = mw;
      *reinterpret_cast<float4*>(pv + i0) = vw;
      if (p.work[t] != nullptr) {  // vec_ok covers the working copy's alignment too
        if (p.work_bf16[t]) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(pw.x, pw.y), hi = __floats2bfloat162_rn(pw.z, pw.w);
          uint2 raw;
          raw.x = *reinterpret_cast<const uint32_t*>(&lo);
          raw.y = *reinterpret_cast<const uint32_t*>(&hi);
          *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.work[t]) + i0) = raw;
        } else {
          *reinterpret_cast<float4*>(static_cast<float*>(p.work[t]) + i0) = pw;
        }
      }
    } else {
      for (int64_t i = i0; i < min64(n, i0 + 4); ++i) {
        adamw_elem(a, wd, grad_at(p.grad[t], bf16, i), pp[i], pm[i], pv[i]);
        if (p.work[t] != nullptr) {
          if (p.work_bf16[t]) {
            static_cast<__nv_bfloat16*>(p.work[t])[i] = __float2bfloat16_rn(pp[i]);
          } else {
            static_cast<float*>(p.work[t])[i] = pp[i];
          }
        }
      }
    }
  }
}

// Each block sums a contiguous range of groups; a thread finds the tensor once per tensor
// its range touches (not once per group), and reads whole groups with one vector load
// where the tensor allows it, so many loads are in flight per thread. A tensor marked plain
// adds its elements unsquared (partial sums of squares made elsewhere).
__global__ void __launch_bounds__(kThreads) sum_squares_multi_kernel(const __grid_constant__ SumSquaresMultiParams p,
                                                                     double* partials) {
  pdl_wait();
  __shared__ double shared[32];
  const int64_t total = p.group_start[p.count];
  const int64_t per_block = (total + gridDim.x - 1) / gridDim.x;
  const int64_t begin = int64_t{blockIdx.x} * per_block, end = min64(total, begin + per_block);
  double acc = 0.0;
  int64_t u = begin + threadIdx.x;
  while (u < end) {
    const int t = tensor_of(p.group_start, p.count, u);
    const int64_t seg_end = min64(end, p.group_start[t + 1]), n = p.numel[t];
    const int64_t g0 = p.group_start[t];
    const bool bf16 = p.bf16[t] != 0, vec = p.vec_ok[t] != 0;
    if (p.plain[t] != 0) {  // rare and short (slots of partial sums): in double
      for (; u < seg_end; u += blockDim.x) {
        const int64_t i0 = (u - g0) * 4;
        for (int64_t i = i0; i < min64(n, i0 + 4); ++i) acc += grad_at(p.x[t], bf16, i);
      }
      continue;
    }
    float s = 0.0f;  // per tensor segment in f32, then into the double accumulator
#pragma unroll 4
    for (; u < seg_end; u += blockDim.x) {
      const int64_t i0 = (u - g0) * 4;
      if (vec && i0 + 4 <= n) {
        float x[4];
        load4_grad(p.x[t], bf16, i0, x);
        s += x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
      } else {
        for (int64_t i = i0; i < min64(n, i0 + 4); ++i) {
          const float x = grad_at(p.x[t], bf16, i);
          s += x * x;
        }
      }
    }
    acc += s;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// out[0] (+)= the sum of partials[0..n), one block, in a fixed order.
__global__ void __launch_bounds__(kThreads)
    finish_sum_kernel(const double* partials, int n, float* out, bool accumulate) {
  pdl_wait();
  __shared__ double shared[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) out[0] = static_cast<float>(acc + (accumulate ? static_cast<double>(out[0]) : 0.0));
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// The split master's halves, 4 elements a thread where the pointers allow (value 16 B,
// hi and lo 8 B), else one.
__global__ void __launch_bounds__(kThreads)
    master_split_kernel(const float* value, uint16_t* hi, uint16_t* lo, int64_t n, bool vec) {
  pdl_wait();
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t u = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; u * 4 < n; u += stride) {
    const int64_t i0 = u * 4;
    if (vec && i0 + 4 <= n) {
      const uint4 b = *reinterpret_cast<const uint4*>(value + i0);
      uint16_t h[4], l[4];
      master_split_bits(b.x, h[0], l[0]);
      master_split_bits(b.y, h[1], l[1]);
      master_split_bits(b.z, h[2], l[2]);
      master_split_bits(b.w, h[3], l[3]);
      *reinterpret_cast<uint2*>(hi + i0) =
          make_uint2(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16));
      *reinterpret_cast<uint2*>(lo + i0) =
          make_uint2(l[0] | (uint32_t{l[1]} << 16), l[2] | (uint32_t{l[3]} << 16));
    } else {
      for (int64_t i = i0; i < min64(n, i0 + 4); ++i)
        master_split_bits(__float_as_uint(value[i]), hi[i], lo[i]);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    master_join_kernel(const uint16_t* hi, const uint16_t* lo, float* value, int64_t n, bool vec) {
  pdl_wait();
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t u = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; u * 4 < n; u += stride) {
    const int64_t i0 = u * 4;
    if (vec && i0 + 4 <= n) {
      const uint2 h = *reinterpret_cast<const uint2*>(hi + i0), l = *reinterpret_cast<const uint2*>(lo + i0);
      uint4 b;
      b.x = master_join_bits(static_cast<uint16_t>(h.x & 0xFFFFu), static_cast<uint16_t>(l.x & 0xFFFFu));
      b.y = master_join_bits(static_cast<uint16_t>(h.x >> 16), static_cast<uint16_t>(l.x >> 16));
      b.z = master_join_bits(static_cast<uint16_t>(h.y & 0xFFFFu), static_cast<uint16_t>(l.y & 0xFFFFu));
      b.w = master_join_bits(static_cast<uint16_t>(h.y >> 16), static_cast<uint16_t>(l.y >> 16));
      *reinterpret_cast<uint4*>(value + i0) = b;
    } else {
      for (int64_t i = i0; i < min64(n, i0 + 4); ++i)
        value[i] = __uint_as_float(master_join_bits(hi[i], lo[i]));
    }
  }
}

unsigned split_grid(const Env& env, int64_t n) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div(ceil_div(n, 4), kThreads), int64_t{env.num_sms} * 8)));
}

void check_float(DType t, const char* what) {
  TROUPE_CHECK(t == DType::kF32 || t == DType::kBF16, "{}: dtype {} is not supported (f32 or bf16)", what,
               dtype_name(t));
}

}  // namespace

void launch_adamw_multi(const Env& env, int count, float* const* param, const void* const* grad,
                        const DType* grad_type, float* const* m, float* const* v, const int64_t* numel,
                        const float* weight_decay, void* const* work, const DType* work_type,
                        void* const* work_lo, const AdamWArgs& args) {
  for (int first = 0; first < count; first += kMultiTensorMax) {
    const int c = std::min(kMultiTensorMax, count - first);
    AdamWMultiParams p{};
    p.a = args;
    p.count = c;
    p.group_start[0] = 0;
    for (int i = 0; i < c; ++i) {
      const int j = first + i;
      check_float(grad_type[j], "adamw_step_multi grad");
      p.numel[i] = numel[j];
      p.group_start[i + 1] = p.group_start[i] + ceil_div(numel[j], 4);
      p.param[i] = param[j];
      p.grad[i] = grad[j];
      p.m[i] = m[j];
      p.v[i] = v[j];
      p.weight_decay[i] = weight_decay[j];
      p.grad_bf16[i] = grad_type[j] == DType::kBF16 ? 1 : 0;
      const bool grad_ok = grad_type[j] == DType::kBF16 ? reinterpret_cast<uintptr_t>(grad[j]) % 8 == 0
                                                        : aligned16(grad[j]);
      p.work[i] = work != nullptr ? work[j] : nullptr;
      bool work_ok = true;
      if (p.work[i] != nullptr) {
        check_float(work_type[j], "adamw_step_multi work");
        p.work_bf16[i] = work_type[j] == DType::kBF16 ? 1 : 0;
        work_ok = p.work_bf16[i] ? reinterpret_cast<uintptr_t>(work[j]) % 8 == 0 : aligned16(work[j]);
      }
      p.work_lo[i] = work_lo != nullptr ? static_cast<uint16_t*>(work_lo[j]) : nullptr;
      if (p.work_lo[i] != nullptr) {  // the split master: param unused, work bf16
        TROUPE_CHECK(p.work[i] != nullptr && p.work_bf16[i],
                     "adamw_step_multi: a split master needs a bf16 work");
        const bool lo_ok = reinterpret_cast<uintptr_t>(work_lo[j]) % 8 == 0;
        p.vec_ok[i] = aligned16(m[j]) && aligned16(v[j]) && grad_ok && work_ok && lo_ok ? 1 : 0;
        continue;
      }
      p.vec_ok[i] = aligned16(param[j]) && aligned16(m[j]) && aligned16(v[j]) && grad_ok && work_ok ? 1 : 0;
    }
    const int64_t groups = p.group_start[c];
    if (groups == 0) continue;
    const int64_t blocks = std::min<int64_t>(ceil_div(groups, kThreads), int64_t{env.num_sms} * 8);
    launch(env, adamw_multi_kernel, static_cast<unsigned>(blocks), kThreads, 0, p);
    TROUPE_CUDA_LAUNCH_CHECK();
  }
}

void launch_master_split(const Env& env, const float* value, void* hi, void* lo, int64_t n) {
  if (n == 0) return;
  const bool vec = aligned16(value) && reinterpret_cast<uintptr_t>(hi) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(lo) % 8 == 0;
  launch(env, master_split_kernel, split_grid(env, n), kThreads, 0, value, static_cast<uint16_t*>(hi),
         static_cast<uint16_t*>(lo), n, vec);
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_master_join(const Env& env, const void* hi, const void* lo, float* value, int64_t n) {
  if (n == 0) return;
  const bool vec = aligned16(value) && reinterpret_cast<uintptr_t>(hi) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(lo) % 8 == 0;
  launch(env, master_join_kernel, split_grid(env, n), kThreads, 0, static_cast<const uint16_t*>(hi),
         static_cast<const uint16_t*>(lo), value, n, vec);
  TROUPE_CUDA_LAUNCH_CHECK();
}

size_t multi_reduce_scratch_bytes() { return kMultiReduceBlocks * sizeof(double); }

double launch_sum_squares_multi(const Env& env, int count, const void* const* x, const DType* types,
                                const int64_t* numel, void* partials) {
  double total = 0.0;
  for (int first = 0; first < count; first += kMultiTensorMax) {
    const int c = std::min(kMultiTensorMax, count - first);
    SumSquaresMultiParams p{};
    p.count = c;
    p.group_start[0] = 0;
    for (int i = 0; i < c; ++i) {
      const int j = first + i;
      check_float(types[j], "sum_squares_multi");
      p.numel[i] = numel[j];
      p.group_start[i + 1] = p.group_start[i] + ceil_div(numel[j], 4);
      p.x[i] = x[j];
      p.bf16[i] = types[j] == DType::kBF16 ? 1 : 0;
      p.vec_ok[i] = reinterpret_cast<uintptr_t>(x[j]) % (types[j] == DType::kBF16 ? 8 : 16) == 0 ? 1 : 0;
    }
    const int64_t groups = p.group_start[c];
    if (groups == 0) continue;
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>(ceil_div(groups, kThreads), kMultiReduceBlocks));
    launch(env, sum_squares_multi_kernel, blocks, kThreads, 0, p, static_cast<double*>(partials));
    TROUPE_CUDA_LAUNCH_CHECK();
    double host[kMultiReduceBlocks];
    CUDA_CHECK(cudaMemcpyAsync(host, partials, blocks * sizeof(double), cudaMemcpyDeviceToHost, env.stream));
    cuda::host_wait(env.stream);
    for (unsigned i = 0; i < blocks; ++i) total += host[i];  // fixed order: deterministic
  }
  return total;
}

void launch_sum_squares_into(const Env& env, int count, const void* const* x, const DType* types,
                             const int64_t* numel, const uint8_t* plain, void* partials, float* out,
                             bool accumulate) {
  bool acc = accumulate;
  for (int first = 0; first < count; first += kMultiTensorMax) {
    const int c = std::min(kMultiTensorMax, count - first);
    SumSquaresMultiParams p{};
    p.count = c;
    p.group_start[0] = 0;
    for (int i = 0; i < c; ++i) {
      const int j = first + i;
      check_float(types[j], "sum_squares_into");
      p.numel[i] = numel[j];
      p.group_start[i + 1] = p.group_start[i] + ceil_div(numel[j], 4);
      p.x[i] = x[j];
      p.bf16[i] = types[j] == DType::kBF16 ? 1 : 0;
      p.vec_ok[i] = reinterpret_cast<uintptr_t>(x[j]) % (types[j] == DType::kBF16 ? 8 : 16) == 0 ? 1 : 0;
      p.plain[i] = plain != nullptr && plain[j] != 0 ? 1 : 0;
    }
    const int64_t groups = p.group_start[c];
    if (groups == 0) continue;
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>(ceil_div(groups, kThreads), kMultiReduceBlocks));
    launch(env, sum_squares_multi_kernel, blocks, kThreads, 0, p, static_cast<double*>(partials));
    TROUPE_CUDA_LAUNCH_CHECK();
    launch(env, finish_sum_kernel, 1, kThreads, 0, static_cast<const double*>(partials),
           static_cast<int>(blocks), out, acc);
    TROUPE_CUDA_LAUNCH_CHECK();
    acc = true;
  }
  if (!acc) CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), env.stream));  // no elements, not accumulating
}

}  // namespace troupe::kernels::gpu
