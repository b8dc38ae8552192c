// training/moe/expert_group.cc — ExpertGroup: the all-to-all and all-gather dispatch
// paths, the same code for host and device tensors. Rows move with kernels/ops.h calls
// (moe_permute/unpermute and their backward, and on a device a row gather,
// kernels::embedding_forward over i32 row indices; host code gathers with memcpy); only the
// per-expert counts (a2a) or the gathered routing (all-gather) reach the host, once per
// MoE block.
#include "training/moe/expert_group.h"

#include <chrono>
#include <cstring>

#include "comm/compression.h"
#include "core/check.h"

#if TROUPE_HAVE_CUDA
#include "kernels/cuda/context.h"
#include "kernels/cuda/peer_rows.h"
#endif

namespace troupe::training {

namespace {

// One token chunk of the all-to-all path.
struct A2AChunk {
  int64_t lo = 0, len = 0;    // tokens [lo, lo + len)
  Tensor row_map, gates, yp;  // plan, gates [len, k], combine input
  layers::Experts::Saved experts;
  std::vector<int64_t> order;  // expert-major position -> row of the received (source-major) buffer
  std::vector<int64_t> send_rows, recv_rows;
  Tensor order_dev, inverse_dev;  // device: order and its inverse permutation (i32)
  Tensor loc_off;                 // i32 [el + 1] expert offsets of the received rows
  int64_t rows = 0, rrows = 0;
  // In flight: the wire buffers of the transfer launched last.
  CommOp op, op_scales;
  Tensor in, out, in_scales, out_scales;
};

struct A2AState final : layers::DispatchState {
  std::vector<A2AChunk> chunks;
  int64_t tokens = 0;
};

struct AGState final : layers::DispatchState {
  Tensor ye, gates_all;  // local expert outputs [Re, D]; gathered gates [n*T, k]
  Tensor row_map;        // i32 [n*T*k]: row of each gathered copy among the local rows, -1 if not local
  layers::Experts::Saved experts;
  int64_t tokens = 0;  // local T
};

// The device-driven all-to-all path (Options::peer): one token chunk.
struct PeerChunk {
  int64_t lo = 0, len = 0;
  Tensor row_map, topk, gates, yp;  // plan, ids and gates [len, k], combine result
  Tensor local;                     // i32 [el + 1] local expert offsets in the chunk's region
  layers::Experts::Saved experts;
  CommOp op;
};

struct PeerState final : layers::DispatchState {
  std::vector<PeerChunk> chunks;
  Tensor shift;  // i32 [nc, E] (kernels/cuda/peer_rows.h)
  int64_t tokens = 0;
};

std::vector<int32_t> host_ints(const Tensor& t) {
  const Tensor c = t.contiguous();
  const int32_t* p = c.data<int32_t>();
  return std::vector<int32_t>(p, p + c.numel());
}

// Device: dst[i] = src[idx[i]] (idx i32 on the device), a gather of whole rows.
void gather_rows_device(const layers::Ctx& c, const Tensor& src, const Tensor& idx, Tensor& dst) {
  kernels::embedding_forward(c.ex, idx, src, dst);
}

}  // namespace

ExpertGroup::ExpertGroup(layers::MoELayer& moe, comm::Communicator& group, CommTime& time, DispatchMode mode,
                         Options options)
    : local_(moe.experts),
      num_experts_(moe.router.cfg.num_experts),
      top_k_(moe.router.cfg.top_k),
      group_(group),
      time_(time),
      mode_(mode),
      options_(options) {
  const int64_t n = group.size();
  TROUPE_CHECK(num_experts_ % n == 0, "ExpertGroup: {} experts do not split over {} ranks", num_experts_, n);
  local_experts_ = num_experts_ / n;
  first_ = group.rank() * local_experts_;
  TROUPE_CHECK(moe.first_expert() == first_ && moe.experts.w1.value.size(0) == local_experts_,
               "ExpertGroup: rank {} of {} owns experts [{}, {}), but its MoE layer holds [{}, {})",
               group.rank(), n, first_, first_ + local_experts_, moe.first_expert(),
               moe.first_expert() + moe.experts.w1.value.size(0));
}

Tensor ExpertGroup::forward(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx,
                            const Tensor& gates, std::unique_ptr<layers::DispatchState>& state,
                            std::vector<int64_t>& kept) {
  if (mode_ == DispatchMode::kAllToAll && options_.peer && c.on_device()) {
    // Room for the worst case: every rank sends every copy to this one.
    const int64_t rows = group_.size() * top_k_ * x.size(0);
    if (options_.peer->reserve(c, time_, rows, x.size(1) * static_cast<int64_t>(dtype_size(x.dtype())))) {
      kept.clear();  // the counts stay on the device (the loads come with the step's read)
      return forward_peer(c, x, topk_idx, gates, state);
    }
  }
  return mode_ == DispatchMode::kAllToAll ? forward_a2a(c, x, topk_idx, gates, state, kept)
                                          : forward_ag(c, x, topk_idx, gates, state, kept);
}

Tensor ExpertGroup::backward(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state,
                             Tensor& dgates) {
  if (dynamic_cast<PeerState*>(&state) != nullptr) return backward_peer(c, dy, state, dgates);
  return mode_ == DispatchMode::kAllToAll ? backward_a2a(c, dy, state, dgates)
                                          : backward_ag(c, dy, state, dgates);
}

// ---- all-to-all ------------------------------------------------------------------------

namespace {

// Launches the rows `in` [sum(send), dm] to the peers by row counts into a fresh
// [sum(recv), dm] buffer. With `scales` defined, `in` holds fp8 e4m3 codes and scales
// f32 [rows] their per-row scales (moe_permute_fp8): two transfers.
void launch_rows(comm::Communicator& g, const layers::Ctx& c, CommTime& t, const Tensor& in,
                 const std::vector<int64_t>& send, const std::vector<int64_t>& recv, A2AChunk& ch,
                 const std::string& what, const Tensor& scales = Tensor()) {
  const int64_t dm = in.size(1);
  int64_t rrows = 0;
  for (int64_t v : recv) rrows += v;
  ch.in = in;
  ch.out = c.empty({rrows, dm}, in.dtype());
  ch.op = t.launch(
      [&](const comm::OpOptions& o) {
        std::vector<int64_t> sc(send.size()), rc(recv.size());
        for (size_t i = 0; i < sc.size(); ++i) sc[i] = send[i] * dm;
        for (size_t i = 0; i < rc.size(); ++i) rc[i] = recv[i] * dm;
        return g.all_to_all_v(ch.in.view({ch.in.numel()}), sc, ch.out.view({ch.out.numel()}), rc, o);
      },
      what);
  if (!scales.defined()) return;
  ch.in_scales = scales;
  ch.out_scales = c.empty({rrows}, DType::kF32);
  ch.op_scales = t.launch(
      [&](const comm::OpOptions& o) { return g.all_to_all_v(ch.in_scales, send, ch.out_scales, recv, o); },
      what + " (scales)");
}

// Awaits the transfer launch_rows started and returns the received rows in `dtype`
// (fp8 rows dequantised).
Tensor finish_rows(const layers::Ctx& c, CommTime& t, A2AChunk& ch, DType dtype) {
  t.await(ch.op);
  Tensor out = ch.out;
  if (ch.out_scales.defined()) {
    t.await(ch.op_scales);
    out = c.empty(ch.out.shape(), dtype);
    kernels::dequantize_fp8(c.ex, ch.out, ch.out_scales.view({ch.out.size(0), 1}), 0, out);
  }
  ch.in = ch.out = ch.in_scales = ch.out_scales = Tensor();
  return out;
}

}  // namespace

Tensor ExpertGroup::forward_a2a(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx,
                                const Tensor& gates, std::unique_ptr<layers::DispatchState>& state,
                                std::vector<int64_t>& kept) {
  auto st = std::make_unique<A2AState>();
  const int64_t t = x.size(0), dm = x.size(1), e = num_experts_, el = local_experts_, n = group_.size();
  const int64_t nc = std::max<int64_t>(1, std::min<int64_t>(options_.chunks, t));
  const bool fp8 = options_.fp8;
  st->tokens = t;
  st->chunks.resize(static_cast<size_t>(nc));
  // Dropless plan per chunk over all experts: rows grouped by expert, so the rows for
  // rank p's experts are one contiguous block. The counts of every chunk reach the host
  // in one read.
  Tensor counts = c.empty({nc * e}, DType::kI32);
  Tensor offsets = c.empty({e + 1}, DType::kI32);
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st->chunks[static_cast<size_t>(ci)];
    ch.lo = ci * t / nc;
    ch.len = (ci + 1) * t / nc - ch.lo;
    ch.gates = gates.narrow(0, ch.lo, ch.len);
    ch.row_map = c.empty({ch.len * top_k_}, DType::kI32);
    Tensor cnt = counts.narrow(0, ci * e, e);
    kernels::moe_dispatch_plan(c.ex, topk_idx.narrow(0, ch.lo, ch.len), e, -1, ch.row_map, cnt, offsets);
  }
  const std::vector<int32_t> cnt = host_ints(c.to_host(counts));  // [chunk][expert]
  kept.assign(static_cast<size_t>(e), 0);
  for (int64_t ci = 0; ci < nc; ++ci)
    for (int64_t j = 0; j < e; ++j) kept[static_cast<size_t>(j)] += cnt[static_cast<size_t>(ci * e + j)];

