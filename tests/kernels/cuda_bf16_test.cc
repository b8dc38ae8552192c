// tests/kernels/cuda_bf16_test.cc — the CUDA backend's bf16 paths (the op table runs in
// f32): every op that has a bf16 kernel of its own (tensor-core grouped matmul, cuBLASLt
// with bf16 operands and f32 or bf16 outputs, attention, fused row kernels, MoE
// permutation, fp8) runs on random bf16 inputs on the GPU and on the CPU backend with the
// same bf16 inputs; outputs must agree to a relative error ||got - want|| / ||want||
// under a bf16-sized tolerance. Outputs are poisoned (NaN) before each run.
//
// Also covers core/cuda's CudaCachingAllocator (reuse, counters). Exits 77 without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/caching_allocator.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/stream.h"
#include "kernels/backend.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/launch.h"
#include "kernels/ops.h"

namespace troupe::kernels {
namespace {

constexpr DType kBF = DType::kBF16;
constexpr DType kF32 = DType::kF32;

struct Gpu {
  cuda::CudaStream stream = cuda::CudaStream::create(0);
  cuda::CudaCachingAllocator alloc{0};
  CudaContext ctx{0, stream.get()};
  Exec ex{Device::cuda(0), &ctx};
};
Gpu* g_gpu = nullptr;

class CudaBf16 : public ::testing::Test {
 protected:
  Gpu& gpu = *g_gpu;
  std::mt19937 gen{static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed()) + 17};

  // A host tensor of `dt` with uniform random values in [lo, hi).
  Tensor host_random(const Shape& shape, DType dt, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
    for (float& x : v) x = u(gen);
    return Tensor::from_floats(shape, v, dt);
  }
  Tensor dev(const Tensor& host) { return cuda::to_device(host, gpu.alloc, gpu.stream.get()); }
  Tensor host_poisoned(const Shape& shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt);
    t.fill(std::nanf(""));
    return t;
  }
  Tensor dev_poisoned(const Shape& shape, DType dt) { return dev(host_poisoned(shape, dt)); }
  Tensor back(const Tensor& d) { return cuda::to_host(d, gpu.stream.get()); }

  static float* f32_mut(Tensor& t) { return static_cast<float*>(t.data_ptr()); }

