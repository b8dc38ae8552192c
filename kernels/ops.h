// kernels/ops.h — every tensor op Troupe's MoE transformer needs, forward and backward,
// behind one dispatching API. Each op checks shapes, then runs the CPU reference
// (kernels/cpu/, fp32 storage, fp32/fp64 accumulation) or the CUDA version
// (kernels/cuda/, bf16 or fp32 storage, fp32 accumulation) according to `ex.device`.
//
// Contracts shared by every op:
// - Outputs are preallocated by the caller on the Exec's device and overwritten, unless
//   the op takes `accumulate` (then out += result). Inputs are never modified unless
//   the comment says the op works in place.
// - Tensors are contiguous row-major unless noted; index tensors are i32.
// - On CUDA, ops are enqueued on `ex.cuda`'s stream and return before completion, except
//   those returning a host value (sum, sum_squares), which synchronise that stream.
// - Shape or dtype mismatches are the caller's bug: they abort via TROUPE_CHECK, naming
//   the op and the shapes.
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "core/device.h"
#include "core/tensor.h"

namespace troupe::kernels {

struct CudaContext;  // kernels/cuda/context.h: stream, cuBLASLt handle, workspace

// Where an op runs. Built by main() (or a test) and passed down.
struct Exec {
  Device device = Device::cpu();
  CudaContext* cuda = nullptr;  // required when device is CUDA
  static Exec cpu() { return Exec{}; }
};

// ---- memory and elementwise ----------------------------------------------------------
void fill(const Exec& ex, Tensor& out, float value);
// Copies src into dst (same shape; dtypes may differ: converts with round-to-nearest-even).
void cast(const Exec& ex, const Tensor& src, Tensor& dst);
// out = a + b (same shapes; out may alias a or b).
void add(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out);
// y = alpha * x + beta * y.
void axpby(const Exec& ex, float alpha, const Tensor& x, float beta, Tensor& y);
// x *= alpha, in place.
void scale(const Exec& ex, Tensor& x, float alpha);
// Sum of all elements / of their squares, accumulated in double (host result).
double sum(const Exec& ex, const Tensor& x);
double sum_squares(const Exec& ex, const Tensor& x);
// out[c] = sum_r x[r, c]  (x [R, C], out [C]); with accumulate, out += that.
void sum_rows(const Exec& ex, const Tensor& x, Tensor& out, bool accumulate = false);

// ---- matrix products -----------------------------------------------------------------
// out = alpha * op(a) @ op(b) + beta * out, op = transpose when the flag is set.
// 2-D: a [M,K] (or [K,M]), b [K,N] (or [N,K]), out [M,N].
// Batched: a [B,M,K], b [B,K,N] or 2-D b shared by every batch, or 2-D a shared by a
// batched b [B,K,N] (one a, several right-hand matrices: e.g. Q, K and V of one input);
// out [B,M,N].
void matmul(const Exec& ex, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a = false,
            bool trans_b = false, float alpha = 1.0f, float beta = 0.0f);
// Gradients of out = op(a) @ op(b): da, db may be null (not wanted). With accumulate,
// gradients are added to da/db (for gradient accumulation over micro-batches).
void matmul_backward(const Exec& ex, const Tensor& a, const Tensor& b, const Tensor& dout, Tensor* da,
                     Tensor* db, bool trans_a = false, bool trans_b = false, bool accumulate = false);

// Grouped matmul over per-expert row segments: rows offsets[e] .. offsets[e+1] of x are
// multiplied by expert e's matrix. x [T,K]; w [E,K,N] (or [E,N,K] with trans_w);
// offsets i32 [E+1], offsets[0] = 0, non-decreasing, offsets[E] = T (empty experts allowed);
// out [T,N]. On CUDA `offsets` lives on the device. One launch for all experts.
void grouped_matmul(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out,
                    bool trans_w = false);
// dw_sum_squares (optional; only where dW is written, not with accumulate_dw): f32
// [grouped_matmul_dw_sum_squares_slots(E, K, N)]; afterwards the SUM of its slots is the
// sum of squares of the dW written (the gradient norm folded into the product).
// Each slot is written once, from a fixed-order f32 sum: repeated runs are bit-identical.
// Which slot holds what is the backend's: the CUDA Hopper (TMA) kernel leaves one partial
// sum per (output tile, consumer warp) from its epilogue; other paths sum dW in a second
// pass into the first slots and zero the rest.
void grouped_matmul_backward(const Exec& ex, const Tensor& x, const Tensor& w, const Tensor& offsets,
                             const Tensor& dout, Tensor* dx, Tensor* dw, bool trans_w = false,
                             bool accumulate_dw = false, Tensor* dw_sum_squares = nullptr);
// The slots of grouped_matmul_backward's dw_sum_squares for `experts` matrices of k x n
// (either orientation: symmetric in k and n, so w's shape alone sizes it). Host-only
// arithmetic, the same for every backend: 8 per 128 x 256 tile of the larger tiling.
int64_t grouped_matmul_dw_sum_squares_slots(int64_t experts, int64_t k, int64_t n);

// ---- embedding -----------------------------------------------------------------------
// out[t] = table[ids[t]]; ids i32 [T] in [0, V), table [V,D], out [T,D].
void embedding_forward(const Exec& ex, const Tensor& ids, const Tensor& table, Tensor& out);
// dtable[ids[t]] += dout[t]  (always accumulates; zero dtable first if needed).
void embedding_backward(const Exec& ex, const Tensor& ids, const Tensor& dout, Tensor& dtable);

// ---- RMSNorm -------------------------------------------------------------------------
// y = x * rstd * w, rstd[t] = 1 / sqrt(mean(x[t]^2) + eps). x, y [T,D]; w [D]; rstd f32 [T].
void rmsnorm_forward(const Exec& ex, const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
// The residual stream's add fused into the norm that follows it: h = x + r (written, and
// rounded to h's dtype exactly as add rounds it), then y = rmsnorm(h) from that rounded h,
// so the results equal add then rmsnorm_forward, in one pass over memory. x, r, h [T,D] of
// one dtype; h may alias x or r.
void rmsnorm_add_forward(const Exec& ex, const Tensor& x, const Tensor& r, const Tensor& w, float eps,
                         Tensor& h, Tensor& y, Tensor& rstd);
// dres (optional, the shape and dtype of dx; dx may alias it): dx = the norm's input
// gradient + dres, summed in f32 and rounded once (add after the unfused backward rounds
// twice in bf16), which is a pre-norm block's residual gradient.
void rmsnorm_backward(const Exec& ex, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool accumulate_dw = false, const Tensor* dres = nullptr);

// ---- rotary position embedding -------------------------------------------------------
// x, out [T,H,Dh] (Dh even), pos i32 [T]. Rotates pairs (i, i + Dh/2) by angle
// pos * theta^(-2i/Dh) ("rotate half", as in Llama/NeoX). out may alias x.
void rope_forward(const Exec& ex, const Tensor& x, const Tensor& pos, float theta, Tensor& out);
// The inverse rotation applied to the gradient. dx may alias dout.
void rope_backward(const Exec& ex, const Tensor& dout, const Tensor& pos, float theta, Tensor& dx);

// ---- attention -----------------------------------------------------------------------
// Causal grouped-query attention. q [B,S,Hq,Dh]; k, v [B,S,Hkv,Dh] with Hq % Hkv == 0
// (query head h uses kv head h / (Hq/Hkv)); out [B,S,Hq,Dh]; lse f32 [B,Hq,S] holds the
// log-sum-exp of each row of scaled scores (saved for backward). scale usually 1/sqrt(Dh).
void attention_forward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                       Tensor& out, Tensor& lse);
// The rotary embedding that made q and k (rope_forward with pos i32 [B*S] and theta),
// folded into attention_backward: dq and dk then come back as the gradients of the
// unrotated q and k (rope_backward applied to each). The CUDA Hopper backward at head dim
// 64 rotates them in its own stores (one rounding to the storage dtype instead of two);
// every other path runs rope_backward after.
struct RopeArgs {
  const Tensor* pos = nullptr;
  float theta = 10000.0f;
};
void attention_backward(const Exec& ex, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, float scale, Tensor& dq, Tensor& dk,
                        Tensor& dv, const RopeArgs* rope = nullptr);

// ---- softmax -------------------------------------------------------------------------
// Row softmax of x [R,C].
void softmax_forward(const Exec& ex, const Tensor& x, Tensor& y);
void softmax_backward(const Exec& ex, const Tensor& y, const Tensor& dy, Tensor& dx);

// ---- MoE router ----------------------------------------------------------------------
enum class RouterScore : uint8_t { kSoftmax, kSigmoid };
struct RouterConfig {
  int top_k = 2;
  RouterScore score = RouterScore::kSoftmax;
  // Renormalise the selected scores to sum to 1 (always done for sigmoid scoring).
  bool normalize = true;
};
// logits f32 [T,E] -> scores f32 [T,E] (softmax or sigmoid of the logits), topk_idx i32
// [T,k] and gates f32 [T,k]. Selection ranks scores (+ bias[e] when bias is given: the
// aux-loss-free balancing bias, used only to select, never in the gate value). Ties go to
// the lower expert index. Gates are the selected scores, renormalised per config.
//
// stats (optional): the load statistics of the same pass, so that a step does not spend
// separate passes (and launches) on them:
//   counts f32 [E]       the copies routed to each expert (top-k entries equal to e);
//   score_sums f32 [E]   (optional) the column sums of the scores over the tokens;
//   acc f32 [E+1]        (optional) acc[0:E] += counts and, with score_sums,
//                        acc[E] += aux_scale * sum_e counts[e] * score_sums[e]
//                        (the load-balancing loss of Switch/GShard, scaled by the caller).
// The sums are taken in a fixed order: the same inputs give the same bits every run.
struct RouterStats {
  Tensor* counts = nullptr;
  Tensor* score_sums = nullptr;
  Tensor* acc = nullptr;
  float aux_scale = 0.0f;
};
void router_forward(const Exec& ex, const Tensor& logits, const Tensor* bias, const RouterConfig& cfg,
                    Tensor& scores, Tensor& topk_idx, Tensor& gates, const RouterStats* stats = nullptr);
// dlogits (f32 or bf16, rounded once) from dgates [T,k] plus, optionally, a direct
// gradient on the scores (from the load-balancing aux loss): dscores [T,E], or [E] for
// one row that every token shares; either way multiplied by dscores_scale. Selection is
// treated as constant.
void router_backward(const Exec& ex, const Tensor& scores, const Tensor& topk_idx, const Tensor& dgates,
                     const Tensor* dscores, const RouterConfig& cfg, Tensor& dlogits,
                     float dscores_scale = 1.0f);
// Row log-sum-exp (the router z-loss, coef * mean_t lse_t^2, on the device): lse [T] =
// log sum_j exp(x[t,j]) of x [T,E] (f32 both).
void logsumexp_forward(const Exec& ex, const Tensor& x, Tensor& lse);
// dx [T,E] (f32) += scale * dlse[t] * exp(x[t,j] - lse[t]): the gradient of
// scale * sum_t dlse[t] * lse[t] (lse from logsumexp_forward; dlse [T] f32).
void logsumexp_backward(const Exec& ex, const Tensor& x, const Tensor& lse, const Tensor& dlse, float scale,
                        Tensor& dx);

// ---- token permutation by expert -----------------------------------------------------
// Plans the dispatch of T tokens' k expert choices (topk_idx i32 [T,k]). Copies are grouped
// by expert, in token order inside an expert. capacity < 0: dropless; otherwise each
// expert keeps its first `capacity` copies and the rest are dropped (row_map = -1).
// Outputs: row_map i32 [T*k] (row of copy (t,j) in the permuted buffer, or -1),
// expert_counts i32 [E] (copies kept per expert), expert_offsets i32 [E+1].
void moe_dispatch_plan(const Exec& ex, const Tensor& topk_idx, int64_t num_experts, int64_t capacity,
                       Tensor& row_map, Tensor& expert_counts, Tensor& expert_offsets);
// xp[row_map[t*k+j]] = x[t] for kept copies. x [T,D]; xp [R,D], R = expert_offsets[E].
void moe_permute(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& xp);
// dx[t] = sum over kept j of dxp[row_map[t*k+j]].
void moe_permute_backward(const Exec& ex, const Tensor& dxp, const Tensor& row_map, int64_t top_k,
                          Tensor& dx);
// y[t] = sum over kept j of gates[t,j] * yp[row_map[t*k+j]]  (rows of dropped copies add 0),
// plus residual[t] when given ([T,D], y's dtype; the block's residual stream, added to the
// sum before y's one rounding, as a separate add after an f32 unpermute would).
void moe_unpermute(const Exec& ex, const Tensor& yp, const Tensor& row_map, const Tensor& gates, Tensor& y,
                   const Tensor* residual = nullptr);
// dyp[row] = gates[t,j] * dy[t]; dgates[t,j] = dot(dy[t], yp[row]) (0 for dropped copies).
void moe_unpermute_backward(const Exec& ex, const Tensor& dy, const Tensor& yp, const Tensor& row_map,
                            const Tensor& gates, Tensor& dyp, Tensor& dgates);

// ---- SwiGLU --------------------------------------------------------------------------
// h [T,2F] = [gate | up]; out [T,F] = silu(gate) * up.
void swiglu_forward(const Exec& ex, const Tensor& h, Tensor& out);
void swiglu_backward(const Exec& ex, const Tensor& h, const Tensor& dout, Tensor& dh);

// ---- cross-entropy -------------------------------------------------------------------
// losses[t] = lse(logits[t]) - logits[t, targets[t]]; targets i32 [T], -1 = ignored (loss 0).
// logits [T,V]; losses, lse f32 [T].
void cross_entropy_forward(const Exec& ex, const Tensor& logits, const Tensor& targets, Tensor& losses,
                           Tensor& lse);
// dlogits[t] = (softmax(logits[t]) - onehot(targets[t])) * grad_scale, 0 for ignored rows.
// dlogits may alias logits (the backward then reuses the logits buffer).
void cross_entropy_backward(const Exec& ex, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float grad_scale, Tensor& dlogits);
// Both in one pass over the logits (the LM head's chunks): losses and lse as the
// forward's, dlogits as the backward's with the lse just computed (bitwise the same
// results); dlogits may alias logits. On CUDA a block takes a row, reads it from memory
// once and again from L2 for the gradient.
void cross_entropy_forward_backward(const Exec& ex, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& losses, Tensor& lse, Tensor& dlogits);

// ---- optimizer -----------------------------------------------------------------------
struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: param -= lr * wd * param
  int64_t step = 1;           // 1-based, for bias correction
  float grad_scale = 1.0f;    // gradient multiplier (gradient-clipping factor, 1/loss-scale)
  // Gradient clipping from a norm that stays on the device (adamw_step_multi only): when
  // set, f32 [1] holding the squared global norm n^2 (sum_squares_into), and grad_scale is
  // multiplied by max_norm / n where n > clip_max_norm > 0, as the host clip does.
  const Tensor* clip_sum_squares = nullptr;
  float clip_max_norm = 0.0f;
  // The step's schedule held on the device (adamw_step_multi only): when set, f32 [3] on
  // the tensors' device holding lr, 1 - beta1^step and 1 - beta2^step (the bias
  // corrections computed in double, then rounded), read by the kernel in place of lr and
  // step, so that the launch's arguments are the same every step (a CUDA graph of the
  // step replays it; AdamW::use_device_schedule).
  const Tensor* device_schedule = nullptr;
};
// The device schedule's values for step (1-based): {lr, 1 - beta1^step, 1 - beta2^step}.
std::array<float, 3> adamw_schedule(const AdamWConfig& cfg);
// In place on param, m, v (all f32, same shape as grad; grad f32 or bf16).
void adamw_step(const Exec& ex, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const AdamWConfig& cfg);
// One tensor of a multi-tensor step: as adamw_step's arguments, with its own weight decay.
struct AdamWTensor {
  Tensor* param;
  const Tensor* grad;
  Tensor* m;
  Tensor* v;
  float weight_decay;
  // When set (bf16 or f32, param's shape): receives the updated param rounded to its dtype
  // in the same pass (the working copy the products read), instead of a cast afterwards.
  Tensor* work = nullptr;
  // When set (i16, param's shape; work must be bf16): the f32 master is split
  // (master_split): work holds its rounded upper half and work_lo its low 16 bits. The
  // step then reads and writes the master there, and param is neither read nor written.
  Tensor* work_lo = nullptr;
};
// adamw_step over every tensor of the list (cfg.weight_decay unused: each tensor has its
// own); on CUDA one launch for up to 256 tensors. With gradient clipping, cfg.grad_scale
// carries the clip factor from the global norm (sum_squares_multi, all-reduced if needed).
void adamw_step_multi(const Exec& ex, std::span<const AdamWTensor> tensors, const AdamWConfig& cfg);
// The split f32 master (kernels/master_bits.h): value (f32) -> hi (bf16, rounded to nearest
// with ties away from zero) and lo (i16, value's low 16 bits), and back. Exact both ways:
// master_join(master_split(x)) has x's bits.
void master_split(const Exec& ex, const Tensor& value, Tensor& hi, Tensor& lo);
void master_join(const Exec& ex, const Tensor& hi, const Tensor& lo, Tensor& value);
// Sum of squares of every element of every tensor (f32 or bf16), in double: the squared
// global gradient norm; on CUDA one launch for up to 256 tensors. Synchronises like sum.
double sum_squares_multi(const Exec& ex, std::span<const Tensor* const> tensors);

