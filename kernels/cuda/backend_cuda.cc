// kernels/cuda/backend_cuda.cc — defines cuda_backend(): the Backend table of the CUDA
// ops. Each entry unpacks its Tensors (shapes were checked by kernels/ops.cc), checks
// what only the CUDA path needs (dtypes it supports, contiguity, the Exec's context),
// takes scratch memory from the context, and calls the launchers of launch.h.
//
// (This file is C++20 because it uses core/tensor.h; the kernels themselves are in the
// .cu files, compiled as CUDA C++17.)
#include <cmath>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/cuda/stream.h"
#include "core/gpu_check.h"
#include "kernels/backend.h"
#include "kernels/cuda/compress.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matmul_lt.h"

namespace troupe::kernels {

namespace {

using gpu::Env;

// Scratch memory for one op from the context's allocator, returned when the op has been
// enqueued (stream order makes the reuse safe; see CudaCachingAllocator).
class Scratch {
 public:
  Scratch(CudaContext& ctx, size_t bytes) : alloc_(ctx.scratch), bytes_(bytes) {
    ptr_ = alloc_->allocate(bytes);
  }
  ~Scratch() { alloc_->deallocate(ptr_, bytes_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return ptr_; }

 private:
  Allocator* alloc_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

CudaContext& context(const Exec& ex, const char* op) {
  TROUPE_CHECK(ex.cuda != nullptr, "{} on {}: Exec has no CudaContext", op, ex.device);
  TROUPE_CHECK(ex.device.index == ex.cuda->device, "{}: Exec device {} but its CudaContext is on cuda:{}", op,
               ex.device, ex.cuda->device);
  return *ex.cuda;
}

Env env_of(const CudaContext& ctx) {
  return Env{ctx.stream, ctx.num_sms, ctx.pdl, ctx.attention_fused_dq};
}

void require(const Tensor& t, const char* op, const char* name) {
  TROUPE_CHECK(t.defined(), "{}: {} is undefined", op, name);
  TROUPE_CHECK(t.is_contiguous(), "{} on cuda: {} must be contiguous, got {}", op, name, t.describe());
  TROUPE_CHECK(t.numel() == 0 || t.device().is_cuda(), "{} on cuda: {} is on {}", op, name, t.device());
}

void require_dtype(const Tensor& t, DType want, const char* op, const char* name) {
  TROUPE_CHECK(t.dtype() == want, "{} on cuda: {} must be {}, got {}", op, name, dtype_name(want),
               dtype_name(t.dtype()));
}

// Sets the context's device for the op and provides its launch environment.
struct OpScope {
  OpScope(const Exec& ex, const char* op) : ctx(context(ex, op)), guard(ctx.device), env(env_of(ctx)) {}
  CudaContext& ctx;
  cuda::DeviceGuard guard;
  Env env;
};

const int32_t* i32(const Tensor& t) {
  return static_cast<const int32_t*>(t.data_ptr());
}
const float* f32(const Tensor& t) {
  return static_cast<const float*>(t.data_ptr());
}
float* f32_mut(const Tensor& t) {
  return static_cast<float*>(t.data_ptr());
}

// ---- memory and elementwise ----------------------------------------------------------
void cuda_fill(const Exec& ex, Tensor& out, float value) {
  OpScope s(ex, "fill");
  require(out, "fill", "out");
  gpu::launch_fill(s.env, out.data_ptr(), out.dtype(), out.numel(), value);
}

void cuda_cast(const Exec& ex, const Tensor& src, Tensor& dst) {
  OpScope s(ex, "cast");
  require(src, "cast", "src");
  require(dst, "cast", "dst");
  gpu::launch_cast(s.env, src.data_ptr(), src.dtype(), dst.data_ptr(), dst.dtype(), src.numel());
}

void cuda_add(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out) {
  OpScope s(ex, "add");
  require(a, "add", "a");
  require(b, "add", "b");
  require(out, "add", "out");
  gpu::launch_add(s.env, a.data_ptr(), a.dtype(), b.data_ptr(), b.dtype(), out.data_ptr(), out.dtype(),
                  out.numel());
}

void cuda_axpby(const Exec& ex, float alpha, const Tensor& x, float beta, Tensor& y) {
  OpScope s(ex, "axpby");
  require(x, "axpby", "x");
  require(y, "axpby", "y");
  gpu::launch_axpby(s.env, alpha, x.data_ptr(), x.dtype(), beta, y.data_ptr(), y.dtype(), y.numel());
}

void cuda_scale(const Exec& ex, Tensor& x, float alpha) {
  OpScope s(ex, "scale");
  require(x, "scale", "x");
  gpu::launch_scale(s.env, x.data_ptr(), x.dtype(), x.numel(), alpha);
}

double reduce(const Exec& ex, const Tensor& x, bool squares) {
  const char* op = squares ? "sum_squares" : "sum";
  OpScope s(ex, op);
  require(x, op, "x");
  Scratch partials(s.ctx, gpu::reduce_scratch_bytes());
  return gpu::launch_sum(s.env, x.data_ptr(), x.dtype(), x.numel(), squares, partials.get());
}
double cuda_sum(const Exec& ex, const Tensor& x) {
  return reduce(ex, x, false);
}
double cuda_sum_squares(const Exec& ex, const Tensor& x) {
  return reduce(ex, x, true);
}

void cuda_sum_rows(const Exec& ex, const Tensor& x, Tensor& out, bool accumulate) {
  OpScope s(ex, "sum_rows");
  require(x, "sum_rows", "x");
  require(out, "sum_rows", "out");
  const int64_t cols = out.numel();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  Scratch scratch(s.ctx, gpu::sum_rows_scratch_bytes(rows, cols));
  gpu::launch_sum_rows(s.env, x.data_ptr(), x.dtype(), rows, cols, out.data_ptr(), out.dtype(), accumulate,
                       scratch.get());
}

// ---- matrix products -----------------------------------------------------------------
void cuda_matmul(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a, bool trans_b,
                 float alpha, float beta) {
  OpScope s(ex, "matmul");
  require(a, "matmul", "a");
  require(b, "matmul", "b");
  require(out, "matmul", "out");
  TROUPE_CHECK(a.dtype() == b.dtype(), "matmul on cuda: a is {} but b is {}", dtype_name(a.dtype()),
               dtype_name(b.dtype()));
  MatmulProblem p;
  p.batch = a.dim() == 3 ? a.size(0) : b.dim() == 3 ? b.size(0) : 1;
  p.m = trans_a ? a.size(-1) : a.size(-2);
  p.k = trans_a ? a.size(-2) : a.size(-1);
  p.n = trans_b ? b.size(-2) : b.size(-1);
  p.trans_a = trans_a;
  p.trans_b = trans_b;
  p.b_shared = a.dim() == 3 && b.dim() == 2;
  p.a_shared = a.dim() == 2 && b.dim() == 3;
  p.ab_type = a.dtype();
  p.out_type = out.dtype();
  if (p.batch == 0) return;
  matmul_lt(s.ctx, p, a.data_ptr(), b.data_ptr(), out.data_ptr(), alpha, beta);
}

void cuda_grouped_matmul(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out,
                         bool trans_w) {
  OpScope s(ex, "grouped_matmul");
  require(x, "grouped_matmul", "x");
  require(w, "grouped_matmul", "w");
  require(offsets, "grouped_matmul", "offsets");
  require(out, "grouped_matmul", "out");
  TROUPE_CHECK(x.dtype() == w.dtype() && x.dtype() == out.dtype(),
               "grouped_matmul on cuda: x {}, w {}, out {}", dtype_name(x.dtype()), dtype_name(w.dtype()),
               dtype_name(out.dtype()));
  const int64_t experts = w.size(0), k = x.size(1), n = trans_w ? w.size(1) : w.size(2);
  gpu::launch_grouped_matmul(s.env, x.data_ptr(), w.data_ptr(), i32(offsets), x.size(0), experts, k, n,
                             trans_w, out.data_ptr(), x.dtype());
}

void cuda_grouped_matmul_backward(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets,
                                  const Tensor& dout, Tensor* dx, Tensor* dw, bool trans_w,
                                  bool accumulate_dw, Tensor* dw_sum_squares) {
  const char* op = "grouped_matmul_backward";
  OpScope s(ex, op);
  require(x, op, "x");
  require(w, op, "w");
  require(offsets, op, "offsets");
  require(dout, op, "dout");
  TROUPE_CHECK(x.dtype() == w.dtype() && x.dtype() == dout.dtype(), "{} on cuda: x {}, w {}, dout {}", op,
               dtype_name(x.dtype()), dtype_name(w.dtype()), dtype_name(dout.dtype()));
  const int64_t tokens = x.size(0), experts = w.size(0), k = x.size(1), n = trans_w ? w.size(1) : w.size(2);
  if (dx != nullptr) {
    require(*dx, op, "dx");
    require_dtype(*dx, x.dtype(), op, "dx");
    gpu::launch_grouped_matmul_dx(s.env, dout.data_ptr(), w.data_ptr(), i32(offsets), tokens, experts, k, n,
                                  trans_w, dx->data_ptr(), x.dtype());
  }
  if (dw != nullptr) {
    require(*dw, op, "dw");
    float* slots = nullptr;
    if (dw_sum_squares != nullptr) {
      require(*dw_sum_squares, op, "dw_sum_squares");
      require_dtype(*dw_sum_squares, DType::kF32, op, "dw_sum_squares");
      slots = f32_mut(*dw_sum_squares);
    }
    gpu::launch_grouped_matmul_dw(s.env, x.data_ptr(), dout.data_ptr(), i32(offsets), tokens, experts, k, n,
                                  trans_w, dw->data_ptr(), dw->dtype(), accumulate_dw, x.dtype(),
                                  gpu::GemmTiling::kAuto, slots,
                                  slots != nullptr ? dw_sum_squares->numel() : 0);
  }
}

// ---- embedding -----------------------------------------------------------------------
void cuda_embedding_forward(const Exec& ex, const Tensor& ids, const Tensor& table, Tensor& out) {
  OpScope s(ex, "embedding_forward");
  require(ids, "embedding_forward", "ids");
  require(table, "embedding_forward", "table");
  require(out, "embedding_forward", "out");
  gpu::launch_embedding_forward(s.env, i32(ids), ids.numel(), table.data_ptr(), table.dtype(), table.size(0),
                                table.size(1), out.data_ptr(), out.dtype());
}

void cuda_embedding_backward(const Exec& ex, const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  OpScope s(ex, "embedding_backward");
  require(ids, "embedding_backward", "ids");
  require(dout, "embedding_backward", "dout");
  require(dtable, "embedding_backward", "dtable");
  const size_t bytes = gpu::embedding_backward_scratch_bytes(ids.numel(), dtable.size(0));
  Scratch scratch(s.ctx, bytes);
  gpu::launch_embedding_backward(s.env, i32(ids), ids.numel(), dout.data_ptr(), dout.dtype(), dtable.size(0),
                                 dtable.size(1), dtable.data_ptr(), dtable.dtype(), scratch.get(), bytes);
}

// ---- RMSNorm -------------------------------------------------------------------------
void cuda_rmsnorm_forward(const Exec& ex, const Tensor& x, const Tensor* r, const Tensor& w, float eps,
                          Tensor* h, Tensor& y, Tensor& rstd) {
  const char* op = r != nullptr ? "rmsnorm_add_forward" : "rmsnorm_forward";
  OpScope s(ex, op);
  require(x, op, "x");
  require(w, op, "w");
  require(y, op, "y");
  require(rstd, op, "rstd");
  require_dtype(y, x.dtype(), op, "y");
  require_dtype(rstd, DType::kF32, op, "rstd");
  if (r != nullptr) {
    require(*r, op, "r");
    require(*h, op, "h");
    require_dtype(*r, x.dtype(), op, "r");
    require_dtype(*h, x.dtype(), op, "h");
  }
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  gpu::launch_rmsnorm_forward(s.env, x.data_ptr(), r != nullptr ? r->data_ptr() : nullptr, x.dtype(),
                              w.data_ptr(), w.dtype(), eps, rows, d, h != nullptr ? h->data_ptr() : nullptr,
                              y.data_ptr(), f32_mut(rstd));
}

void cuda_rmsnorm_backward(const Exec& ex, const Tensor& dy, const Tensor& x, const Tensor& w,
                           const Tensor& rstd, Tensor& dx, Tensor& dw, bool accumulate_dw,
                           const Tensor* dres) {
  const char* op = "rmsnorm_backward";
  OpScope s(ex, op);
  require(dy, op, "dy");
  require(x, op, "x");
  require(w, op, "w");
  require(rstd, op, "rstd");
  require(dx, op, "dx");
  require(dw, op, "dw");
  require_dtype(dy, x.dtype(), op, "dy");
  require_dtype(dx, x.dtype(), op, "dx");
  require_dtype(rstd, DType::kF32, op, "rstd");
  if (dres != nullptr) {
    require(*dres, op, "dres");
    require_dtype(*dres, x.dtype(), op, "dres");
  }
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  Scratch scratch(s.ctx, gpu::rmsnorm_backward_scratch_bytes(s.env, rows, d));
  gpu::launch_rmsnorm_backward(s.env, dy.data_ptr(), x.data_ptr(), x.dtype(), w.data_ptr(), w.dtype(),
                               f32(rstd), rows, d, dres != nullptr ? dres->data_ptr() : nullptr,
                               dx.data_ptr(), dw.data_ptr(), dw.dtype(), accumulate_dw, scratch.get());
}

// ---- RoPE ----------------------------------------------------------------------------
void rope(const Exec& ex, const Tensor& x, const Tensor& pos, float theta, Tensor& out, bool inverse) {
  const char* op = inverse ? "rope_backward" : "rope_forward";
  OpScope s(ex, op);
  require(x, op, "x");
  require(pos, op, "pos");
  require(out, op, "out");
  require_dtype(out, x.dtype(), op, "out");
  gpu::launch_rope(s.env, x.data_ptr(), i32(pos), theta, x.size(0), x.size(1), x.size(2), out.data_ptr(),
                   x.dtype(), inverse);
}
void cuda_rope_forward(const Exec& ex, const Tensor& x, const Tensor& pos, float theta, Tensor& out) {
  rope(ex, x, pos, theta, out, false);
}
void cuda_rope_backward(const Exec& ex, const Tensor& dout, const Tensor& pos, float theta, Tensor& dx) {
  rope(ex, dout, pos, theta, dx, true);
}

// ---- attention -----------------------------------------------------------------------
gpu::AttentionShape attention_shape(const Tensor& q, const Tensor& k) {
  return gpu::AttentionShape{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
}

void cuda_attention_forward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                            Tensor& out, Tensor& lse) {
  const char* op = "attention_forward";
  OpScope s(ex, op);
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}}) {
    require(*t, op, name);
    require_dtype(*t, q.dtype(), op, name);
  }
  require(lse, op, "lse");
  require_dtype(lse, DType::kF32, op, "lse");
  gpu::launch_attention_forward(s.env, attention_shape(q, k), q.data_ptr(), k.data_ptr(), v.data_ptr(), scale,
                                out.data_ptr(), f32_mut(lse), q.dtype());
}

void cuda_attention_backward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const Tensor& dout, float scale,
                             Tensor& dq, Tensor& dk, Tensor& dv, const RopeArgs* rope) {
  const char* op = "attention_backward";
  OpScope s(ex, op);
  for (auto [t, name] : {std::pair{&q, "q"},
                         {&k, "k"},
                         {&v, "v"},
                         {&out, "out"},
                         {&dout, "dout"},
                         {&dq, "dq"},
                         {&dk, "dk"},
                         {&dv, "dv"}}) {
    require(*t, op, name);
    require_dtype(*t, q.dtype(), op, name);
  }
  require(lse, op, "lse");
  require_dtype(lse, DType::kF32, op, "lse");
  const gpu::AttentionShape shape = attention_shape(q, k);
  gpu::AttentionRope rope_args;
  if (rope != nullptr) {
    require(*rope->pos, op, "rope_pos");
    rope_args = {i32(*rope->pos), rope->theta};
  }
  Scratch scratch(s.ctx,
                  gpu::attention_backward_scratch_bytes(shape, s.env.attention_fused_dq, rope != nullptr));
  gpu::launch_attention_backward(s.env, shape, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                 f32(lse), dout.data_ptr(), scale, dq.data_ptr(), dk.data_ptr(),
                                 dv.data_ptr(), q.dtype(), scratch.get(), gpu::kAttentionAuto,
                                 rope != nullptr ? &rope_args : nullptr);
}

