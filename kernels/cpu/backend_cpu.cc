// kernels/cpu/backend_cpu.cc — cpu_backend(): the Backend table of the CPU reference
// kernels, every entry set.
#include "kernels/backend.h"
#include "kernels/cpu/cpu_ops.h"

namespace troupe::kernels {

const Backend& cpu_backend() {
  static const Backend kCpu = {
      .name = "cpu",
      .fill = cpu::fill,
      .cast = cpu::cast,
      .add = cpu::add,
      .axpby = cpu::axpby,
      .scale = cpu::scale,
      .sum = cpu::sum,
      .sum_squares = cpu::sum_squares,
      .sum_rows = cpu::sum_rows,
      .matmul = cpu::matmul,
      .grouped_matmul = cpu::grouped_matmul,
      .grouped_matmul_backward = cpu::grouped_matmul_backward,
      .embedding_forward = cpu::embedding_forward,
      .embedding_backward = cpu::embedding_backward,
      .rmsnorm_forward = cpu::rmsnorm_forward,
      .rmsnorm_backward = cpu::rmsnorm_backward,
      .rope_forward = cpu::rope_forward,
      .rope_backward = cpu::rope_backward,
      .attention_forward = cpu::attention_forward,
      .attention_backward = cpu::attention_backward,
      .softmax_forward = cpu::softmax_forward,
      .softmax_backward = cpu::softmax_backward,
      .router_forward = cpu::router_forward,
      .router_backward = cpu::router_backward,
      .logsumexp_forward = cpu::logsumexp_forward,
      .logsumexp_backward = cpu::logsumexp_backward,
      .moe_dispatch_plan = cpu::moe_dispatch_plan,
      .moe_permute = cpu::moe_permute,
      .moe_permute_backward = cpu::moe_permute_backward,
      .moe_unpermute = cpu::moe_unpermute,
      .moe_unpermute_backward = cpu::moe_unpermute_backward,
      .swiglu_forward = cpu::swiglu_forward,
      .swiglu_backward = cpu::swiglu_backward,
      .cross_entropy_forward = cpu::cross_entropy_forward,
      .cross_entropy_backward = cpu::cross_entropy_backward,
      .cross_entropy_forward_backward = cpu::cross_entropy_forward_backward,
      .adamw_step = cpu::adamw_step,
      .quantize_fp8 = cpu::quantize_fp8,
      .dequantize_fp8 = cpu::dequantize_fp8,
      .adamw_step_multi = cpu::adamw_step_multi,
      .sum_squares_multi = cpu::sum_squares_multi,
      .master_split = cpu::master_split,
      .master_join = cpu::master_join,
      // ---- device-resident step statistics
      .sum_squares_into = cpu::sum_squares_into,
      // ---- communication codecs ----
      .moe_permute_fp8 = cpu::moe_permute_fp8,
      .sum_chunks = cpu::sum_chunks,
  };
  return kCpu;
}

}  // namespace troupe::kernels
