// kernels/cuda/launch.h — the CUDA kernel launchers behind cuda_backend(): raw device
// pointers, sizes and dtypes in, one or a few kernel launches on `env.stream` out.
//
// This header is plain C++17 (the .cu files are compiled as CUDA C++17 and cannot
// include core/tensor.h); backend_cuda.cc unpacks Tensors, checks what only the CUDA
// backend needs (supported dtypes, alignment) and calls these. Every launcher checks
// cudaGetLastError() after its launches. Floating tensors are f32 or bf16 unless noted;
// index tensors are i32. Scratch memory, where a launcher needs it, is passed in by the
// caller (sized by the matching *_scratch_bytes function) and is stream-ordered.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace troupe::kernels::gpu {

struct Env {
  cudaStream_t stream = nullptr;
  int num_sms = 132;
  // Launch with programmatic dependent launch (common.cuh, launch()): sm_90 and up,
  // unless the run turned it off (bench.pdl = false; CudaContext::pdl).
  bool pdl = false;
  // kAttentionAuto's Hopper backward computes dQ inside its dK/dV kernel
  // (added in no fixed order); false: in its own kernel, reproducible run to run
  // (CudaContext::attention_fused_dq).
  bool attention_fused_dq = true;
};

// ---- elementwise (elementwise.cu) ----------------------------------------------------
void launch_fill(const Env& env, void* out, DType dt, int64_t n, float value);  // f32/bf16/f16/i32
void launch_cast(const Env& env, const void* src, DType st, void* dst, DType dt, int64_t n);  // float types
void launch_add(const Env& env, const void* a, DType at, const void* b, DType bt, void* out, DType ot, int64_t n);
void launch_axpby(const Env& env, float alpha, const void* x, DType xt, float beta, void* y, DType yt, int64_t n);
void launch_scale(const Env& env, void* x, DType t, int64_t n, float alpha);
// Sum (squares = false) or sum of squares of x, in double; `partials` holds
// reduce_scratch_bytes() bytes. Synchronises the stream.
size_t reduce_scratch_bytes();
double launch_sum(const Env& env, const void* x, DType t, int64_t n, bool squares, void* partials);
// out[c] (+)= sum_r x[r,c]; scratch holds sum_rows_scratch_bytes(R, C).
size_t sum_rows_scratch_bytes(int64_t rows, int64_t cols);
void launch_sum_rows(const Env& env, const void* x, DType xt, int64_t rows, int64_t cols, void* out, DType ot,
                     bool accumulate, void* scratch);
void launch_swiglu_forward(const Env& env, const void* h, void* out, DType t, int64_t rows, int64_t f);
void launch_swiglu_backward(const Env& env, const void* h, const void* dout, void* dh, DType t, int64_t rows,
                            int64_t f);
void launch_softmax_forward(const Env& env, const void* x, void* y, DType t, int64_t rows, int64_t cols);
void launch_softmax_backward(const Env& env, const void* y, const void* dy, void* dx, DType t, int64_t rows,
                             int64_t cols);
struct AdamWArgs {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 - beta^step, computed in double by the caller
  // Multi-tensor only: the squared global norm on the device (null: none) and the clip
  // threshold; grad_scale *= clip_max_norm / n where n = sqrt(*clip_sum_squares) > max > 0.
  const float* clip_sum_squares;
  float clip_max_norm;
  // Multi-tensor only: f32 [3] on the device (null: none) holding lr, bias_correction1 and
  // bias_correction2, which replace the arguments' (AdamWConfig::device_schedule).
  const float* schedule;
};
void launch_adamw(const Env& env, float* param, const void* grad, DType gt, float* m, float* v, int64_t n,
                  const AdamWArgs& args);
// Multi-tensor (multi_tensor.cu): one launch per kMultiTensorMax tensors. AdamW over
// tensors i < count (param, m, v f32; grad f32/bf16 per grad_type; numel[i] elements;
// weight_decay[i] replaces args.weight_decay). Sum of squares over tensors x (f32/bf16),
// in double, with partials of multi_reduce_scratch_bytes(); synchronises the stream.
constexpr int kMultiTensorMax = 256;
// work[i] (nullptr: none): receives param i after its update, as work_type[i] (f32/bf16).
// work_lo[i] (nullptr: none; work_lo itself may be null): param i's master is split
// (kernels/master_bits.h): read from and written to work[i] (bf16) and work_lo[i] (16-bit),
// and param[i] is not touched.
void launch_adamw_multi(const Env& env, int count, float* const* param, const void* const* grad,
                        const DType* grad_type, float* const* m, float* const* v, const int64_t* numel,
                        const float* weight_decay, void* const* work, const DType* work_type,
                        void* const* work_lo, const AdamWArgs& args);