// ---- softmax -------------------------------------------------------------------------
void cuda_softmax_forward(const Exec& ex, const Tensor& x, Tensor& y) {
  OpScope s(ex, "softmax_forward");
  require(x, "softmax_forward", "x");
  require(y, "softmax_forward", "y");
  require_dtype(y, x.dtype(), "softmax_forward", "y");
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  gpu::launch_softmax_forward(s.env, x.data_ptr(), y.data_ptr(), x.dtype(), rows, cols);
}

void cuda_softmax_backward(const Exec& ex, const Tensor& y, const Tensor& dy, Tensor& dx) {
  OpScope s(ex, "softmax_backward");
  require(y, "softmax_backward", "y");
  require(dy, "softmax_backward", "dy");
  require(dx, "softmax_backward", "dx");
  require_dtype(dy, y.dtype(), "softmax_backward", "dy");
  require_dtype(dx, y.dtype(), "softmax_backward", "dx");
  const int64_t cols = y.size(-1), rows = cols == 0 ? 0 : y.numel() / cols;
  gpu::launch_softmax_backward(s.env, y.data_ptr(), dy.data_ptr(), dx.data_ptr(), y.dtype(), rows, cols);
}

// ---- MoE router ----------------------------------------------------------------------
void cuda_router_forward(const Exec& ex, const Tensor& logits, const Tensor* bias, const RouterConfig& cfg,
                         Tensor& scores, Tensor& topk_idx, Tensor& gates, const RouterStats* stats) {
  const char* op = "router_forward";
  OpScope s(ex, op);
  require(logits, op, "logits");
  require_dtype(logits, DType::kF32, op, "logits");
  if (bias != nullptr) {
    require(*bias, op, "bias");
    require_dtype(*bias, DType::kF32, op, "bias");
  }
  require(scores, op, "scores");
  require(topk_idx, op, "topk_idx");
  require(gates, op, "gates");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  gpu::RouterStatsArgs args;
  std::optional<Scratch> scratch;
  if (stats != nullptr) {
    require(*stats->counts, op, "stats.counts");
    args.counts = f32_mut(*stats->counts);
    if (stats->score_sums != nullptr) {
      require(*stats->score_sums, op, "stats.score_sums");
      args.score_sums = f32_mut(*stats->score_sums);
    }
    if (stats->acc != nullptr) {
      require(*stats->acc, op, "stats.acc");
      args.acc = f32_mut(*stats->acc);
    }
    args.aux_scale = stats->aux_scale;
    scratch.emplace(s.ctx, gpu::router_stats_scratch_bytes(tokens, experts));
  }
  gpu::launch_router_forward(s.env, f32(logits), bias != nullptr ? f32(*bias) : nullptr, tokens, experts,
                             cfg.top_k, cfg.score == RouterScore::kSigmoid, cfg.normalize, f32_mut(scores),
                             static_cast<int32_t*>(topk_idx.data_ptr()), f32_mut(gates),
                             stats != nullptr ? &args : nullptr, scratch ? scratch->get() : nullptr);
}

