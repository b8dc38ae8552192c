// actors/training/attention_shard.cc — Ulysses attention: pack/unpack around the two
// all-to-alls, and the forward/backward chain over layers::Attention's separable steps.
// Host tensors are packed with memcpy loops; device tensors (CommTime in device mode) with
// strided 2-D copies on the compute stream, in the activation dtype (bf16 on the wire).
#include "actors/training/attention_shard.h"

#include <cstring>

#include "core/check.h"

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda/stream.h"
#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::training {

namespace {

// height rows of `width` bytes: row i from src + i*spitch to dst + i*dpitch, on the device
// Ctx's stream (byte offsets into two contiguous device tensors).
void copy_2d(const layers::Ctx& c, const Tensor& dst, size_t doff, size_t dpitch, const Tensor& src,
             size_t soff, size_t spitch, size_t width, size_t height) {
  if (width == 0 || height == 0) return;
#if TROUPE_HAVE_CUDA
  auto* d = static_cast<char*>(dst.data_ptr()) + doff;
  const auto* s = static_cast<const char*>(src.data_ptr()) + soff;
  cuda::DeviceGuard guard(c.ex.device.index);
  CUDA_CHECK(
      cudaMemcpy2DAsync(d, dpitch, s, spitch, width, height, cudaMemcpyDeviceToDevice, c.ex.cuda->stream));
#else
  (void)c, (void)dst, (void)doff, (void)dpitch, (void)src, (void)soff, (void)spitch;
  TROUPE_CHECK(false, "AttentionShard: device tensors in a build without CUDA");
#endif
}

}  // namespace

Tensor AttentionShard::seq_to_head_device(const Tensor& x) {
  const layers::Ctx& c = *time_.device_ctx();
  const int64_t n = group_.size();
  const int64_t b = x.size(0), sl = x.size(1), h = x.size(2), dh = x.size(3);
  TROUPE_CHECK(h % n == 0, "Ulysses: {} heads do not split over {} ranks", h, n);
  TROUPE_CHECK(x.is_contiguous(), "Ulysses: {} is not contiguous", x.describe());
  const size_t es = x.element_size();
  const int64_t hl = h / n;
  const size_t row = static_cast<size_t>(hl * dh) * es;  // bytes of one token's local heads
  const size_t chunk = static_cast<size_t>(b * sl) * row;
  Tensor send = c.empty({n * b * sl * hl * dh}, x.dtype());
  for (int64_t p = 0; p < n; ++p) {
    copy_2d(c, send, static_cast<size_t>(p) * chunk, row, x, static_cast<size_t>(p) * row,
            static_cast<size_t>(h * dh) * es, row, static_cast<size_t>(b * sl));
  }
  Tensor recv = c.empty(send.shape(), x.dtype());
  time_.issue(group_.all_to_all(send, recv, time_.op_options()), "ulysses seq->head");
  Tensor out = c.empty({b, n * sl, hl, dh}, x.dtype());
  for (int64_t q = 0; q < n; ++q) {
    copy_2d(c, out, static_cast<size_t>(q * sl) * row, static_cast<size_t>(n * sl) * row, recv,
            static_cast<size_t>(q) * chunk, static_cast<size_t>(sl) * row, static_cast<size_t>(sl) * row,
            static_cast<size_t>(b));
  }
  return out;
}

Tensor AttentionShard::head_to_seq_device(const Tensor& y) {
  const layers::Ctx& c = *time_.device_ctx();
  const int64_t n = group_.size();
  const int64_t b = y.size(0), s = y.size(1), hl = y.size(2), dh = y.size(3);
  TROUPE_CHECK(s % n == 0, "Ulysses: sequence {} does not split over {} ranks", s, n);
  TROUPE_CHECK(y.is_contiguous(), "Ulysses: {} is not contiguous", y.describe());
  const size_t es = y.element_size();
  const int64_t sl = s / n, h = hl * n;
  const size_t row = static_cast<size_t>(hl * dh) * es;
  const size_t chunk = static_cast<size_t>(b * sl) * row;
  Tensor send = c.empty({n * b * sl * hl * dh}, y.dtype());
  for (int64_t p = 0; p < n; ++p) {
    copy_2d(c, send, static_cast<size_t>(p) * chunk, static_cast<size_t>(sl) * row, y,
            static_cast<size_t>(p * sl) * row, static_cast<size_t>(s) * row, static_cast<size_t>(sl) * row,
            static_cast<size_t>(b));
  }
  Tensor recv = c.empty(send.shape(), y.dtype());
  time_.issue(group_.all_to_all(send, recv, time_.op_options()), "ulysses head->seq");
  Tensor out = c.empty({b, sl, h, dh}, y.dtype());
  for (int64_t q = 0; q < n; ++q) {
    copy_2d(c, out, static_cast<size_t>(q) * row, static_cast<size_t>(h * dh) * es, recv,
            static_cast<size_t>(q) * chunk, row, row, static_cast<size_t>(b * sl));
  }
  return out;
}

AttentionShard::AttentionShard(layers::Attention& attn, comm::Communicator& group, CommTime& time)
    : attn_(attn), group_(group), time_(time) {}

