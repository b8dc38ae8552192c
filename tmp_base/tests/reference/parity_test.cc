// tests/reference/parity_test.cc — Troupe's model against PyTorch: for three tiny models
// (dense blocks; MoE with softmax top-2, aux loss and z-loss; MoE with sigmoid scores and
// the aux-loss-free selection bias, a shared expert and SwiGLU recomputation) the C++
// loss and every parameter gradient must match tests/reference/torch_reference.py
// (run with /usr/bin/python3) within relative error 1e-4.
//
// Exits 77 (skipped) only when /usr/bin/python3 cannot import torch.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "layers/model.h"

extern char** environ;

namespace troupe::layers {
namespace {

constexpr const char* kPython = "/usr/bin/python3";
const std::string kScript = std::string(TROUPE_SOURCE_DIR) + "/tests/reference/torch_reference.py";

// Runs argv, waits at most timeout_s (then kills it); returns the exit code or -1.
int run_process(const std::vector<std::string>& args, int timeout_s) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

nlohmann::json tensor_json(const Tensor& t) {
  return {{"shape", t.shape()}, {"data", t.to_floats()}};
}

ModelConfig base_config() {
  ModelConfig m;
  m.vocab_size = 61;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.ffn_hidden = 40;
  m.init_std = 0.2;  // large enough that routing and attention are far from uniform
  m.moe.num_experts = 4;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 24;
  return m;
}

struct Figures {
  double loss_rel = 0, max_grad_rel = 0;
  std::string worst;
};

Figures run_case(const std::string& name, const ModelConfig& cfg, bool random_bias) {
  Figures fig;
  Model model(cfg, 77);
  const Ctx c = Ctx::cpu();
  if (random_bias) {
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-0.3f, 0.3f);
    for (auto& b : model.buffers())
      for (int64_t i = 0; i < b.tensor->numel(); ++i) b.tensor->data<float>()[i] = u(rng);
  }
  const int64_t batch = 2, seq = 8;
  std::mt19937 rng(11);
  std::vector<int32_t> ids(batch * seq), targets(batch * seq);
  for (auto& v : ids) v = static_cast<int32_t>(rng() % cfg.vocab_size);
  for (auto& v : targets) v = static_cast<int32_t>(rng() % cfg.vocab_size);
  targets[3] = -1;  // an ignored position
  model.zero_grad(c);
  Model::MicroBatchStats st = model.forward_backward(c, Tensor::from_ints({batch, seq}, ids),
                                                     Tensor::from_ints({batch, seq}, targets), 1.0f);
  const double loss = st.lm_loss_sum / static_cast<double>(st.tokens) + st.aux_loss;

  nlohmann::json j;
  j["model"] = {{"n_layers", cfg.n_layers},
                {"d_model", cfg.d_model},
                {"n_heads", cfg.n_heads},
                {"n_kv_heads", cfg.n_kv_heads},
                {"head_dim", cfg.head_dim},
                {"rope_theta", cfg.rope_theta},
                {"norm_eps", cfg.norm_eps},
                {"moe",
                 {{"num_experts", cfg.moe.num_experts},
                  {"top_k", cfg.moe.top_k},
                  {"router", cfg.moe.score == kernels::RouterScore::kSigmoid ? "sigmoid" : "softmax"},
                  {"normalize_gates", cfg.moe.normalize_gates},
                  {"aux_loss_coef", cfg.moe.aux_loss_coef},
                  {"z_loss_coef", cfg.moe.z_loss_coef},
                  {"bias_update_rate", cfg.moe.bias_update_rate},
                  {"shared_experts", cfg.moe.shared_experts}}}};
  j["batch"] = batch;
  j["seq"] = seq;
  j["ids"] = ids;
  j["targets"] = targets;
  for (auto& p : model.parameters()) j["params"][p.name] = tensor_json(p.param->value);
  j["buffers"] = nlohmann::json::object();
  for (auto& b : model.buffers()) j["buffers"][b.name] = tensor_json(*b.tensor);

