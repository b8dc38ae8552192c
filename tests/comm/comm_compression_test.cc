// tests/comm/comm_compression_test.cc — codecs: fp8 per-row quantisation (round trip,
// per-row range, zero rows), bf16 reduce-scatter against the exact fp32 result (4 real
// processes) with and without error feedback, fp8 token dispatch with uneven row counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "comm/compression.h"
#include "comm/gloo_communicator.h"
#include "kernels/ops.h"
#include "tests/comm/comm_test_util.h"

namespace troupe::comm {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

std::unique_ptr<Communicator> connect(const std::filesystem::path& dir, std::unique_ptr<FileStore>& store, int rank,
                                      int size) {
  store = FileStore::open(dir).value();
  CommSpec spec;
  spec.store = store.get();
  spec.ns = StoreNamespace{"codec", 0};
  spec.rank = rank;
  spec.size = size;
  spec.options.op_timeout = 20s;
  return make_gloo_communicator(spec).value();
}

TEST(Fp8Codec, EncodeDecodeMatchTheDTypeConversionBitForBit) {
  auto check = [](float x) {
    uint8_t fast;
    encode_fp8e4m3(&x, &fast, 1, 1.0f);
    EXPECT_EQ(fast, float_to_fp8e4m3_bits(x)) << "x = " << x;
  };
  // A stride through every float bit pattern (both signs, NaN, inf, subnormals).
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 65537) {
    float x;
    uint32_t b = static_cast<uint32_t>(u);
    std::memcpy(&x, &b, sizeof(x));
    check(x);
  }
  // Every fp8 value, and the exact midpoints (ties) and their neighbours.
  for (int c = 0; c < 0x7F; ++c) {
    float v = fp8e4m3_bits_to_float(static_cast<uint8_t>(c));
    float w = fp8e4m3_bits_to_float(static_cast<uint8_t>(c + 1));
    for (float x : {v, (v + w) / 2, std::nextafter((v + w) / 2, 0.0f), std::nextafter((v + w) / 2, 1e9f)}) {
      check(x);
      check(-x);
    }
  }
  for (float x : {448.0f, 464.0f, 465.0f, 1e30f, INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1e-30f}) check(x);
  for (int c = 0; c < 256; ++c) {
    uint8_t b = static_cast<uint8_t>(c);
    float fast;
    decode_fp8e4m3(&b, &fast, 1, 1.0f);
    float core = fp8e4m3_bits_to_float(b);
    EXPECT_TRUE(fast == core || (std::isnan(fast) && std::isnan(core))) << c;
  }
}

TEST(Bf16ReduceScatter, SingleRankRoundsLikeCore) {
  // One rank: the output is the bf16 rounding of the input, bit for bit as core rounds it.
  TempDir dir;
  auto exits = testing::run_ranks(
      1,
      [&](int rank) {
        std::unique_ptr<FileStore> store;
        auto c = connect(dir.path(), store, rank, 1);
        std::vector<float> v = random_floats(4096, 77, 3.0f);
        v[0] = NAN;
        v[1] = INFINITY;
        v[2] = -0.0f;
        v[3] = 3.4e38f;                 // rounds to inf in bf16
        v[4] = 1.0f + 1.0f / 256.0f;    // a tie: rounds to even (1.0)
        Tensor grad = Tensor::from_floats({4096}, v), out = Tensor::empty({4096}, DType::kF32);
        Bf16ReduceScatter codec(*c, {});
        CHILD_CHECK_OK(codec.run(grad, out));
        for (size_t i = 0; i < v.size(); ++i) {
          float want = bf16_bits_to_float(float_to_bf16_bits(v[i]));
          float got = out.data<float>()[i];
          CHILD_CHECK(std::memcmp(&want, &got, 4) == 0 || (std::isnan(want) && std::isnan(got)), "element {}", i);
        }
        return 0;
      },
      30s);
  EXPECT_TRUE(exits[0].exited && exits[0].code == 0) << testing::describe(exits[0]);
}

