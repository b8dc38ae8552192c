// training/parallel/attention_shard.cc — Ulysses attention: pack/unpack around the two
// all-to-alls, and the forward/backward chain over layers::Attention's separable steps.
// Host tensors are packed with memcpy loops; device tensors (CommTime in device mode) with
// strided 2-D copies on the compute stream, in the activation dtype (bf16 on the wire).
// The transfers go through CommTime::launch/await (the communication side).
#include "training/parallel/attention_shard.h"

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

AttentionShard::AttentionShard(layers::Attention& attn, comm::Communicator& group, CommTime& time,
                               bool overlap)
    : attn_(attn), group_(group), time_(time), overlap_(overlap) {}

AttentionShard::Switch AttentionShard::launch(const Tensor& x_in, bool to_head) {
  const bool dev = !x_in.device().is_cpu();
  const Tensor x = dev ? x_in : x_in.contiguous();
  const int64_t n = group_.size();
  Switch sw;
  sw.to_head = to_head;
  sw.b = x.size(0), sw.s = x.size(1), sw.h = x.size(2), sw.dh = x.size(3);
  sw.dtype = x.dtype();
  const int64_t b = sw.b, dh = sw.dh;
  if (dev) TROUPE_CHECK(x.is_contiguous(), "Ulysses: {} is not contiguous", x.describe());
  if (to_head) {
    // Send chunk p (to rank p) = heads [p*hl, (p+1)*hl) of every local token, [b][s][hl][dh].
    const int64_t sl = sw.s, h = sw.h;
    TROUPE_CHECK(h % n == 0, "Ulysses: {} heads do not split over {} ranks", h, n);
    const int64_t hl = h / n, row = hl * dh;
    if (dev) {
      const layers::Ctx& c = *time_.device_ctx();
      const size_t es = x.element_size();
      const size_t rowb = static_cast<size_t>(row) * es;
      const size_t chunk = static_cast<size_t>(b * sl) * rowb;
      sw.send = c.empty({n * b * sl * row}, x.dtype());
      for (int64_t p = 0; p < n; ++p) {
        copy_2d(c, sw.send, static_cast<size_t>(p) * chunk, rowb, x, static_cast<size_t>(p) * rowb,
                static_cast<size_t>(h * dh) * es, rowb, static_cast<size_t>(b * sl));
      }
      sw.recv = c.empty(sw.send.shape(), x.dtype());
    } else {
      sw.send = Tensor::empty({n * b * sl * row}, DType::kF32);
      const float* src = x.data<float>();
      float* sp = sw.send.data<float>();
      for (int64_t p = 0; p < n; ++p)
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t si = 0; si < sl; ++si)
            std::memcpy(sp + ((p * b + bi) * sl + si) * row, src + ((bi * sl + si) * h + p * hl) * dh,
                        static_cast<size_t>(row) * sizeof(float));
      sw.recv = Tensor::empty(sw.send.shape(), DType::kF32);
    }
  } else {
    // Send chunk p = positions [p*sl, (p+1)*sl) of every sequence, local heads, [b][s][hl][dh].
    const int64_t s = sw.s, hl = sw.h;
    TROUPE_CHECK(s % n == 0, "Ulysses: sequence {} does not split over {} ranks", s, n);
    const int64_t sl = s / n, row = hl * dh;
    if (dev) {
      const layers::Ctx& c = *time_.device_ctx();
      const size_t es = x.element_size();
      const size_t rowb = static_cast<size_t>(row) * es;
      const size_t chunk = static_cast<size_t>(b * sl) * rowb;
      sw.send = c.empty({n * b * sl * row}, x.dtype());
      for (int64_t p = 0; p < n; ++p) {
        copy_2d(c, sw.send, static_cast<size_t>(p) * chunk, static_cast<size_t>(sl) * rowb, x,
                static_cast<size_t>(p * sl) * rowb, static_cast<size_t>(s) * rowb,
                static_cast<size_t>(sl) * rowb, static_cast<size_t>(b));
      }
      sw.recv = c.empty(sw.send.shape(), x.dtype());
    } else {
      sw.send = Tensor::empty({n * b * sl * row}, DType::kF32);
      const float* src = x.data<float>();
      float* sp = sw.send.data<float>();
      for (int64_t p = 0; p < n; ++p)
        for (int64_t bi = 0; bi < b; ++bi)
          std::memcpy(sp + (p * b + bi) * sl * row, src + (bi * s + p * sl) * row,
                      static_cast<size_t>(sl * row) * sizeof(float));
      sw.recv = Tensor::empty(sw.send.shape(), DType::kF32);
    }
  }
  if (n > 1) {
    sw.op = time_.launch([&](const comm::OpOptions& o) { return group_.all_to_all(sw.send, sw.recv, o); },
                         to_head ? "ulysses seq->head" : "ulysses head->seq");
  } else if (dev) {
    kernels::cast(time_.device_ctx()->ex, sw.send, sw.recv);
  } else {
    sw.recv.copy_from(sw.send);
  }
  return sw;
}

