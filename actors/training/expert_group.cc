// actors/training/expert_group.cc — ExpertGroup: the all-to-all and all-gather dispatch
// paths. Row movement between layouts is host code on the CPU backend; on a device (a2a
// only) the rows move with kernels::embedding_forward over i32 row indices (a row gather)
// on the compute stream, and only the per-expert counts reach the host. The expert GEMMs
// and the permute/unpermute are kernels/ops.h calls as in one process.
#include "actors/training/expert_group.h"

#include <chrono>
#include <cstring>

#include "core/check.h"

namespace troupe::training {

namespace {

struct A2AState final : layers::DispatchState {
  Tensor row_map, yp, gates;
  layers::Experts::Saved experts;
  std::vector<int64_t> order;  // expert-major position -> row of the received (source-major) buffer
  std::vector<int64_t> send_rows, recv_rows;
  Tensor order_dev, inverse_dev;  // device: order, and its inverse permutation (i32)
  int64_t tokens = 0;
};

struct AGState final : layers::DispatchState {
  Tensor ye, gates_all;                 // local expert outputs [Re, D]; gathered gates [n*T, k]
  layers::Experts::Saved experts;
  std::vector<int64_t> token, slot;     // per local row: gathered token index, top-k slot
  int64_t tokens = 0;                   // local T
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

ExpertGroup::ExpertGroup(const layers::Experts& full, int64_t top_k, bool recompute, comm::Communicator& group,
                         CommTime& time, DispatchMode mode)
    : num_experts_(full.w1.value.size(0)), top_k_(top_k), group_(group), time_(time), mode_(mode) {
  const int64_t n = group.size();
  TROUPE_CHECK(num_experts_ % n == 0, "ExpertGroup: {} experts do not split over {} ranks", num_experts_, n);
  local_experts_ = num_experts_ / n;
  first_ = group.rank() * local_experts_;
  const int64_t d = full.w1.value.size(1), f = full.w2.value.size(1);
  local_ = std::make_unique<layers::Experts>(local_experts_, d, f, recompute);
  local_->w1.value.copy_from(full.w1.value.narrow(0, first_, local_experts_));
  local_->w2.value.copy_from(full.w2.value.narrow(0, first_, local_experts_));
}

Tensor ExpertGroup::forward(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                            std::unique_ptr<layers::DispatchState>& state, std::vector<int64_t>& kept) {
  return mode_ == DispatchMode::kAllToAll ? forward_a2a(c, x, topk_idx, gates, state, kept)
                                          : forward_ag(c, x, topk_idx, gates, state, kept);
}

Tensor ExpertGroup::backward(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state, Tensor& dgates) {
  return mode_ == DispatchMode::kAllToAll ? backward_a2a(c, dy, state, dgates) : backward_ag(c, dy, state, dgates);
}

// ---- all-to-all ------------------------------------------------------------------------

Tensor ExpertGroup::forward_a2a(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                                std::unique_ptr<layers::DispatchState>& state, std::vector<int64_t>& kept) {
  auto st = std::make_unique<A2AState>();
  const int64_t t = x.size(0), dm = x.size(1), e = num_experts_, el = local_experts_, n = group_.size();
  st->tokens = t;
  st->gates = gates;
  // Dropless plan over all experts: rows grouped by expert, so the rows for rank p's
  // experts are one contiguous block.
  st->row_map = c.empty({t * top_k_}, DType::kI32);
  Tensor counts = c.empty({e}, DType::kI32);
  Tensor offsets = c.empty({e + 1}, DType::kI32);
  kernels::moe_dispatch_plan(c.ex, topk_idx, e, -1, st->row_map, counts, offsets);
  const std::vector<int32_t> cnt = host_ints(c.to_host(counts));
  kept.assign(cnt.begin(), cnt.end());
  int64_t rows = 0;
  for (int32_t v : cnt) rows += v;
  Tensor xp = c.empty({rows, dm});
  kernels::moe_permute(c.ex, x, st->row_map, top_k_, xp);

  // Counts per (peer, local expert of the peer) -> per (source, my local expert).
  Tensor send_cnt = Tensor::empty({e}, DType::kI64);
  for (int64_t j = 0; j < e; ++j) send_cnt.data<int64_t>()[j] = cnt[static_cast<size_t>(j)];
  Tensor recv_cnt = Tensor::empty({e}, DType::kI64);
  if (c.on_device()) {
    // The counts must reach the host (they size the buffers): the one sync per dispatch.
    Tensor d_recv = c.empty({e}, DType::kI64);
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
  st->send_rows.assign(static_cast<size_t>(n), 0);
  st->recv_rows.assign(static_cast<size_t>(n), 0);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t j = 0; j < el; ++j) {
      st->send_rows[static_cast<size_t>(p)] += cnt[static_cast<size_t>(p * el + j)];
      st->recv_rows[static_cast<size_t>(p)] += rc[p * el + j];
    }
  int64_t rrows = 0;
  for (int64_t v : st->recv_rows) rrows += v;
  Tensor xr = c.empty({rrows, dm});
  all_to_all_v_rows(group_, xp, st->send_rows, xr, st->recv_rows, time_, "expert dispatch all_to_all_v");

  // Received rows are source-major (then local expert); the GEMMs want expert-major.
  std::vector<int64_t> src_base(static_cast<size_t>(n), 0);
  for (int64_t q = 1; q < n; ++q) src_base[static_cast<size_t>(q)] = src_base[static_cast<size_t>(q - 1)] + st->recv_rows[static_cast<size_t>(q - 1)];
  std::vector<int32_t> loc_off(static_cast<size_t>(el + 1), 0);
  st->order.reserve(static_cast<size_t>(rrows));
  for (int64_t j = 0; j < el; ++j) {
    for (int64_t q = 0; q < n; ++q) {
      int64_t start = src_base[static_cast<size_t>(q)];
      for (int64_t jj = 0; jj < j; ++jj) start += rc[q * el + jj];
      for (int64_t i = 0; i < rc[q * el + j]; ++i) st->order.push_back(start + i);
    }
    loc_off[static_cast<size_t>(j + 1)] = static_cast<int32_t>(st->order.size());
  }
  Tensor xe = c.empty({rrows, dm});
  if (c.on_device()) {
    std::vector<int32_t> ord(st->order.size()), inv(st->order.size());
    for (size_t i = 0; i < ord.size(); ++i) {
      ord[i] = static_cast<int32_t>(st->order[i]);
      inv[static_cast<size_t>(st->order[i])] = static_cast<int32_t>(i);
    }
    st->order_dev = c.to_device(Tensor::from_ints({rrows}, ord));
    st->inverse_dev = c.to_device(Tensor::from_ints({rrows}, inv));
    gather_rows_device(c, xr, st->order_dev, xe);
  } else {
    gather_rows(xr, st->order, xe);
  }
  Tensor ye = local_->forward(c, xe, c.to_device(Tensor::from_ints({el + 1}, loc_off)), st->experts);
  Tensor yr = c.empty({rrows, dm});
  if (c.on_device()) {
    gather_rows_device(c, ye, st->inverse_dev, yr);  // yr[order[i]] = ye[i]
  } else {
    scatter_rows(ye, st->order, yr);
  }
  st->yp = c.empty({rows, dm});
  all_to_all_v_rows(group_, yr, st->recv_rows, st->yp, st->send_rows, time_, "expert combine all_to_all_v");
  Tensor y = c.empty(x.shape());
  kernels::moe_unpermute(c.ex, st->yp, st->row_map, gates, y);
  state = std::move(st);
  return y;
}

Tensor ExpertGroup::backward_a2a(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state,
                                 Tensor& dgates) {
  auto& st = static_cast<A2AState&>(state);
  const int64_t dm = dy.size(1), rrows = static_cast<int64_t>(st.order.size());
  Tensor dyp = c.empty(st.yp.shape());
  dgates = c.empty(st.gates.shape(), DType::kF32);  // gate gradients are f32, like the gates
  kernels::moe_unpermute_backward(c.ex, dy, st.yp, st.row_map, st.gates, dyp, dgates);
  Tensor dyr = c.empty({rrows, dm});
  all_to_all_v_rows(group_, dyp, st.send_rows, dyr, st.recv_rows, time_, "expert grad dispatch all_to_all_v");
  Tensor dye = c.empty({rrows, dm});
  if (c.on_device()) {
    gather_rows_device(c, dyr, st.order_dev, dye);
  } else {
    gather_rows(dyr, st.order, dye);
  }
  Tensor dxe = local_->backward(c, dye, st.experts);
  Tensor dxr = c.empty({rrows, dm});
  if (c.on_device()) {
    gather_rows_device(c, dxe, st.inverse_dev, dxr);
  } else {
    scatter_rows(dxe, st.order, dxr);
  }
  Tensor dxp = c.empty(st.yp.shape());
  all_to_all_v_rows(group_, dxr, st.recv_rows, dxp, st.send_rows, time_, "expert grad combine all_to_all_v");
  Tensor dx = c.empty({st.tokens, dm});
  kernels::moe_permute_backward(c.ex, dxp, st.row_map, top_k_, dx);
  return dx;
}

// ---- all-gather / reduce-scatter -------------------------------------------------------

Tensor ExpertGroup::forward_ag(const layers::Ctx& c, const Tensor& x, const Tensor& topk_idx, const Tensor& gates,
                               std::unique_ptr<layers::DispatchState>& state, std::vector<int64_t>& kept) {
  TROUPE_CHECK(!c.on_device(),
               "ExpertGroup: dispatch \"allgather\" runs on the CPU backend only; use "
               "parallel.dispatch = \"alltoall\" on GPUs");
  auto st = std::make_unique<AGState>();
  const int64_t t = x.size(0), dm = x.size(1), n = group_.size(), k = top_k_;
  st->tokens = t;
  Tensor xg = c.empty({n * t, dm});
  all_gather(group_, x.contiguous(), xg, time_, "expert tokens all_gather");
  Tensor ig = Tensor::empty({n * t, k}, DType::kI32);
  all_gather(group_, topk_idx.contiguous(), ig, time_, "expert ids all_gather");
  st->gates_all = c.empty({n * t, k});
  all_gather(group_, gates.contiguous(), st->gates_all, time_, "expert gates all_gather");

  const std::vector<int32_t> ids = host_ints(ig);
  kept.assign(static_cast<size_t>(num_experts_), 0);
  const std::vector<int32_t> mine = host_ints(topk_idx);
  for (int32_t v : mine) kept[static_cast<size_t>(v)]++;
  // Local scatter: rows for local expert j, in gathered-token order.
  std::vector<int32_t> off(static_cast<size_t>(local_experts_ + 1), 0);
  for (int64_t j = 0; j < local_experts_; ++j) {
    for (int64_t g = 0; g < n * t; ++g)
      for (int64_t s = 0; s < k; ++s)
        if (ids[static_cast<size_t>(g * k + s)] == first_ + j) {
          st->token.push_back(g);
          st->slot.push_back(s);
        }
    off[static_cast<size_t>(j + 1)] = static_cast<int32_t>(st->token.size());
  }
  const int64_t re = static_cast<int64_t>(st->token.size());
  Tensor xe = c.empty({re, dm});
  gather_rows(xg, st->token, xe);
  st->ye = local_->forward(c, xe, Tensor::from_ints({local_experts_ + 1}, off), st->experts);
  // Local gather, weighted by the gates: partial[g] = sum over local rows of g.
  Tensor partial = Tensor::zeros({n * t, dm}, DType::kF32);
  const float* ye = st->ye.data<float>();
  const float* ga = st->gates_all.data<float>();
  float* pp = partial.data<float>();
  for (int64_t i = 0; i < re; ++i) {
    const int64_t g = st->token[static_cast<size_t>(i)];
    const float w = ga[g * k + st->slot[static_cast<size_t>(i)]];
    for (int64_t d = 0; d < dm; ++d) pp[g * dm + d] += w * ye[i * dm + d];
  }
  Tensor y = c.empty({t, dm});
  reduce_scatter_sum(group_, partial, y, time_, "expert combine reduce_scatter");
  state = std::move(st);
  return y;
}

Tensor ExpertGroup::backward_ag(const layers::Ctx& c, const Tensor& dy, layers::DispatchState& state,
                                Tensor& dgates) {
  auto& st = static_cast<AGState&>(state);
  const int64_t t = st.tokens, dm = dy.size(1), n = group_.size(), k = top_k_;
  const int64_t re = static_cast<int64_t>(st.token.size());
  Tensor dyg = c.empty({n * t, dm});
  all_gather(group_, dy.contiguous(), dyg, time_, "expert grad all_gather");
  const float* g_dy = dyg.data<float>();
  const float* ga = st.gates_all.data<float>();
  const float* ye = st.ye.data<float>();
  Tensor dye = c.empty({re, dm});
  Tensor dg_partial = Tensor::zeros({n * t, k}, DType::kF32);
  float* pdye = dye.data<float>();
  float* pdg = dg_partial.data<float>();
  for (int64_t i = 0; i < re; ++i) {
    const int64_t g = st.token[static_cast<size_t>(i)], s = st.slot[static_cast<size_t>(i)];
    const float w = ga[g * k + s];
    double dot = 0;
    for (int64_t d = 0; d < dm; ++d) {
      pdye[i * dm + d] = w * g_dy[g * dm + d];
      dot += static_cast<double>(g_dy[g * dm + d]) * static_cast<double>(ye[i * dm + d]);
    }
    pdg[g * k + s] = static_cast<float>(dot);
  }
  Tensor dxe = local_->backward(c, dye, st.experts);
  Tensor dx_partial = Tensor::zeros({n * t, dm}, DType::kF32);
  const float* pdxe = dxe.data<float>();
  float* pdx = dx_partial.data<float>();
  for (int64_t i = 0; i < re; ++i) {
    const int64_t g = st.token[static_cast<size_t>(i)];
    for (int64_t d = 0; d < dm; ++d) pdx[g * dm + d] += pdxe[i * dm + d];
  }
  Tensor dx = c.empty({t, dm});
  reduce_scatter_sum(group_, dx_partial, dx, time_, "expert grad reduce_scatter");
  dgates = c.empty({t, k});
  reduce_scatter_sum(group_, dg_partial, dgates, time_, "expert gate grad reduce_scatter");
  return dx;
}

}  // namespace troupe::training