  // ||got - want|| / ||want|| (NaN anywhere fails).
  static double rel_error(const Tensor& got_host, const Tensor& want_host) {
    const std::vector<float> g = got_host.to_floats(), w = want_host.to_floats();
    EXPECT_EQ(g.size(), w.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < g.size() && i < w.size(); ++i) {
      if (!std::isfinite(g[i])) return INFINITY;
      num += (double(g[i]) - w[i]) * (double(g[i]) - w[i]);
      den += double(w[i]) * w[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
  }
  void expect_close(const Tensor& got_dev, const Tensor& want_host, double tol, const char* what) {
    const double err = rel_error(back(got_dev), want_host);
    std::printf("  %-40s rel err %.2e\n", what, err);
    EXPECT_LT(err, tol) << what;
  }
};

constexpr double kTol = 1.5e-2;  // bf16 inputs/outputs, fp32 accumulation on both sides

TEST_F(CudaBf16, MatmulVariants) {
  const Exec cpu = Exec::cpu();
  for (auto [ta, tb] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    const int64_t m = 70, k = 96, n = 56;
    Tensor a = host_random(ta ? Shape{k, m} : Shape{m, k}, kBF), b = host_random(tb ? Shape{n, k} : Shape{k, n}, kBF);
    Tensor want = host_random({m, n}, kF32), got = dev(want);  // beta = 1 into an f32 output
    matmul(cpu, a, b, want, ta, tb, 0.5f, 1.0f);
    matmul(gpu.ex, dev(a), dev(b), got, ta, tb, 0.5f, 1.0f);
    expect_close(got, want, 1e-3, ta ? (tb ? "matmul tt bf16->f32 beta1" : "matmul tn bf16->f32 beta1")
                                     : (tb ? "matmul nt bf16->f32 beta1" : "matmul nn bf16->f32 beta1"));
  }
  Tensor a = host_random({3, 40, 32}, kBF), b = host_random({32, 24}, kBF), b3 = host_random({3, 32, 24}, kBF);
  Tensor want = host_poisoned({3, 40, 24}, kBF), got = dev_poisoned({3, 40, 24}, kBF);
  matmul(cpu, a, b, want);
  matmul(gpu.ex, dev(a), dev(b), got);
  expect_close(got, want, kTol, "matmul batched, shared b, bf16");
  matmul(cpu, a, b3, want);
  matmul(gpu.ex, dev(a), dev(b3), got);
  expect_close(got, want, kTol, "matmul batched bf16");
  Tensor at = host_random({3, 32, 40}, kBF);
  matmul(cpu, at, b, want, true, false);
  matmul(gpu.ex, dev(at), dev(b), got, true, false);
  expect_close(got, want, kTol, "matmul batched trans_a, shared b");
}

TEST_F(CudaBf16, GroupedMatmulTensorCores) {
  const Exec cpu = Exec::cpu();
  // Uneven segments, one empty expert, sizes that are not multiples of the 128 tiles.
  const std::vector<int32_t> off = {0, 37, 37, 200, 331, 460};
  const int64_t experts = 5, rows = 460, k = 72, n = 136;
  Tensor offsets = Tensor::from_ints({experts + 1}, off);
  Tensor doff = dev(offsets);
  for (bool trans : {false, true}) {
    Tensor x = host_random({rows, k}, kBF), w = host_random(trans ? Shape{experts, n, k} : Shape{experts, k, n}, kBF);
    Tensor want = host_poisoned({rows, n}, kBF), got = dev_poisoned({rows, n}, kBF);
    grouped_matmul(cpu, x, w, offsets, want, trans);
    grouped_matmul(gpu.ex, dev(x), dev(w), doff, got, trans);
    expect_close(got, want, kTol, trans ? "grouped_matmul trans_w" : "grouped_matmul");
    // Every configuration of the tensor-core kernel, through the launchers.
    const Tensor dout0 = host_random({rows, n}, kBF);
    Tensor dx0 = host_poisoned({rows, k}, kBF), dw0 = host_poisoned(w.shape(), kF32);
    grouped_matmul_backward(cpu, x, w, offsets, dout0, &dx0, &dw0, trans, false);
    const auto* off_p = static_cast<const int32_t*>(doff.data_ptr());
    // The Hopper configurations also run on 2 "SMs": each persistent block then walks many
    // tiles, so loads running ahead into the next tile are exercised too.
    const std::vector<std::pair<gpu::GemmTiling, int>> configs = {
        {gpu::GemmTiling::kWarps2x2, gpu.ctx.num_sms},   {gpu::GemmTiling::kWarps2x4, gpu.ctx.num_sms},
        {gpu::GemmTiling::kWarps2x2K64, gpu.ctx.num_sms}, {gpu::GemmTiling::kWgmma128, gpu.ctx.num_sms},
        {gpu::GemmTiling::kWgmma256, gpu.ctx.num_sms},   {gpu::GemmTiling::kWgmma128, 2},
        {gpu::GemmTiling::kWgmma256, 2},                 {gpu::GemmTiling::kWgmmaTma, gpu.ctx.num_sms},
        {gpu::GemmTiling::kWgmmaTma, 2},                 {gpu::GemmTiling::kAuto, 3}};
    for (const auto& [tiling, sms] : configs) {
      const gpu::Env env{gpu.ctx.stream, sms};
      Tensor got2 = dev_poisoned({rows, n}, kBF), xd = dev(x), wd = dev(w), dd = dev(dout0);
      Tensor dxg = dev_poisoned({rows, k}, kBF), dwg = dev_poisoned(w.shape(), kF32);
      gpu::launch_grouped_matmul(env, xd.data_ptr(), wd.data_ptr(), off_p, rows, experts, k, n, trans, got2.data_ptr(),
                                 kBF, tiling);
      gpu::launch_grouped_matmul_dx(env, dd.data_ptr(), wd.data_ptr(), off_p, rows, experts, k, n, trans,
                                    dxg.data_ptr(), kBF, tiling);
      gpu::launch_grouped_matmul_dw(env, xd.data_ptr(), dd.data_ptr(), off_p, rows, experts, k, n, trans,
                                    dwg.data_ptr(), kF32, false, kBF, tiling);
      const std::string tag = fmt::format("tiling {} sms {}{}", static_cast<int>(tiling), sms, trans ? " trans_w" : "");
      expect_close(got2, want, kTol, ("grouped_matmul " + tag).c_str());
      expect_close(dxg, dx0, kTol, ("grouped_matmul dx " + tag).c_str());
      expect_close(dwg, dw0, 2e-3, ("grouped_matmul dw " + tag).c_str());
      // A written bf16 dW (train.expert_grads = "bf16"): the f32 product rounded once.
      Tensor dwb = dev_poisoned(w.shape(), kBF);
      gpu::launch_grouped_matmul_dw(env, xd.data_ptr(), dd.data_ptr(), off_p, rows, experts, k, n, trans,
                                    dwb.data_ptr(), kBF, false, kBF, tiling);
      expect_close(dwb, dw0, kTol, ("grouped_matmul dw bf16 " + tag).c_str());
    }

    Tensor dout = host_random({rows, n}, kBF);
    Tensor dx_want = host_poisoned({rows, k}, kBF), dx_got = dev_poisoned({rows, k}, kBF);
    Tensor dw_init = host_random(w.shape(), kF32);
    Tensor dw_want = dw_init.clone(), dw_got = dev(dw_init);
    grouped_matmul_backward(cpu, x, w, offsets, dout, &dx_want, &dw_want, trans, true);
    grouped_matmul_backward(gpu.ex, dev(x), dev(w), doff, dev(dout), &dx_got, &dw_got, trans, true);
    expect_close(dx_got, dx_want, kTol, trans ? "grouped_matmul dx trans_w" : "grouped_matmul dx");
    expect_close(dw_got, dw_want, 2e-3, trans ? "grouped_matmul dw f32 accumulate trans_w" : "grouped_matmul dw f32 acc");
    // The adding dW of each Hopper kernel, also on 2 "SMs" (tiles walked in turn): the TMA
    // kernel adds through the bulk tensor reduction.
    for (const auto& [tiling, sms] :
         std::vector<std::pair<gpu::GemmTiling, int>>{{gpu::GemmTiling::kWgmmaTma, 2},
                                                      {gpu::GemmTiling::kWgmma256, 2},
                                                      {gpu::GemmTiling::kWgmmaTma, 132}}) {
      const gpu::Env env{gpu.ctx.stream, std::min(sms, gpu.ctx.num_sms)};
      Tensor xd = dev(x), dd = dev(dout), dwg = dev(dw_init);
      gpu::launch_grouped_matmul_dw(env, xd.data_ptr(), dd.data_ptr(), off_p, rows, experts, k, n, trans,
                                    dwg.data_ptr(), kF32, true, kBF, tiling);
      expect_close(dwg, dw_want, 2e-3,
                   fmt::format("grouped_matmul dw f32 acc tiling {} sms {}{}", static_cast<int>(tiling), sms,
                               trans ? " trans_w" : "")
                       .c_str());
      // An added bf16 dW: the TMA kernel only writes one, so that request takes the
      // cp.async kernel (read, add in f32, round once), as the CPU does.
      Tensor dwb_init = host_random(w.shape(), kBF), dwb_want = dwb_init.clone(), dwb = dev(dwb_init);
      grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, &dwb_want, trans, true);
      gpu::launch_grouped_matmul_dw(env, xd.data_ptr(), dd.data_ptr(), off_p, rows, experts, k, n, trans,
                                    dwb.data_ptr(), kBF, true, kBF, tiling);
      expect_close(dwb, dwb_want, kTol,
                   fmt::format("grouped_matmul dw bf16 acc tiling {} sms {}{}", static_cast<int>(tiling), sms,
                               trans ? " trans_w" : "")
                       .c_str());
    }
  }
}

// Many experts: the TMA kernel finds a row tile's expert in a table in shared memory up
// to 1024 experts (its fill scans 32 experts a step, empty experts among them) and by a
// scan of the offsets beyond; both against the CPU, forward and dx, on 2 "SMs" (each block
// walks many tiles) and on all of them.
TEST_F(CudaBf16, GroupedMatmulManyExperts) {
  const Exec cpu = Exec::cpu();
  for (int64_t experts : {40, 1030}) {
    std::vector<int32_t> off(static_cast<size_t>(experts + 1), 0);
    for (int64_t e = 0; e < experts; ++e) {
      const int32_t rows_e =
          e % 5 == 0 ? 0 : static_cast<int32_t>(experts > 1024 ? (e * 53) % 20 : (e * 53) % 150 + 1);
      off[static_cast<size_t>(e + 1)] = off[static_cast<size_t>(e)] + rows_e;
    }
    const int64_t rows = off.back(), k = 64, n = 72;
    Tensor offsets = Tensor::from_ints({experts + 1}, off);
    Tensor doff = dev(offsets);
    Tensor x = host_random({rows, k}, kBF), w = host_random({experts, k, n}, kBF);
    Tensor dout = host_random({rows, n}, kBF);
    Tensor want = host_poisoned({rows, n}, kBF), dx_want = host_poisoned({rows, k}, kBF);
    grouped_matmul(cpu, x, w, offsets, want, false);
    grouped_matmul_backward(cpu, x, w, offsets, dout, &dx_want, nullptr, false, false);
    const auto* off_p = static_cast<const int32_t*>(doff.data_ptr());
    for (int sms : {2, gpu.ctx.num_sms}) {
      const gpu::Env env{gpu.ctx.stream, sms};
      Tensor xd = dev(x), wd = dev(w), dd = dev(dout);
      Tensor got = dev_poisoned({rows, n}, kBF), dx = dev_poisoned({rows, k}, kBF);
      gpu::launch_grouped_matmul(env, xd.data_ptr(), wd.data_ptr(), off_p, rows, experts, k, n, false,
                                 got.data_ptr(), kBF, gpu::GemmTiling::kAuto);
      gpu::launch_grouped_matmul_dx(env, dd.data_ptr(), wd.data_ptr(), off_p, rows, experts, k, n, false,
                                    dx.data_ptr(), kBF, gpu::GemmTiling::kAuto);
      const std::string tag = fmt::format(" ({} experts, {} rows, sms {})", experts, rows, sms);
      expect_close(got, want, kTol, ("grouped_matmul" + tag).c_str());
      expect_close(dx, dx_want, kTol, ("grouped_matmul dx" + tag).c_str());
    }
  }
}

// A rank whose experts got no token at all: the written dW is zeros (the Hopper default
// writes through TMA, whose tensor maps need rows, so this case takes another kernel).
TEST_F(CudaBf16, GroupedMatmulDwWithoutTokensWritesZeros) {
  const int64_t experts = 3, k = 64, n = 128;
  Tensor offsets = dev(Tensor::from_ints({experts + 1}, std::vector<int32_t>(experts + 1, 0)));
  Tensor x = dev(host_random({0, k}, kBF)), dout = dev(host_random({0, n}, kBF));
  Tensor w = dev(host_random({experts, k, n}, kBF));
  Tensor dw = dev_poisoned({experts, k, n}, kF32);
  grouped_matmul_backward(gpu.ex, x, w, offsets, dout, nullptr, &dw, false, false);
  const std::vector<float> got = back(dw).to_floats();
  EXPECT_EQ(got, std::vector<float>(got.size(), 0.0f));
  // With the dW sum of squares: zero slots.
  Tensor slots = dev_poisoned({grouped_matmul_dw_sum_squares_slots(experts, k, n)}, kF32);
  grouped_matmul_backward(gpu.ex, x, w, offsets, dout, nullptr, &dw, false, false, &slots);
  const std::vector<float> zeros = back(slots).to_floats();
  EXPECT_EQ(zeros, std::vector<float>(zeros.size(), 0.0f));
}

// parallel.device_dispatch hands the experts a buffer of capacity rows filled up to a count
// known only on the device: the rows past the last expert's end are not data (here NaN).
// The dW (written in f32 and in bf16, with its sum of squares and without) must not see
// them: every kernel zeroes both operands' k-rows past a segment's end (0 * NaN is NaN).
TEST_F(CudaBf16, GroupedMatmulDwIgnoresRowsPastTheLastExpert) {
  const Exec cpu = Exec::cpu();
  const std::vector<int32_t> off = {0, 70, 70, 203};  // 203 rows of data in 320
  const int64_t experts = 3, data = off.back(), cap = 320, k = 256, n = 512;
  Tensor offsets = Tensor::from_ints({experts + 1}, off);
  Tensor x = host_random({data, k}, kBF), dout = host_random({data, n}, kBF);
  Tensor w = host_random({experts, k, n}, kBF);
  Tensor dw_want = host_poisoned({experts, k, n}, kF32);
  grouped_matmul_backward(cpu, x, w, offsets, dout, nullptr, &dw_want, false, false);
  // The same rows, then capacity rows of NaN.
  Tensor xc = host_poisoned({cap, k}, kBF), dc = host_poisoned({cap, n}, kBF);
  std::memcpy(xc.data_ptr(), x.data_ptr(), x.nbytes());
  std::memcpy(dc.data_ptr(), dout.data_ptr(), dout.nbytes());
  for (DType dwt : {kF32, kBF}) {
    for (bool fold : {false, true}) {
      Tensor dw = dev_poisoned({experts, k, n}, dwt);
      Tensor slots = dev_poisoned({grouped_matmul_dw_sum_squares_slots(experts, k, n)}, kF32);
      grouped_matmul_backward(gpu.ex, dev(xc), dev(w), dev(offsets), dev(dc), nullptr, &dw, false, false,
                              fold ? &slots : nullptr);
      const std::string what =
          fmt::format("dW past the data ({}, {})", dtype_name(dwt), fold ? "sum of squares" : "plain");
      expect_close(dw, dw_want, kTol, what.c_str());
      if (fold) {
        double sum = 0;
        for (float v : back(slots).to_floats()) sum += v;
        EXPECT_TRUE(std::isfinite(sum)) << what;
      }
    }
  }
}

// grouped_matmul_backward's dw_sum_squares on every CUDA path. The slots' sum is
// the sum of squares of the dW written (taken on the host from the downloaded dW), dW is
// bit-identical to the same call without slots, and a second run gives bit-identical
// slots. Where the Hopper TMA kernel folds the sum into its epilogue, each slot must sit
// where that kernel puts it (8 * tile + 4 * warpgroup + warp): exactly zero for warps whose
// rows lie past the matrix or whose expert got no rows, positive elsewhere. Shapes: dW
// matrices that are not multiples of the 128 x 256 tile, experts without rows.
TEST_F(CudaBf16, GroupedMatmulDwSumSquares) {
  struct Problem {
    std::vector<int32_t> off;
    int64_t k, n;
  };
  const std::vector<Problem> problems = {
      {{0, 37, 37, 200, 331, 460}, 72, 136},  // one partial tile per expert (two with trans_w)
      {{0, 0, 150, 150, 300}, 200, 264},      // 2 x 2 partial tiles; experts 0 and 2 empty
  };
  for (const Problem& pr : problems) {
    const int64_t experts = static_cast<int64_t>(pr.off.size()) - 1, rows = pr.off.back(), k = pr.k, n = pr.n;
    const int64_t count = grouped_matmul_dw_sum_squares_slots(experts, k, n);
    Tensor doff = dev(Tensor::from_ints({experts + 1}, pr.off));
    const auto* off_p = static_cast<const int32_t*>(doff.data_ptr());
    for (bool trans : {false, true}) {
      const Shape ws = trans ? Shape{experts, n, k} : Shape{experts, k, n};
      const int64_t p = trans ? n : k, q = trans ? k : n;  // each expert's dW is [p, q]
      Tensor x = dev(host_random({rows, k}, kBF)), dout = dev(host_random({rows, n}, kBF));
      const std::vector<std::pair<gpu::GemmTiling, int>> configs = {
          {gpu::GemmTiling::kAuto, gpu.ctx.num_sms},     {gpu::GemmTiling::kAuto, 2},
          {gpu::GemmTiling::kWgmmaTma, gpu.ctx.num_sms}, {gpu::GemmTiling::kWgmmaTma, 2},
          {gpu::GemmTiling::kWgmma256, gpu.ctx.num_sms}, {gpu::GemmTiling::kWarps2x2, gpu.ctx.num_sms}};
      // Each configuration with an f32 dW and with a bf16 one (train.expert_grads): the
      // bf16 slots hold the squares of the rounded values the kernel stores.
      for (const auto& [tiling, sms] : configs)
        for (DType dwt : {kF32, kBF}) {
          const std::string tag =
              fmt::format("dw {} sum of squares, k {} n {}{}, tiling {} sms {}", dtype_name(dwt), k, n,
                          trans ? " trans_w" : "", static_cast<int>(tiling), sms);
          const gpu::Env env{gpu.ctx.stream, sms};
          Tensor dw_plain = dev_poisoned(ws, dwt), dw = dev_poisoned(ws, dwt);
          Tensor slots = dev_poisoned({count}, kF32), slots2 = dev_poisoned({count}, kF32);
          gpu::launch_grouped_matmul_dw(env, x.data_ptr(), dout.data_ptr(), off_p, rows, experts, k, n, trans,
                                        dw_plain.data_ptr(), dwt, false, kBF, tiling);
          const bool folded = gpu::launch_grouped_matmul_dw(env, x.data_ptr(), dout.data_ptr(), off_p, rows,
                                                            experts, k, n, trans, dw.data_ptr(), dwt, false,
                                                            kBF, tiling, f32_mut(slots), count);
          gpu::launch_grouped_matmul_dw(env, x.data_ptr(), dout.data_ptr(), off_p, rows, experts, k, n, trans,
                                        dw.data_ptr(), dwt, false, kBF, tiling, f32_mut(slots2), count);
          const bool tma = tiling == gpu::GemmTiling::kAuto || tiling == gpu::GemmTiling::kWgmmaTma;
          EXPECT_EQ(folded, tma && gpu::grouped_matmul_hopper_available()) << tag;
          const std::vector<float> dwh = back(dw).to_floats(), plain = back(dw_plain).to_floats();
          const std::vector<float> got = back(slots).to_floats(), again = back(slots2).to_floats();
          ASSERT_EQ(std::memcmp(dwh.data(), plain.data(), dwh.size() * sizeof(float)), 0) << tag;
          ASSERT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(float)), 0)
              << tag << ": not bit-equal";
          double want = 0, sum = 0;
          for (float v : dwh) want += static_cast<double>(v) * v;
          for (float v : got) sum += v;  // NaN (a slot left unwritten) fails below
          std::printf("  %-60s %s, rel err %.2e\n", tag.c_str(), folded ? "epilogue" : "second pass",
                      std::abs(sum - want) / want);
          EXPECT_NEAR(sum, want, 1e-5 * want) << tag;
          if (!folded) continue;
          const int64_t tiles_m = (p + 127) / 128, tiles_n = (q + 255) / 256;
          for (int64_t i = 0; i < count; ++i) {
            const int64_t t = i / 8, cw = (i % 8) / 4, warp = i % 4;
            const int64_t e = t / (tiles_m * tiles_n), m0 = (t / tiles_n) % tiles_m * 128;
            const bool zero = e >= experts || pr.off[e + 1] == pr.off[e] || m0 + cw * 64 + warp * 16 >= p;
            if (zero) {
              EXPECT_EQ(got[i], 0.0f) << tag << ": slot " << i;
            } else {
              EXPECT_GT(got[i], 0.0f) << tag << ": slot " << i;
            }
          }
        }
      // Through the op (the default path), against the CPU backend's slots.
      Tensor w = dev(host_random(ws, kBF));
      Tensor dw = dev_poisoned(ws, kF32), slots = dev_poisoned({count}, kF32);
      grouped_matmul_backward(gpu.ex, x, w, doff, dout, nullptr, &dw, trans, false, &slots);
      Tensor dw_cpu = host_poisoned(ws, kF32), slots_cpu = host_poisoned({count}, kF32);
      grouped_matmul_backward(Exec::cpu(), back(x), back(w), back(doff), back(dout), nullptr, &dw_cpu, trans,
                              false, &slots_cpu);
      double got = 0, want = 0;
      for (float v : back(slots).to_floats()) got += v;
      for (float v : slots_cpu.to_floats()) want += v;
      EXPECT_NEAR(got, want, 1e-4 * want) << "op, k " << k << " n " << n << (trans ? " trans_w" : "");
    }
  }
  // f32 operands (the plain kernel, with the second pass) and bf16 operands with a bf16 dW
  // (the TMA kernel on Hopper, folded; the second pass elsewhere), through the op.
  const std::vector<int32_t> off = {0, 30, 30, 77};
  Tensor offsets = Tensor::from_ints({4}, off);
  for (auto [xt, dwt] : {std::pair{kF32, kF32}, std::pair{kBF, kBF}}) {
    Tensor x = host_random({77, 40}, xt), w = host_random({3, 40, 24}, xt), dout = host_random({77, 24}, xt);
    Tensor dw = dev_poisoned({3, 40, 24}, dwt),
           slots = dev_poisoned({grouped_matmul_dw_sum_squares_slots(3, 40, 24)}, kF32);
    grouped_matmul_backward(gpu.ex, dev(x), dev(w), dev(offsets), dev(dout), nullptr, &dw, false, false,
                            &slots);
    double got = 0, want = 0;
    for (float v : back(slots).to_floats()) got += v;
    for (float v : back(dw).to_floats()) want += static_cast<double>(v) * v;
    EXPECT_NEAR(got, want, 1e-5 * want) << dtype_name(xt) << " operands, " << dtype_name(dwt) << " dW";
  }
}