Tensor AttentionShard::finish(Switch& sw) {
  time_.await(sw.op);
  const int64_t n = group_.size();
  const bool dev = !sw.recv.device().is_cpu();
  const int64_t b = sw.b, dh = sw.dh;
  Tensor out;
  if (sw.to_head) {
    // Chunk q came from rank q: its tokens are positions [q*sl, (q+1)*sl) of each sequence.
    const int64_t sl = sw.s, hl = sw.h / n, row = hl * dh;
    if (dev) {
      const layers::Ctx& c = *time_.device_ctx();
      const size_t rowb = static_cast<size_t>(row) * sw.recv.element_size();
      const size_t chunk = static_cast<size_t>(b * sl) * rowb;
      out = c.empty({b, n * sl, hl, dh}, sw.dtype);
      for (int64_t q = 0; q < n; ++q) {
        copy_2d(c, out, static_cast<size_t>(q * sl) * rowb, static_cast<size_t>(n * sl) * rowb, sw.recv,
                static_cast<size_t>(q) * chunk, static_cast<size_t>(sl) * rowb,
                static_cast<size_t>(sl) * rowb, static_cast<size_t>(b));
      }
    } else {
      out = Tensor::empty({b, n * sl, hl, dh}, DType::kF32);
      const float* rp = sw.recv.data<float>();
      float* op = out.data<float>();
      for (int64_t q = 0; q < n; ++q)
        for (int64_t bi = 0; bi < b; ++bi)
          std::memcpy(op + (bi * n * sl + q * sl) * row, rp + (q * b + bi) * sl * row,
                      static_cast<size_t>(sl * row) * sizeof(float));
    }
  } else {
    // Chunk q holds heads [q*hl, (q+1)*hl) of our local tokens.
    const int64_t sl = sw.s / n, hl = sw.h, h = hl * n, row = hl * dh;
    if (dev) {
      const layers::Ctx& c = *time_.device_ctx();
      const size_t es = sw.recv.element_size();
      const size_t rowb = static_cast<size_t>(row) * es;
      const size_t chunk = static_cast<size_t>(b * sl) * rowb;
      out = c.empty({b, sl, h, dh}, sw.dtype);
      for (int64_t q = 0; q < n; ++q) {
        copy_2d(c, out, static_cast<size_t>(q) * rowb, static_cast<size_t>(h * dh) * es, sw.recv,
                static_cast<size_t>(q) * chunk, rowb, rowb, static_cast<size_t>(b * sl));
      }
    } else {
      out = Tensor::empty({b, sl, h, dh}, DType::kF32);
      const float* rp = sw.recv.data<float>();
      float* op = out.data<float>();
      for (int64_t q = 0; q < n; ++q)
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t si = 0; si < sl; ++si)
            std::memcpy(op + ((bi * sl + si) * h + q * hl) * dh, rp + ((q * b + bi) * sl + si) * row,
                        static_cast<size_t>(row) * sizeof(float));
    }
  }
  sw.send = sw.recv = Tensor();
  return out;
}

Tensor AttentionShard::seq_to_head(const Tensor& x) {
  Switch sw = launch(x, true);
  return finish(sw);
}

Tensor AttentionShard::head_to_seq(const Tensor& y) {
  Switch sw = launch(y, false);
  return finish(sw);
}

std::vector<Tensor> AttentionShard::switch_all(const std::vector<Tensor>& xs, bool to_head) {
  std::vector<Tensor> out;
  if (!overlap_) {
    for (const Tensor& x : xs) out.push_back(to_head ? seq_to_head(x) : head_to_seq(x));
    return out;
  }
  std::vector<Switch> sws;
  for (const Tensor& x : xs) sws.push_back(launch(x, to_head));
  for (Switch& sw : sws) out.push_back(finish(sw));
  return out;
}

Tensor AttentionShard::forward(const layers::Ctx& c, const Tensor& x, int64_t batch, int64_t seq_local,
                               Saved& s) {
  s.x = x;
  // This rank's positions (it holds tokens [r * seq_local, (r + 1) * seq_local) of each
  // sequence), uploaded once.
  s.pos = attn_.device_positions(c, batch, seq_local, group_.rank() * seq_local);
  Tensor q, k, v;
  attn_.project_qkv(c, x, s.pos, batch, seq_local, q, k, v, nullptr, &s.qk_norm);
  std::vector<Tensor> qkv = switch_all({q, k, v}, true);
  s.q = qkv[0];
  s.k = qkv[1];
  s.v = qkv[2];
  attn_.core_forward(c, s.q, s.k, s.v, s.out, s.lse);
  s.out_seq = head_to_seq(s.out);
  return attn_.project_out(c, s.out_seq);
}

Tensor AttentionShard::backward(const layers::Ctx& c, const Tensor& dy, const Saved& s) {
  Tensor dout_seq = attn_.project_out_backward(c, dy, s.out_seq);
  Tensor dout = seq_to_head(dout_seq);
  Tensor dq, dk, dv;
  attn_.core_backward(c, s.q, s.k, s.v, s.out, s.lse, dout, dq, dk, dv);
  std::vector<Tensor> d = switch_all({dq, dk, dv}, false);
  return attn_.project_qkv_backward(c, s.x, s.pos, d[0], d[1], d[2], false, &s.qk_norm);
}

}  // namespace troupe::training
