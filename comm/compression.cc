// comm/compression.cc — Bf16ReduceScatter, fp8 row quantisation and Fp8TokenDispatch.
#include "comm/compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/fp8.h"

namespace troupe::comm {

void CodecStats::record_error(double rel) {
  last_rel_l2_error = rel;
  max_rel_l2_error = std::max(max_rel_l2_error, rel);
  ++measured_calls;
}

double relative_l2_error(const float* got, const float* exact, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    double d = static_cast<double>(got[i]) - static_cast<double>(exact[i]);
    num += d * d;
    den += static_cast<double>(exact[i]) * exact[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Same rounding as core's float_to_bf16_bits (nearest even, NaN kept quiet), inlined so
// the codec loops vectorise.
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct DecodeTable {
  float value[256];
  DecodeTable() {
    for (int i = 0; i < 256; ++i) value[i] = fp8e4m3_bits_to_float(static_cast<uint8_t>(i));
  }
};

Status check_host(const Tensor& t, std::string_view what) {
  if (!t.defined()) return invalid_argument("{}: tensor undefined", what);
  if (!t.device().is_cpu()) return invalid_argument("{}: codecs take host tensors, got {}", what, t.describe());
  if (!t.is_contiguous()) return invalid_argument("{}: tensor {} not contiguous", what, t.describe());
  return ok_status();
}
}  // namespace

Status Bf16ReduceScatter::run(const Tensor& grad, const Tensor& out, const OpOptions& opts) {
  TROUPE_RETURN_IF_ERROR(check_host(grad, "bf16 reduce-scatter grad"));
  TROUPE_RETURN_IF_ERROR(check_host(out, "bf16 reduce-scatter out"));
  if (grad.dtype() != DType::kF32 || out.dtype() != DType::kF32) {
    return invalid_argument("bf16 reduce-scatter: gradients and output are f32 (got {} and {})",
                            dtype_name(grad.dtype()), dtype_name(out.dtype()));
  }
  const int n = comm_.size();
  const int64_t m = out.numel();
  if (grad.numel() != m * n) {
    return invalid_argument("bf16 reduce-scatter: grad has {} elements, expected {} x {}", grad.numel(), n, m);
  }
  const size_t total = static_cast<size_t>(grad.numel());
  const float* g = grad.data<float>();

  // Compensated input, rounded once to bf16 (one pass: round, keep the residual).
  Tensor wire = Tensor::empty({static_cast<int64_t>(total)}, DType::kBF16);
  auto* w = static_cast<uint16_t*>(wire.data_ptr());
  if (options_.error_feedback) {
    if (residual_.size() != total) residual_.assign(total, 0.0f);
    for (size_t i = 0; i < total; ++i) {
      const float x = g[i] + residual_[i];
      w[i] = to_bf16(x);
      residual_[i] = x - from_bf16(w[i]);
    }
  } else {
    for (size_t i = 0; i < total; ++i) w[i] = to_bf16(g[i]);
  }

  // Chunk r of every rank lands as chunk (sender) on rank r; sum in fp32 in rank order.
  Tensor gathered = Tensor::empty({static_cast<int64_t>(total)}, DType::kBF16);
  TROUPE_RETURN_IF_ERROR(comm_.all_to_all(wire, gathered, opts)->wait());
  const auto* in = static_cast<const uint16_t*>(gathered.data_ptr());
  float* o = out.data<float>();
  for (int64_t i = 0; i < m; ++i) o[i] = from_bf16(in[i]);
  for (int r = 1; r < n; ++r) {
    const uint16_t* chunk = in + static_cast<size_t>(r) * m;
    for (int64_t i = 0; i < m; ++i) o[i] += from_bf16(chunk[i]);
  }

  ++stats_.calls;
  stats_.bytes_uncompressed += total / n * (n - 1) * sizeof(float);
  stats_.bytes_on_wire += total / n * (n - 1) * sizeof(uint16_t);
  if (options_.measure_error) {
    Tensor exact = Tensor::empty({m}, DType::kF32);
    TROUPE_RETURN_IF_ERROR(comm_.reduce_scatter(grad, exact, ReduceOp::kSum, opts)->wait());
    stats_.record_error(relative_l2_error(o, exact.data<float>(), static_cast<size_t>(m)));
  }
  return ok_status();
}

void encode_fp8e4m3(const float* src, uint8_t* dst, size_t n, float inv_scale) {
  for (size_t i = 0; i < n; ++i) dst[i] = fp8e4m3_encode(src[i] * inv_scale);
}

void decode_fp8e4m3(const uint8_t* src, float* dst, size_t n, float scale) {
  static const DecodeTable table;
  for (size_t i = 0; i < n; ++i) dst[i] = table.value[src[i]] * scale;
}

Result<Fp8Rows> quantize_rows_fp8(const Tensor& x) {
  TROUPE_RETURN_IF_ERROR(check_host(x, "quantize_rows_fp8"));
  if (x.dim() != 2) return invalid_argument("quantize_rows_fp8: expected [rows, cols], got {}", x.describe());
  if (x.dtype() != DType::kF32 && x.dtype() != DType::kBF16) {
    return invalid_argument("quantize_rows_fp8: takes f32 or bf16, got {}", dtype_name(x.dtype()));
  }
  const int64_t rows = x.size(0), cols = x.size(1);
  Fp8Rows q{Tensor::empty({rows, cols}, DType::kF8E4M3), Tensor::empty({rows}, DType::kF32)};
  if (rows == 0) return q;
  if (cols == 0) {
    q.scales.fill(1.0f);
    return q;
  }
  std::vector<float> row(cols);
  auto* data = static_cast<uint8_t*>(q.data.data_ptr());
  float* scales = q.scales.data<float>();
  const size_t esize = x.element_size();
  for (int64_t r = 0; r < rows; ++r) {
    convert_dtype(static_cast<const uint8_t*>(x.data_ptr()) + r * cols * esize, x.dtype(), row.data(), DType::kF32,
                  cols);
    float amax = 0.0f;
    for (float v : row) amax = std::max(amax, std::fabs(v));
    float scale = (amax > 0.0f && std::isfinite(amax)) ? amax / kFp8E4M3Max : 1.0f;
    // x / scale, as a multiplication by the reciprocal computed once per row.
    encode_fp8e4m3(row.data(), data + r * cols, cols, 1.0f / scale);
    scales[r] = scale;
  }
  return q;
}

Result<Tensor> dequantize_rows_fp8(const Fp8Rows& q, DType dtype) {
  TROUPE_RETURN_IF_ERROR(check_host(q.data, "dequantize_rows_fp8 data"));
  TROUPE_RETURN_IF_ERROR(check_host(q.scales, "dequantize_rows_fp8 scales"));
  if (q.data.dim() != 2 || q.data.dtype() != DType::kF8E4M3 || q.scales.dtype() != DType::kF32 ||
      q.scales.numel() != q.data.size(0)) {
    return invalid_argument("dequantize_rows_fp8: expected fp8e4m3 [rows, cols] and f32 [rows], got {} and {}",
                            q.data.describe(), q.scales.describe());
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return invalid_argument("dequantize_rows_fp8: produces f32 or bf16, not {}", dtype_name(dtype));
  }
  const int64_t rows = q.data.size(0), cols = q.data.size(1);
  Tensor out = Tensor::empty({rows, cols}, dtype);
  if (rows == 0 || cols == 0) return out;
  std::vector<float> row(cols);
  const auto* data = static_cast<const uint8_t*>(q.data.data_ptr());
  const float* scales = q.scales.data<float>();
  const size_t esize = out.element_size();
  for (int64_t r = 0; r < rows; ++r) {
    decode_fp8e4m3(data + r * cols, row.data(), cols, scales[r]);
    convert_dtype(row.data(), DType::kF32, static_cast<uint8_t*>(out.data_ptr()) + r * cols * esize, dtype, cols);
  }
  return out;
}

Status Fp8TokenDispatch::run(const Tensor& tokens, const std::vector<int64_t>& send_rows, const Tensor& out,
                             const std::vector<int64_t>& recv_rows, const OpOptions& opts) {
  TROUPE_RETURN_IF_ERROR(check_host(tokens, "fp8 dispatch tokens"));
  TROUPE_RETURN_IF_ERROR(check_host(out, "fp8 dispatch out"));
  if (tokens.dim() != 2 || out.dim() != 2 || tokens.size(1) != out.size(1) || tokens.dtype() != out.dtype()) {
    return invalid_argument("fp8 dispatch: tokens {} and out {} must be [rows, hidden] of one dtype and hidden size",
                            tokens.describe(), out.describe());
  }
  const int n = comm_.size();
  TROUPE_RETURN_IF_ERROR(detail::check_counts(send_rows, n, tokens.size(0), "fp8 dispatch send_rows"));
  TROUPE_RETURN_IF_ERROR(detail::check_counts(recv_rows, n, out.size(0), "fp8 dispatch recv_rows"));
  const int64_t hidden = tokens.size(1);
  TROUPE_ASSIGN_OR_RETURN(Fp8Rows q, quantize_rows_fp8(tokens));

  std::vector<int64_t> send_elems(n), recv_elems(n);
  for (int p = 0; p < n; ++p) {
    send_elems[p] = send_rows[p] * hidden;
    recv_elems[p] = recv_rows[p] * hidden;
  }
  Fp8Rows got{Tensor::empty({out.size(0), hidden}, DType::kF8E4M3), Tensor::empty({out.size(0)}, DType::kF32)};
  WorkPtr wd = comm_.all_to_all_v(q.data, send_elems, got.data, recv_elems, opts);
  WorkPtr ws = comm_.all_to_all_v(q.scales, send_rows, got.scales, recv_rows, opts);
  TROUPE_RETURN_IF_ERROR(wd->wait());
  TROUPE_RETURN_IF_ERROR(ws->wait());
  TROUPE_ASSIGN_OR_RETURN(Tensor deq, dequantize_rows_fp8(got, out.dtype()));
  if (out.nbytes() > 0) std::memcpy(out.data_ptr(), deq.data_ptr(), out.nbytes());

  // Sender-side error (what every receiver of our rows sees), excluding rows kept locally.
  ++stats_.calls;
  const int64_t remote_rows = tokens.size(0) - send_rows[comm_.rank()];
  stats_.bytes_uncompressed += remote_rows * hidden * sizeof(float);
  stats_.bytes_on_wire += remote_rows * (hidden + sizeof(float));
  if (tokens.numel() > 0) {
    TROUPE_ASSIGN_OR_RETURN(Tensor back, dequantize_rows_fp8(q, DType::kF32));
    std::vector<float> exact = tokens.to_floats();
    stats_.record_error(relative_l2_error(back.data<float>(), exact.data(), exact.size()));
  }
  return ok_status();
}

}  // namespace troupe::comm