TEST_F(CudaBf16, Attention) {
  const Exec cpu = Exec::cpu();
  // 77: one partial tile; 333: several tiles, the causal skip and a partial last tile; 256:
  // whole 128-row tiles (the fused backward's preparation then clears dQ's accumulator alone);
  // 300: a last key block of 44 keys (one query tile; its second warpgroup's keys all past
  // the sequence).
  for (int64_t dh : {64, 128, 40}) {  // tensor-core paths (64, 128) and fp32 path (40)
    for (int64_t s : {77, 256, 300, 333}) {
      const int64_t b = 2, hq = 4, hkv = 2;
      const std::string at = fmt::format(" (dh {} s {})", dh, s);
      Tensor q = host_random({b, s, hq, dh}, kBF), k = host_random({b, s, hkv, dh}, kBF);
      Tensor v = host_random({b, s, hkv, dh}, kBF);
      const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
      Tensor out_w = host_poisoned({b, s, hq, dh}, kBF), lse_w = host_poisoned({b, hq, s}, kF32);
      Tensor out_g = dev_poisoned({b, s, hq, dh}, kBF), lse_g = dev_poisoned({b, hq, s}, kF32);
      attention_forward(cpu, q, k, v, scale, out_w, lse_w);
      Tensor dq_ = dev(q), dk_ = dev(k), dv_ = dev(v);
      attention_forward(gpu.ex, dq_, dk_, dv_, scale, out_g, lse_g);
      expect_close(out_g, out_w, kTol, ("attention_forward out" + at).c_str());
      expect_close(lse_g, lse_w, 1e-4, ("attention_forward lse" + at).c_str());
      Tensor dout = host_random({b, s, hq, dh}, kBF);
      Tensor gq_w = host_poisoned(q.shape(), kBF), gk_w = host_poisoned(k.shape(), kBF);
      Tensor gv_w = host_poisoned(v.shape(), kBF);
      Tensor gq = dev_poisoned(q.shape(), kBF), gk = dev_poisoned(k.shape(), kBF),
             gv = dev_poisoned(v.shape(), kBF);
      attention_backward(cpu, q, k, v, out_w, lse_w, dout, scale, gq_w, gk_w, gv_w);
      attention_backward(gpu.ex, dq_, dk_, dv_, dev(out_w), dev(lse_w), dev(dout), scale, gq, gk, gv);
      expect_close(gq, gq_w, 2e-2, ("attention_backward dq" + at).c_str());
      expect_close(gk, gk_w, 2e-2, ("attention_backward dk" + at).c_str());
      expect_close(gv, gv_w, 2e-2, ("attention_backward dv" + at).c_str());
      if (dh == 40) continue;
      // Each tensor-core kernel by name: mma.sync with 4 and 8 warps per block, and the
      // Hopper kernels where they run (the default path above took one of them).
      const gpu::Env env{gpu.ctx.stream, gpu.ctx.num_sms};
      const gpu::AttentionShape shape{b, s, hq, hkv, dh};
      std::vector<int> variants = {4, 8};
      if (gpu::attention_hopper_available(shape)) {
        variants.push_back(gpu::kAttentionHopper);  // dQ inside the dK/dV kernel
        variants.push_back(gpu::kAttentionHopperSplitDq);
        variants.push_back(gpu::kAttentionHopperFwd2);  // at dh 64 a two-warpgroup forward
      }
      // One variant's backward through its launcher (rope: null or undone in it) against the
      // CPU's gradients.
      const auto backward_variant = [&](int variant, const gpu::AttentionRope* rope, const Tensor& want_q,
                                        const Tensor& want_k, const Tensor& want_v, const std::string& tag) {
        const int64_t scratch_floats =
            static_cast<int64_t>(gpu::attention_backward_scratch_bytes(shape, true, rope != nullptr) / 4) + 1;
        Tensor scratch = dev_poisoned({scratch_floats}, kF32);
        Tensor gqv = dev_poisoned(q.shape(), kBF), gkv = dev_poisoned(k.shape(), kBF);
        Tensor gvv = dev_poisoned(v.shape(), kBF);
        Tensor lse_d = dev(lse_w), out_d = dev(out_w), dout_d = dev(dout);
        gpu::launch_attention_backward(env, shape, dq_.data_ptr(), dk_.data_ptr(), dv_.data_ptr(),
                                       out_d.data_ptr(), static_cast<const float*>(lse_d.data_ptr()),
                                       dout_d.data_ptr(), scale, gqv.data_ptr(), gkv.data_ptr(),
                                       gvv.data_ptr(), kBF, scratch.data_ptr(), variant, rope);
        expect_close(gqv, want_q, 2e-2, ("attention_backward dq" + tag).c_str());
        expect_close(gkv, want_k, 2e-2, ("attention_backward dk" + tag).c_str());
        expect_close(gvv, want_v, 2e-2, ("attention_backward dv" + tag).c_str());
      };
      for (int variant : variants) {
        const std::string tag = fmt::format(" (variant {}, dh {} s {})", variant, dh, s);
        Tensor out_v = dev_poisoned({b, s, hq, dh}, kBF), lse_v = dev_poisoned({b, hq, s}, kF32);
        gpu::launch_attention_forward(env, shape, dq_.data_ptr(), dk_.data_ptr(), dv_.data_ptr(), scale,
                                      out_v.data_ptr(), static_cast<float*>(lse_v.data_ptr()), kBF, variant);
        expect_close(out_v, out_w, kTol, ("attention_forward out" + tag).c_str());
        expect_close(lse_v, lse_w, 1e-4, ("attention_forward lse" + tag).c_str());
        backward_variant(variant, nullptr, gq_w, gk_w, gv_w, tag);
      }
      // With the RoPE that made q and k undone in the backward (RopeArgs): the fused Hopper
      // kernel rotates dK in its stores and dQ in its conversion (rotation table at
      // the scratch's end), the other kernels run rope_backward after. Positions out of
      // order, some past the sequence (a sequence shard's).
      std::vector<int32_t> pos(static_cast<size_t>(b * s));
      for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>((i * 37) % 3001);
      const Tensor pos_h = Tensor::from_ints({b * s}, pos), pos_d = dev(pos_h);
      const RopeArgs rope_h{&pos_h, 500.0f}, rope_d{&pos_d, 500.0f};
      Tensor rq_w = host_poisoned(q.shape(), kBF), rk_w = host_poisoned(k.shape(), kBF);
      Tensor rv_w = host_poisoned(v.shape(), kBF);
      attention_backward(cpu, q, k, v, out_w, lse_w, dout, scale, rq_w, rk_w, rv_w, &rope_h);
      Tensor rq = dev_poisoned(q.shape(), kBF), rk = dev_poisoned(k.shape(), kBF),
             rv = dev_poisoned(v.shape(), kBF);
      attention_backward(gpu.ex, dq_, dk_, dv_, dev(out_w), dev(lse_w), dev(dout), scale, rq, rk, rv,
                         &rope_d);
      expect_close(rq, rq_w, 2e-2, ("attention_backward rope dq" + at).c_str());
      expect_close(rk, rk_w, 2e-2, ("attention_backward rope dk" + at).c_str());
      expect_close(rv, rv_w, 2e-2, ("attention_backward rope dv" + at).c_str());
      const gpu::AttentionRope rope_g{static_cast<const int32_t*>(pos_d.data_ptr()), 500.0f};
      for (int variant : variants) {
        backward_variant(variant, &rope_g, rq_w, rk_w, rv_w,
                         fmt::format(" (rope, variant {}, dh {} s {})", variant, dh, s));
      }
    }
  }
}