void cuda_logsumexp_forward(const Exec& ex, const Tensor& x, Tensor& lse) {
  OpScope s(ex, "logsumexp_forward");
  require(x, "logsumexp_forward", "x");
  require(lse, "logsumexp_forward", "lse");
  gpu::launch_logsumexp_forward(s.env, static_cast<const float*>(x.data_ptr()), x.size(0), x.size(1),
                                f32_mut(lse));
}

void cuda_logsumexp_backward(const Exec& ex, const Tensor& x, const Tensor& lse, const Tensor& dlse,
                             float scale, Tensor& dx) {
  OpScope s(ex, "logsumexp_backward");
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&lse, "lse"}, {&dlse, "dlse"}}) {
    require(*t, "logsumexp_backward", name);
  }
  require(dx, "logsumexp_backward", "dx");
  gpu::launch_logsumexp_backward(
      s.env, static_cast<const float*>(x.data_ptr()), static_cast<const float*>(lse.data_ptr()),
      static_cast<const float*>(dlse.data_ptr()), scale, x.size(0), x.size(1), f32_mut(dx));
}

void cuda_router_backward(const Exec& ex, const Tensor& scores, const Tensor& topk_idx, const Tensor& dgates,
                          const Tensor* dscores, const RouterConfig& cfg, Tensor& dlogits,
                          float dscores_scale) {
  const char* op = "router_backward";
  OpScope s(ex, op);
  require(scores, op, "scores");
  require(topk_idx, op, "topk_idx");
  require(dgates, op, "dgates");
  require_dtype(dgates, DType::kF32, op, "dgates");
  if (dscores != nullptr) {
    require(*dscores, op, "dscores");
    require_dtype(*dscores, DType::kF32, op, "dscores");
  }
  require(dlogits, op, "dlogits");
  gpu::launch_router_backward(
      s.env, f32(scores), i32(topk_idx), f32(dgates), dscores != nullptr ? f32(*dscores) : nullptr,
      dscores != nullptr && dscores->dim() == 1, dscores_scale, scores.size(0), scores.size(1), cfg.top_k,
      cfg.score == RouterScore::kSigmoid, cfg.normalize, dlogits.data_ptr(), dlogits.dtype());
}

