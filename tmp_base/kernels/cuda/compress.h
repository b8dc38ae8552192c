// kernels/cuda/compress.h — launchers of the communication codec kernels (compress.cu):
// the expert permute fused with fp8 e4m3 quantisation (per-row scales) and the fp32 sum
// of received chunks. Contracts as kernels/ops.h's moe_permute_fp8 and sum_chunks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "kernels/cuda/launch.h"

namespace troupe::kernels::gpu {

// x [tokens, d] (f32/bf16), row_map i32 [tokens*top_k] -> q e4m3 [rows, d] (bytes),
// scales f32 [rows]; rows no copy maps to: zeros with scale 1.
void launch_moe_permute_fp8(const Env& env, const void* x, DType xt, int64_t tokens, int64_t d,
                            const int32_t* row_map, int64_t top_k, int64_t rows, uint8_t* q, float* scales);
// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ... in fp32; in [n, m] f32/bf16.
void launch_sum_chunks(const Env& env, const void* in, DType it, int64_t n, int64_t m, float* out);

}  // namespace troupe::kernels::gpu