  // Counts per (peer, chunk, local expert of the peer) -> per (source, chunk, my local expert).
  Tensor send_cnt = Tensor::empty({n * nc * el}, DType::kI64);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t ci = 0; ci < nc; ++ci)
      for (int64_t j = 0; j < el; ++j)
        send_cnt.data<int64_t>()[(p * nc + ci) * el + j] = cnt[static_cast<size_t>(ci * e + p * el + j)];
  Tensor recv_cnt = Tensor::empty({n * nc * el}, DType::kI64);
  if (c.on_device()) {
    // The counts must reach the host (they size the buffers): the one sync per layer.
    Tensor d_recv = c.empty({n * nc * el}, DType::kI64);
    time_.issue(group_.all_to_all(c.to_device(send_cnt), d_recv, time_.op_options()),
                "expert counts all_to_all");
    const auto c0 = std::chrono::steady_clock::now();
    recv_cnt = c.to_host(d_recv);
    time_.add(std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count(),
              "expert counts sync");
  } else {
    time_.wait(group_.all_to_all(send_cnt, recv_cnt), "expert counts all_to_all");
  }
  const int64_t* rc = recv_cnt.data<int64_t>();
  auto rcount = [&](int64_t q, int64_t ci, int64_t j) { return rc[(q * nc + ci) * el + j]; };

  std::vector<Tensor> xp(static_cast<size_t>(nc)), xs(static_cast<size_t>(nc));  // rows, fp8 scales
  std::vector<int32_t> idx;
  std::vector<int64_t> idx_at(static_cast<size_t>(nc), 0);
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st->chunks[static_cast<size_t>(ci)];
    ch.send_rows.assign(static_cast<size_t>(n), 0);
    ch.recv_rows.assign(static_cast<size_t>(n), 0);
    for (int64_t p = 0; p < n; ++p)
      for (int64_t j = 0; j < el; ++j) {
        ch.send_rows[static_cast<size_t>(p)] += cnt[static_cast<size_t>(ci * e + p * el + j)];
        ch.recv_rows[static_cast<size_t>(p)] += rcount(p, ci, j);
      }
    for (int64_t v : ch.send_rows) ch.rows += v;
    for (int64_t v : ch.recv_rows) ch.rrows += v;
    // Received rows are source-major (then local expert); the GEMMs want expert-major.
    std::vector<int64_t> src_base(static_cast<size_t>(n), 0);
    for (int64_t q = 1; q < n; ++q)
      src_base[static_cast<size_t>(q)] =
          src_base[static_cast<size_t>(q - 1)] + ch.recv_rows[static_cast<size_t>(q - 1)];
    std::vector<int32_t> loc_off(static_cast<size_t>(el + 1), 0);
    ch.order.reserve(static_cast<size_t>(ch.rrows));
    for (int64_t j = 0; j < el; ++j) {
      for (int64_t q = 0; q < n; ++q) {
        int64_t start = src_base[static_cast<size_t>(q)];
        for (int64_t jj = 0; jj < j; ++jj) start += rcount(q, ci, jj);
        for (int64_t i = 0; i < rcount(q, ci, j); ++i) ch.order.push_back(start + i);
      }
      loc_off[static_cast<size_t>(j + 1)] = static_cast<int32_t>(ch.order.size());
    }
    // Index tables of every chunk go to the device in one upload (below): [loc_off,
    // order, inverse] per chunk (order and inverse on a device only).
    idx_at[static_cast<size_t>(ci)] = static_cast<int64_t>(idx.size());
    idx.insert(idx.end(), loc_off.begin(), loc_off.end());
    if (c.on_device()) {
      const size_t base = idx.size();
      idx.resize(base + 2 * ch.order.size());
      for (size_t i = 0; i < ch.order.size(); ++i) {
        idx[base + i] = static_cast<int32_t>(ch.order[i]);
        idx[base + ch.order.size() + static_cast<size_t>(ch.order[i])] = static_cast<int32_t>(i);
      }
    }
    if (fp8) {
      // The permute writes the fp8 codes and per-row scales directly (one pass).
      xp[static_cast<size_t>(ci)] = c.empty({ch.rows, dm}, DType::kF8E4M3);
      xs[static_cast<size_t>(ci)] = c.empty({ch.rows}, DType::kF32);
      kernels::moe_permute_fp8(c.ex, x.narrow(0, ch.lo, ch.len), ch.row_map, top_k_,
                               xp[static_cast<size_t>(ci)], xs[static_cast<size_t>(ci)]);
    } else {
      xp[static_cast<size_t>(ci)] = c.empty({ch.rows, dm});
      kernels::moe_permute(c.ex, x.narrow(0, ch.lo, ch.len), ch.row_map, top_k_, xp[static_cast<size_t>(ci)]);
    }
  }

  const Tensor tables = c.to_device(Tensor::from_ints({static_cast<int64_t>(idx.size())}, idx));
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st->chunks[static_cast<size_t>(ci)];
    const int64_t at = idx_at[static_cast<size_t>(ci)];
    ch.loc_off = tables.narrow(0, at, el + 1);
    if (c.on_device()) {
      ch.order_dev = tables.narrow(0, at + el + 1, ch.rrows);
      ch.inverse_dev = tables.narrow(0, at + el + 1 + ch.rrows, ch.rrows);
    }
  }

  const bool overlap = options_.overlap;
  if (overlap) {
    for (int64_t ci = 0; ci < nc; ++ci) {
      A2AChunk& ch = st->chunks[static_cast<size_t>(ci)];
      launch_rows(group_, c, time_, xp[static_cast<size_t>(ci)], ch.send_rows, ch.recv_rows, ch,
                  "expert dispatch all_to_all_v", xs[static_cast<size_t>(ci)]);
    }
  }
  std::vector<A2AChunk> back(static_cast<size_t>(nc));  // combine transfers
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st->chunks[static_cast<size_t>(ci)];
    if (!overlap) {
      launch_rows(group_, c, time_, xp[static_cast<size_t>(ci)], ch.send_rows, ch.recv_rows, ch,
                  "expert dispatch all_to_all_v", xs[static_cast<size_t>(ci)]);
    }
    Tensor xr = finish_rows(c, time_, ch, x.dtype());
    xp[static_cast<size_t>(ci)] = Tensor();
    Tensor xe = c.empty({ch.rrows, dm});
    if (c.on_device()) {
      gather_rows_device(c, xr, ch.order_dev, xe);
    } else {
      gather_rows(xr, ch.order, xe);
    }
    Tensor ye = local_.forward(c, xe, ch.loc_off, ch.experts);
    Tensor yr = c.empty({ch.rrows, dm});
    if (c.on_device()) {
      gather_rows_device(c, ye, ch.inverse_dev, yr);  // yr[order[i]] = ye[i]
    } else {
      scatter_rows(ye, ch.order, yr);
    }
    A2AChunk& bk = back[static_cast<size_t>(ci)];
    launch_rows(group_, c, time_, yr, ch.recv_rows, ch.send_rows, bk, "expert combine all_to_all_v");
    if (!overlap) ch.yp = finish_rows(c, time_, bk, x.dtype());
  }
  Tensor y = c.empty(x.shape());
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st->chunks[static_cast<size_t>(ci)];
    if (overlap) ch.yp = finish_rows(c, time_, back[static_cast<size_t>(ci)], x.dtype());
    Tensor yc = y.narrow(0, ch.lo, ch.len);
    kernels::moe_unpermute(c.ex, ch.yp, ch.row_map, ch.gates, yc);
  }
  state = std::move(st);
  return y;
}