void cuda_moe_dispatch_plan(const Exec& ex, const Tensor& topk_idx, int64_t num_experts, int64_t capacity,
                            Tensor& row_map, Tensor& expert_counts, Tensor& expert_offsets) {
  const char* op = "moe_dispatch_plan";
  OpScope s(ex, op);
  require(topk_idx, op, "topk_idx");
  require(row_map, op, "row_map");
  require(expert_counts, op, "expert_counts");
  require(expert_offsets, op, "expert_offsets");
  const int64_t copies = topk_idx.numel();
  Scratch scratch(s.ctx, gpu::dispatch_plan_scratch_bytes(copies, num_experts));
  gpu::launch_moe_dispatch_plan(s.env, i32(topk_idx), copies, num_experts, capacity,
                                static_cast<int32_t*>(row_map.data_ptr()),
                                static_cast<int32_t*>(expert_counts.data_ptr()),
                                static_cast<int32_t*>(expert_offsets.data_ptr()), scratch.get());
}

void cuda_moe_permute(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& xp) {
  OpScope s(ex, "moe_permute");
  require(x, "moe_permute", "x");
  require(row_map, "moe_permute", "row_map");
  require(xp, "moe_permute", "xp");
  require_dtype(xp, x.dtype(), "moe_permute", "xp");
  gpu::launch_moe_permute(s.env, x.data_ptr(), x.size(0), x.size(1), i32(row_map), top_k, xp.data_ptr(),
                          x.dtype());
}

