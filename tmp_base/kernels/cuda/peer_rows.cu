// kernels/cuda/peer_rows.cu — the device-driven expert dispatch (contracts in
// peer_rows.h): the index tables from the all-gathered counts, and row copies between this
// GPU and the mapped buffers of its n-group's GPUs, one warp per row.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/peer_rows.h"

namespace troupe::kernels::gpu {
namespace {

constexpr int kWarps = 8;  // warps (rows) per block of the copy kernels

// One thread per (chunk, expert g) entry of shift and per (chunk, local expert j) entry of
// local; the sums run over ranks and experts (tens), so a serial scan each is cheap.
__global__ void peer_plan_kernel(const int32_t* __restrict__ cnt, int n, int me, int64_t nc, int64_t tokens,
                                 int64_t e, int64_t el, int64_t top_k, int32_t* __restrict__ shift,
                                 int32_t* __restrict__ local) {
  pdl_wait();
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto at = [&](int64_t q, int64_t c, int64_t g) { return static_cast<int64_t>(cnt[(q * nc + c) * e + g]); };
  if (id < nc * e) {
    const int64_t c = id / e, g = id % e, p = g / el, j = g % el;
    int64_t v = static_cast<int64_t>(n) * top_k * (c * tokens / nc);  // chunk region of the owner p
    for (int64_t jj = 0; jj < j; ++jj)                                // p's local experts before j
      for (int64_t q = 0; q < n; ++q) v += at(q, c, p * el + jj);
    for (int64_t q = 0; q < me; ++q) v += at(q, c, g);      // sources before this rank, expert g
    for (int64_t gg = 0; gg < g; ++gg) v -= at(me, c, gg);  // this rank's plan offset of g
    shift[id] = static_cast<int32_t>(v);
    return;
  }
  const int64_t k = id - nc * e;
  if (k >= nc * (el + 1)) return;
  const int64_t c = k / (el + 1), j = k % (el + 1);
  int64_t v = 0;
  for (int64_t jj = 0; jj < j; ++jj)
    for (int64_t q = 0; q < n; ++q) v += at(q, c, me * el + jj);
  local[k] = static_cast<int32_t>(v);
}

// Copies row_bytes bytes with one warp; 16-byte words when kVec (row_bytes % 16 == 0 and
// both rows 16-byte aligned).
template <bool kVec>
__device__ __forceinline__ void copy_row(const char* __restrict__ src, char* __restrict__ dst,
                                         int64_t row_bytes, int lane) {
  if constexpr (kVec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t w = lane; w < row_bytes / 16; w += 32) d[w] = s[w];
  } else {
    for (int64_t b = lane; b < row_bytes; b += 32) dst[b] = src[b];
  }
}

template <bool kVec>
__global__ void peer_push_kernel(const char* __restrict__ src, bool by_token,
                                 const float* __restrict__ src_scales, int64_t row_bytes,
                                 const int32_t* __restrict__ row_map, const int32_t* __restrict__ topk_idx,
                                 int64_t copies, int64_t top_k, int64_t el, const int32_t* __restrict__ shift,
                                 void* const* __restrict__ peers, float* const* __restrict__ peer_scales) {
  pdl_wait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (i < copies) {
    const int32_t r = row_map[i];
    if (r >= 0) {
      const int32_t g = topk_idx[i];
      const int64_t p = g / el, dst_row = static_cast<int64_t>(shift[g]) + r;
      const int64_t src_row = by_token ? i / top_k : r;
      copy_row<kVec>(src + src_row * row_bytes, static_cast<char*>(peers[p]) + dst_row * row_bytes, row_bytes,
                     lane);
      if (src_scales != nullptr && lane == 0) peer_scales[p][dst_row] = src_scales[src_row];
    }
  }
  __threadfence_system();  // the rows are visible on the peers before anything after this kernel
}

template <bool kVec>
__global__ void peer_pull_kernel(char* __restrict__ dst, int64_t row_bytes,
                                 const int32_t* __restrict__ row_map, const int32_t* __restrict__ topk_idx,
                                 int64_t copies, int64_t el, const int32_t* __restrict__ shift,
                                 const void* const* __restrict__ peers) {
  pdl_wait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= copies) return;
  const int32_t r = row_map[i];
  if (r < 0) return;
  const int32_t g = topk_idx[i];
  const int64_t p = g / el, src_row = static_cast<int64_t>(shift[g]) + r;
  copy_row<kVec>(static_cast<const char*>(peers[p]) + src_row * row_bytes,
                 dst + static_cast<int64_t>(r) * row_bytes, row_bytes, static_cast<int>(threadIdx.x % 32));
}