// The split master's halves (multi_tensor.cu): value f32 [n] <-> hi bf16 [n], lo 16-bit [n].
void launch_master_split(const Env& env, const float* value, void* hi, void* lo, int64_t n);
void launch_master_join(const Env& env, const void* hi, const void* lo, float* value, int64_t n);
size_t multi_reduce_scratch_bytes();
double launch_sum_squares_multi(const Env& env, int count, const void* const* x, const DType* types,
                                const int64_t* numel, void* partials);
// ---- device-resident step statistics ---------------------------------------
// out[0] (+)= the multi-tensor sum of squares, reduced on the device in a fixed order
// (deterministic); partials of multi_reduce_scratch_bytes(). No host wait. plain (null:
// none): tensors i with plain[i] != 0 add the plain sum of their elements instead.
void launch_sum_squares_into(const Env& env, int count, const void* const* x, const DType* types,
                             const int64_t* numel, const uint8_t* plain, void* partials, float* out,
                             bool accumulate);
// x [R,C] f32/bf16 -> q fp8 (e4m3/e5m2), scales f32 [R, nb]; block_size 0 = per row.
void launch_quantize_fp8(const Env& env, const void* x, DType xt, int64_t rows, int64_t cols, int64_t block_size,
                         void* q, DType qt, float* scales);
void launch_dequantize_fp8(const Env& env, const void* q, DType qt, const float* scales, int64_t rows, int64_t cols,
                           int64_t block_size, void* out, DType ot);

// ---- rows: RMSNorm, RoPE, embedding, cross-entropy (rows.cu) -------------------------
// r (null: none) is a residual added first: h = x + r is stored, and normalised.
void launch_rmsnorm_forward(const Env& env, const void* x, const void* r, DType xt, const void* w, DType wt,
                            float eps, int64_t rows, int64_t d, void* h, void* y, float* rstd);
size_t rmsnorm_backward_scratch_bytes(const Env& env, int64_t rows, int64_t d);
// dres (null: none) is added to dx (which may alias it).
void launch_rmsnorm_backward(const Env& env, const void* dy, const void* x, DType xt, const void* w, DType wt,
                             const float* rstd, int64_t rows, int64_t d, const void* dres, void* dx, void* dw,
                             DType dwt, bool accumulate_dw, void* scratch);
// x, out [T,H,Dh] (dtype t); inverse = true applies the backward (inverse) rotation.
void launch_rope(const Env& env, const void* x, const int32_t* pos, float theta, int64_t tokens, int64_t heads,
                 int64_t head_dim, void* out, DType t, bool inverse);
void launch_embedding_forward(const Env& env, const int32_t* ids, int64_t tokens, const void* table, DType tt,
                              int64_t vocab, int64_t d, void* out, DType ot);
// dtable[ids[t]] += dout[t], deterministic: a stable sort by id, then one f32 sum per row
// in token order (scratch: embedding_backward_scratch_bytes).
size_t embedding_backward_scratch_bytes(int64_t tokens, int64_t vocab);
void launch_embedding_backward(const Env& env, const int32_t* ids, int64_t tokens, const void* dout, DType gt,
                               int64_t vocab, int64_t d, void* dtable, DType dtt, void* scratch,
                               size_t scratch_bytes);
void launch_cross_entropy_forward(const Env& env, const void* logits, DType lt, const int32_t* targets,
                                  int64_t rows, int64_t vocab, float* losses, float* lse);
void launch_cross_entropy_backward(const Env& env, const void* logits, DType lt, const int32_t* targets,
                                   const float* lse, float grad_scale, int64_t rows, int64_t vocab, void* dlogits,
                                   DType dt);
// Both in one kernel (a block per row; dlogits may alias logits).
void launch_cross_entropy_forward_backward(const Env& env, const void* logits, DType lt,
                                           const int32_t* targets, float grad_scale, int64_t rows,
                                           int64_t vocab, float* losses, float* lse, void* dlogits, DType dt);

// ---- MoE routing and permutation (moe.cu) --------------------------------------------
// router_forward's statistics (ops.h RouterStats) on the device; score_sums and acc may be
// null. They take router_stats_scratch_bytes of scratch and a second, one-block kernel.
struct RouterStatsArgs {
  float* counts = nullptr;
  float* score_sums = nullptr;
  float* acc = nullptr;
  float aux_scale = 0.0f;
};
size_t router_stats_scratch_bytes(int64_t tokens, int64_t experts);
void launch_router_forward(const Env& env, const float* logits, const float* bias, int64_t tokens,
                           int64_t experts, int top_k, bool sigmoid, bool normalize, float* scores,
                           int32_t* topk_idx, float* gates, const RouterStatsArgs* stats = nullptr,
                           void* scratch = nullptr);