void cuda_moe_permute_backward(const Exec& ex, const Tensor& dxp, const Tensor& row_map, int64_t top_k,
                               Tensor& dx) {
  OpScope s(ex, "moe_permute_backward");
  require(dxp, "moe_permute_backward", "dxp");
  require(row_map, "moe_permute_backward", "row_map");
  require(dx, "moe_permute_backward", "dx");
  require_dtype(dx, dxp.dtype(), "moe_permute_backward", "dx");
  gpu::launch_moe_permute_backward(s.env, dxp.data_ptr(), i32(row_map), dx.size(0), top_k, dx.size(1),
                                   dx.data_ptr(), dx.dtype());
}

void cuda_moe_unpermute(const Exec& ex, const Tensor& yp, const Tensor& row_map, const Tensor& gates,
                        Tensor& y, const Tensor* residual) {
  OpScope s(ex, "moe_unpermute");
  require(yp, "moe_unpermute", "yp");
  require(row_map, "moe_unpermute", "row_map");
  require(gates, "moe_unpermute", "gates");
  require(y, "moe_unpermute", "y");
  require_dtype(y, yp.dtype(), "moe_unpermute", "y");
  if (residual != nullptr) require(*residual, "moe_unpermute", "residual");
  gpu::launch_moe_unpermute(s.env, yp.data_ptr(), i32(row_map), gates.data_ptr(), gates.dtype(), y.size(0),
                            gates.size(1), y.size(1), y.data_ptr(), y.dtype(),
                            residual != nullptr ? residual->data_ptr() : nullptr);
}

void cuda_moe_unpermute_backward(const Exec& ex, const Tensor& dy, const Tensor& yp, const Tensor& row_map,
                                 const Tensor& gates, Tensor& dyp, Tensor& dgates) {
  const char* op = "moe_unpermute_backward";
  OpScope s(ex, op);
  require(dy, op, "dy");
  require(yp, op, "yp");
  require(row_map, op, "row_map");
  require(gates, op, "gates");
  require(dyp, op, "dyp");
  require(dgates, op, "dgates");
  require_dtype(yp, dy.dtype(), op, "yp");
  require_dtype(dyp, dy.dtype(), op, "dyp");
  require_dtype(dgates, gates.dtype(), op, "dgates");
  gpu::launch_moe_unpermute_backward(s.env, dy.data_ptr(), yp.data_ptr(), i32(row_map), gates.data_ptr(),
                                     gates.dtype(), dy.size(0), gates.size(1), dy.size(1), dyp.data_ptr(),
                                     dgates.data_ptr(), dy.dtype());
}