Tensor ExpertGroup::backward_a2a(const layers::Ctx& c, const Tensor& dy_in, layers::DispatchState& state,
                                 Tensor& dgates) {
  auto& st = static_cast<A2AState&>(state);
  const Tensor dy = dy_in.contiguous();
  const int64_t dm = dy.size(1), nc = static_cast<int64_t>(st.chunks.size());
  const bool overlap = options_.overlap;
  dgates = c.empty({st.tokens, top_k_}, DType::kF32);  // gate gradients are f32, like the gates
  std::vector<Tensor> dyp(static_cast<size_t>(nc));
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st.chunks[static_cast<size_t>(ci)];
    dyp[static_cast<size_t>(ci)] = c.empty(ch.yp.shape());
    Tensor dg = dgates.narrow(0, ch.lo, ch.len);
    kernels::moe_unpermute_backward(c.ex, dy.narrow(0, ch.lo, ch.len), ch.yp, ch.row_map, ch.gates,
                                    dyp[static_cast<size_t>(ci)], dg);
    if (overlap) {
      launch_rows(group_, c, time_, dyp[static_cast<size_t>(ci)], ch.send_rows, ch.recv_rows, ch,
                  "expert grad dispatch all_to_all_v");
    }
  }
  std::vector<A2AChunk> back(static_cast<size_t>(nc));
  std::vector<Tensor> dxp(static_cast<size_t>(nc));
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st.chunks[static_cast<size_t>(ci)];
    if (!overlap) {
      launch_rows(group_, c, time_, dyp[static_cast<size_t>(ci)], ch.send_rows, ch.recv_rows, ch,
                  "expert grad dispatch all_to_all_v");
    }
    Tensor dyr = finish_rows(c, time_, ch, dy.dtype());
    dyp[static_cast<size_t>(ci)] = Tensor();
    Tensor dye = c.empty({ch.rrows, dm});
    if (c.on_device()) {
      gather_rows_device(c, dyr, ch.order_dev, dye);
    } else {
      gather_rows(dyr, ch.order, dye);
    }
    Tensor dxe = local_.backward(c, dye, ch.experts);
    ch.experts = layers::Experts::Saved();
    Tensor dxr = c.empty({ch.rrows, dm});
    if (c.on_device()) {
      gather_rows_device(c, dxe, ch.inverse_dev, dxr);
    } else {
      scatter_rows(dxe, ch.order, dxr);
    }
    A2AChunk& bk = back[static_cast<size_t>(ci)];
    launch_rows(group_, c, time_, dxr, ch.recv_rows, ch.send_rows, bk, "expert grad combine all_to_all_v");
    if (!overlap) dxp[static_cast<size_t>(ci)] = finish_rows(c, time_, bk, dy.dtype());
  }
  Tensor dx = c.empty({st.tokens, dm});
  for (int64_t ci = 0; ci < nc; ++ci) {
    A2AChunk& ch = st.chunks[static_cast<size_t>(ci)];
    if (overlap)
      dxp[static_cast<size_t>(ci)] = finish_rows(c, time_, back[static_cast<size_t>(ci)], dy.dtype());
    Tensor dxc = dx.narrow(0, ch.lo, ch.len);
    kernels::moe_permute_backward(c.ex, dxp[static_cast<size_t>(ci)], ch.row_map, top_k_, dxc);
  }
  return dx;
}

