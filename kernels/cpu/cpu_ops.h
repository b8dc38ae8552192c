// kernels/cpu/cpu_ops.h — private header of the CPU reference backend: one function per
// Backend entry (same signatures as kernels/ops.h), plus the f32 views every kernel uses.
//
// Contract: kernels/ops.cc has already checked shapes, dtypes, devices and contiguity,
// so these functions only check what depends on data (index ranges, segment offsets).
// Float tensors may be f32 or bf16 (converted to f32 on entry and back on exit); the
// arithmetic is f32 with f32 or f64 accumulation, written as plain loops.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace troupe::kernels::cpu {

// Read-only f32 view of a float tensor: points into it when it is f32, otherwise holds
// a converted copy (one allocation per call, never per element).
class F32In {
 public:
  explicit F32In(const Tensor& t);
  const float* get() const { return p_; }
  float operator[](int64_t i) const { return p_[i]; }

 private:
  std::vector<float> buf_;
  const float* p_ = nullptr;
};

// Writable f32 view of a float tensor. For a non-f32 tensor the values are staged in a
// buffer (loaded first when `load` is set, for in-place and accumulating ops) and
// converted back when the view is destroyed, so the view must die before the tensor is
// read again.
class F32Out {
 public:
  explicit F32Out(Tensor& t, bool load = false);
  ~F32Out();
  F32Out(const F32Out&) = delete;
  F32Out& operator=(const F32Out&) = delete;
  float* get() const { return p_; }
  float& operator[](int64_t i) const { return p_[i]; }

 private:
  Tensor t_;
  std::vector<float> buf_;
  float* p_ = nullptr;
};

// ---- elementwise.cc -------------------------------------------------------------------
void fill(const Exec& ex, Tensor& out, float value);
void cast(const Exec& ex, const Tensor& src, Tensor& dst);
void add(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out);
void axpby(const Exec& ex, float alpha, const Tensor& x, float beta, Tensor& y);
void scale(const Exec& ex, Tensor& x, float alpha);
double sum(const Exec& ex, const Tensor& x);
double sum_squares(const Exec& ex, const Tensor& x);
void sum_rows(const Exec& ex, const Tensor& x, Tensor& out, bool accumulate);
void swiglu_forward(const Exec& ex, const Tensor& h, Tensor& out);
void swiglu_backward(const Exec& ex, const Tensor& h, const Tensor& dout, Tensor& dh);

// ---- matmul.cc ------------------------------------------------------------------------
void matmul(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a, bool trans_b,
            float alpha, float beta);
void grouped_matmul(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out,
                    bool trans_w);
// dw_sum_squares (null: none): slot 0 = the sum of squares of the written dW, the rest 0.
void grouped_matmul_backward(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets,
                             const Tensor& dout, Tensor* dx, Tensor* dw, bool trans_w, bool accumulate_dw,
                             Tensor* dw_sum_squares);

// ---- embedding.cc (token embedding and rotary position embedding) ----------------------
void embedding_forward(const Exec& ex, const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Exec& ex, const Tensor& ids, const Tensor& dout, Tensor& dtable);
void rope_forward(const Exec& ex, const Tensor& x, const Tensor& pos, float theta, Tensor& out);
void rope_backward(const Exec& ex, const Tensor& dout, const Tensor& pos, float theta, Tensor& dx);

// ---- norm.cc (RMSNorm and softmax) ----------------------------------------------------
void rmsnorm_forward(const Exec& ex, const Tensor& x, const Tensor* r, const Tensor& w, float eps, Tensor* h,
                     Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Exec& ex, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool accumulate_dw, const Tensor* dres);
void softmax_forward(const Exec& ex, const Tensor& x, Tensor& y);
void softmax_backward(const Exec& ex, const Tensor& y, const Tensor& dy, Tensor& dx);

// ---- attention.cc ---------------------------------------------------------------------
void attention_forward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                       Tensor& out, Tensor& lse);
// rope (null: none): rope_backward applied to dq and dk after.
void attention_backward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, float scale, Tensor& dq, Tensor& dk,
                        Tensor& dv, const RopeArgs* rope);

// ---- moe.cc (router, dispatch plan, permutation) --------------------------------------
void router_forward(const Exec& ex, const Tensor& logits, const Tensor* bias, const RouterConfig& cfg,
                    Tensor& scores, Tensor& topk_idx, Tensor& gates, const RouterStats* stats);
void router_backward(const Exec& ex, const Tensor& scores, const Tensor& topk_idx, const Tensor& dgates,
                     const Tensor* dscores, const RouterConfig& cfg, Tensor& dlogits, float dscores_scale);
void logsumexp_forward(const Exec& ex, const Tensor& x, Tensor& lse);
void logsumexp_backward(const Exec& ex, const Tensor& x, const Tensor& lse, const Tensor& dlse, float scale,
                        Tensor& dx);
void moe_dispatch_plan(const Exec& ex, const Tensor& topk_idx, int64_t num_experts, int64_t capacity,
                       Tensor& row_map, Tensor& expert_counts, Tensor& expert_offsets);
void moe_permute(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& xp);
void moe_permute_backward(const Exec& ex, const Tensor& dxp, const Tensor& row_map, int64_t top_k,
                          Tensor& dx);
void moe_unpermute(const Exec& ex, const Tensor& yp, const Tensor& row_map, const Tensor& gates, Tensor& y,
                   const Tensor* residual);
void moe_unpermute_backward(const Exec& ex, const Tensor& dy, const Tensor& yp, const Tensor& row_map,
                            const Tensor& gates, Tensor& dyp, Tensor& dgates);

// ---- loss.cc --------------------------------------------------------------------------
void cross_entropy_forward(const Exec& ex, const Tensor& logits, const Tensor& targets, Tensor& losses,
                           Tensor& lse);
void cross_entropy_backward(const Exec& ex, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float grad_scale, Tensor& dlogits);
void cross_entropy_forward_backward(const Exec& ex, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& losses, Tensor& lse, Tensor& dlogits);

// ---- optim.cc -------------------------------------------------------------------------
void adamw_step(const Exec& ex, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const AdamWConfig& cfg);
void adamw_step_multi(const Exec& ex, std::span<const AdamWTensor> tensors, const AdamWConfig& cfg);
double sum_squares_multi(const Exec& ex, std::span<const Tensor* const> tensors);
void master_split(const Exec& ex, const Tensor& value, Tensor& hi, Tensor& lo);
void master_join(const Exec& ex, const Tensor& hi, const Tensor& lo, Tensor& value);
void sum_squares_into(const Exec& ex, std::span<const Tensor* const> tensors,
                      std::span<const Tensor* const> sums, Tensor& out, bool accumulate);

// ---- quant.cc -------------------------------------------------------------------------
void quantize_fp8(const Exec& ex, const Tensor& x, int64_t block_size, Tensor& q, Tensor& scales);
void dequantize_fp8(const Exec& ex, const Tensor& q, const Tensor& scales, int64_t block_size, Tensor& out);

// ---- communication codecs (compress.cc) ----
void moe_permute_fp8(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& q,
                     Tensor& scales);
void sum_chunks(const Exec& ex, const Tensor& in, Tensor& out);

}  // namespace troupe::kernels::cpu