// ---- SwiGLU --------------------------------------------------------------------------
void cuda_swiglu_forward(const Exec& ex, const Tensor& h, Tensor& out) {
  OpScope s(ex, "swiglu_forward");
  require(h, "swiglu_forward", "h");
  require(out, "swiglu_forward", "out");
  require_dtype(out, h.dtype(), "swiglu_forward", "out");
  const int64_t f = out.size(-1), rows = f == 0 ? 0 : out.numel() / f;
  gpu::launch_swiglu_forward(s.env, h.data_ptr(), out.data_ptr(), h.dtype(), rows, f);
}

void cuda_swiglu_backward(const Exec& ex, const Tensor& h, const Tensor& dout, Tensor& dh) {
  OpScope s(ex, "swiglu_backward");
  require(h, "swiglu_backward", "h");
  require(dout, "swiglu_backward", "dout");
  require(dh, "swiglu_backward", "dh");
  require_dtype(dout, h.dtype(), "swiglu_backward", "dout");
  require_dtype(dh, h.dtype(), "swiglu_backward", "dh");
  const int64_t f = dout.size(-1), rows = f == 0 ? 0 : dout.numel() / f;
  gpu::launch_swiglu_backward(s.env, h.data_ptr(), dout.data_ptr(), dh.data_ptr(), h.dtype(), rows, f);
}

// ---- cross-entropy -------------------------------------------------------------------
void cuda_cross_entropy_forward(const Exec& ex, const Tensor& logits, const Tensor& targets, Tensor& losses,
                                Tensor& lse) {
  const char* op = "cross_entropy_forward";
  OpScope s(ex, op);
  require(logits, op, "logits");
  require(targets, op, "targets");
  require(losses, op, "losses");
  require(lse, op, "lse");
  require_dtype(losses, DType::kF32, op, "losses");
  require_dtype(lse, DType::kF32, op, "lse");
  gpu::launch_cross_entropy_forward(s.env, logits.data_ptr(), logits.dtype(), i32(targets), logits.size(0),
                                    logits.size(1), f32_mut(losses), f32_mut(lse));
}

void cuda_cross_entropy_backward(const Exec& ex, const Tensor& logits, const Tensor& targets,
                                 const Tensor& lse, float grad_scale, Tensor& dlogits) {
  const char* op = "cross_entropy_backward";
  OpScope s(ex, op);
  require(logits, op, "logits");
  require(targets, op, "targets");
  require(lse, op, "lse");
  require(dlogits, op, "dlogits");
  require_dtype(lse, DType::kF32, op, "lse");
  gpu::launch_cross_entropy_backward(s.env, logits.data_ptr(), logits.dtype(), i32(targets), f32(lse),
                                     grad_scale, logits.size(0), logits.size(1), dlogits.data_ptr(),
                                     dlogits.dtype());
}

void cuda_cross_entropy_forward_backward(const Exec& ex, const Tensor& logits, const Tensor& targets,
                                         float grad_scale, Tensor& losses, Tensor& lse, Tensor& dlogits) {
  const char* op = "cross_entropy_forward_backward";
  OpScope s(ex, op);
  require(logits, op, "logits");
  require(targets, op, "targets");
  require(losses, op, "losses");
  require(lse, op, "lse");
  require(dlogits, op, "dlogits");
  require_dtype(losses, DType::kF32, op, "losses");
  require_dtype(lse, DType::kF32, op, "lse");
  gpu::launch_cross_entropy_forward_backward(s.env, logits.data_ptr(), logits.dtype(), i32(targets),
                                             grad_scale, logits.size(0), logits.size(1), f32_mut(losses),
                                             f32_mut(lse), dlogits.data_ptr(), dlogits.dtype());
}

// ---- optimizer -----------------------------------------------------------------------
void cuda_adamw_step(const Exec& ex, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                     const AdamWConfig& cfg) {
  const char* op = "adamw_step";
  OpScope s(ex, op);
  for (auto [t, name] : {std::pair{&param, "param"}, {&m, "m"}, {&v, "v"}}) {
    require(*t, op, name);
    require_dtype(*t, DType::kF32, op, name);
  }
  require(grad, op, "grad");
  TROUPE_CHECK(cfg.step >= 1, "adamw_step: step must be >= 1, got {}", cfg.step);
  gpu::AdamWArgs args{};
  args.lr = cfg.lr;
  args.beta1 = cfg.beta1;
  args.beta2 = cfg.beta2;
  args.eps = cfg.eps;
  args.weight_decay = cfg.weight_decay;
  args.grad_scale = cfg.grad_scale;
  args.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta1), cfg.step));
  args.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta2), cfg.step));
  gpu::launch_adamw(s.env, f32_mut(param), grad.data_ptr(), grad.dtype(), f32_mut(m), f32_mut(v),
                    param.numel(), args);
}

gpu::AdamWArgs adamw_args(const AdamWConfig& cfg) {
  gpu::AdamWArgs args{};
  args.lr = cfg.lr;
  args.beta1 = cfg.beta1;
  args.beta2 = cfg.beta2;
  args.eps = cfg.eps;
  args.weight_decay = cfg.weight_decay;
  args.grad_scale = cfg.grad_scale;
  args.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta1), cfg.step));
  args.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta2), cfg.step));
  return args;
}