// ---- device-driven all-to-all (Options::peer) ------------------------------------------
//
// Every index is computed on the device from the all-gathered plan counts; the rows move
// by kernels that write into (dispatch) and read from (combine) the n-group's mapped
// buffers (PeerRows, kernels/cuda/peer_rows.h), each transfer closed by a barrier of the
// group (an all-reduce of one value) on the same stream. Chunk c owns the same region of
// every rank's buffers in every block and in backward, and the buffers are reused safely:
//  - recv region c is written by the sources' pushes after their barrier closing the
//    previous combine of chunk c, which every rank enters only after it copied its recv
//    region c out (stream order: copy-out -> GEMMs -> copy into out -> barrier -> pull);
//  - out region c is written after the barrier closing the next dispatch of chunk c,
//    which every rank enters only after its pull of chunk c completed.
// With Options::overlap the transfers and barriers run on the communication stream
// (CommTime::launch) and chunk c's GEMMs overlap the other chunks' transfers, as on the
// host-count path; the arithmetic is that path's (same rows, same order per expert).

#if TROUPE_HAVE_CUDA
namespace {
kernels::gpu::Env env_on(const layers::Ctx& c, void* stream) {
  return kernels::gpu::Env{stream != nullptr ? static_cast<cudaStream_t>(stream) : c.ex.cuda->stream,
                           c.ex.cuda->num_sms};
}
}  // namespace
#endif

