// bench/kernels/kernel_bench.cc — times every hot CUDA kernel of Troupe on the shapes of
// bench_1b (d_model 1024, 16 heads of 64, 16 experts top-2, expert FFN 2048, seq 2048,
// micro-batch 8 => 16384 tokens) and prints, per kernel, the median time, the achieved
// TFLOP/s or GB/s with the formula used, and the fraction of the peak (989 TFLOP/s dense
// bf16; for bandwidth, the device-to-device copy bandwidth measured first).
//
// Output: a human table, plus one machine line per kernel "RESULT <name> <ms>" that
// bench/kernels/compare.py joins with torch_kernels.py's "TORCH <name> <ms>" lines.
// Inputs are random (never zeros); each kernel gets 3 warm-up runs and 15 timed runs.
// KERNEL_BENCH_ONLY=<substring> times only the kernels whose name contains it (the inputs
// of the others are still made: about 15 s on the GPU host).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/caching_allocator.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/stream.h"
#include "core/gpu_check.h"
#include "core/peak_flops.h"
#include "kernels/backend.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/launch.h"

namespace troupe::kernels {
namespace {

constexpr double kPeakBf16Tflops = kPeakBf16FlopsPerGpu / 1e12;
constexpr int64_t kD = 1024, kHeads = 16, kHeadDim = 64, kExperts = 16, kTopK = 2, kFfn = 2048, kSeq = 2048,
                  kBatch = 8, kVocab = 32768;
constexpr int64_t kTokens = kSeq * kBatch;

struct Bench {
  CudaContext& ctx;
  Allocator& alloc;
  Exec ex;
  const Backend& be;
  double copy_gbs = 0.0;
  std::mt19937 gen{12345};
  std::string only = std::getenv("KERNEL_BENCH_ONLY") ? std::getenv("KERNEL_BENCH_ONLY") : "";

  bool skipped(const std::string& name) const {
    return !only.empty() && name.find(only) == std::string::npos;
  }

  // Uniform in [lo, hi) from a splitmix64 stream seeded by gen, a few ns an element: with
  // uniform_real_distribution a filtered run spent 30-40 s making its inputs.
  Tensor random(const Shape& shape, DType dt, float lo = -1.0f, float hi = 1.0f) {
    Tensor host = Tensor::empty(shape, DType::kF32);
    float* p = host.data<float>();
    uint64_t x = (uint64_t{gen()} << 32) | gen();
    const float step = (hi - lo) * 0x1.0p-24f;
    const int64_t n = host.numel();
    for (int64_t i = 0; i < n; i += 2) {
      uint64_t z = (x += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      p[i] = lo + static_cast<float>(z >> 40) * step;
      if (i + 1 < n) p[i + 1] = lo + static_cast<float>((z >> 8) & 0xffffffu) * step;
    }
    Tensor f32 = cuda::to_device(host, alloc, ctx.stream);
    if (dt == DType::kF32) return f32;
    Tensor out = Tensor::empty(shape, dt, alloc);
    be.cast(ex, f32, out);
    return out;
  }
  Tensor ints(const Shape& shape, const std::vector<int32_t>& v) {
    return cuda::to_device(Tensor::from_ints(shape, v), alloc, ctx.stream);
  }
  Tensor empty(const Shape& shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt, alloc);
    be.fill(ex, t, 0.5f);
    return t;
  }

  double time_ms(const std::function<void()>& fn, int warmup = 3, int reps = 15) {
    for (int i = 0; i < warmup; ++i) fn();
    auto start = cuda::CudaEvent::create(ctx.device), stop = cuda::CudaEvent::create(ctx.device);
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      start.record(ctx.stream);
      fn();
      stop.record(ctx.stream);
      stop.synchronize();
      ms.push_back(cuda::CudaEvent::elapsed_ms(start, stop));
    }
    CUDA_CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  void flops(const std::string& name, double flop, const std::string& formula,
             const std::function<void()>& fn) {
    if (skipped(name)) return;
    const double ms = time_ms(fn);
    const double tflops = flop / (ms * 1e-3) / 1e12;
    std::printf("%-30s %9.3f ms %8.1f TFLOP/s %5.1f%% of %.0f   [%s]\n", name.c_str(), ms, tflops,
                100.0 * tflops / kPeakBf16Tflops, kPeakBf16Tflops, formula.c_str());
    std::printf("RESULT %s %.4f\n", name.c_str(), ms);
  }