// dscores: [T,E], or with dscores_row one [E] row for every token; times dscores_scale.
// dlogits f32 or bf16.
// lse[t] = log sum_j exp(x[t,j]); dx[t,j] += scale * dlse[t] * exp(x[t,j] - lse[t]) (moe.cu).
void launch_logsumexp_forward(const Env& env, const float* x, int64_t rows, int64_t cols, float* lse);
void launch_logsumexp_backward(const Env& env, const float* x, const float* lse, const float* dlse,
                               float scale, int64_t rows, int64_t cols, float* dx);
void launch_router_backward(const Env& env, const float* scores, const int32_t* topk_idx, const float* dgates,
                            const float* dscores, bool dscores_row, float dscores_scale, int64_t tokens,
                            int64_t experts, int top_k, bool sigmoid, bool normalize, void* dlogits,
                            DType dlogits_type);
size_t dispatch_plan_scratch_bytes(int64_t copies, int64_t experts);
void launch_moe_dispatch_plan(const Env& env, const int32_t* topk_idx, int64_t copies, int64_t experts,
                              int64_t capacity, int32_t* row_map, int32_t* counts, int32_t* offsets, void* scratch);
void launch_moe_permute(const Env& env, const void* x, int64_t tokens, int64_t d, const int32_t* row_map,
                        int64_t top_k, void* xp, DType t);
void launch_moe_permute_backward(const Env& env, const void* dxp, const int32_t* row_map, int64_t tokens,
                                 int64_t top_k, int64_t d, void* dx, DType t);
// residual (null: none): [tokens, d] of y's dtype, added to the sum before y's rounding.
void launch_moe_unpermute(const Env& env, const void* yp, const int32_t* row_map, const void* gates, DType gt,
                          int64_t tokens, int64_t top_k, int64_t d, void* y, DType t,
                          const void* residual = nullptr);
void launch_moe_unpermute_backward(const Env& env, const void* dy, const void* yp, const int32_t* row_map,
                                   const void* gates, DType gt, int64_t tokens, int64_t top_k, int64_t d, void* dyp,
                                   void* dgates, DType t);

// ---- grouped matmul (grouped_matmul.cu) ----------------------------------------------
// Configuration of the bf16 tensor-core kernel. mma.sync (any sm_80+ GPU; 128 x 128 block
// tile): 2 x 2 warps of 64 x 64 or 2 x 4 warps of 64 x 32 with 32-deep k steps in a
// 4-stage pipeline, or 2 x 2 warps with 64-deep k steps in 3 stages. wgmma (sm_90a build on
// a compute-capability-9.0 GPU; elsewhere these fall back to kWarps2x2): 128 x 128 or
// 128 x 256 tiles, persistent grid, operands by cp.async; kWgmmaTma: 128 x 256 tiles with
// operands by TMA and a producer warpgroup. kAuto where these can run: kWgmmaTma for the
// forward and dx, kWgmma256 for dW (faster there); elsewhere kWarps2x2.
// kernel_bench times each; the bf16 test checks each.
enum class GemmTiling { kAuto, kWarps2x2, kWarps2x4, kWarps2x2K64, kWgmma128, kWgmma256, kWgmmaTma };
// out[T,N] = x[T,K] @ W_e for the rows of expert e (W [E,K,N], or [E,N,K] with trans_w).
void launch_grouped_matmul(const Env& env, const void* x, const void* w, const int32_t* offsets, int64_t tokens,
                           int64_t experts, int64_t k, int64_t n, bool trans_w, void* out, DType t,
                           GemmTiling tiling = GemmTiling::kAuto);
// True where kAuto runs the Hopper kernels (sm_90a build, compute capability 9.0 device).
bool grouped_matmul_hopper_available();
// dx[T,K] = dout[T,N] @ op(W_e)^T per segment.
void launch_grouped_matmul_dx(const Env& env, const void* dout, const void* w, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dx,
                              DType t, GemmTiling tiling = GemmTiling::kAuto);