Tensor ExpertGroup::forward_peer(const layers::Ctx& c, const Tensor& x_in, const Tensor& topk_idx,
                                 const Tensor& gates, std::unique_ptr<layers::DispatchState>& state) {
#if TROUPE_HAVE_CUDA
  auto st = std::make_unique<PeerState>();
  const Tensor x = x_in.contiguous();
  const int64_t t = x.size(0), dm = x.size(1), e = num_experts_, el = local_experts_, n = group_.size(),
                k = top_k_;
  const int64_t nc = std::max<int64_t>(1, std::min<int64_t>(options_.chunks, t));
  const int64_t act_bytes = static_cast<int64_t>(dtype_size(x.dtype()));
  PeerRows& pr = *options_.peer;
  st->tokens = t;
  st->chunks.resize(static_cast<size_t>(nc));
  Tensor counts = c.empty({nc * e}, DType::kI32);
  Tensor offsets = c.empty({e + 1}, DType::kI32);
  const Tensor topk = topk_idx.contiguous();
  for (int64_t ci = 0; ci < nc; ++ci) {
    PeerChunk& ch = st->chunks[static_cast<size_t>(ci)];
    ch.lo = ci * t / nc;
    ch.len = (ci + 1) * t / nc - ch.lo;
    ch.gates = gates.narrow(0, ch.lo, ch.len);
    ch.topk = topk.narrow(0, ch.lo, ch.len);
    ch.row_map = c.empty({ch.len * k}, DType::kI32);
    Tensor cnt = counts.narrow(0, ci * e, e);
    kernels::moe_dispatch_plan(c.ex, ch.topk, e, -1, ch.row_map, cnt, offsets);
  }
  Tensor counts_all = c.empty({n * nc * e}, DType::kI32);
  time_.issue(group_.all_gather(counts, counts_all, time_.op_options()), "expert counts all_gather");
  st->shift = c.empty({nc * e}, DType::kI32);
  Tensor local = c.empty({nc * (el + 1)}, DType::kI32);
  kernels::gpu::launch_peer_plan(env_on(c, nullptr), counts_all.data<int32_t>(), static_cast<int>(n),
                                 group_.rank(), nc, t, e, el, k, st->shift.data<int32_t>(),
                                 local.data<int32_t>());
  auto region = [&](const PeerChunk& ch) { return n * k * ch.lo; };  // first row of chunk's region
  auto cap = [&](const PeerChunk& ch) { return n * k * ch.len; };

  const bool overlap = options_.overlap, fp8 = options_.fp8;
  // Dispatch: each chunk's copies go straight into their owners' recv regions (from the
  // tokens, or from the fp8 codes the permute quantised, with their scales).
  std::vector<Tensor> xq(static_cast<size_t>(nc)), xs(static_cast<size_t>(nc));
  auto dispatch = [&](int64_t ci) {
    PeerChunk& ch = st->chunks[static_cast<size_t>(ci)];
    const int32_t* shift = st->shift.data<int32_t>() + ci * e;
    if (fp8) {
      xq[static_cast<size_t>(ci)] = c.empty({ch.len * k, dm}, DType::kF8E4M3);
      xs[static_cast<size_t>(ci)] = c.empty({ch.len * k}, DType::kF32);
      kernels::moe_permute_fp8(c.ex, x.narrow(0, ch.lo, ch.len), ch.row_map, k, xq[static_cast<size_t>(ci)],
                               xs[static_cast<size_t>(ci)]);
    }
    const Tensor src = fp8 ? xq[static_cast<size_t>(ci)] : x.narrow(0, ch.lo, ch.len);
    const float* scales = fp8 ? xs[static_cast<size_t>(ci)].data<float>() : nullptr;
    const int64_t row_bytes = fp8 ? dm : dm * act_bytes;
    ch.op = time_.launch(
        [&, src, scales, shift, row_bytes](const comm::OpOptions& o) {
          kernels::gpu::launch_peer_push(env_on(c, o.stream), src.data_ptr(), !fp8, scales, row_bytes,
                                         ch.row_map.data<int32_t>(), ch.topk.data<int32_t>(), ch.len * k, k,
                                         el, shift, pr.recv_peers(), pr.scale_peers());
          return pr.barrier(o);
        },
        fp8 ? "expert dispatch (peer, fp8)" : "expert dispatch (peer)");
  };
  auto combine = [&](int64_t ci) {
    PeerChunk& ch = st->chunks[static_cast<size_t>(ci)];
    const int32_t* shift = st->shift.data<int32_t>() + ci * e;
    ch.yp = c.empty({ch.len * k, dm});
    ch.op = time_.launch(
        [&, shift](const comm::OpOptions& o) {
          comm::WorkPtr w = pr.barrier(o);  // every owner's outputs are in place
          kernels::gpu::launch_peer_pull(env_on(c, o.stream), ch.yp.data_ptr(), dm * act_bytes,
                                         ch.row_map.data<int32_t>(), ch.topk.data<int32_t>(), ch.len * k, el,
                                         shift, pr.out_peers());
          return w;
        },
        "expert combine (peer)");
  };
  if (overlap) {
    for (int64_t ci = 0; ci < nc; ++ci) dispatch(ci);
  }
  for (int64_t ci = 0; ci < nc; ++ci) {
    PeerChunk& ch = st->chunks[static_cast<size_t>(ci)];
    if (!overlap) dispatch(ci);
    time_.await(ch.op);
    xq[static_cast<size_t>(ci)] = xs[static_cast<size_t>(ci)] = Tensor();
    ch.local = local.narrow(0, ci * (el + 1), el + 1);
    const int32_t* nrows = ch.local.data<int32_t>() + el;
    // The received rows (expert-major; a device count of them) leave the shared buffer:
    // the GEMMs keep their input for backward.
    Tensor xe = c.empty({cap(ch), dm});
    if (fp8) {
      const Tensor q = Tensor::wrap(static_cast<uint8_t*>(pr.recv()) + region(ch) * dm, {cap(ch), dm},
                                    DType::kF8E4M3, c.ex.device);
      const Tensor sc = Tensor::wrap(pr.scales() + region(ch), {cap(ch), 1}, DType::kF32, c.ex.device);
      kernels::dequantize_fp8(c.ex, q, sc, 0, xe);
    } else {
      kernels::gpu::launch_copy_rows_upto(env_on(c, nullptr),
                                          static_cast<char*>(pr.recv()) + region(ch) * dm * act_bytes,
                                          xe.data_ptr(), dm * act_bytes, cap(ch), nrows);
    }
    Tensor ye = local_.forward(c, xe, ch.local, ch.experts);
    kernels::gpu::launch_copy_rows_upto(env_on(c, nullptr), ye.data_ptr(),
                                        static_cast<char*>(pr.out()) + region(ch) * dm * act_bytes,
                                        dm * act_bytes, cap(ch), nrows);
    combine(ci);
    if (!overlap) time_.await(ch.op);
  }
  Tensor y = c.empty(x.shape());
  for (int64_t ci = 0; ci < nc; ++ci) {
    PeerChunk& ch = st->chunks[static_cast<size_t>(ci)];
    time_.await(ch.op);
    Tensor yc = y.narrow(0, ch.lo, ch.len);
    kernels::moe_unpermute(c.ex, ch.yp, ch.row_map, ch.gates, yc);
  }
  state = std::move(st);
  return y;
#else
  (void)c, (void)x_in, (void)topk_idx, (void)gates, (void)state;
  TROUPE_CHECK(false, "ExpertGroup: the device-driven dispatch needs a CUDA build");
  return Tensor();
#endif
}