Tensor AttentionShard::seq_to_head(const Tensor& x) {
  if (!x.device().is_cpu()) return seq_to_head_device(x);
  const int64_t n = group_.size();
  const int64_t b = x.size(0), sl = x.size(1), h = x.size(2), dh = x.size(3);
  TROUPE_CHECK(h % n == 0, "Ulysses: {} heads do not split over {} ranks", h, n);
  const int64_t hl = h / n, row = hl * dh;
  const Tensor xc = x.contiguous();
  // Send chunk p (to rank p) = heads [p*hl, (p+1)*hl) of every local token, [b][s][hl][dh].
  Tensor send = Tensor::empty({n * b * sl * row}, DType::kF32);
  const float* src = xc.data<float>();
  float* sp = send.data<float>();
  for (int64_t p = 0; p < n; ++p)
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t si = 0; si < sl; ++si)
        std::memcpy(sp + ((p * b + bi) * sl + si) * row, src + ((bi * sl + si) * h + p * hl) * dh,
                    static_cast<size_t>(row) * sizeof(float));
  Tensor recv = Tensor::empty(send.shape(), DType::kF32);
  if (n > 1) {
    time_.wait(group_.all_to_all(send, recv), "ulysses seq->head");
  } else {
    recv.copy_from(send);
  }
  // Chunk q came from rank q: its tokens are positions [q*sl, (q+1)*sl) of each sequence.
  Tensor out = Tensor::empty({b, n * sl, hl, dh}, DType::kF32);
  const float* rp = recv.data<float>();
  float* op = out.data<float>();
  for (int64_t q = 0; q < n; ++q)
    for (int64_t bi = 0; bi < b; ++bi)
      std::memcpy(op + (bi * n * sl + q * sl) * row, rp + (q * b + bi) * sl * row,
                  static_cast<size_t>(sl * row) * sizeof(float));
  return out;
}

Tensor AttentionShard::head_to_seq(const Tensor& y) {
  if (!y.device().is_cpu()) return head_to_seq_device(y);
  const int64_t n = group_.size();
  const int64_t b = y.size(0), s = y.size(1), hl = y.size(2), dh = y.size(3);
  TROUPE_CHECK(s % n == 0, "Ulysses: sequence {} does not split over {} ranks", s, n);
  const int64_t sl = s / n, row = hl * dh;
  const Tensor yc = y.contiguous();
  // Send chunk p = positions [p*sl, (p+1)*sl) of every sequence, local heads, [b][s][hl][dh].
  Tensor send = Tensor::empty({n * b * sl * row}, DType::kF32);
  const float* src = yc.data<float>();
  float* sp = send.data<float>();
  for (int64_t p = 0; p < n; ++p)
    for (int64_t bi = 0; bi < b; ++bi)
      std::memcpy(sp + (p * b + bi) * sl * row, src + (bi * s + p * sl) * row,
                  static_cast<size_t>(sl * row) * sizeof(float));
  Tensor recv = Tensor::empty(send.shape(), DType::kF32);
  if (n > 1) {
    time_.wait(group_.all_to_all(send, recv), "ulysses head->seq");
  } else {
    recv.copy_from(send);
  }
  // Chunk q holds heads [q*hl, (q+1)*hl) of our local tokens.
  const int64_t h = hl * n;
  Tensor out = Tensor::empty({b, sl, h, dh}, DType::kF32);
  const float* rp = recv.data<float>();
  float* op = out.data<float>();
  for (int64_t q = 0; q < n; ++q)
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t si = 0; si < sl; ++si)
        std::memcpy(op + ((bi * sl + si) * h + q * hl) * dh, rp + ((q * b + bi) * sl + si) * row,
                    static_cast<size_t>(row) * sizeof(float));
  return out;
}

Tensor AttentionShard::forward(const layers::Ctx& c, const Tensor& x, int64_t batch, int64_t seq_local, Saved& s) {
  const int64_t r = group_.rank();
  std::vector<int32_t> pos(static_cast<size_t>(batch * seq_local));
  for (int64_t i = 0; i < batch * seq_local; ++i) {
    pos[static_cast<size_t>(i)] = static_cast<int32_t>(r * seq_local + i % seq_local);
  }
  s.x = x;
  s.pos = c.to_device(Tensor::from_ints({batch * seq_local}, pos));
  Tensor q, k, v;
  attn_.project_qkv(c, x, s.pos, batch, seq_local, q, k, v);
  s.q = seq_to_head(q);
  s.k = seq_to_head(k);
  s.v = seq_to_head(v);
  attn_.core_forward(c, s.q, s.k, s.v, s.out, s.lse);
  s.out_seq = head_to_seq(s.out);
  return attn_.project_out(c, s.out_seq);
}

Tensor AttentionShard::backward(const layers::Ctx& c, const Tensor& dy, const Saved& s) {
  Tensor dout_seq = attn_.project_out_backward(c, dy, s.out_seq);
  Tensor dout = seq_to_head(dout_seq);
  Tensor dq, dk, dv;
  attn_.core_backward(c, s.q, s.k, s.v, s.out, s.lse, dout, dq, dk, dv);
  Tensor dq_s = head_to_seq(dq);
  Tensor dk_s = head_to_seq(dk);
  Tensor dv_s = head_to_seq(dv);
  return attn_.project_qkv_backward(c, s.x, s.pos, dq_s, dk_s, dv_s);
}

}  // namespace troupe::training