void cuda_adamw_step_multi(const Exec& ex, std::span<const AdamWTensor> tensors, const AdamWConfig& cfg) {
  const char* op = "adamw_step_multi";
  OpScope s(ex, op);
  TROUPE_CHECK(cfg.step >= 1, "adamw_step_multi: step must be >= 1, got {}", cfg.step);
  const size_t n = tensors.size();
  std::vector<float*> param(n), m(n), v(n);
  std::vector<const void*> grad(n);
  std::vector<void*> work(n, nullptr), work_lo(n, nullptr);
  std::vector<DType> grad_type(n), work_type(n, DType::kF32);
  std::vector<int64_t> numel(n);
  std::vector<float> wd(n);
  for (size_t i = 0; i < n; ++i) {
    const AdamWTensor& t = tensors[i];
    for (auto [x, name] : {std::pair{t.param, "param"}, {t.m, "m"}, {t.v, "v"}}) {
      require(*x, op, name);
      require_dtype(*x, DType::kF32, op, name);
    }
    require(*t.grad, op, "grad");
    param[i] = f32_mut(*t.param);
    m[i] = f32_mut(*t.m);
    v[i] = f32_mut(*t.v);
    grad[i] = t.grad->data_ptr();
    grad_type[i] = t.grad->dtype();
    numel[i] = t.param->numel();
    wd[i] = t.weight_decay;
    if (t.work != nullptr) {
      require(*t.work, op, "work");
      work[i] = t.work->data_ptr();
      work_type[i] = t.work->dtype();
    }
    if (t.work_lo != nullptr) {
      require(*t.work_lo, op, "work_lo");
      require_dtype(*t.work_lo, DType::kI16, op, "work_lo");
      TROUPE_CHECK(t.work != nullptr && t.work->dtype() == DType::kBF16,
                   "adamw_step_multi: a split master (work_lo) needs a bf16 work");
      work_lo[i] = t.work_lo->data_ptr();
    }
  }
  gpu::AdamWArgs args = adamw_args(cfg);
  if (cfg.clip_sum_squares != nullptr) {
    require(*cfg.clip_sum_squares, op, "clip_sum_squares");
    args.clip_sum_squares = f32(*cfg.clip_sum_squares);
    args.clip_max_norm = cfg.clip_max_norm;
  }
  if (cfg.device_schedule != nullptr) {
    require(*cfg.device_schedule, op, "device_schedule");
    args.schedule = f32(*cfg.device_schedule);
  }
  gpu::launch_adamw_multi(s.env, static_cast<int>(n), param.data(), grad.data(), grad_type.data(), m.data(),
                          v.data(), numel.data(), wd.data(), work.data(), work_type.data(), work_lo.data(),
                          args);
}

void cuda_master_split(const Exec& ex, const Tensor& value, Tensor& hi, Tensor& lo) {
  const char* op = "master_split";
  OpScope s(ex, op);
  require(value, op, "value");
  require(hi, op, "hi");
  require(lo, op, "lo");
  gpu::launch_master_split(s.env, f32(value), hi.data_ptr(), lo.data_ptr(), value.numel());
}

void cuda_master_join(const Exec& ex, const Tensor& hi, const Tensor& lo, Tensor& value) {
  const char* op = "master_join";
  OpScope s(ex, op);
  require(hi, op, "hi");
  require(lo, op, "lo");
  require(value, op, "value");
  gpu::launch_master_join(s.env, hi.data_ptr(), lo.data_ptr(), f32_mut(value), value.numel());
}

double cuda_sum_squares_multi(const Exec& ex, std::span<const Tensor* const> tensors) {
  const char* op = "sum_squares_multi";
  OpScope s(ex, op);
  const size_t n = tensors.size();
  std::vector<const void*> x(n);
  std::vector<DType> types(n);
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    require(*tensors[i], op, "x");
    x[i] = tensors[i]->data_ptr();
    types[i] = tensors[i]->dtype();
    numel[i] = tensors[i]->numel();
  }
  Scratch partials(s.ctx, gpu::multi_reduce_scratch_bytes());
  return gpu::launch_sum_squares_multi(s.env, static_cast<int>(n), x.data(), types.data(), numel.data(),
                                       partials.get());
}

// ---- device-resident step statistics ------------------------------------------
void cuda_sum_squares_into(const Exec& ex, std::span<const Tensor* const> tensors,
                           std::span<const Tensor* const> sums, Tensor& out, bool accumulate) {
  const char* op = "sum_squares_into";
  OpScope s(ex, op);
  require(out, op, "out");
  require_dtype(out, DType::kF32, op, "out");
  // One list: the squared tensors, then the summed ones (plain[i] = 1).
  const size_t n = tensors.size() + sums.size();
  std::vector<const void*> x(n);
  std::vector<DType> types(n);
  std::vector<int64_t> numel(n);
  std::vector<uint8_t> plain(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const bool summed = i >= tensors.size();
    const Tensor& t = summed ? *sums[i - tensors.size()] : *tensors[i];
    require(t, op, summed ? "sums" : "x");
    x[i] = t.data_ptr();
    types[i] = t.dtype();
    numel[i] = t.numel();
    plain[i] = summed ? 1 : 0;
  }
  Scratch partials(s.ctx, gpu::multi_reduce_scratch_bytes());
  gpu::launch_sum_squares_into(s.env, static_cast<int>(n), x.data(), types.data(), numel.data(),
                               sums.empty() ? nullptr : plain.data(), partials.get(), f32_mut(out),
                               accumulate);
}