Tensor ExpertGroup::backward_peer(const layers::Ctx& c, const Tensor& dy_in, layers::DispatchState& state,
                                  Tensor& dgates) {
#if TROUPE_HAVE_CUDA
  auto& st = static_cast<PeerState&>(state);
  const Tensor dy = dy_in.contiguous();
  const int64_t dm = dy.size(1), e = num_experts_, el = local_experts_, n = group_.size(), k = top_k_;
  const int64_t nc = static_cast<int64_t>(st.chunks.size());
  const int64_t row_bytes = dm * static_cast<int64_t>(dtype_size(dy.dtype()));
  const bool overlap = options_.overlap;
  PeerRows& pr = *options_.peer;
  auto region = [&](const PeerChunk& ch) { return n * k * ch.lo; };
  auto cap = [&](const PeerChunk& ch) { return n * k * ch.len; };
  dgates = c.empty({st.tokens, k}, DType::kF32);
  std::vector<Tensor> dyp(static_cast<size_t>(nc)), dxp(static_cast<size_t>(nc));
  auto dispatch = [&](int64_t ci) {
    PeerChunk& ch = st.chunks[static_cast<size_t>(ci)];
    const int32_t* shift = st.shift.data<int32_t>() + ci * e;
    const Tensor src = dyp[static_cast<size_t>(ci)];
    ch.op = time_.launch(
        [&, src, shift](const comm::OpOptions& o) {
          kernels::gpu::launch_peer_push(env_on(c, o.stream), src.data_ptr(), false, nullptr, row_bytes,
                                         ch.row_map.data<int32_t>(), ch.topk.data<int32_t>(), ch.len * k, k,
                                         el, shift, pr.recv_peers(), nullptr);
          return pr.barrier(o);
        },
        "expert grad dispatch (peer)");
  };
  for (int64_t ci = 0; ci < nc; ++ci) {
    PeerChunk& ch = st.chunks[static_cast<size_t>(ci)];
    dyp[static_cast<size_t>(ci)] = c.empty(ch.yp.shape());
    Tensor dg = dgates.narrow(0, ch.lo, ch.len);
    kernels::moe_unpermute_backward(c.ex, dy.narrow(0, ch.lo, ch.len), ch.yp, ch.row_map, ch.gates,
                                    dyp[static_cast<size_t>(ci)], dg);
    if (overlap) dispatch(ci);
  }
  for (int64_t ci = 0; ci < nc; ++ci) {
    PeerChunk& ch = st.chunks[static_cast<size_t>(ci)];
    if (!overlap) dispatch(ci);
    time_.await(ch.op);
    dyp[static_cast<size_t>(ci)] = Tensor();
    const int32_t* nrows = ch.local.data<int32_t>() + el;
    Tensor dye = c.empty({cap(ch), dm});
    kernels::gpu::launch_copy_rows_upto(env_on(c, nullptr),
                                        static_cast<char*>(pr.recv()) + region(ch) * row_bytes,
                                        dye.data_ptr(), row_bytes, cap(ch), nrows);
    Tensor dxe = local_.backward(c, dye, ch.experts);
    ch.experts = layers::Experts::Saved();
    kernels::gpu::launch_copy_rows_upto(env_on(c, nullptr), dxe.data_ptr(),
                                        static_cast<char*>(pr.out()) + region(ch) * row_bytes, row_bytes,
                                        cap(ch), nrows);
    const int32_t* shift = st.shift.data<int32_t>() + ci * e;
    dxp[static_cast<size_t>(ci)] = c.empty({ch.len * k, dm});
    const Tensor dst = dxp[static_cast<size_t>(ci)];
    ch.op = time_.launch(
        [&, dst, shift](const comm::OpOptions& o) {
          comm::WorkPtr w = pr.barrier(o);
          kernels::gpu::launch_peer_pull(env_on(c, o.stream), dst.data_ptr(), row_bytes,
                                         ch.row_map.data<int32_t>(), ch.topk.data<int32_t>(), ch.len * k, el,
                                         shift, pr.out_peers());
          return w;
        },
        "expert grad combine (peer)");
    if (!overlap) time_.await(ch.op);
  }
  Tensor dx = c.empty({st.tokens, dm});
  for (int64_t ci = 0; ci < nc; ++ci) {
    PeerChunk& ch = st.chunks[static_cast<size_t>(ci)];
    time_.await(ch.op);
    Tensor dxc = dx.narrow(0, ch.lo, ch.len);
    kernels::moe_permute_backward(c.ex, dxp[static_cast<size_t>(ci)], ch.row_map, k, dxc);
  }
  return dx;
#else
  (void)c, (void)dy_in, (void)state, (void)dgates;
  TROUPE_CHECK(false, "ExpertGroup: the device-driven dispatch needs a CUDA build");
  return Tensor();
#endif
}

