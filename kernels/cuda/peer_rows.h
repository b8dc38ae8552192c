// kernels/cuda/peer_rows.h — launchers of the device-driven expert dispatch
// (parallel.device_dispatch): the GPUs of one n-group on one host write the dispatched rows straight into
// each other's receive buffers (CUDA IPC mappings, NVLink or PCIe peer access) and read
// the expert outputs back the same way, with every index computed on the device from the
// all-gathered per-expert counts: no count reaches the host inside a step.
//
// Layout. counts_all i32 [n][nc][E] holds every rank's dispatch-plan counts (rank q's
// chunk c sends counts_all[q][c][g] copies to expert g, owned by rank g / El). Every rank
// owns a receive region per chunk, chunk c starting at row n * top_k * lo_c (lo_c =
// c * T / nc, its capacity n * top_k * len_c rows: the worst case, every source sending
// every copy to this rank); inside it the rows are expert-major (local expert j), then
// source-major, then in the source's plan order, i.e. the order the host-count path
// builds. The expert outputs go to a second buffer with the same layout, from which the
// sources read them back.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

// From counts_all, per chunk c of T tokens split in nc chunks:
//  shift[c][g]  = row of this rank's plan row i for expert g in its owner's buffer, minus i
//                 (dst row = shift[c][g] + i);
//  local[c][j]  = start of local expert j's rows in this rank's chunk-c region (relative to
//                 the region; j = 0..El, local[c][El] = rows received).
void launch_peer_plan(const Env& env, const int32_t* counts_all, int n, int me, int64_t nc, int64_t tokens,
                      int64_t experts, int64_t local_experts, int64_t top_k, int32_t* shift, int32_t* local);

// Moves the copies of one chunk (len tokens, top_k copies each; row_map/topk_idx i32
// [len*top_k], the chunk's plan) between this rank and the row buffers of every rank:
//  push (to_peers): peers[g / El][shift[g] + row_map[i]] = src[by_token ? i / top_k : row_map[i]]
//  pull:            dst[row_map[i]] = peers[g / El][shift[g] + row_map[i]]
// Rows are row_bytes bytes; with scales (push only) one f32 per row travels alongside
// (src_scales indexed like src, peer_scales like peers). peers / peer_scales: device
// arrays of n pointers. Every thread fences at system scope before it exits, so a
// collective enqueued after the push sees the rows on the peers.
void launch_peer_push(const Env& env, const void* src, bool by_token, const float* src_scales,
                      int64_t row_bytes, const int32_t* row_map, const int32_t* topk_idx, int64_t copies,
                      int64_t top_k, int64_t local_experts, const int32_t* shift, void* const* peers,
                      float* const* peer_scales);
void launch_peer_pull(const Env& env, void* dst, int64_t row_bytes, const int32_t* row_map,
                      const int32_t* topk_idx, int64_t copies, int64_t local_experts, const int32_t* shift,
                      const void* const* peers);

// dst[r] = src[r] for the rows r < *rows (a device count), at most cap rows.
void launch_copy_rows_upto(const Env& env, const void* src, void* dst, int64_t row_bytes, int64_t cap,
                           const int32_t* rows);

}  // namespace troupe::kernels::gpu
