// tests/interop/hf_import_test.cc — importing the checkpoints transformers wrote
// (fixtures/mixtral, fixtures/qwen3_moe): the config as Troupe's model, every tensor in
// its place (the logits of every position and the loss of the batch equal transformers'),
// the names Troupe's model gives its tensors, and the refusals of what Troupe cannot
// express, each naming the feature.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "interop/hf_checkpoint.h"
#include "interop_test_util.h"
#include "layers/model.h"

namespace troupe::interop {
namespace {

using test::fixture;
using test::read_json_file;

class HfImport : public ::testing::TestWithParam<std::string> {};

TEST_P(HfImport, LogitsAndLossEqualTransformers) {
  auto ckpt = HfCheckpoint::open(fixture(GetParam()));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  const layers::ModelConfig& cfg = (*ckpt)->config().model;
  layers::Model model(cfg, /*seed=*/99);  // every value is then overwritten
  const Status loaded = load_hf_weights(**ckpt, model);
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  const test::Reference ref = test::read_reference(GetParam());
  const layers::Ctx c = layers::Ctx::cpu();

  // The loss of the batch: inputs are the tokens but the last, targets the tokens shifted
  // (transformers' labels=input_ids).
  const int64_t s = ref.positions - 1;
  std::vector<int32_t> ids, targets;
  for (int64_t r = 0; r < ref.rows; ++r) {
    for (int64_t t = 0; t < s; ++t) {
      ids.push_back(ref.tokens[static_cast<size_t>(r * ref.positions + t)]);
      targets.push_back(ref.tokens[static_cast<size_t>(r * ref.positions + t + 1)]);
    }
  }
  int64_t tokens = 0;
  const double sum = model.eval_loss_sum(c, Tensor::from_ints({ref.rows, s}, ids),
                                         Tensor::from_ints({ref.rows, s}, targets), tokens);
  const double loss = sum / static_cast<double>(tokens);
  const double rel = std::abs(loss - ref.loss) / ref.loss;
  fmt::print("[{}] loss {:.7f}, transformers {:.7f}, relative difference {:.2e}\n", GetParam(), loss,
             ref.loss, rel);
  EXPECT_LT(rel, 1e-4);

  // The logits of every position: position t of a row is the last position of its prefix
  // (causal attention).
  double max_diff = 0;
  for (int64_t r = 0; r < ref.rows; ++r) {
    for (int64_t t = 0; t < ref.positions; ++t) {
      std::vector<int32_t> prefix(ref.tokens.begin() + r * ref.positions,
                                  ref.tokens.begin() + r * ref.positions + t + 1);
      const std::vector<float> lg = model.last_logits(c, Tensor::from_ints({1, t + 1}, prefix));
      ASSERT_EQ(static_cast<int64_t>(lg.size()), ref.vocab);
      for (int64_t v = 0; v < ref.vocab; ++v) {
        const float want = ref.logits[static_cast<size_t>((r * ref.positions + t) * ref.vocab + v)];
        max_diff = std::max(max_diff, static_cast<double>(std::abs(lg[static_cast<size_t>(v)] - want)));
      }
    }
  }
  fmt::print("[{}] logits of {} positions: max |diff| vs transformers {:.2e}\n", GetParam(),
             ref.rows * ref.positions, max_diff);
  EXPECT_LT(max_diff, 2e-4);
}

TEST_P(HfImport, TensorListIsTheModelsOwn) {
  auto ckpt = HfCheckpoint::open(fixture(GetParam()));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  const layers::ModelConfig& cfg = (*ckpt)->config().model;
  layers::Model model(cfg, 1);
  const std::vector<TroupeTensor> planned = troupe_tensors(cfg);
  const std::vector<layers::NamedParameter> params = model.parameters();
  ASSERT_EQ(planned.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(planned[i].name, params[i].name);
    EXPECT_EQ(planned[i].shape, params[i].param->value.shape()) << params[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, HfImport, ::testing::Values("mixtral", "qwen3_moe"));

TEST(HfImportConfig, FamiliesAsTroupeModels) {
  auto mix = HfCheckpoint::open(fixture("mixtral"));
  ASSERT_TRUE(mix.ok()) << mix.status().to_string();
  const layers::ModelConfig& m = (*mix)->config().model;
  EXPECT_EQ((*mix)->config().family, HfFamily::kMixtral);
  EXPECT_EQ(m.n_layers, 2);
  EXPECT_TRUE(m.is_moe_block(0) && m.is_moe_block(1));
  EXPECT_EQ(m.dh(), 16);
  EXPECT_EQ(m.n_kv_heads, 2);
  EXPECT_TRUE(m.moe.normalize_gates);
  EXPECT_FALSE(m.qk_norm);
  EXPECT_FALSE(m.tie_embeddings);
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(m.norm_eps, 1e-5);
  EXPECT_EQ(m.moe.expert_hidden, 96);

  auto qw = HfCheckpoint::open(fixture("qwen3_moe"));
  ASSERT_TRUE(qw.ok()) << qw.status().to_string();
  const layers::ModelConfig& q = (*qw)->config().model;
  EXPECT_EQ((*qw)->config().family, HfFamily::kQwen3Moe);
  // mlp_only_layers = [0], decoder_sparse_step = 2: blocks 1 and 3 are MoE.
  EXPECT_EQ(q.moe_layers, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(q.is_moe_block(0) || q.is_moe_block(2));
  EXPECT_EQ(q.dh(), 32);  // head_dim apart from hidden / heads
  EXPECT_TRUE(q.qk_norm);
  EXPECT_FALSE(q.moe.normalize_gates);  // norm_topk_prob = false
  EXPECT_TRUE(q.tie_embeddings);
  EXPECT_EQ(q.ffn_hidden, 96);
  EXPECT_EQ(q.moe.expert_hidden, 48);
  EXPECT_EQ(q.norm_eps, 1e-6);
}

// A copy of a fixture with config.json changed by `edit`.
std::string edited_copy(const test::ScratchDir& dir, const std::string& family,
                        const std::function<void(nlohmann::json&)>& edit) {
  const std::string out = dir / family;
  std::filesystem::create_directories(out);
  std::filesystem::copy_file(fixture(family) + "/model.safetensors", out + "/model.safetensors");
  nlohmann::json c = read_json_file(fixture(family) + "/config.json");
  edit(c);
  test::write_text(out + "/config.json", c.dump(2));
  return out;
}

TEST(HfImportConfig, RefusesWhatTroupeCannotExpressByName) {
  struct Case {
    std::string family;
    std::function<void(nlohmann::json&)> edit;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"mixtral", [](nlohmann::json& c) { c["sliding_window"] = 4096; }, "sliding_window"},
      {"mixtral", [](nlohmann::json& c) { c["router_jitter_noise"] = 0.01; }, "router_jitter_noise"},
      {"mixtral",
       [](nlohmann::json& c) {
         c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
       },
       "RoPE scaling 'yarn'"},
      {"mixtral", [](nlohmann::json& c) { c["hidden_act"] = "gelu"; }, "activation 'gelu'"},
      {"mixtral", [](nlohmann::json& c) { c["model_type"] = "deepseek_v3"; }, "multi-head latent attention"},
      {"mixtral", [](nlohmann::json& c) { c["model_type"] = "llama"; }, "supported: mixtral, qwen3_moe"},
      {"mixtral",
       [](nlohmann::json& c) {
         c["quantization_config"] = {{"quant_method", "fp8"}};
       },
       "quantized"},
      {"qwen3_moe", [](nlohmann::json& c) { c["attention_bias"] = true; }, "attention_bias"},
      {"qwen3_moe", [](nlohmann::json& c) { c["use_sliding_window"] = true; }, "use_sliding_window"},
      {"qwen3_moe",
       [](nlohmann::json& c) {
         c["layer_types"] = {"full_attention", "sliding_attention"};
       },
       "sliding_attention"},
      {"qwen3_moe", [](nlohmann::json& c) { c.erase("moe_intermediate_size"); }, "moe_intermediate_size"},
  };
  test::ScratchDir dir("hf-refuse");
  int i = 0;
  for (const Case& k : cases) {
    test::ScratchDir sub(fmt::format("case{}", i++));
    const std::string d = edited_copy(sub, k.family, k.edit);
    auto ckpt = HfCheckpoint::open(d);
    ASSERT_FALSE(ckpt.ok()) << k.says;
    EXPECT_NE(ckpt.status().message().find(k.says), std::string::npos) << ckpt.status().to_string();
  }
}

TEST(HfImportFiles, RefusesMissingExtraAndMisshapenTensors) {
  auto ckpt = HfCheckpoint::open(fixture("qwen3_moe"));
  ASSERT_TRUE(ckpt.ok());
  const layers::ModelConfig base = (*ckpt)->config().model;
  // A run whose model is not the checkpoint's: the differing key is named.
  layers::ModelConfig other = base;
  other.moe.top_k = 1;
  Status st = (*ckpt)->validate(other);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("moe.top_k"), std::string::npos) << st.to_string();

  // Files with a tensor too many (a bias the model would drop), one missing, one of
  // another shape: rewritten from the fixture with SafetensorsLayout.
  auto src = SafetensorsFile::open(fixture("qwen3_moe") + "/model.safetensors");
  ASSERT_TRUE(src.ok());
  const auto rewrite = [&](const std::string& dir, const std::string& drop, const std::string& add,
                           Shape add_shape) {
    std::filesystem::create_directories(dir);
    std::filesystem::copy_file(fixture("qwen3_moe") + "/config.json", dir + "/config.json");
    std::vector<SafetensorsLayout::Entry> es;
    for (const auto& [name, info] : (*src)->tensors())
      if (name != drop) es.push_back({name, info.dtype, info.shape});
    if (!add.empty()) es.push_back({add, StDType::kF32, add_shape});
    const SafetensorsLayout l = SafetensorsLayout::plan(es, nlohmann::json{{"format", "pt"}});
    std::string bytes = l.header;
    bytes.resize(l.file_size, '\0');
    for (const auto& e : l.entries) {
      auto it = (*src)->tensors().find(e.name);
      if (it != (*src)->tensors().end() && it->second.shape == e.shape)
        std::memcpy(bytes.data() + e.offset, (*src)->data(it->second), e.bytes);
    }
    test::write_text(dir + "/model.safetensors", bytes);
  };
  test::ScratchDir dir("hf-files");
  rewrite(dir / "extra", "", "model.layers.0.self_attn.q_proj.bias", {128});
  rewrite(dir / "missing", "model.layers.2.self_attn.k_norm.weight", "", {});
  rewrite(dir / "shape", "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.weight", {5, 64});
  for (const auto& [sub, says] :
       std::vector<std::pair<std::string, std::string>>{{"extra", "model.layers.0.self_attn.q_proj.bias"},
                                                        {"missing", "model.layers.2.self_attn.k_norm.weight"},
                                                        {"shape", "model.layers.1.mlp.gate.weight"}}) {
    auto c = HfCheckpoint::open(dir / sub);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    const Status v = (*c)->validate(base);
    EXPECT_FALSE(v.ok()) << sub;
    EXPECT_NE(v.message().find(says), std::string::npos) << v.to_string();
  }
  // A truncated file: its header names bytes past the end.
  {
    const std::string d = dir / "truncated";
    std::filesystem::create_directories(d);
    std::filesystem::copy_file(fixture("qwen3_moe") + "/config.json", d + "/config.json");
    std::ifstream in(fixture("qwen3_moe") + "/model.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes.resize(bytes.size() / 2);
    test::write_text(d + "/model.safetensors", bytes);
    auto c = HfCheckpoint::open(d);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("truncated"), std::string::npos) << c.status().to_string();
  }
}

TEST(HfImportConfig, OverridesRebuildTheModel) {
  auto ckpt = HfCheckpoint::open(fixture("qwen3_moe"));
  ASSERT_TRUE(ckpt.ok());
  const layers::ModelConfig& m = (*ckpt)->config().model;
  auto cfg = ConfigTable::parse_string("[model]\nrecompute_swiglu = true\n");
  ASSERT_TRUE(cfg.ok());
  for (const std::string& o : model_overrides(m)) ASSERT_TRUE(cfg->set_from_string(o).ok()) << o;
  auto parsed = layers::parse_model_config(*cfg);
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  std::string why;
  EXPECT_TRUE(same_architecture(*parsed, m, &why)) << why;
  EXPECT_TRUE(parsed->recompute_swiglu);  // the config's own training knobs stay
}

}  // namespace
}  // namespace troupe::interop
