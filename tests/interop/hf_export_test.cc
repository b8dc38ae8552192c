// tests/interop/hf_export_test.cc — export_hf from Troupe checkpoints: the fixtures that
// transformers wrote, imported and saved as a checkpoint (one rank, or experts split over
// two), export to the same tensor names, shapes and dtypes, byte for byte in f32 and
// rounded to nearest even in bf16 (the names, shapes and dtypes of transformers' own bf16
// save); the export imports back to the same parameters; a model a family cannot express
// is refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "checkpoint/layout.h"
#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "interop/hf_checkpoint.h"
#include "interop_test_util.h"
#include "layers/model.h"

namespace troupe::interop {
namespace {

using test::fixture;

// Saves `model`'s parameters as the checkpoint of step 1 of `run_dir` in layout 1 x 1 x n:
// each rank writes what it would (replicated tensors from n rank 0, its block of experts).
void write_checkpoint(layers::Model& model, int n, const std::string& run_dir) {
  auto layout = ParallelLayout::make(1, 1, n);
  ASSERT_TRUE(layout.ok());
  for (int r = 0; r < n; ++r) {
    const ParallelCoord coords = layout->coord(r);
    std::vector<checkpoint::SaveEntry> entries;
    for (auto& p : model.parameters()) {
      const bool expert = p.name.find(".moe.experts.") != std::string::npos;
      const auto place =
          expert ? checkpoint::TensorPlacement::experts(0) : checkpoint::TensorPlacement::replicated(0);
      auto box = checkpoint::save_slice(p.name, p.param->value.shape(), place, *layout, coords);
      ASSERT_TRUE(box.ok()) << box.status().to_string();
      if (!box->has_value()) continue;
      checkpoint::SaveEntry e;
      e.name = p.name;
      e.global_shape = p.param->value.shape();
      for (const auto& x : **box) e.offsets.push_back(x.start);
      e.tensor = p.param->value.narrow(0, (**box)[0].start, (**box)[0].length);
      entries.push_back(std::move(e));
    }
    auto w = checkpoint::CheckpointWriter::create({.run_dir = run_dir, .layout = *layout, .rank = r});
    ASSERT_TRUE(w.ok());
    auto h = (*w)->save(1, entries);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    ASSERT_TRUE(h->wait().ok());
  }
  checkpoint::FinalizeOptions fo;
  fo.world_size = n;
  auto f = checkpoint::finalize_checkpoint(run_dir, 1, fo);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
}

std::unique_ptr<layers::Model> imported(const std::string& family) {
  auto ckpt = HfCheckpoint::open(fixture(family));
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  auto model = std::make_unique<layers::Model>((*ckpt)->config().model, 7);
  const Status st = load_hf_weights(**ckpt, *model);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return model;
}

// Every tensor of the export directory `dir` (through its index), by name.
struct Exported {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const StTensorInfo*>> tensors;
};
Exported read_export(const std::string& dir) {
  Exported e;
  const nlohmann::json idx = test::read_json_file(dir + "/model.safetensors.index.json");
  std::set<std::string> names;
  for (const auto& [t, f] : idx.at("weight_map").items()) names.insert(f.get<std::string>());
  for (const std::string& f : names) {
    auto sf = SafetensorsFile::open(dir + "/" + f);
    EXPECT_TRUE(sf.ok()) << sf.status().to_string();
    for (const auto& [name, info] : (*sf)->tensors()) {
      EXPECT_EQ(idx["weight_map"].value(name, ""), f) << name;
      e.tensors[name] = {sf->get(), &info};
    }
    e.files.push_back(std::move(*sf));
  }
  return e;
}

class HfExport : public ::testing::TestWithParam<std::string> {};

TEST_P(HfExport, F32IsTransformersFileByteForByte) {
  const std::string family = GetParam();
  auto model = imported(family);
  test::ScratchDir dir("hf-export");
  write_checkpoint(*model, /*n=*/2, dir / "run");
  auto reader = checkpoint::CheckpointReader::open_latest_valid(dir / "run");
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  ExportOptions o;
  o.family = *parse_family(family);
  o.dtype = DType::kF32;
  o.max_shard_bytes = 300'000;  // several files
  uint64_t last = 0, calls = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_LE(done, total);
    last = done;
    ++calls;
  };
  auto s = export_hf(**reader, model->config(), dir / "out", o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_GT(s->files, 1);
  EXPECT_EQ(last, s->bytes);
  EXPECT_GT(calls, 0u);

  const Exported ours = read_export(dir / "out");
  auto theirs = SafetensorsFile::open(fixture(family) + "/model.safetensors");
  ASSERT_TRUE(theirs.ok());
  ASSERT_EQ(ours.tensors.size(), (*theirs)->tensors().size());
  for (const auto& [name, info] : (*theirs)->tensors()) {
    auto it = ours.tensors.find(name);
    ASSERT_NE(it, ours.tensors.end()) << "missing " << name;
    const StTensorInfo& mine = *it->second.second;
    EXPECT_EQ(mine.dtype_name, info.dtype_name) << name;
    EXPECT_EQ(mine.shape, info.shape) << name;
    ASSERT_EQ(mine.end - mine.begin, info.end - info.begin) << name;
    EXPECT_EQ(std::memcmp(it->second.first->data(mine), (*theirs)->data(info), info.end - info.begin), 0)
        << name;
  }
  // config.json: the same family and architecture as transformers' own.
  const nlohmann::json mine = test::read_json_file(dir / "out/config.json");
  const nlohmann::json ref = test::read_json_file(fixture(family) + "/config.json");
  EXPECT_EQ(mine["model_type"], ref["model_type"]);
  EXPECT_EQ(mine["architectures"], ref["architectures"]);
  auto a = parse_hf_config(mine, "exported config.json");
  auto b = parse_hf_config(ref, "transformers' config.json");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok());
  std::string why;
  EXPECT_TRUE(same_architecture(a->model, b->model, &why)) << why;
  for (const auto& [k, v] : ref.items()) {
    if (k == "transformers_version" || k == "pad_token_id" || k == "bos_token_id" || k == "eos_token_id")
      continue;
    EXPECT_TRUE(mine.contains(k)) << "config.json lacks '" << k << "', which transformers writes";
  }