TEST_F(CudaBf16, RowKernels) {
  const Exec cpu = Exec::cpu();
  const int64_t t = 33, d = 264;
  // RMSNorm with f32 weights (the master copy) and bf16 activations.
  Tensor x = host_random({t, d}, kBF), w = host_random({d}, kF32, 0.5f, 1.5f);
  Tensor y_w = host_poisoned({t, d}, kBF), r_w = host_poisoned({t}, kF32);
  Tensor y_g = dev_poisoned({t, d}, kBF), r_g = dev_poisoned({t}, kF32);
  rmsnorm_forward(cpu, x, w, 1e-5f, y_w, r_w);
  rmsnorm_forward(gpu.ex, dev(x), dev(w), 1e-5f, y_g, r_g);
  expect_close(y_g, y_w, kTol, "rmsnorm_forward");
  expect_close(r_g, r_w, 1e-4, "rmsnorm_forward rstd");
  Tensor dy = host_random({t, d}, kBF);
  Tensor dx_w = host_poisoned({t, d}, kBF), dw_w = host_poisoned({d}, kF32);
  Tensor dx_g = dev_poisoned({t, d}, kBF), dw_g = dev_poisoned({d}, kF32);
  rmsnorm_backward(cpu, dy, x, w, r_w, dx_w, dw_w);
  rmsnorm_backward(gpu.ex, dev(dy), dev(x), dev(w), dev(r_w), dx_g, dw_g);
  expect_close(dx_g, dx_w, kTol, "rmsnorm_backward dx");
  expect_close(dw_g, dw_w, 1e-3, "rmsnorm_backward dw");
  // The fused residual forms: h = x + r (the same bf16 rounding on both: exact), the norm of
  // it, and the backward adding the residual gradient into dx in place.
  {
    Tensor rr = host_random({t, d}, kBF), h_w = host_poisoned({t, d}, kBF), h_g = dev_poisoned({t, d}, kBF);
    rmsnorm_add_forward(cpu, x, rr, w, 1e-5f, h_w, y_w, r_w);
    rmsnorm_add_forward(gpu.ex, dev(x), dev(rr), dev(w), 1e-5f, h_g, y_g, r_g);
    EXPECT_EQ(back(h_g).to_floats(), h_w.to_floats()) << "rmsnorm_add_forward h";
    expect_close(y_g, y_w, kTol, "rmsnorm_add_forward y");
    expect_close(r_g, r_w, 1e-4, "rmsnorm_add_forward rstd");
    Tensor dres = host_random({t, d}, kBF);
    Tensor dx_res = dres.clone(), dx_resg = dev(dres);
    rmsnorm_backward(cpu, dy, h_w, w, r_w, dx_res, dw_w, false, &dx_res);
    rmsnorm_backward(gpu.ex, dev(dy), h_g, dev(w), dev(r_w), dx_resg, dw_g, false, &dx_resg);
    expect_close(dx_resg, dx_res, kTol, "rmsnorm_backward dx + dres");
    expect_close(dw_g, dw_w, 1e-3, "rmsnorm_backward dw (dres)");
  }

  // SwiGLU: t x d, and rows wider than one block's packs (256 threads x 8), an odd count.
  for (const auto& [rows, f] : std::vector<std::pair<int64_t, int64_t>>{{t, d}, {5, 2056}}) {
    const std::string at = fmt::format(" ({} x {})", rows, f);
    Tensor h = host_random({rows, 2 * f}, kBF, -3.0f, 3.0f), dyh = host_random({rows, f}, kBF);
    Tensor o_w = host_poisoned({rows, f}, kBF), o_g = dev_poisoned({rows, f}, kBF);
    swiglu_forward(cpu, h, o_w);
    swiglu_forward(gpu.ex, dev(h), o_g);
    expect_close(o_g, o_w, kTol, ("swiglu_forward" + at).c_str());
    Tensor dh_w = host_poisoned({rows, 2 * f}, kBF), dh_g = dev_poisoned({rows, 2 * f}, kBF);
    swiglu_backward(cpu, h, dyh, dh_w);
    swiglu_backward(gpu.ex, dev(h), dev(dyh), dh_g);
    expect_close(dh_g, dh_w, kTol, ("swiglu_backward" + at).c_str());
  }

  // Cross-entropy on bf16 logits (vocab a multiple of 8: packed loads), one ignored row.
  const int64_t vocab = 1000;
  Tensor logits = host_random({t, vocab}, kBF, -5.0f, 5.0f);
  std::vector<int32_t> tg(t);
  for (int64_t i = 0; i < t; ++i) tg[i] = i == 3 ? -1 : static_cast<int32_t>((i * 37) % vocab);
  Tensor targets = Tensor::from_ints({t}, tg);
  Tensor l_w = host_poisoned({t}, kF32), s_w = host_poisoned({t}, kF32), l_g = dev_poisoned({t}, kF32), s_g = dev_poisoned({t}, kF32);
  cross_entropy_forward(cpu, logits, targets, l_w, s_w);
  Tensor dlogits_in = dev(logits), dtargets = dev(targets);
  cross_entropy_forward(gpu.ex, dlogits_in, dtargets, l_g, s_g);
  expect_close(l_g, l_w, 1e-4, "cross_entropy_forward losses");
  expect_close(s_g, s_w, 1e-5, "cross_entropy_forward lse");
  Tensor g_w = host_poisoned({t, vocab}, kBF);
  cross_entropy_backward(cpu, logits, targets, s_w, 0.25f, g_w);
  cross_entropy_backward(gpu.ex, dlogits_in, dtargets, s_g, 0.25f, dlogits_in);  // in place
  expect_close(dlogits_in, g_w, kTol, "cross_entropy_backward (in place)");

  // Softmax and RoPE.
  Tensor sx = host_random({t, 50}, kBF, -4.0f, 4.0f), sy_w = host_poisoned({t, 50}, kBF), sy_g = dev_poisoned({t, 50}, kBF);
  softmax_forward(cpu, sx, sy_w);
  softmax_forward(gpu.ex, dev(sx), sy_g);
  expect_close(sy_g, sy_w, kTol, "softmax_forward");
  Tensor rx = host_random({t, 4, 64}, kBF);
  std::vector<int32_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = static_cast<int32_t>(i * 61 % 2048);
  Tensor p = Tensor::from_ints({t}, pos), ro_w = host_poisoned({t, 4, 64}, kBF), ro_g = dev_poisoned({t, 4, 64}, kBF);
  rope_forward(cpu, rx, p, 10000.0f, ro_w);
  rope_forward(gpu.ex, dev(rx), dev(p), 10000.0f, ro_g);
  expect_close(ro_g, ro_w, kTol, "rope_forward");
  // The backward in place, as the attention layer runs it.
  Tensor rb_w = host_poisoned({t, 4, 64}, kBF), rb_g = dev(rx);
  rope_backward(cpu, rx, p, 10000.0f, rb_w);
  rope_backward(gpu.ex, rb_g, dev(p), 10000.0f, rb_g);
  expect_close(rb_g, rb_w, kTol, "rope_backward in place");
}