TEST(Fp8Rows, PerRowScalesKeepSmallAndLargeRowsAccurate) {
  const int64_t cols = 64;
  std::vector<float> v;
  auto small = random_floats(cols, 1, 1e-3f), large = random_floats(cols, 2, 1e3f);
  v.insert(v.end(), small.begin(), small.end());
  v.insert(v.end(), large.begin(), large.end());
  v.insert(v.end(), cols, 0.0f);  // an all-zero row
  Tensor x = Tensor::from_floats({3, cols}, v);
  auto q = quantize_rows_fp8(x).value();
  EXPECT_EQ(q.data.dtype(), DType::kF8E4M3);
  EXPECT_EQ(q.scales.item({2}), 1.0f);
  auto back = dequantize_rows_fp8(q, DType::kF32).value().to_floats();
  for (int r = 0; r < 2; ++r) {
    double err = relative_l2_error(back.data() + r * cols, v.data() + r * cols, cols);
    // e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 per element.
    EXPECT_LT(err, 0.0625) << "row " << r;
    EXPECT_GT(err, 0.0) << "row " << r;
  }
  for (int c = 0; c < cols; ++c) EXPECT_EQ(back[2 * cols + c], 0.0f);
  // The largest magnitude of each row maps to fp8's maximum.
  float amax = 0;
  for (int c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(large[c]));
  EXPECT_FLOAT_EQ(q.scales.item({1}), amax / kFp8E4M3Max);
  EXPECT_EQ(quantize_rows_fp8(Tensor::zeros({4}, DType::kF32)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dequantize_rows_fp8(q, DType::kF8E4M3).status().code(), StatusCode::kInvalidArgument);
}

TEST(Bf16ReduceScatter, MatchesFp32WithinBf16ErrorAndErrorFeedbackBoundsDrift) {
  constexpr int kRanks = 4;
  constexpr int64_t kChunk = 4096;
  TempDir dir;
  auto exits = testing::run_ranks(
      kRanks,
      [&](int rank) {
        std::unique_ptr<FileStore> store;
        auto c = connect(dir.path(), store, rank, kRanks);
        auto g = random_floats(kChunk * kRanks, 100 + rank);
        Tensor grad = Tensor::from_floats({kChunk * kRanks}, g);
        // Exact reference computed locally from every rank's (seeded) gradients.
        std::vector<float> exact(kChunk, 0.0f);
        for (int q = 0; q < kRanks; ++q) {
          auto gq = random_floats(kChunk * kRanks, 100 + q);
          for (int64_t i = 0; i < kChunk; ++i) exact[i] += gq[rank * kChunk + i];
        }
        Bf16ReduceScatter plain(*c, {.error_feedback = false, .measure_error = true});
        Bf16ReduceScatter fed(*c, {.error_feedback = true, .measure_error = false});
        Tensor out = Tensor::empty({kChunk}, DType::kF32);
        Tensor out_fed = Tensor::empty({kChunk}, DType::kF32);
        std::vector<double> sum_plain(kChunk, 0.0), sum_fed(kChunk, 0.0);
        constexpr int kSteps = 8;
        for (int step = 0; step < kSteps; ++step) {
          CHILD_CHECK_OK(plain.run(grad, out));
          CHILD_CHECK_OK(fed.run(grad, out_fed));
          for (int64_t i = 0; i < kChunk; ++i) {
            sum_plain[i] += out.data<float>()[i];
            sum_fed[i] += out_fed.data<float>()[i];
          }
        }
        double err = relative_l2_error(out.data<float>(), exact.data(), kChunk);
        CHILD_CHECK(err > 1e-4 && err < 8e-3, "bf16 error {}", err);
        // The codec's own measurement agrees with ours (it compares to an fp32 reduce-scatter).
        CHILD_CHECK(std::fabs(plain.stats().last_rel_l2_error - err) < 1e-5, "stats {} vs {}",
                    plain.stats().last_rel_l2_error, err);
        CHILD_CHECK(plain.stats().calls == kSteps && plain.stats().measured_calls == kSteps);
        CHILD_CHECK(plain.stats().bytes_on_wire * 2 == plain.stats().bytes_uncompressed);
        // Over steps, error feedback keeps the accumulated update close to the exact one.
        std::vector<float> want(kChunk), got_plain(kChunk), got_fed(kChunk);
        for (int64_t i = 0; i < kChunk; ++i) {
          want[i] = exact[i] * kSteps;
          got_plain[i] = static_cast<float>(sum_plain[i]);
          got_fed[i] = static_cast<float>(sum_fed[i]);
        }
        double drift_plain = relative_l2_error(got_plain.data(), want.data(), kChunk);
        double drift_fed = relative_l2_error(got_fed.data(), want.data(), kChunk);
        CHILD_CHECK(drift_fed < drift_plain / 2, "feedback drift {} vs plain {}", drift_fed, drift_plain);
        CHILD_CHECK(fed.residual().size() == static_cast<size_t>(kChunk * kRanks));
        // Bad arguments.
        CHILD_CHECK(plain.run(Tensor::empty({kChunk * kRanks}, DType::kBF16), out).code() ==
                    StatusCode::kInvalidArgument);
        CHILD_CHECK(plain.run(grad, Tensor::empty({kChunk + 1}, DType::kF32)).code() == StatusCode::kInvalidArgument);
        return 0;
      },
      60s);
  for (const auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << testing::describe(e);
}

TEST(Fp8TokenDispatch, RowsArriveDequantisedWithUnevenCounts) {
  constexpr int kRanks = 4;
  constexpr int64_t kHidden = 96;
  TempDir dir;
  // rows[from][to], zeros included.
  auto rows = [](int from, int to) -> int64_t { return ((from + 2 * to) % 3) * (from + 1); };
  auto exits = testing::run_ranks(
      kRanks,
      [&](int rank) {
        std::unique_ptr<FileStore> store;
        auto c = connect(dir.path(), store, rank, kRanks);
        auto tokens_of = [&](int q) {
          int64_t total = 0;
          for (int p = 0; p < kRanks; ++p) total += rows(q, p);
          if (total == 0) return Tensor::empty({0, kHidden}, DType::kF32);
          auto v = random_floats(total * kHidden, 500 + q, 2.0f);
          // Rows of very different magnitudes.
          for (int64_t r = 0; r < total; ++r) {
            for (int64_t h = 0; h < kHidden; ++h) v[r * kHidden + h] *= std::pow(10.0f, float(r % 5) - 2);
          }
          return Tensor::from_floats({total, kHidden}, v);
        };
        for (DType dt : {DType::kF32, DType::kBF16}) {
          Tensor tokens = tokens_of(rank).to_dtype(dt);
          std::vector<int64_t> sr(kRanks), rr(kRanks);
          int64_t recv_total = 0;
          for (int p = 0; p < kRanks; ++p) {
            sr[p] = rows(rank, p);
            rr[p] = rows(p, rank);
            recv_total += rr[p];
          }
          Tensor out = Tensor::zeros({recv_total, kHidden}, dt);
          Fp8TokenDispatch dispatch(*c);
          CHILD_CHECK_OK(dispatch.run(tokens, sr, out, rr));
          // Reference: each sender's rows for us, quantised and dequantised locally.
          std::vector<float> want;
          for (int q = 0; q < kRanks; ++q) {
            Tensor tq = tokens_of(q).to_dtype(dt);
            int64_t off = 0;
            for (int p = 0; p < rank; ++p) off += rows(q, p);
            Tensor mine = tq.narrow(0, off, rows(q, rank)).contiguous();
            if (mine.numel() == 0) continue;
            auto deq = dequantize_rows_fp8(quantize_rows_fp8(mine).value(), dt).value().to_floats();
            want.insert(want.end(), deq.begin(), deq.end());
          }
          auto got = out.to_floats();
          CHILD_CHECK(got == want, "dispatch {} rank {}", dtype_name(dt), rank);
          double err = dispatch.stats().last_rel_l2_error;
          CHILD_CHECK(err > 0 && err < 0.06, "fp8 error {}", err);
        }
        return 0;
      },
      60s);
  for (const auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << testing::describe(e);
}

// The codec kernels of kernels/ops.h (whose CUDA versions the op table checks against
// these CPU ones) produce the bytes of this file's codecs: moe_permute_fp8 equals
// quantize_rows_fp8 of moe_permute's output, and sum_chunks of bf16 chunks equals the fp32
// sum in rank order that Bf16ReduceScatter computes.
TEST(CodecKernels, PermuteFp8AndSumChunksMatchTheCodecsBitForBit) {
  std::mt19937 gen(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t tokens = 37, d = 48, k = 2;
  Tensor x = Tensor::empty({tokens, d}, DType::kF32);
  for (int64_t i = 0; i < x.numel(); ++i)
    x.data<float>()[i] = nd(gen) * std::pow(10.0f, float(i / d % 5) - 2.0f);
  for (int64_t j = 0; j < d; ++j) x.data<float>()[3 * d + j] = 0.0f;  // an all-zero row: scale 1
  x.data<float>()[5 * d] = 1e6f;                                      // saturating magnitudes
  // A permutation of the tokens*k copies onto rows.
  std::vector<int32_t> perm(static_cast<size_t>(tokens * k));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), gen);
  const Tensor row_map = Tensor::from_ints({tokens * k}, perm);
  const kernels::Exec ex = kernels::Exec::cpu();
  Tensor xp = Tensor::empty({tokens * k, d}, DType::kF32);
  kernels::moe_permute(ex, x, row_map, k, xp);
  auto want = quantize_rows_fp8(xp);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  Tensor q = Tensor::empty({tokens * k, d}, DType::kF8E4M3),
         scales = Tensor::empty({tokens * k}, DType::kF32);
  kernels::moe_permute_fp8(ex, x, row_map, k, q, scales);
  EXPECT_EQ(std::memcmp(q.data_ptr(), want->data.data_ptr(), static_cast<size_t>(q.nbytes())), 0);
  EXPECT_EQ(std::memcmp(scales.data_ptr(), want->scales.data_ptr(), static_cast<size_t>(scales.nbytes())), 0);

  // sum_chunks: 4 bf16 chunks, fp32 sum in order.
  const int64_t n = 4, m = 1000;
  Tensor f = Tensor::empty({n, m}, DType::kF32);
  for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] = nd(gen);
  Tensor b = Tensor::empty({n, m}, DType::kBF16);
  kernels::cast(ex, f, b);
  Tensor out = Tensor::empty({m}, DType::kF32);
  kernels::sum_chunks(ex, b, out);
  const std::vector<float> bf = b.to_floats();
  for (int64_t i = 0; i < m; ++i) {
    float s = bf[static_cast<size_t>(i)];
    for (int64_t r = 1; r < n; ++r) s += bf[static_cast<size_t>(r * m + i)];
    ASSERT_EQ(out.data<float>()[i], s) << i;
  }
}

}  // namespace
}  // namespace troupe::comm