// ---- all-gather / reduce-scatter -------------------------------------------------------

Tensor ExpertGroup::forward_ag(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx,
                               const Tensor& gates, std::unique_ptr<layers::DispatchState>& state,
                               std::vector<int64_t>& kept) {
  auto st = std::make_unique<AGState>();
  const int64_t t = x.size(0), dm = x.size(1), n = group_.size(), k = top_k_;
  st->tokens = t;
  Tensor xg = c.empty({n * t, dm}, x.dtype());
  all_gather(group_, x.contiguous(), xg, time_, "expert tokens all_gather");
  Tensor ig = c.empty({n * t, k}, DType::kI32);
  all_gather(group_, topk_idx.contiguous(), ig, time_, "expert ids all_gather");
  st->gates_all = c.empty({n * t, k}, gates.dtype());
  all_gather(group_, gates.contiguous(), st->gates_all, time_, "expert gates all_gather");

  // The routing reaches the host once per block (it sizes the local rows).
  const std::vector<int32_t> ids = host_ints(c.to_host(ig));
  kept.assign(static_cast<size_t>(num_experts_), 0);
  const int64_t me = group_.rank();
  for (int64_t i = me * t * k; i < (me + 1) * t * k; ++i)
    kept[static_cast<size_t>(ids[static_cast<size_t>(i)])]++;
  // Local scatter: rows for local expert j, in gathered-token order; other copies -1.
  std::vector<int32_t> off(static_cast<size_t>(local_experts_ + 1), 0), row_map(ids.size(), -1);
  int32_t pos = 0;
  for (int64_t j = 0; j < local_experts_; ++j) {
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == first_ + j) row_map[i] = pos++;
    off[static_cast<size_t>(j + 1)] = pos;
  }
  st->row_map = c.to_device(Tensor::from_ints({n * t * k}, row_map));
  Tensor xe = c.empty({static_cast<int64_t>(pos), dm}, x.dtype());
  kernels::moe_permute(c.ex, xg, st->row_map, k, xe);
  st->ye = local_.forward(c, xe, c.to_device(Tensor::from_ints({local_experts_ + 1}, off)), st->experts);
  // Local gather, weighted by the gates: partial[g] = sum over the local copies of g.
  Tensor partial = c.empty({n * t, dm}, x.dtype());
  kernels::moe_unpermute(c.ex, st->ye, st->row_map, st->gates_all, partial);
  Tensor y = c.empty({t, dm}, x.dtype());
  reduce_scatter_sum(group_, partial, y, time_, "expert combine reduce_scatter");
  state = std::move(st);
  return y;
}