// The embedding gradient sums a repeated token's rows in token order (a stable sort by id,
// one writer per table row): two runs are bit-identical, and both agree with the CPU's
// in-order sum. Half the tokens share one id, so atomics in any order would show.
// The LM head's fused cross-entropy pass on bf16 logits: vocabularies of 1 to 14 sweeps of
// 512 x 8 elements stage a row in shared memory (2, 5 (an odd count: two groups of two
// packs, then one), 8 (bench_1b's 32768) and 14 here); 16 sweeps and 20488 take the kernel
// that reads a row twice. Every one must equal the forward kernel then the
// backward kernel bit for bit (losses, lse, dlogits; in place and into another buffer),
// with an ignored row and a target in the last column, and agree with the CPU.
TEST_F(CudaBf16, CrossEntropyFusedEqualsForwardThenBackward) {
  Exec cpu = Exec::cpu();
  const int64_t t = 7;
  for (const int64_t vocab :
       {int64_t{8192}, int64_t{20480}, int64_t{32768}, int64_t{57344}, int64_t{65536}, int64_t{20488}}) {
    for (const bool in_place : {false, true}) {
      const std::string at = fmt::format(" (vocab {}{})", vocab, in_place ? ", in place" : "");
      Tensor logits = host_random({t, vocab}, kBF, -6.0f, 6.0f);
      std::vector<int32_t> tg(t);
      for (int64_t i = 0; i < t; ++i) tg[i] = static_cast<int32_t>((i * 7919) % vocab);
      tg[2] = -1;
      tg[5] = static_cast<int32_t>(vocab - 1);
      Tensor targets = Tensor::from_ints({t}, tg), dtargets = dev(targets);

      Tensor l_two = dev_poisoned({t}, kF32), s_two = dev_poisoned({t}, kF32);
      Tensor d_two = dev(logits);
      cross_entropy_forward(gpu.ex, d_two, dtargets, l_two, s_two);
      cross_entropy_backward(gpu.ex, d_two, dtargets, s_two, 0.25f, d_two);

      Tensor l_one = dev_poisoned({t}, kF32), s_one = dev_poisoned({t}, kF32);
      Tensor in = dev(logits);
      Tensor d_one = in_place ? in : dev_poisoned({t, vocab}, kBF);
      cross_entropy_forward_backward(gpu.ex, in, dtargets, 0.25f, l_one, s_one, d_one);

      for (const auto& [got, want, what] :
           {std::tuple{&l_one, &l_two, "losses"}, std::tuple{&s_one, &s_two, "lse"},
            std::tuple{&d_one, &d_two, "dlogits"}}) {
        const Tensor a = back(*got), b = back(*want);
        ASSERT_EQ(a.nbytes(), b.nbytes());
        EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << what << at;
      }
      Tensor l_w = host_poisoned({t}, kF32), s_w = host_poisoned({t}, kF32);
      cross_entropy_forward(cpu, logits, targets, l_w, s_w);
      Tensor g_w = host_poisoned({t, vocab}, kBF);
      cross_entropy_backward(cpu, logits, targets, s_w, 0.25f, g_w);
      expect_close(l_one, l_w, 1e-4, ("fused losses" + at).c_str());
      expect_close(s_one, s_w, 1e-5, ("fused lse" + at).c_str());
      expect_close(d_one, g_w, kTol, ("fused dlogits" + at).c_str());
    }
  }
}