// ---- quantization --------------------------------------------------------------------
// Scaled fp8: x [R,C] (f32 or bf16) -> q [R,C] (fp8e4m3 or fp8e5m2) and scales f32
// [R, nb], with nb = 1 when block_size == 0 (one scale per row) or ceil(C/block_size)
// (a scale per block of block_size elements along the row, 128 in MegaScale-MoE).
// scale = amax(block) / fp8_max (1 for an all-zero block); q = saturate(x / scale).
void quantize_fp8(const Exec& ex, const Tensor& x, int64_t block_size, Tensor& q, Tensor& scales);
// out = q * scale (out f32 or bf16).
void dequantize_fp8(const Exec& ex, const Tensor& q, const Tensor& scales, int64_t block_size, Tensor& out);

// ---- device-resident step statistics (no host read inside a step) ------------
// out f32 [1] (+)= the sum of squares of every element of every tensor (f32 or bf16),
// accumulated in double and left on the device (no host wait; compare sum_squares_multi).
// `sums` (optional) adds the plain sum of every element of each of its tensors in the same
// pass: partial sums of squares made elsewhere (grouped_matmul_backward's dw_sum_squares).
void sum_squares_into(const Exec& ex, std::span<const Tensor* const> tensors, Tensor& out,
                      bool accumulate = false, std::span<const Tensor* const> sums = {});
// ---- communication codecs (overlap/compression; CPU side is comm/compression.h) ----
// moe_permute fused with fp8 e4m3 quantisation, one f32 scale per row: row r of q holds
// the row moe_permute would write as e4m3 codes of x * (1 / scale), scale = amax / 448 (1
// for an all-zero or non-finite amax), round to nearest even, saturated to ±448; scales
// [rows] (f32). Rows no copy maps to: zero codes, scale 1. Byte-identical to
// comm::quantize_rows_fp8 of moe_permute's output. x f32/bf16 [T, D]; q fp8e4m3 [rows, D].
void moe_permute_fp8(const Exec& ex, const Tensor& x, const Tensor& row_map, int64_t top_k, Tensor& q,
                     Tensor& scales);
// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ... in fp32 (chunk order): in [n, m] f32
// or bf16, out f32 [m]. The local sum of a reduce-scatter done as an all-to-all.
void sum_chunks(const Exec& ex, const Tensor& in, Tensor& out);

}  // namespace troupe::kernels