  // Imported back: the same parameters, bitwise.
  auto back = HfCheckpoint::open(dir / "out");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  layers::Model again(model->config(), 123);
  ASSERT_TRUE(load_hf_weights(**back, again).ok());
  auto p0 = model->parameters(), p1 = again.parameters();
  for (size_t i = 0; i < p0.size(); ++i) {
    const Tensor& x = p0[i].param->value;
    EXPECT_EQ(std::memcmp(x.data_ptr(), p1[i].param->value.data_ptr(), x.nbytes()), 0) << p0[i].name;
  }
}

TEST_P(HfExport, Bf16HasTransformersNamesShapesDtypesAndRoundsToNearestEven) {
  const std::string family = GetParam();
  auto model = imported(family);
  test::ScratchDir dir("hf-export16");
  write_checkpoint(*model, /*n=*/1, dir / "run");
  auto reader = checkpoint::CheckpointReader::open_latest_valid(dir / "run");
  ASSERT_TRUE(reader.ok());
  ExportOptions o;
  o.family = *parse_family(family);
  o.dtype = DType::kBF16;
  o.threads = 3;
  auto s = export_hf(**reader, model->config(), dir / "out", o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->files, 1);
  const Exported ours = read_export(dir / "out");
  const nlohmann::json hdr = test::read_json_file(fixture(family) + "/bf16_header.json");
  const nlohmann::json& want = hdr.at("tensors");
  ASSERT_EQ(ours.tensors.size(), want.size());
  auto f32 = SafetensorsFile::open(fixture(family) + "/model.safetensors");
  ASSERT_TRUE(f32.ok());
  for (const auto& [name, w] : want.items()) {
    auto it = ours.tensors.find(name);
    ASSERT_NE(it, ours.tensors.end()) << "missing " << name;
    const StTensorInfo& mine = *it->second.second;
    EXPECT_EQ(mine.dtype_name, w.at("dtype").get<std::string>()) << name;
    EXPECT_EQ(mine.shape, w.at("shape").get<Shape>()) << name;
    const StTensorInfo& src = *(*(*f32)->info(name));
    const auto* x = reinterpret_cast<const float*>((*f32)->data(src));
    const auto* y = reinterpret_cast<const uint16_t*>(it->second.first->data(mine));
    for (int64_t i = 0; i < src.numel(); ++i)
      ASSERT_EQ(y[i], float_to_bf16_bits(x[i])) << name << " [" << i << "]";
  }
  const nlohmann::json cfg = test::read_json_file(dir / "out/config.json");
  EXPECT_EQ(cfg["dtype"], hdr["config"]["dtype"]);
}

INSTANTIATE_TEST_SUITE_P(Families, HfExport, ::testing::Values("mixtral", "qwen3_moe"));

TEST(HfExportRefusals, NameTheFeatureTheFamilyLacks) {
  auto qwen = HfCheckpoint::open(fixture("qwen3_moe"));
  auto mix = HfCheckpoint::open(fixture("mixtral"));
  ASSERT_TRUE(qwen.ok() && mix.ok());
  const layers::ModelConfig q = (*qwen)->config().model, m = (*mix)->config().model;
  const auto says = [](const Result<nlohmann::json>& r, const std::string& what) {
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().to_string();
  };
  says(hf_config_for(q, HfFamily::kMixtral, DType::kBF16), "block 0 is dense");
  layers::ModelConfig q_all_moe = q;
  q_all_moe.moe_layers = {0, 1, 2, 3};
  says(hf_config_for(q_all_moe, HfFamily::kMixtral, DType::kBF16), "no q/k norm");
  says(hf_config_for(m, HfFamily::kQwen3Moe, DType::kBF16), "model.qk_norm = false");
  layers::ModelConfig biased = m;
  biased.moe.bias_update_rate = 1e-3;
  says(hf_config_for(biased, HfFamily::kMixtral, DType::kBF16), "selection bias");
  layers::ModelConfig sigmoid = m;
  sigmoid.moe.score = kernels::RouterScore::kSigmoid;
  says(hf_config_for(sigmoid, HfFamily::kMixtral, DType::kBF16), "sigmoid");
  layers::ModelConfig shared = q;
  shared.moe.shared_experts = 1;
  says(hf_config_for(shared, HfFamily::kQwen3Moe, DType::kBF16), "shared experts");
  layers::ModelConfig unnormalised = m;
  unnormalised.moe.normalize_gates = false;
  says(hf_config_for(unnormalised, HfFamily::kMixtral, DType::kBF16), "normalize_gates");
  EXPECT_NE(parse_family("deepseek_v3").status().message().find("multi-head latent attention"),
            std::string::npos);
}

}  // namespace
}  // namespace troupe::interop