// ---- quantization --------------------------------------------------------------------
void cuda_quantize_fp8(const Exec& ex, const Tensor& x, int64_t block_size, Tensor& q, Tensor& scales) {
  const char* op = "quantize_fp8";
  OpScope s(ex, op);
  require(x, op, "x");
  require(q, op, "q");
  require(scales, op, "scales");
  require_dtype(scales, DType::kF32, op, "scales");
  gpu::launch_quantize_fp8(s.env, x.data_ptr(), x.dtype(), x.size(0), x.size(1), block_size, q.data_ptr(),
                           q.dtype(), f32_mut(scales));
}

void cuda_dequantize_fp8(const Exec& ex, const Tensor& q, const Tensor& scales, int64_t block_size,
                         Tensor& out) {
  const char* op = "dequantize_fp8";
  OpScope s(ex, op);
  require(q, op, "q");
  require(scales, op, "scales");
  require(out, op, "out");
  require_dtype(scales, DType::kF32, op, "scales");
  gpu::launch_dequantize_fp8(s.env, q.data_ptr(), q.dtype(), f32(scales), q.size(0), q.size(1), block_size,
                             out.data_ptr(), out.dtype());
}

// ---- communication codecs (compress.cu) ---------------------------------------
void cuda_moe_permute_fp8(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& q,
                          Tensor& scales) {
  const char* op = "moe_permute_fp8";
  OpScope s(ex, op);
  require(x, op, "x");
  require(row_map, op, "row_map");
  require(q, op, "q");
  require(scales, op, "scales");
  gpu::launch_moe_permute_fp8(s.env, x.data_ptr(), x.dtype(), x.size(0), x.size(1), i32(row_map), top_k,
                              q.size(0), static_cast<uint8_t*>(q.data_ptr()), f32_mut(scales));
}

void cuda_sum_chunks(const Exec& ex, const Tensor& in, Tensor& out) {
  const char* op = "sum_chunks";
  OpScope s(ex, op);
  require(in, op, "in");
  require(out, op, "out");
  gpu::launch_sum_chunks(s.env, in.data_ptr(), in.dtype(), in.size(0), in.size(1), f32_mut(out));
}

const Backend kCudaBackend = {
    .name = "cuda",
    .fill = cuda_fill,
    .cast = cuda_cast,
    .add = cuda_add,
    .axpby = cuda_axpby,
    .scale = cuda_scale,
    .sum = cuda_sum,
    .sum_squares = cuda_sum_squares,
    .sum_rows = cuda_sum_rows,
    .matmul = cuda_matmul,
    .grouped_matmul = cuda_grouped_matmul,
    .grouped_matmul_backward = cuda_grouped_matmul_backward,
    .embedding_forward = cuda_embedding_forward,
    .embedding_backward = cuda_embedding_backward,
    .rmsnorm_forward = cuda_rmsnorm_forward,
    .rmsnorm_backward = cuda_rmsnorm_backward,
    .rope_forward = cuda_rope_forward,
    .rope_backward = cuda_rope_backward,
    .attention_forward = cuda_attention_forward,
    .attention_backward = cuda_attention_backward,
    .softmax_forward = cuda_softmax_forward,
    .softmax_backward = cuda_softmax_backward,
    .router_forward = cuda_router_forward,
    .router_backward = cuda_router_backward,
    .logsumexp_forward = cuda_logsumexp_forward,
    .logsumexp_backward = cuda_logsumexp_backward,
    .moe_dispatch_plan = cuda_moe_dispatch_plan,
    .moe_permute = cuda_moe_permute,
    .moe_permute_backward = cuda_moe_permute_backward,
    .moe_unpermute = cuda_moe_unpermute,
    .moe_unpermute_backward = cuda_moe_unpermute_backward,
    .swiglu_forward = cuda_swiglu_forward,
    .swiglu_backward = cuda_swiglu_backward,
    .cross_entropy_forward = cuda_cross_entropy_forward,
    .cross_entropy_backward = cuda_cross_entropy_backward,
    .cross_entropy_forward_backward = cuda_cross_entropy_forward_backward,
    .adamw_step = cuda_adamw_step,
    .quantize_fp8 = cuda_quantize_fp8,
    .dequantize_fp8 = cuda_dequantize_fp8,
    .adamw_step_multi = cuda_adamw_step_multi,
    .sum_squares_multi = cuda_sum_squares_multi,
    .master_split = cuda_master_split,
    .master_join = cuda_master_join,
    // ---- device-resident step statistics
    .sum_squares_into = cuda_sum_squares_into,
    // ---- communication codecs ----
    .moe_permute_fp8 = cuda_moe_permute_fp8,
    .sum_chunks = cuda_sum_chunks,
};

}  // namespace

const Backend* cuda_backend() {
  return &kCudaBackend;
}

}  // namespace troupe::kernels
