// comm/compression.h — defines the communication codecs of MegaScale-MoE: CodecStats,
// Bf16ReduceScatter (gradients accumulated in fp32, exchanged in bf16: reduce-scatter as
// an all-to-all of bf16 chunks plus a local fp32 sum, optional error feedback),
// Fp8Rows / quantize_rows_fp8 / dequantize_rows_fp8 (fp8 e4m3 payloads with one fp32
// scale per row) and Fp8TokenDispatch (an all_to_all_v of token rows in that format).
//
// These run on host tensors over any Communicator whose device is the CPU (Gloo); the
// quantize/sum loops are plain CPU code. Errors are relative L2 errors against the
// uncompressed result: ||compressed - exact||_2 / ||exact||_2 (0 when exact is all zero
// and so is the difference).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"

namespace troupe::comm {

struct CodecStats {
  uint64_t calls = 0;
  double last_rel_l2_error = 0.0;  // of the latest call (if measured)
  double max_rel_l2_error = 0.0;   // over measured calls
  uint64_t measured_calls = 0;
  uint64_t bytes_uncompressed = 0;  // what fp32 would have sent (this rank, all calls)
  uint64_t bytes_on_wire = 0;       // what was sent (this rank, all calls)

  void record_error(double rel);
};

// ||a - b|| / ||b|| over n floats.
double relative_l2_error(const float* got, const float* exact, size_t n);

// Reduce-scatter of fp32 gradients with bf16 on the wire (sum only).
// run(): grad f32 [size * m] -> out f32 [m] (rank r gets the sum of chunk r).
// With error feedback, the rounding error of this step (grad + residual - bf16(grad +
// residual)) is kept and added to the next step's gradient of the same shape, so the
// error does not accumulate over steps. With measure_error, a second, uncompressed fp32
// reduce-scatter gives the exact result for the stats (doubling the traffic: for tests
// and benchmarks).
class Bf16ReduceScatter {
 public:
  struct Options {
    bool error_feedback = false;
    bool measure_error = false;
  };
  Bf16ReduceScatter(Communicator& comm, Options options) : comm_(comm), options_(options) {}

  // Blocking. Collective: every rank calls it with the same shapes.
  Status run(const Tensor& grad, const Tensor& out, const OpOptions& opts = {});
  const CodecStats& stats() const { return stats_; }
  // The residual carried to the next step (empty without error feedback).
  const std::vector<float>& residual() const { return residual_; }
  void reset_residual() { residual_.clear(); }

 private:
  Communicator& comm_;
  Options options_;
  CodecStats stats_;
  std::vector<float> residual_;
};

// Rows of fp8 e4m3 with one fp32 scale each: value = float(data[r][c]) * scales[r].
struct Fp8Rows {
  Tensor data;    // fp8e4m3 [rows, cols]
  Tensor scales;  // f32 [rows]
};

// Scale per row = amax / 448 (1 for an all-zero row), so each row uses fp8's full range.
// x: f32 or bf16 [rows, cols], host.
Result<Fp8Rows> quantize_rows_fp8(const Tensor& x);
// Back to `dtype` (f32 or bf16) [rows, cols].
Result<Tensor> dequantize_rows_fp8(const Fp8Rows& q, DType dtype);

// Fast fp8 e4m3 conversions used by the codecs: bit-identical to core's convert_dtype
// (round to nearest even, saturation to ±448, NaN kept), checked against it in the tests.
void encode_fp8e4m3(const float* src, uint8_t* dst, size_t n, float inv_scale);
void decode_fp8e4m3(const uint8_t* src, float* dst, size_t n, float scale);

// Token dispatch for expert parallelism: rows of `tokens` go to peers by row counts,
// quantised to fp8 e4m3 with per-row scales; the receiver gets them dequantised. Two
// all_to_all_v calls (fp8 data, fp32 scales). The receiver's error equals the sender's
// quantisation error, so the stats measure it at the sender, at no extra traffic.
class Fp8TokenDispatch {
 public:
  explicit Fp8TokenDispatch(Communicator& comm) : comm_(comm) {}

  // tokens: f32/bf16 [sum(send_rows), hidden]; out: same dtype [sum(recv_rows), hidden].
  Status run(const Tensor& tokens, const std::vector<int64_t>& send_rows, const Tensor& out,
             const std::vector<int64_t>& recv_rows, const OpOptions& opts = {});
  const CodecStats& stats() const { return stats_; }

 private:
  Communicator& comm_;
  CodecStats stats_;
};

}  // namespace troupe::comm