// dW_e (+)= x_e^T @ dout_e ([K,N]), or dout_e^T @ x_e ([N,K]) with trans_w; dw has dtype dwt.
// sum_squares (null: none; only without accumulate): f32 [slots], slots >=
// grouped_matmul_dw_sum_squares_slots(experts, k, n) of ops.h; afterwards the sum of the
// slots is the sum of squares of the written dW. The TMA kernel (f32 dW) fills them in its
// epilogue, slot 8 * tile + 4 * consumer warpgroup + warp; every other path runs a second
// pass over dW (sum_squares_slots_kernel) into the first slots; unused slots are zeroed.
// Deterministic. Returns whether the product's epilogue filled them (no second pass).
bool launch_grouped_matmul_dw(const Env& env, const void* x, const void* dout, const int32_t* offsets,
                              int64_t tokens, int64_t experts, int64_t k, int64_t n, bool trans_w, void* dw,
                              DType dwt, bool accumulate, DType t, GemmTiling tiling = GemmTiling::kAuto,
                              float* sum_squares = nullptr, int64_t slots = 0);

// ---- attention (attention.cu) --------------------------------------------------------
struct AttentionShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
};
// variant (bf16 with head dim 64/128, the tensor-core paths): kAttentionAuto runs the
// Hopper kernels (attention_hopper.cu: TMA, wgmma, warp-specialised) where they can run
// (sm_90a build, compute capability 9.0), else the mma.sync kernels (attention_mma.cu) with
// kAttentionDefaultWarps; 4 or 8 force the mma.sync kernels with that many warps of 16
// rows per block; kAttentionHopper forces the Hopper kernels (an error where they cannot
// run): their backward computes dQ inside the dK/dV kernel, each block bulk-adding its
// partial dQ into an f32 buffer, in no fixed order (runs agree to rounding);
// kAttentionHopperSplitDq runs the Hopper kernels with dQ in a kernel of its own (fixed
// order, what kAttentionAuto takes when !env.attention_fused_dq); kAttentionHopperFwd2
// runs them with the head-dim-64 forward on two consumer warpgroups (128 queries a block)
// instead of three (192; head dim 128 always has two). kernel_bench times each; the bf16
// test checks each.
constexpr int kAttentionAuto = 0, kAttentionHopper = 1, kAttentionHopperSplitDq = 2, kAttentionHopperFwd2 = 3;
constexpr int kAttentionDefaultWarps = 4;  // H200 bench_1b: 4 warps 0.50 + 1.44 ms, 8 warps 0.56 + 1.47
// True where kAttentionAuto runs the Hopper kernels for this shape (bf16, 16-byte aligned).
bool attention_hopper_available(const AttentionShape& s);
void launch_attention_forward(const Env& env, const AttentionShape& s, const void* q, const void* k,
                              const void* v, float scale, void* out, float* lse, DType t,
                              int variant = kAttentionAuto);
// scratch: attention_backward_scratch_bytes(s) bytes: D = rowsum(dO * O) (the first
// attention_dsum_floats(s) floats), then, for the fused Hopper backward, dQ's f32
// accumulator (attention_fused_dq_bytes(s)).
// fused_dq = false: for the default variant with !env.attention_fused_dq only (no dQ buffer).
// rope: room for the rotation table the fused Hopper backward reads (attention_rope_bytes).
size_t attention_backward_scratch_bytes(const AttentionShape& s, bool fused_dq = true, bool rope = false);
size_t attention_dsum_floats(const AttentionShape& s);
size_t attention_fused_dq_bytes(const AttentionShape& s);
// The rotary embedding of q and k (ops.h RopeArgs): pos i32 [B*S] on the device.
struct AttentionRope {
  const int32_t* pos = nullptr;
  float theta = 10000.0f;
};
// The (cos, -sin) table of the inverse rotation, [B*S][head_dim / 2] float2, at the end of
// the scratch of a backward with rope on the fused Hopper kernel (0 bytes elsewhere).
size_t attention_rope_bytes(const AttentionShape& s, bool fused_dq);
// rope (null: none): dq and dk come back rotated back (rope_backward applied): in the fused
// Hopper kernel's dK stores and dQ conversion, by launch_rope elsewhere.
void launch_attention_backward(const Env& env, const AttentionShape& s, const void* q, const void* k,
                               const void* v, const void* out, const float* lse, const void* dout,
                               float scale, void* dq, void* dk, void* dv, DType t, void* scratch,
                               int variant = kAttentionAuto, const AttentionRope* rope = nullptr);
// The inverse rotation's (cos, -sin) of each token and frequency, as rope_backward computes
// them (double precision), into cs [tokens][head_dim / 2] (rows.cu).
void launch_rope_table(const Env& env, const int32_t* pos, float theta, int64_t tokens, int64_t head_dim,
                       float2* cs);

}  // namespace troupe::kernels::gpu
