// tests/apps/train_moe_cuda_test.cc — GPU training against the CPU reference (label gpu;
// exits 77 where the build has no CUDA or no GPU is visible). The same small MoE model
// (a dense and an MoE block, grouped-query attention, aux loss, z-loss, bias balancing,
// shared expert) and the same batches train on the CPU (fp32) and on CUDA through the
// train_moe device setup (RunDevice: caching allocator, bf16 activations, f32 master
// weights with bf16 working copies). Checks: the first steps' losses and gradient norms
// agree within bf16 tolerance, the CUDA loss falls over 20 steps, and after warm-up the
// steps take no new device memory from the driver (everything through the cache).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include "layers/model.h"
#include "layers/optimizer.h"
#include "training/app/run_device.h"

#if TROUPE_HAVE_CUDA
#include "core/cuda/caching_allocator.h"
#endif

namespace troupe::train_moe {
namespace {

using training::RunDevice;

constexpr int64_t kBatch = 4, kSeq = 128, kVocab = 512;

layers::ModelConfig small_config() {
  layers::ModelConfig m;
  m.vocab_size = kVocab;
  m.d_model = 256;
  m.n_layers = 2;
  m.n_heads = 4;  // head dim 64: the tensor-core attention path
  m.n_kv_heads = 2;
  m.ffn_hidden = 512;
  m.moe_every = 2;
  m.moe_first = 1;  // block 0 dense, block 1 MoE
  m.tie_embeddings = false;
  m.moe.num_experts = 8;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 256;
  m.moe.aux_loss_coef = 0.01;
  m.moe.z_loss_coef = 0.001;
  m.moe.bias_update_rate = 0.001;
  m.moe.shared_experts = 1;
  return m;
}

// Batch k of a learnable stream: each sequence repeats a short random motif, so the loss
// can fall well below ln(vocab) within a few steps. Host tensors, as the data loader gives.
void make_batch(int64_t k, Tensor& ids, Tensor& targets) {
  std::vector<int32_t> in(static_cast<size_t>(kBatch * kSeq)), tg(in.size());
  for (int64_t b = 0; b < kBatch; ++b) {
    uint64_t state = layers::mix64(static_cast<uint64_t>(1000 * k + b + 1));
    const int64_t period = 5 + static_cast<int64_t>(state % 11);
    std::vector<int32_t> motif(static_cast<size_t>(period));
    for (auto& t : motif) {
      state = layers::mix64(state);
      t = static_cast<int32_t>(state % kVocab);
    }
    for (int64_t s = 0; s <= kSeq; ++s) {
      const int32_t tok = motif[static_cast<size_t>(s % period)];
      if (s < kSeq) in[static_cast<size_t>(b * kSeq + s)] = tok;
      if (s > 0) tg[static_cast<size_t>(b * kSeq + s - 1)] = tok;
    }
  }
  tg[3] = -1;  // an ignored target
  ids = Tensor::from_ints({kBatch, kSeq}, in);
  targets = Tensor::from_ints({kBatch, kSeq}, tg);
}

struct StepRecord {
  double loss = 0, grad_norm = 0;
};

// train_moe's step: zero, forward/backward, global norm, AdamW, working copies, bias.
// split: the masters split (train.master_weights = "split"), AdamW writing the working
// copies; after step `resplit_at` (0: never) the values are synced and split again, as a
// checkpoint's save and load do. `model_out` (if given) receives the trained model.
std::vector<StepRecord> train(RunDevice& dev, int64_t steps, std::vector<size_t>* mallocs = nullptr,
                              bool split = false, std::unique_ptr<layers::Model>* model_out = nullptr,
                              int64_t resplit_at = 0) {
  const layers::Ctx& c = dev.ctx();
  auto owned = std::make_unique<layers::Model>(small_config(), /*seed=*/7);
  layers::Model& model = *owned;
  model.to_device(c);
  if (split) {
    EXPECT_GT(model.split_masters(c), 0);
  }
  layers::AdamWOptions ao;
  ao.weight_decay = 0.1;
  ao.grad_clip = 1.0;
  layers::AdamW opt(model.parameters(), ao, c);
  opt.write_working_copies(split);
  std::vector<StepRecord> out;
  for (int64_t step = 1; step <= steps; ++step) {
    model.zero_grad(c);
    Tensor ids, targets;
    make_batch(step % 2, ids, targets);
    const layers::Model::MicroBatchStats st = model.forward_backward(c, ids, targets, 1.0f);
    const double gn = std::sqrt(model.flat_grads().defined() ? kernels::sum_squares(c.ex, model.flat_grads())
                                                             : opt.grad_norm_squared(c));
    opt.step(c, 3e-3, gn);
    if (!split) model.refresh_working_copies(c);
    if (step == resplit_at) {
      model.sync_master_values(c);
      model.refresh_working_copies(c);
    }
    model.end_step(c);
    dev.synchronize();
    out.push_back({st.lm_loss_sum / static_cast<double>(st.tokens) + st.aux_loss, gn});
#if TROUPE_HAVE_CUDA
    if (mallocs != nullptr) {
      auto* ca = dynamic_cast<cuda::CudaCachingAllocator*>(c.alloc);
      mallocs->push_back(ca != nullptr ? ca->num_device_mallocs() : 0);
    }
#else
    (void)mallocs;  // a build without CUDA counts no device allocations
#endif
  }
  if (model_out != nullptr) *model_out = std::move(owned);
  return out;
}

TEST(TrainMoeCuda, MatchesCpuAndLearns) {
  auto gpu = RunDevice::create("cuda");
  if (!gpu.ok()) {
    std::printf("skipping: %s\n", gpu.status().to_string().c_str());
    std::exit(77);
  }
  ASSERT_TRUE((*gpu)->is_cuda());
  auto cpu = RunDevice::create("cpu");
  ASSERT_TRUE(cpu.ok());

  constexpr int64_t kCpuSteps = 5, kGpuSteps = 20;
  const std::vector<StepRecord> ref = train(**cpu, kCpuSteps);
  std::vector<size_t> mallocs;
  const std::vector<StepRecord> got = train(**gpu, kGpuSteps, &mallocs);

  for (int64_t i = 0; i < kGpuSteps; ++i) {
    std::printf("step %2lld  loss cuda %.5f  cpu %s   grad norm cuda %.4f  cpu %s\n", static_cast<long long>(i + 1),
                got[static_cast<size_t>(i)].loss,
                i < kCpuSteps ? std::to_string(ref[static_cast<size_t>(i)].loss).c_str() : "-",
                got[static_cast<size_t>(i)].grad_norm,
                i < kCpuSteps ? std::to_string(ref[static_cast<size_t>(i)].grad_norm).c_str() : "-");
    ASSERT_TRUE(std::isfinite(got[static_cast<size_t>(i)].loss)) << "step " << i + 1;
  }
  // bf16 activations and weights against fp32: the first loss within 2e-2, the gradient
  // norm (a sum over every parameter) within 5e-2; later steps drift a little further.
  EXPECT_NEAR(got[0].loss, ref[0].loss, 2e-2 * ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 5e-2 * ref[0].grad_norm);
  for (int64_t i = 1; i < kCpuSteps; ++i) {
    EXPECT_NEAR(got[static_cast<size_t>(i)].loss, ref[static_cast<size_t>(i)].loss,
                5e-2 * ref[static_cast<size_t>(i)].loss)
        << "step " << i + 1;
  }
  // It learns: the motifs are easy, so 20 steps take the loss well down.
  EXPECT_LT(got.back().loss, 0.8 * got.front().loss);
  // Steady state: the last steps reuse cached blocks (no cudaMalloc in the loop).
  ASSERT_EQ(mallocs.size(), static_cast<size_t>(kGpuSteps));
  EXPECT_EQ(mallocs[5], mallocs.back()) << "device mallocs grew after warm-up";
}

// train.master_weights = "split": the same f32 masters as the f32 run, kept as bf16
// working copies and 16-bit low halves, synced and split again after step 5 (a
// checkpoint's save and load). The losses follow the f32-master run's over 10 steps (the
// working copies differ only where a value's low half is exactly 0x8000, and the attention
// backward adds dQ in no fixed order; a step lost or undone would move the loss by far
// more), every value is behind after a step, and after sync_master_values each value is the
// master its working copy was rounded from.
TEST(TrainMoeCuda, SplitMasterTrainsAsTheF32Master) {
  auto gpu = RunDevice::create("cuda");
  if (!gpu.ok()) {
    std::printf("skipping: %s\n", gpu.status().to_string().c_str());
    std::exit(77);
  }
  constexpr int64_t kSteps = 10;
  const std::vector<StepRecord> f32 = train(**gpu, kSteps);
  std::unique_ptr<layers::Model> model;
  const std::vector<StepRecord> split =
      train(**gpu, kSteps, nullptr, /*split=*/true, &model, /*resplit_at=*/5);
  for (int64_t i = 0; i < kSteps; ++i) {
    const size_t k = static_cast<size_t>(i);
    std::printf("step %2lld  loss f32 master %.6f  split %.6f\n", static_cast<long long>(i + 1), f32[k].loss,
                split[k].loss);
    EXPECT_NEAR(split[k].loss, f32[k].loss, 5e-3 * f32[k].loss) << "step " << i + 1;
  }
  const layers::Ctx& c = (*gpu)->ctx();
  int64_t stale = 0, split_params = 0;
  for (auto& p : model->parameters()) {
    if (p.param->work_lo.defined()) ++split_params;
    if (p.param->value_stale) ++stale;
  }
  EXPECT_GT(split_params, 0);
  EXPECT_EQ(stale, split_params) << "every split master's value is behind after a step";
  model->sync_master_values(c);
  for (auto& p : model->parameters()) {
    const layers::Parameter& prm = *p.param;
    EXPECT_FALSE(prm.value_stale) << p.name;
    if (!prm.work_lo.defined()) continue;
    const std::vector<float> value = c.to_host(prm.value).to_floats(), work = c.to_host(prm.work).to_floats();
    int64_t bad = 0;
    for (size_t i = 0; i < value.size(); ++i) {
      // The working copy is the value rounded to 8 significant bits, ties away from zero.
      const double a = std::fabs(static_cast<double>(value[i]));
      const double ulp = a > 0 ? std::ldexp(1.0, std::ilogb(a) - 7) : 0.0;
      const double r = a > 0 ? std::floor(a / ulp + 0.5) * ulp : 0.0;
      if (std::fabs(static_cast<double>(work[i])) != r) ++bad;
    }
    EXPECT_EQ(bad, 0) << p.name << ": working copy and synced value disagree";
  }
}

TEST(TrainMoeCuda, UnknownBackendIsRefused) {
  auto d = RunDevice::create("tpu");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().to_string().find("cpu or cuda"), std::string::npos) << d.status().to_string();
}

}  // namespace
}  // namespace troupe::train_moe