  void bytes(const std::string& name, double nbytes, const std::string& formula,
             const std::function<void()>& fn) {
    if (skipped(name)) return;
    const double ms = time_ms(fn);
    const double gbs = nbytes / (ms * 1e-3) / 1e9;
    std::printf("%-30s %9.3f ms %8.1f GB/s    %5.1f%% of copy %.0f GB/s   [%s]\n", name.c_str(), ms, gbs,
                100.0 * gbs / copy_gbs, copy_gbs, formula.c_str());
    std::printf("RESULT %s %.4f\n", name.c_str(), ms);
  }
};

// Offsets [E+1] of `rows` rows over `experts` experts: `first` of them to expert 0 and the
// rest spread evenly (first = rows / experts: a balanced load).
std::vector<int32_t> load_offsets(int64_t rows, int64_t experts, int64_t first) {
  std::vector<int32_t> off(static_cast<size_t>(experts + 1));
  off[0] = 0;
  off[1] = static_cast<int32_t>(first);
  for (int64_t e = 1; e < experts; ++e) {
    off[static_cast<size_t>(e + 1)] = static_cast<int32_t>(first + (rows - first) * e / (experts - 1));
  }
  return off;
}

// The six expert GEMMs of a MoE layer (up/down forward, dx, dW with f32 accumulation) on one
// load, named grouped_<tag>_{up,down,up_dx,down_dx,up_dw,down_dw} (torch_kernels.py times
// torch._grouped_mm on the same shapes and offsets).
void grouped_set(Bench& b, const std::string& tag, int64_t experts, int64_t ffn,
                 const std::vector<int32_t>& off) {
  const DType bf = DType::kBF16;
  const int64_t rows = off.back();
  Tensor offsets = b.ints({experts + 1}, off);
  Tensor xp = b.random({rows, kD}, bf), w1 = b.random({experts, kD, 2 * ffn}, bf, -0.05f, 0.05f);
  Tensor h = b.empty({rows, 2 * ffn}, bf);
  const double f1 = 2.0 * rows * kD * 2 * ffn, f2 = 2.0 * rows * ffn * kD;
  const std::string g = "grouped_" + tag + "_";
  b.flops(g + "up", f1, "2*rows*N*K", [&] { b.be.grouped_matmul(b.ex, xp, w1, offsets, h, false); });
  Tensor a = b.random({rows, ffn}, bf), w2 = b.random({experts, ffn, kD}, bf, -0.05f, 0.05f);
  Tensor y = b.empty({rows, kD}, bf);
  b.flops(g + "down", f2, "2*rows*N*K", [&] { b.be.grouped_matmul(b.ex, a, w2, offsets, y, false); });
  Tensor dxp = b.empty({rows, kD}, bf), dw1 = b.empty({experts, kD, 2 * ffn}, DType::kF32);
  b.flops(g + "up_dx", f1, "2*rows*N*K", [&] {
    b.be.grouped_matmul_backward(b.ex, xp, w1, offsets, h, &dxp, nullptr, false, false, nullptr);
  });
  b.flops(g + "up_dw", f1, "2*rows*N*K", [&] {
    b.be.grouped_matmul_backward(b.ex, xp, w1, offsets, h, nullptr, &dw1, false, true, nullptr);
  });
  Tensor da = b.empty({rows, ffn}, bf), dw2 = b.empty({experts, ffn, kD}, DType::kF32);
  b.flops(g + "down_dx", f2, "2*rows*N*K", [&] {
    b.be.grouped_matmul_backward(b.ex, a, w2, offsets, y, &da, nullptr, false, false, nullptr);
  });
  b.flops(g + "down_dw", f2, "2*rows*N*K", [&] {
    b.be.grouped_matmul_backward(b.ex, a, w2, offsets, y, nullptr, &dw2, false, true, nullptr);
  });
}

// Each tensor-core attention kernel by name on one shape: attention_{fwd,bwd}_mma4 and
// _mma8 (mma.sync, 4 or 8 warps per block) and _hopper where it runs, suffixed `tag`.
void attention_variants(Bench& b, CudaContext& ctx, const gpu::AttentionShape& shape, double fwd,
                        const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const std::string& tag) {
  const DType bf = DType::kBF16;
  const gpu::Env env{ctx.stream, ctx.num_sms};
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  Tensor scratch =
      b.empty({static_cast<int64_t>(gpu::attention_backward_scratch_bytes(shape) / 4) + 1}, DType::kF32);
  std::vector<std::pair<std::string, int>> variants = {{"mma4", 4}, {"mma8", 8}};
  if (gpu::attention_hopper_available(shape)) {
    variants.emplace_back("hopper", gpu::kAttentionHopper);
    variants.emplace_back("hopper_split_dq", gpu::kAttentionHopperSplitDq);
    if (shape.head_dim == 64) variants.emplace_back("hopper_fwd2", gpu::kAttentionHopperFwd2);
  }
  for (const auto& [name, variant] : variants) {
    b.flops("attention_fwd_" + name + tag, fwd, "4*B*H*S^2*Dh/2", [&] {
      gpu::launch_attention_forward(env, shape, q.data_ptr(), k.data_ptr(), v.data_ptr(), scale,
                                    out.data_ptr(), static_cast<float*>(lse.data_ptr()), bf, variant);
    });
    b.flops("attention_bwd_" + name + tag, 2.5 * fwd, "2.5*fwd", [&] {
      gpu::launch_attention_backward(env, shape, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                     static_cast<const float*>(lse.data_ptr()), dout.data_ptr(), scale,
                                     dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), bf, scratch.data_ptr(),
                                     variant);
    });
  }
}

void run() {
  const int dev = 0;
  CUDA_CHECK(cudaSetDevice(dev));
  cuda::CudaStream stream = cuda::CudaStream::create(dev);
  cuda::CudaCachingAllocator alloc(dev);
  CudaContext ctx(dev, stream.get());
  const Backend& be = *cuda_backend();
  Bench b{ctx, alloc, Exec{Device::cuda(dev), &ctx}, be};
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6);