TEST_F(CudaBf16, EmbeddingBackwardIsDeterministic) {
  const Exec cpu = Exec::cpu();
  const int64_t tokens = 8192, vocab = 50000;
  std::vector<int32_t> id(tokens);
  std::uniform_int_distribution<int32_t> pick(0, 99);
  for (int64_t t = 0; t < tokens; ++t) id[t] = t % 2 == 0 ? 7 : pick(gen) * 499;
  const Tensor ids = Tensor::from_ints({tokens}, id);
  const Tensor ids_g = dev(ids);
  for (const auto& [d, tt] : std::vector<std::pair<int64_t, DType>>{{1024, kF32}, {1024, kBF}, {36, kF32}}) {
    const std::string at = fmt::format(" (d {}, table {})", d, tt == kF32 ? "f32" : "bf16");
    const Tensor dout = host_random({tokens, d}, kBF);
    const Tensor init = host_random({vocab, d}, tt);
    Tensor want = init.to_dtype(kF32);
    embedding_backward(cpu, ids, dout, want);
    const Tensor dout_g = dev(dout);
    Tensor a = dev(init), b = dev(init);
    embedding_backward(gpu.ex, ids_g, dout_g, a);
    embedding_backward(gpu.ex, ids_g, dout_g, b);
    const Tensor ha = back(a), hb = back(b);
    EXPECT_EQ(std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()), 0) << "two runs differ" << at;
    const double err = rel_error(ha, want);
    std::printf("  embedding_backward%-22s rel err %.2e\n", at.c_str(), err);
    EXPECT_LT(err, tt == kF32 ? 1e-6 : 4e-3) << at;
  }
}