Tensor ExpertGroup::backward_ag(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state,
                                Tensor& dgates) {
  auto& st = static_cast<AGState&>(state);
  const int64_t t = st.tokens, dm = dy.size(1), n = group_.size(), k = top_k_;
  Tensor dyg = c.empty({n * t, dm}, dy.dtype());
  all_gather(group_, dy.contiguous(), dyg, time_, "expert grad all_gather");
  Tensor dye = c.empty(st.ye.shape(), dy.dtype());
  Tensor dg_partial = c.empty({n * t, k}, DType::kF32);
  kernels::moe_unpermute_backward(c.ex, dyg, st.ye, st.row_map, st.gates_all, dye, dg_partial);
  Tensor dxe = local_.backward(c, dye, st.experts);
  Tensor dx_partial = c.empty({n * t, dm}, dy.dtype());
  kernels::moe_permute_backward(c.ex, dxe, st.row_map, k, dx_partial);
  Tensor dx = c.empty({t, dm}, dy.dtype());
  reduce_scatter_sum(group_, dx_partial, dx, time_, "expert grad reduce_scatter");
  dgates = c.empty({t, k}, DType::kF32);
  reduce_scatter_sum(group_, dg_partial, dgates, time_, "expert gate grad reduce_scatter");
  return dx;
}

}  // namespace troupe::training