  // Copy bandwidth (bytes read + written) of a 2 GiB device-to-device copy.
  {
    const size_t n = size_t{1} << 31;
    cuda::DeviceBuffer src(n, dev), dst(n, dev);
    CUDA_CHECK(cudaMemsetAsync(src.data(), 1, n, ctx.stream));
    const double ms = b.time_ms([&] {
      CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), n, cudaMemcpyDeviceToDevice, ctx.stream));
    });
    b.copy_gbs = 2.0 * n / (ms * 1e-3) / 1e9;
    std::printf("%-30s %9.3f ms %8.1f GB/s    (2 x 2 GiB / t)\n", "copy_d2d", ms, b.copy_gbs);
    std::printf("RESULT copy_d2d %.4f\n", ms);
  }

  const DType bf = DType::kBF16;
  const double T = kTokens;
  // ---- dense GEMMs (cuBLASLt) ----
  {
    Tensor x = b.random({kTokens, kD}, bf), wqkv = b.random({kD, 3 * kD}, bf, -0.05f, 0.05f);
    Tensor qkv = b.empty({kTokens, 3 * kD}, bf);
    b.flops("gemm_qkv_16384x3072x1024", 2 * T * kD * 3 * kD, "2*M*N*K",
            [&] { be.matmul(b.ex, x, wqkv, qkv, false, false, 1.0f, 0.0f); });
    Tensor wo = b.random({kD, kD}, bf, -0.05f, 0.05f), o = b.empty({kTokens, kD}, bf);
    b.flops("gemm_out_16384x1024x1024", 2 * T * kD * kD, "2*M*N*K",
            [&] { be.matmul(b.ex, x, wo, o, false, false, 1.0f, 0.0f); });
    // Weight gradient: dW [K,N] = x^T @ dout, accumulated in f32.
    Tensor dw = b.empty({kD, 3 * kD}, DType::kF32);
    b.flops("gemm_dw_qkv_tn_f32acc", 2 * T * kD * 3 * kD, "2*M*N*K",
            [&] { be.matmul(b.ex, x, qkv, dw, true, false, 1.0f, 1.0f); });
    Tensor dx = b.empty({kTokens, kD}, bf);
    b.flops("gemm_dx_qkv_nt", 2 * T * kD * 3 * kD, "2*M*N*K",
            [&] { be.matmul(b.ex, qkv, wqkv, dx, false, true, 1.0f, 0.0f); });
  }
  {
    Tensor x = b.random({kTokens, kD}, bf), wlm = b.random({kD, kVocab}, bf, -0.05f, 0.05f);
    Tensor logits = b.empty({kTokens, kVocab}, bf);
    b.flops("gemm_lm_head_16384x32768x1024", 2 * T * kD * kVocab, "2*M*N*K",
            [&] { be.matmul(b.ex, x, wlm, logits, false, false, 1.0f, 0.0f); });
  }
  // ---- grouped expert GEMMs ----
  {
    const int64_t rows = kTokens * kTopK;
    std::vector<int32_t> off(kExperts + 1);
    std::mt19937 g(7);
    std::vector<double> w(kExperts);
    double tot = 0;
    for (auto& v : w) tot += (v = 0.6 + std::uniform_real_distribution<double>(0, 0.8)(g));
    int64_t acc = 0;
    for (int64_t e = 0; e < kExperts; ++e) {
      off[e] = static_cast<int32_t>(acc);
      acc += e + 1 == kExperts ? rows - acc : static_cast<int64_t>(rows * w[e] / tot);
    }
    off[kExperts] = static_cast<int32_t>(rows);
    Tensor offsets = b.ints({kExperts + 1}, off);
    Tensor xp = b.random({rows, kD}, bf), w1 = b.random({kExperts, kD, 2 * kFfn}, bf, -0.05f, 0.05f);
    Tensor h = b.empty({rows, 2 * kFfn}, bf);
    const double f1 = 2.0 * rows * kD * 2 * kFfn;
    b.flops("grouped_up_32768x4096x1024", f1, "2*rows*N*K",
            [&] { be.grouped_matmul(b.ex, xp, w1, offsets, h, false); });
    Tensor a = b.random({rows, kFfn}, bf), w2 = b.random({kExperts, kFfn, kD}, bf, -0.05f, 0.05f);
    Tensor y = b.empty({rows, kD}, bf);
    const double f2 = 2.0 * rows * kFfn * kD;
    b.flops("grouped_down_32768x1024x2048", f2, "2*rows*N*K",
            [&] { be.grouped_matmul(b.ex, a, w2, offsets, y, false); });
    // The other configurations of the grouped kernel (the backend runs kAuto: on an sm_90a
    // build on Hopper kWgmmaTma for forward, dx and f32 dW, kWgmma256 for a bf16 dW, mma.sync
    // 2 x 2 elsewhere).
    const gpu::Env env{ctx.stream, ctx.num_sms};
    const auto* off_p = static_cast<const int32_t*>(offsets.data_ptr());
    const std::pair<const char*, gpu::GemmTiling> variants[] = {{"mma2x2", gpu::GemmTiling::kWarps2x2},
                                                                {"wgmma128", gpu::GemmTiling::kWgmma128},
                                                                {"wgmma256", gpu::GemmTiling::kWgmma256},
                                                                {"wgmmatma", gpu::GemmTiling::kWgmmaTma}};
    for (const auto& [name, tiling] : variants) {
      const gpu::GemmTiling tl = tiling;
      b.flops(std::string("grouped_up_") + name, f1, "2*rows*N*K", [&] {
        gpu::launch_grouped_matmul(env, xp.data_ptr(), w1.data_ptr(), off_p, rows, kExperts, kD, 2 * kFfn,
                                   false, h.data_ptr(), bf, tl);
      });
      b.flops(std::string("grouped_down_") + name, f2, "2*rows*N*K", [&] {
        gpu::launch_grouped_matmul(env, a.data_ptr(), w2.data_ptr(), off_p, rows, kExperts, kFfn, kD, false,
                                   y.data_ptr(), bf, tl);
      });
    }
    Tensor da = b.empty({rows, kFfn}, bf);
    b.flops("grouped_down_dx", f2, "2*rows*N*K", [&] {
      be.grouped_matmul_backward(b.ex, a, w2, offsets, y, &da, nullptr, false, false, nullptr);
    });
    Tensor dw2 = b.empty({kExperts, kFfn, kD}, DType::kF32);
    b.flops("grouped_down_dw_f32acc", f2, "2*rows*N*K", [&] {
      be.grouped_matmul_backward(b.ex, a, w2, offsets, y, nullptr, &dw2, false, true, nullptr);
    });
    for (const auto& [name, tiling] : variants) {
      const gpu::GemmTiling tl = tiling;
      b.flops(std::string("grouped_down_dx_") + name, f2, "2*rows*N*K", [&] {
        gpu::launch_grouped_matmul_dx(env, y.data_ptr(), w2.data_ptr(), off_p, rows, kExperts, kFfn, kD,
                                      false, da.data_ptr(), bf, tl);
      });
      b.flops(std::string("grouped_down_dw_") + name, f2, "2*rows*N*K", [&] {
        gpu::launch_grouped_matmul_dw(env, a.data_ptr(), y.data_ptr(), off_p, rows, kExperts, kFfn, kD, false,
                                      dw2.data_ptr(), DType::kF32, true, bf, tl);
      });
      // Written instead of accumulated: a step's first micro-batch (Model::zero_grad).
      b.flops(std::string("grouped_down_dw_write_") + name, f2, "2*rows*N*K", [&] {
        gpu::launch_grouped_matmul_dw(env, a.data_ptr(), y.data_ptr(), off_p, rows, kExperts, kFfn, kD, false,
                                      dw2.data_ptr(), DType::kF32, false, bf, tl);
      });
    }
    b.flops("grouped_down_dw_f32write", f2, "2*rows*N*K", [&] {
      be.grouped_matmul_backward(b.ex, a, w2, offsets, y, nullptr, &dw2, false, false, nullptr);
    });
    // The same with the gradient norm's sum of squares folded into the epilogue.
    Tensor ss2 = b.empty({grouped_matmul_dw_sum_squares_slots(kExperts, kFfn, kD)}, DType::kF32);
    b.flops("grouped_down_dw_f32write_sumsq", f2, "2*rows*N*K",
            [&] { be.grouped_matmul_backward(b.ex, a, w2, offsets, y, nullptr, &dw2, false, false, &ss2); });
    // The up projection's backward (dx: K-major B of 4096-deep k; dW: [1024, 4096] per expert).
    Tensor dxp = b.empty({rows, kD}, bf);
    Tensor dw1 = b.empty({kExperts, kD, 2 * kFfn}, DType::kF32);
    b.flops("grouped_up_dx", f1, "2*rows*N*K", [&] {
      be.grouped_matmul_backward(b.ex, xp, w1, offsets, h, &dxp, nullptr, false, false, nullptr);
    });
    b.flops("grouped_up_dw_f32acc", f1, "2*rows*N*K", [&] {
      be.grouped_matmul_backward(b.ex, xp, w1, offsets, h, nullptr, &dw1, false, true, nullptr);
    });
    b.flops("grouped_up_dw_f32write", f1, "2*rows*N*K", [&] {
      be.grouped_matmul_backward(b.ex, xp, w1, offsets, h, nullptr, &dw1, false, false, nullptr);
    });
    Tensor ss1 = b.empty({grouped_matmul_dw_sum_squares_slots(kExperts, kD, 2 * kFfn)}, DType::kF32);
    b.flops("grouped_up_dw_f32write_sumsq", f1, "2*rows*N*K",
            [&] { be.grouped_matmul_backward(b.ex, xp, w1, offsets, h, nullptr, &dw1, false, false, &ss1); });
    for (const auto& [name, tiling] : variants) {
      if (tiling == gpu::GemmTiling::kWarps2x2) continue;
      const gpu::GemmTiling tl = tiling;
      b.flops(std::string("grouped_up_dw_write_") + name, f1, "2*rows*N*K", [&] {
        gpu::launch_grouped_matmul_dw(env, xp.data_ptr(), h.data_ptr(), off_p, rows, kExperts, kD, 2 * kFfn,
                                      false, dw1.data_ptr(), DType::kF32, false, bf, tl);
      });
    }
    // The dense equivalent through cuBLASLt, for scale.
    Tensor wd = b.random({kD, 2 * kFfn}, bf, -0.05f, 0.05f);
    b.flops("dense_equiv_32768x4096x1024", f1, "2*M*N*K",
            [&] { be.matmul(b.ex, xp, wd, h, false, false, 1.0f, 0.0f); });
  }
  // ---- grouped GEMMs on two more loads: bench_1b's shapes with one expert
  // holding half the rows, and fine-grained experts (64 of hidden 256, top-8) ----
  {
    const int64_t rows = kTokens * kTopK;
    grouped_set(b, "skew", kExperts, kFfn, load_offsets(rows, kExperts, rows / 2));
    const int64_t fine_e = 64, fine_k = 8, fine_f = 256, fine_rows = kTokens * fine_k;
    grouped_set(b, "fine", fine_e, fine_f, load_offsets(fine_rows, fine_e, fine_rows / fine_e));
  }
  // ---- attention ----
  {
    Tensor q = b.random({kBatch, kSeq, kHeads, kHeadDim}, bf),
           k = b.random({kBatch, kSeq, kHeads, kHeadDim}, bf);
    Tensor v = b.random({kBatch, kSeq, kHeads, kHeadDim}, bf);
    Tensor out = b.empty({kBatch, kSeq, kHeads, kHeadDim}, bf),
           lse = b.empty({kBatch, kHeads, kSeq}, DType::kF32);
    const float scale = 0.125f;
    // Causal: half of the 4*B*H*S^2*Dh of full attention (two matmuls of 2 flops per MAC).
    const double fwd = 4.0 * kBatch * kHeads * double(kSeq) * kSeq * kHeadDim / 2;
    b.flops("attention_fwd_b8_s2048_h16_d64", fwd, "4*B*H*S^2*Dh/2",
            [&] { be.attention_forward(b.ex, q, k, v, scale, out, lse); });
    Tensor dout = b.random({kBatch, kSeq, kHeads, kHeadDim}, bf);
    Tensor dq = b.empty(q.shape(), bf), dk = b.empty(q.shape(), bf), dv = b.empty(q.shape(), bf);
    b.flops("attention_bwd", 2.5 * fwd, "2.5*fwd",
            [&] { be.attention_backward(b.ex, q, k, v, out, lse, dout, scale, dq, dk, dv, nullptr); });
    // Each tensor-core kernel by name (the rows above run the backend's choice).
    attention_variants(b, ctx, {kBatch, kSeq, kHeads, kHeads, kHeadDim}, fwd, q, k, v, out, lse, dout, dq, dk,
                       dv, "");
  }
  // Head dim 128 (8 heads of 128: the same d_model), with the backend's default kernels.
  {
    const int64_t heads = 8, dh = 128;
    Tensor q = b.random({kBatch, kSeq, heads, dh}, bf), k = b.random({kBatch, kSeq, heads, dh}, bf);
    Tensor v = b.random({kBatch, kSeq, heads, dh}, bf);
    Tensor out = b.empty({kBatch, kSeq, heads, dh}, bf), lse = b.empty({kBatch, heads, kSeq}, DType::kF32);
    const float scale = 0.08838834764f;  // 1/sqrt(128)
    const double fwd = 4.0 * kBatch * heads * double(kSeq) * kSeq * dh / 2;
    b.flops("attention_fwd_b8_s2048_h8_d128", fwd, "4*B*H*S^2*Dh/2",
            [&] { be.attention_forward(b.ex, q, k, v, scale, out, lse); });
    Tensor dout = b.random(q.shape(), bf);
    Tensor dq = b.empty(q.shape(), bf), dk = b.empty(q.shape(), bf), dv = b.empty(q.shape(), bf);
    b.flops("attention_bwd_d128", 2.5 * fwd, "2.5*fwd",
            [&] { be.attention_backward(b.ex, q, k, v, out, lse, dout, scale, dq, dk, dv, nullptr); });
    attention_variants(b, ctx, {kBatch, kSeq, heads, heads, dh}, fwd, q, k, v, out, lse, dout, dq, dk, dv,
                       "_d128");
  }
  // ---- memory-bound kernels ----
  {
    Tensor x = b.random({kTokens, kD}, bf), w = b.random({kD}, DType::kF32), y = b.empty({kTokens, kD}, bf);
    Tensor rstd = b.empty({kTokens}, DType::kF32);
    const double n = T * kD;
    b.bytes("rmsnorm_fwd_16384x1024", 2 * n * 2, "read x + write y (bf16)",
            [&] { be.rmsnorm_forward(b.ex, x, nullptr, w, 1e-5f, nullptr, y, rstd); });
    Tensor dy = b.random({kTokens, kD}, bf), dx = b.empty({kTokens, kD}, bf), dw = b.empty({kD}, DType::kF32);
    b.bytes("rmsnorm_bwd_16384x1024", 3 * n * 2, "read x, dy + write dx (bf16)",
            [&] { be.rmsnorm_backward(b.ex, dy, x, w, rstd, dx, dw, false, nullptr); });
    // The block's residual adds fused in (against add + the unfused kernel: 3 + 2 and 3 + 3
    // passes over a [T, D] bf16 tensor).
    Tensor hsum = b.empty({kTokens, kD}, bf), dres = b.random({kTokens, kD}, bf);
    b.bytes("rmsnorm_add_fwd_16384x1024", 4 * n * 2, "read x, r + write h, y (bf16)",
            [&] { be.rmsnorm_forward(b.ex, x, &dy, w, 1e-5f, &hsum, y, rstd); });
    b.bytes("rmsnorm_bwd_dres_16384x1024", 4 * n * 2, "read x, dy, dres + write dx (bf16)",
            [&] { be.rmsnorm_backward(b.ex, dy, x, w, rstd, dx, dw, false, &dres); });
    Tensor s = b.empty({kTokens, kD}, bf);
    b.bytes("add_16384x1024", 3 * n * 2, "read a, b + write out (bf16)", [&] { be.add(b.ex, x, dy, s); });
    Tensor qh = b.random({kTokens, kHeads, kHeadDim}, bf), qr = b.empty({kTokens, kHeads, kHeadDim}, bf);
    std::vector<int32_t> pos_v(static_cast<size_t>(kTokens));
    for (int64_t i = 0; i < kTokens; ++i) pos_v[static_cast<size_t>(i)] = static_cast<int32_t>(i % kSeq);
    Tensor pos = b.ints({kTokens}, pos_v);
    b.bytes("rope_fwd_16384x16x64", 2 * n * 2, "read x + write out (bf16)",
            [&] { be.rope_forward(b.ex, qh, pos, 10000.0f, qr); });
  }
  {
    const int64_t rows = kTokens * kTopK;
    Tensor h = b.random({rows, 2 * kFfn}, bf), a = b.empty({rows, kFfn}, bf);
    const double n = double(rows) * kFfn;
    b.bytes("swiglu_fwd_32768x2048", 3 * n * 2, "read 2F + write F (bf16)",
            [&] { be.swiglu_forward(b.ex, h, a); });
    Tensor da = b.random({rows, kFfn}, bf), dh = b.empty({rows, 2 * kFfn}, bf);
    b.bytes("swiglu_bwd_32768x2048", 5 * n * 2, "read 2F + F, write 2F (bf16)",
            [&] { be.swiglu_backward(b.ex, h, da, dh); });
  }
  {
    const int64_t rows = 4096;  // a quarter of the micro-batch: the same per-row work
    Tensor logits = b.random({rows, kVocab}, bf, -4.0f, 4.0f);
    std::vector<int32_t> tg(rows);
    for (int64_t i = 0; i < rows; ++i) tg[i] = static_cast<int32_t>((i * 7919) % kVocab);
    Tensor targets = b.ints({rows}, tg), losses = b.empty({rows}, DType::kF32),
           lse = b.empty({rows}, DType::kF32);
    const double n = double(rows) * kVocab;
    b.bytes("xent_fwd_4096x32768", n * 2, "read logits (bf16)",
            [&] { be.cross_entropy_forward(b.ex, logits, targets, losses, lse); });
    Tensor dl = b.empty({rows, kVocab}, bf);
    b.bytes("xent_bwd_4096x32768", 2 * n * 2, "read logits + write dlogits (bf16)",
            [&] { be.cross_entropy_backward(b.ex, logits, targets, lse, 1.0f / rows, dl); });
    // The LM head's one pass (dlogits into a separate buffer, so that every run reads the
    // same logits): bytes as one read and one write; the second read comes from L2.
    b.bytes("xent_fwd_bwd_4096x32768", 2 * n * 2, "read logits + write dlogits (bf16), one kernel",
            [&] { be.cross_entropy_forward_backward(b.ex, logits, targets, 1.0f / rows, losses, lse, dl); });
  }
  {
    const int64_t n = 64 << 20;
    Tensor p = b.random({n}, DType::kF32), g = b.random({n}, DType::kF32), m = b.empty({n}, DType::kF32);
    Tensor v = b.empty({n}, DType::kF32);
    AdamWConfig cfg;
    cfg.weight_decay = 0.1f;
    b.bytes("adamw_64M_f32", double(n) * 4 * 7, "read p,g,m,v + write p,m,v (f32)",
            [&] { be.adamw_step(b.ex, p, g, m, v, cfg); });
  }
  // ---- the whole bench_1b optimizer step: 87 tensors, 1.33 B f32 parameters ----
  {
    std::vector<Shape> shapes;
    for (int l = 0; l < 12; ++l) {
      for (const Shape& s : std::vector<Shape>{{kD},
                                               {kD, 3 * kD},
                                               {kD, kD},
                                               {kD},
                                               {kD, kExperts},
                                               {kExperts, kD, 2 * kFfn},
                                               {kExperts, kFfn, kD}}) {
        shapes.push_back(s);
      }
    }
    shapes.push_back({kVocab, kD});
    shapes.push_back({kD});
    shapes.push_back({kD, kVocab});
    std::vector<Tensor> p, g, m, v;
    double numel = 0;
    for (const Shape& s : shapes) {
      p.push_back(b.random(s, DType::kF32));
      g.push_back(b.random(s, DType::kF32, -0.01f, 0.01f));
      m.push_back(b.empty(s, DType::kF32));
      v.push_back(b.empty(s, DType::kF32));
      numel += static_cast<double>(p.back().numel());
    }
    std::vector<AdamWTensor> list;
    std::vector<const Tensor*> grads;
    for (size_t i = 0; i < shapes.size(); ++i) {
      list.push_back({&p[i], &g[i], &m[i], &v[i], shapes[i].size() > 1 ? 0.1f : 0.0f});
      grads.push_back(&g[i]);
    }
    AdamWConfig cfg;
    cfg.grad_scale = 0.5f;
    b.bytes("adamw_loop_bench1b", numel * 4 * 7, "87 adamw_step launches; read p,g,m,v + write p,m,v", [&] {
      for (const AdamWTensor& t : list) {
        AdamWConfig c = cfg;
        c.weight_decay = t.weight_decay;
        be.adamw_step(b.ex, *t.param, *t.grad, *t.m, *t.v, c);
      }
    });
    b.bytes("adamw_multi_bench1b", numel * 4 * 7, "one launch; read p,g,m,v + write p,m,v (f32)",
            [&] { be.adamw_step_multi(b.ex, list, cfg); });
    // The same with the bf16 working copies written in the pass, against the update and a
    // separate cast pass (read p f32 + write bf16) one after the other.
    std::vector<Tensor> work;
    for (const Shape& s : shapes) work.push_back(b.empty(s, DType::kBF16));
    std::vector<AdamWTensor> with_work = list;
    for (size_t i = 0; i < with_work.size(); ++i) with_work[i].work = &work[i];
    b.bytes("adamw_then_cast_bench1b", numel * (4 * 7 + 4 + 2), "one launch + 87 casts; + read p, write bf16",
            [&] {
              be.adamw_step_multi(b.ex, list, cfg);
              for (size_t i = 0; i < work.size(); ++i) be.cast(b.ex, p[i], work[i]);
            });
    b.bytes("adamw_multi_work_bench1b", numel * (4 * 7 + 2),
            "one launch; read p,g,m,v + write p,m,v + bf16 p",
            [&] { be.adamw_step_multi(b.ex, with_work, cfg); });
    // The matrices' masters split (train.master_weights = "split"): each is its bf16 working
    // copy and a 16-bit low half, read and written in place of p and the copy (28 bytes an
    // element instead of 30); the vectors as above.
    std::vector<Tensor> low(shapes.size());
    std::vector<AdamWTensor> split = with_work;
    double split_numel = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (shapes[i].size() < 2) continue;
      low[i] = Tensor::empty(shapes[i], DType::kI16, b.alloc);  // written by the split
      be.master_split(b.ex, p[i], work[i], low[i]);
      split[i].work_lo = &low[i];
      split_numel += static_cast<double>(p[i].numel());
    }
    b.bytes("adamw_multi_split_bench1b", split_numel * 4 * 7 + (numel - split_numel) * (4 * 7 + 2),
            "one launch; matrices: read bf16 p + lo, g, m, v + write them; vectors as adamw_multi_work",
            [&] { be.adamw_step_multi(b.ex, split, cfg); });
    double sink = 0;
    b.bytes("grad_norm_loop_bench1b", numel * 4, "87 sum_squares (each syncs); read g (f32)", [&] {
      for (const Tensor* t : grads) sink += be.sum_squares(b.ex, *t);
    });
    b.bytes("grad_norm_bench1b", numel * 4, "sum_squares_multi, one launch + sync; read g (f32)",
            [&] { sink += be.sum_squares_multi(b.ex, grads); });
    Tensor norm_sq = b.empty({1}, DType::kF32);
    b.bytes("grad_norm_device_bench1b", numel * 4, "sum_squares_into: one launch + a 1-block finish, no sync",
            [&] { be.sum_squares_into(b.ex, grads, {}, norm_sq, false); });
    std::printf("(norm checksum %.3e)\n", sink);

    // ---- could the optimizer hide behind the products? A measurement, not a
    // path the step takes: the expert products of a bench_1b forward (12 x up + down on the
    // balanced load) on the main stream, limited to num_sms - r SMs (the TMA kernel's
    // persistent grid), and the whole AdamW pass (with its bf16 working copies) on a second
    // stream with a grid for `a` SMs (8 blocks an SM), started together; against the two
    // one after the other on all SMs. The products' blocks fill an SM (shared memory and
    // registers), so the two share the GPU by SMs, and the power cap decides the rest.
    {
      const int64_t rows = kTokens * kTopK;
      Tensor offsets = b.ints({kExperts + 1}, load_offsets(rows, kExperts, rows / kExperts));
      Tensor xp = b.random({rows, kD}, bf), w1 = b.random({kExperts, kD, 2 * kFfn}, bf, -0.05f, 0.05f);
      Tensor h = b.empty({rows, 2 * kFfn}, bf), act = b.random({rows, kFfn}, bf);
      Tensor w2 = b.random({kExperts, kFfn, kD}, bf, -0.05f, 0.05f), y = b.empty({rows, kD}, bf);
      const auto* off_p = static_cast<const int32_t*>(offsets.data_ptr());
      const cuda::CudaStream side = cuda::CudaStream::create(ctx.device);
      // The AdamW pass is adamw_multi_work_bench1b's backend op; beside the products it runs
      // on a context of its own whose stream is the side stream and whose SM count bounds
      // the pass's grid.
      CudaContext side_ctx(ctx.device, side.get());
      const Exec side_ex{Device::cuda(ctx.device), &side_ctx};
      const cuda::CudaEvent fork = cuda::CudaEvent::create(ctx.device, false),
                            join = cuda::CudaEvent::create(ctx.device, false);
      auto products = [&](int sms) {
        const gpu::Env env{ctx.stream, sms};
        for (int l = 0; l < 12; ++l) {
          gpu::launch_grouped_matmul(env, xp.data_ptr(), w1.data_ptr(), off_p, rows, kExperts, kD, 2 * kFfn,
                                     false, h.data_ptr(), bf);
          gpu::launch_grouped_matmul(env, act.data_ptr(), w2.data_ptr(), off_p, rows, kExperts, kFfn, kD,
                                     false, y.data_ptr(), bf);
        }
      };
      auto adamw_side = [&](int sms) {
        side_ctx.num_sms = sms;
        be.adamw_step_multi(side_ex, with_work, cfg);
      };
      const double flop =
          12 * 2.0 * rows * kD * 2 * kFfn * 1.5;  // up (K 1024, N 4096) + down (K 2048, N 1024)
      b.flops("overlap_products_alone", flop, "12 x (up + down)", [&] { products(ctx.num_sms); });
      b.bytes("overlap_adamw_alone", numel * (4 * 7 + 2), "the AdamW pass with working copies",
              [&] { be.adamw_step_multi(b.ex, with_work, cfg); });
      b.flops("overlap_serial", flop, "products, then AdamW (all SMs)", [&] {
        products(ctx.num_sms);
        be.adamw_step_multi(b.ex, with_work, cfg);
      });
      for (const auto& [r, a] :
           std::vector<std::pair<int, int>>{{0, ctx.num_sms}, {0, 16}, {16, 16}, {32, 32}, {24, 24}}) {
        b.flops("overlap_products_sms" + std::to_string(ctx.num_sms - r) + "_adamw_sms" + std::to_string(a),
                flop, "both at once, two streams", [&] {
                  fork.record(ctx.stream);
                  fork.wait_on(side.get());
                  adamw_side(a);
                  products(ctx.num_sms - r);
                  join.record(side.get());
                  join.wait_on(ctx.stream);
                });
      }
      side.synchronize();
    }
  }
  {
    const int64_t rows = kTokens * kTopK;
    std::vector<int32_t> idx(rows);
    std::mt19937 g(3);
    for (int64_t t = 0; t < kTokens; ++t) {
      const int32_t e0 = static_cast<int32_t>(g() % kExperts);
      idx[2 * t] = e0;
      idx[2 * t + 1] = static_cast<int32_t>((e0 + 1 + g() % (kExperts - 1)) % kExperts);
    }
    Tensor topk = b.ints({kTokens, kTopK}, idx), row_map = b.empty({rows}, DType::kI32);
    Tensor counts = b.empty({kExperts}, DType::kI32), offs = b.empty({kExperts + 1}, DType::kI32);
    b.flops("moe_dispatch_plan_32768", 0, "(time only)",
            [&] { be.moe_dispatch_plan(b.ex, topk, kExperts, -1, row_map, counts, offs); });
    Tensor x = b.random({kTokens, kD}, bf), xp = b.empty({rows, kD}, bf);
    b.bytes("moe_permute_16384x1024_k2", 3.0 * T * kD * 2, "read x + write 2 copies (bf16)",
            [&] { be.moe_permute(b.ex, x, row_map, kTopK, xp); });
    Tensor gates = b.random({kTokens, kTopK}, DType::kF32, 0.0f, 1.0f), y = b.empty({kTokens, kD}, bf);
    b.bytes("moe_unpermute_16384x1024_k2", 3.0 * T * kD * 2, "read 2 copies + write y (bf16)",
            [&] { be.moe_unpermute(b.ex, xp, row_map, gates, y, nullptr); });
    Tensor logits = b.random({kTokens, kExperts}, DType::kF32),
           scores = b.empty({kTokens, kExperts}, DType::kF32);
    Tensor ti = b.empty({kTokens, kTopK}, DType::kI32), gt = b.empty({kTokens, kTopK}, DType::kF32);
    RouterConfig rc;
    b.bytes("router_fwd_16384x16", T * kExperts * 4 * 2 + T * kTopK * 8,
            "read logits + write scores, ids, gates",
            [&] { be.router_forward(b.ex, logits, nullptr, rc, scores, ti, gt, nullptr); });
    {
      // What a bench_1b layer's router runs: the statistics in the same pass (and a one-block
      // finish).
      Tensor counts_f = b.empty({kExperts}, DType::kF32);
      Tensor sums = b.empty({kExperts}, DType::kF32), acc = b.random({kExperts + 1}, DType::kF32);
      RouterStats st{&counts_f, &sums, &acc, 1e-9f};
      b.bytes("router_fwd_16384x16_stats", T * kExperts * 4 * 2 + T * kTopK * 8,
              "read logits + write scores, ids, gates; + counts, score sums, aux",
              [&] { be.router_forward(b.ex, logits, nullptr, rc, scores, ti, gt, &st); });
    }
    // Fine-grained routing: 64 experts, top-8.
    const int64_t fe = 64, fk = 8;
    Tensor lf = b.random({kTokens, fe}, DType::kF32), sf = b.empty({kTokens, fe}, DType::kF32);
    Tensor tif = b.empty({kTokens, fk}, DType::kI32), gf = b.empty({kTokens, fk}, DType::kF32);
    RouterConfig rf;
    rf.top_k = static_cast<int>(fk);
    b.bytes("router_fwd_16384x64_k8", T * fe * 4 * 2 + T * fk * 8, "read logits + write scores, ids, gates",
            [&] { be.router_forward(b.ex, lf, nullptr, rf, sf, tif, gf, nullptr); });
  }
  std::printf("kernel_bench done\n");
}

}  // namespace
}  // namespace troupe::kernels

int main() {
  if (troupe::cuda::device_count() == 0) {
    std::printf("kernel_bench: no CUDA device visible\n");
    return 77;
  }
  troupe::kernels::run();
  return 0;
}