TEST_F(CudaBf16, MoeAndElementwise) {
  const Exec cpu = Exec::cpu();
  const int64_t t = 300, e = 8, k = 2, d = 136;
  Tensor logits = host_random({t, e}, kF32, -2.0f, 2.0f);
  RouterConfig rc;
  Tensor sc = host_poisoned({t, e}, kF32), idx = Tensor::empty({t, k}, DType::kI32), gates = host_poisoned({t, k}, kF32);
  router_forward(cpu, logits, nullptr, rc, sc, idx, gates);
  Tensor didx = dev(idx);
  Tensor row_map = dev(Tensor::from_ints({t * k}, std::vector<int32_t>(t * k, 12345)));  // poison
  Tensor counts = dev(Tensor::from_ints({e}, std::vector<int32_t>(e, 7))), offs = dev(Tensor::from_ints({e + 1}, std::vector<int32_t>(e + 1, 7)));
  Tensor rm_w = Tensor::empty({t * k}, DType::kI32), c_w = Tensor::empty({e}, DType::kI32), o_w = Tensor::empty({e + 1}, DType::kI32);
  moe_dispatch_plan(cpu, idx, e, 50, rm_w, c_w, o_w);  // capacity 50 drops copies
  moe_dispatch_plan(gpu.ex, didx, e, 50, row_map, counts, offs);
  EXPECT_EQ(back(row_map).to_floats(), rm_w.to_floats()) << "moe_dispatch_plan row_map";
  EXPECT_EQ(back(counts).to_floats(), c_w.to_floats()) << "moe_dispatch_plan counts";
  EXPECT_EQ(back(offs).to_floats(), o_w.to_floats()) << "moe_dispatch_plan offsets";
  const int64_t r = static_cast<int64_t>(o_w.to_floats().back());
  Tensor x = host_random({t, d}, kBF), xp_w = host_poisoned({r, d}, kBF), xp_g = dev_poisoned({r, d}, kBF);
  moe_permute(cpu, x, rm_w, k, xp_w);
  moe_permute(gpu.ex, dev(x), row_map, k, xp_g);
  expect_close(xp_g, xp_w, 1e-6, "moe_permute (exact copy)");
  Tensor y_w = host_poisoned({t, d}, kBF), y_g = dev_poisoned({t, d}, kBF);
  moe_unpermute(cpu, xp_w, rm_w, gates, y_w);
  Tensor dgates_in = dev(gates);
  moe_unpermute(gpu.ex, xp_g, row_map, dgates_in, y_g);
  expect_close(y_g, y_w, kTol, "moe_unpermute");
  Tensor dy = host_random({t, d}, kBF);
  Tensor dyp_w = host_poisoned({r, d}, kBF), dg_w = host_poisoned({t, k}, kF32);
  Tensor dyp_g = dev_poisoned({r, d}, kBF), dg_g = dev_poisoned({t, k}, kF32);
  moe_unpermute_backward(cpu, dy, xp_w, rm_w, gates, dyp_w, dg_w);
  moe_unpermute_backward(gpu.ex, dev(dy), xp_g, row_map, dgates_in, dyp_g, dg_g);
  expect_close(dyp_g, dyp_w, kTol, "moe_unpermute_backward dyp");
  expect_close(dg_g, dg_w, 1e-3, "moe_unpermute_backward dgates");
  Tensor dx_w = host_poisoned({t, d}, kBF), dx_g = dev_poisoned({t, d}, kBF);
  moe_permute_backward(cpu, dyp_w, rm_w, k, dx_w);
  moe_permute_backward(gpu.ex, dyp_g, row_map, k, dx_g);
  expect_close(dx_g, dx_w, kTol, "moe_permute_backward");

  // Mixed-dtype elementwise: bf16 gradient accumulated into f32, f32 -> bf16 cast.
  const int64_t n = 1003;  // not a multiple of the 8-element packs
  Tensor gx = host_random({n}, kBF), acc = host_random({n}, kF32);
  Tensor acc_g = dev(acc);
  axpby(cpu, 0.5f, gx, 2.0f, acc);
  axpby(gpu.ex, 0.5f, dev(gx), 2.0f, acc_g);
  expect_close(acc_g, acc, 1e-6, "axpby bf16 -> f32");
  Tensor cf = host_random({n}, kF32), cb_w = host_poisoned({n}, kBF), cb_g = dev_poisoned({n}, kBF);
  cast(cpu, cf, cb_w);
  cast(gpu.ex, dev(cf), cb_g);
  EXPECT_EQ(back(cb_g).to_floats(), cb_w.to_floats()) << "cast f32 -> bf16 rounds like the CPU";
  Tensor q_w = Tensor::empty({7, 300}, DType::kF8E4M3), s_w = host_poisoned({7, 3}, kF32);
  Tensor qx = host_random({7, 300}, kBF, -20.0f, 20.0f);
  Tensor q_g = dev(q_w), s_g = dev_poisoned({7, 3}, kF32);
  quantize_fp8(cpu, qx, 128, q_w, s_w);
  quantize_fp8(gpu.ex, dev(qx), 128, q_g, s_g);
  expect_close(s_g, s_w, 1e-6, "quantize_fp8 scales");
  expect_close(q_g, q_w, 1e-6, "quantize_fp8 values");
  EXPECT_NEAR(sum(gpu.ex, dev(qx)), sum(cpu, qx), 1e-6 * std::abs(sum(cpu, qx)) + 1e-3);
  EXPECT_NEAR(sum_squares(gpu.ex, dev(qx)), sum_squares(cpu, qx), 1e-6 * sum_squares(cpu, qx));
}