template <bool kVec>
__global__ void copy_rows_upto_kernel(const char* __restrict__ src, char* __restrict__ dst, int64_t row_bytes,
                                      int64_t cap, const int32_t* __restrict__ rows) {
  pdl_wait();
  const int64_t n = min(cap, static_cast<int64_t>(*rows));
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * kWarps)
    copy_row<kVec>(src + r * row_bytes, dst + r * row_bytes, row_bytes, static_cast<int>(threadIdx.x % 32));
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kWarps - 1) / kWarps);
}

}  // namespace

void launch_peer_plan(const Env& env, const int32_t* counts_all, int n, int me, int64_t nc, int64_t tokens,
                      int64_t experts, int64_t local_experts, int64_t top_k, int32_t* shift, int32_t* local) {
  const int64_t total = nc * experts + nc * (local_experts + 1);
  constexpr int kThreads = 256;
  launch(env, peer_plan_kernel, static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0,
         counts_all, n, me, nc, tokens, experts, local_experts, top_k, shift, local);
  TROUPE_CUDA_LAUNCH_CHECK();
}

// The peers' buffers are allocated whole (cudaMalloc, 256-byte aligned), so a row is
// 16-byte aligned wherever row_bytes is a multiple of 16; the local side is checked.
void launch_peer_push(const Env& env, const void* src, bool by_token, const float* src_scales,
                      int64_t row_bytes, const int32_t* row_map, const int32_t* topk_idx, int64_t copies,
                      int64_t top_k, int64_t local_experts, const int32_t* shift, void* const* peers,
                      float* const* peer_scales) {
  if (copies == 0) return;
  const bool vec = row_bytes % 16 == 0 && aligned16(src);
  const auto* s = static_cast<const char*>(src);
  if (vec) {
    launch(env, peer_push_kernel<true>, row_blocks(copies), kWarps * 32, 0, s, by_token, src_scales,
           row_bytes, row_map, topk_idx, copies, top_k, local_experts, shift, peers, peer_scales);
  } else {
    launch(env, peer_push_kernel<false>, row_blocks(copies), kWarps * 32, 0, s, by_token, src_scales,
           row_bytes, row_map, topk_idx, copies, top_k, local_experts, shift, peers, peer_scales);
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_peer_pull(const Env& env, void* dst, int64_t row_bytes, const int32_t* row_map,
                      const int32_t* topk_idx, int64_t copies, int64_t local_experts, const int32_t* shift,
                      const void* const* peers) {
  if (copies == 0) return;
  auto* d = static_cast<char*>(dst);
  if (row_bytes % 16 == 0 && aligned16(dst)) {
    launch(env, peer_pull_kernel<true>, row_blocks(copies), kWarps * 32, 0, d, row_bytes, row_map, topk_idx,
           copies, local_experts, shift, peers);
  } else {
    launch(env, peer_pull_kernel<false>, row_blocks(copies), kWarps * 32, 0, d, row_bytes, row_map, topk_idx,
           copies, local_experts, shift, peers);
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

void launch_copy_rows_upto(const Env& env, const void* src, void* dst, int64_t row_bytes, int64_t cap,
                           const int32_t* rows) {
  if (cap == 0) return;
  const unsigned blocks = std::min<unsigned>(row_blocks(cap), static_cast<unsigned>(env.num_sms) * 8);
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  if (row_bytes % 16 == 0 && aligned16(src) && aligned16(dst)) {
    launch(env, copy_rows_upto_kernel<true>, blocks, kWarps * 32, 0, s, d, row_bytes, cap, rows);
  } else {
    launch(env, copy_rows_upto_kernel<false>, blocks, kWarps * 32, 0, s, d, row_bytes, cap, rows);
  }
  TROUPE_CUDA_LAUNCH_CHECK();
}

}  // namespace troupe::kernels::gpu