  const std::string dir = ::testing::TempDir() + "/troupe_parity_" + std::to_string(getpid()) + "_" + name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/case.json") << j.dump();
  const int rc = run_process({kPython, kScript, dir + "/case.json", dir + "/out.json"}, 240);
  EXPECT_EQ(rc, 0) << "torch_reference.py failed for " << name;
  if (rc != 0) return fig;
  nlohmann::json out = nlohmann::json::parse(std::ifstream(dir + "/out.json"));

  const double ref_loss = out["loss"];
  fig.loss_rel = std::abs(loss - ref_loss) / std::abs(ref_loss);
  EXPECT_LE(fig.loss_rel, 1e-4) << name << ": loss " << loss << " vs torch " << ref_loss;
  EXPECT_NEAR(st.aux_loss, out["aux_loss"].get<double>(), 1e-4 * std::abs(ref_loss)) << name;
  if (cfg.moe.aux_loss_coef > 0 && cfg.n_layers > 0 && model.num_moe_blocks() > 0) {
    EXPECT_GT(st.aux_loss, 0.0);
  }
  for (auto& p : model.parameters()) {
    EXPECT_TRUE(out["grads"].contains(p.name)) << name << ": torch has no gradient for " << p.name;
    if (!out["grads"].contains(p.name)) continue;
    const std::vector<double> ref = out["grads"][p.name].get<std::vector<double>>();
    const std::vector<float> got = p.param->grad.to_floats();
    EXPECT_EQ(ref.size(), got.size()) << p.name;
    if (ref.size() != got.size()) continue;
    double diff2 = 0, ref2 = 0, ref_max = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      diff2 += (got[i] - ref[i]) * (got[i] - ref[i]);
      ref2 += ref[i] * ref[i];
      ref_max = std::max(ref_max, std::abs(ref[i]));
    }
    const double rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
    EXPECT_GT(ref_max, 0.0) << name << ": " << p.name << " has an all-zero reference gradient";
    EXPECT_LE(rel, 1e-4) << name << ": gradient of " << p.name;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_LE(std::abs(got[i] - ref[i]), 1e-4 * ref_max + 1e-9)
          << name << ": " << p.name << "[" << i << "]";
      if (std::abs(got[i] - ref[i]) > 1e-4 * ref_max + 1e-9) break;
    }
    if (rel > fig.max_grad_rel) {
      fig.max_grad_rel = rel;
      fig.worst = p.name;
    }
  }
  std::printf("parity %-18s loss %.6f (torch %.6f, rel %.2e); %zu gradients, max relative error %.2e (%s)\n",
              name.c_str(), loss, ref_loss, fig.loss_rel, model.parameters().size(), fig.max_grad_rel,
              fig.worst.c_str());
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
  return fig;
}

TEST(TorchParity, DenseBlocks) {
  ModelConfig m = base_config();
  m.moe_every = 0;  // all dense
  m.tie_embeddings = false;
  run_case("dense", m, false);
}

TEST(TorchParity, MoESoftmaxTop2WithAuxLoss) {
  ModelConfig m = base_config();
  m.moe_layers = {1};  // block 0 dense, block 1 MoE
  m.moe.score = kernels::RouterScore::kSoftmax;
  m.moe.aux_loss_coef = 0.05;
  m.moe.z_loss_coef = 0.01;
  run_case("moe_softmax_aux", m, false);
}

TEST(TorchParity, MoESigmoidWithSelectionBias) {
  ModelConfig m = base_config();
  m.moe_every = 1;  // both blocks MoE
  m.moe.score = kernels::RouterScore::kSigmoid;
  m.moe.aux_loss_coef = 0.0;
  m.moe.bias_update_rate = 0.001;
  m.moe.shared_experts = 1;
  m.recompute_swiglu = true;
  m.tie_embeddings = false;
  run_case("moe_sigmoid_bias", m, true);
}

}  // namespace
}  // namespace troupe::layers

int main(int argc, char** argv) {
  if (troupe::layers::run_process({troupe::layers::kPython, "-c", "import torch"}, 120) != 0) {
    std::printf("SKIPPED: /usr/bin/python3 cannot import torch (install python3-torch)\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