// Kernels launch with programmatic dependent launch on sm_90 and up (common.cuh): each
// waits for its predecessor before touching memory. A chain of dependent launches, each
// reading what the one before wrote (a grid far larger than one wave, so the next grid's
// first blocks start while this one's last run), must see every write in stream order.
TEST_F(CudaBf16, ProgrammaticDependentLaunchKeepsStreamOrder) {
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  EXPECT_EQ(gpu.ctx.pdl, major >= 9);
  EXPECT_EQ(gpu.ctx.pdl_supported, major >= 9);
  const int64_t n = int64_t{1} << 22;
  Tensor a = dev(Tensor::from_floats({n}, std::vector<float>(static_cast<size_t>(n), 0.0f)));
  Tensor b = dev_poisoned({n}, kF32);
  Tensor one = dev(Tensor::from_floats({n}, std::vector<float>(static_cast<size_t>(n), 1.0f)));
  constexpr int kRounds = 400;
  for (int i = 0; i < kRounds; ++i) {
    add(gpu.ex, a, one, b);  // b = a + 1
    add(gpu.ex, b, one, a);  // a = b + 1
  }
  const std::vector<float> got = back(a).to_floats();
  int64_t wrong = 0;
  for (float v : got) wrong += v != 2.0f * kRounds;
  EXPECT_EQ(wrong, 0) << "elements that missed a predecessor's write";
}

TEST(CudaCachingAllocator, ReusesBlocksAndCounts) {
  cuda::CudaCachingAllocator alloc(0);
  void* a = alloc.allocate(1000);
  EXPECT_EQ(alloc.bytes_in_use(), 1000u);
  void* b = alloc.allocate(3 << 20);
  EXPECT_EQ(alloc.bytes_in_use(), 1000u + (3u << 20));
  alloc.deallocate(a, 1000);
  EXPECT_EQ(alloc.bytes_in_use(), size_t{3} << 20);
  void* c = alloc.allocate(900);  // same 1024-byte class: the cached block comes back
  EXPECT_EQ(c, a);
  EXPECT_EQ(alloc.num_device_mallocs(), 2u);
  EXPECT_EQ(alloc.peak_bytes_in_use(), 1000u + (3u << 20));
  alloc.deallocate(b, 3 << 20);
  alloc.deallocate(c, 900);
  EXPECT_EQ(alloc.bytes_in_use(), 0u);
  EXPECT_GT(alloc.bytes_reserved(), 0u);
  alloc.empty_cache();
  EXPECT_EQ(alloc.bytes_reserved(), 0u);
  alloc.reset_peak();
  EXPECT_EQ(alloc.peak_bytes_in_use(), 0u);
}

// The graph pool: a real stream capture allocates and frees a temporary, the graph replays
// into its address, and no allocation outside the capture is handed that address until the
// pool is released.
TEST(CudaCachingAllocator, GraphPoolKeepsTheCapturedAddresses) {
  cuda::CudaStream stream = cuda::CudaStream::create(0);
  cuda::CudaCachingAllocator alloc(0);
  CudaContext ctx(0, stream.get(), &alloc);
  const Exec ex{Device::cuda(0), &ctx};
  Tensor out = Tensor::empty({4096}, kF32, alloc);  // live before the capture: the caller's
  Tensor before = Tensor::empty({4096}, kF32, alloc);
  void* before_ptr = before.data_ptr();
  fill(ex, out, 0.0f);
  stream.synchronize();

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeRelaxed), cudaSuccess);
  alloc.begin_graph_pool();
  EXPECT_TRUE(alloc.capturing());
  void* tmp_ptr = nullptr;
  {
    Tensor tmp = Tensor::empty({4096}, kF32, alloc);
    tmp_ptr = tmp.data_ptr();
    EXPECT_NE(tmp_ptr, before_ptr);
    fill(ex, tmp, 3.0f);
    add(ex, tmp, tmp, out);  // out = 6 on every replay
  }
  before = Tensor();  // freed during the capture: the graph's from now on
  alloc.end_graph_pool();
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(alloc.graph_pool_bytes(), 2 * cuda::CudaCachingAllocator::round_size(4096 * 4));
  EXPECT_EQ(alloc.num_device_mallocs(), 3u);  // out, before, and the capture's tmp

  // Outside the capture, the same size class gets neither graph block.
  Tensor eager = Tensor::empty({4096}, kF32, alloc);
  EXPECT_NE(eager.data_ptr(), tmp_ptr);
  EXPECT_NE(eager.data_ptr(), before_ptr);
  fill(ex, eager, -1.0f);
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  const Tensor got = cuda::to_host(out, stream.get());
  for (int64_t i = 0; i < got.numel(); i += 511) ASSERT_EQ(got.data<float>()[i], 6.0f) << i;
  EXPECT_EQ(cuda::to_host(eager, stream.get()).data<float>()[7], -1.0f);  // untouched by the replay
  eager = Tensor();

  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  alloc.release_graph_pool();
  EXPECT_EQ(alloc.graph_pool_bytes(), 0u);
  // Released: the shared cache hands the graph's blocks out again.
  std::vector<Tensor> again;
  std::vector<void*> ptrs;
  for (int i = 0; i < 3; ++i) {
    again.push_back(Tensor::empty({4096}, kF32, alloc));
    ptrs.push_back(again.back().data_ptr());
  }
  EXPECT_NE(std::find(ptrs.begin(), ptrs.end(), tmp_ptr), ptrs.end());
  EXPECT_NE(std::find(ptrs.begin(), ptrs.end(), before_ptr), ptrs.end());
  EXPECT_EQ(alloc.num_device_mallocs(), 4u);  // and the eager one, nothing since
}

}  // namespace
}  // namespace troupe::kernels

int main(int argc, char** argv) {
  if (troupe::cuda::device_count() == 0 || troupe::kernels::cuda_backend() == nullptr) {
    std::printf("no CUDA device or no CUDA backend: skipping\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  troupe::kernels::Gpu gpu;
  troupe::kernels::g_gpu = &gpu;
  const int rc = RUN_ALL_TESTS();
  troupe::kernels::g_gpu = nullptr;
  return rc;
}
