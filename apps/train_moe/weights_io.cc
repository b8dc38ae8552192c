// apps/train_moe/weights_io.cc — the interim weights file.
#include "apps/train_moe/weights_io.h"

#include <cstring>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

namespace troupe::train_moe {

namespace {
constexpr char kMagic[8] = {'T', 'R', 'P', 'W', 'T', 'S', '0', '1'};

nlohmann::json model_to_json(const layers::ModelConfig& m) {
  nlohmann::json j;
  j["vocab_size"] = m.vocab_size;
  j["d_model"] = m.d_model;
  j["n_layers"] = m.n_layers;
  j["n_heads"] = m.n_heads;
  j["n_kv_heads"] = m.n_kv_heads;
  j["head_dim"] = m.head_dim;
  j["ffn_hidden"] = m.ffn_hidden;
  j["tie_embeddings"] = m.tie_embeddings;
  j["rope_theta"] = m.rope_theta;
  j["norm_eps"] = m.norm_eps;
  j["qk_norm"] = m.qk_norm;
  j["init_std"] = m.init_std;
  j["moe_layers"] = m.moe_layers;
  j["moe_every"] = m.moe_every;
  j["moe_first"] = m.moe_first;
  j["recompute_swiglu"] = m.recompute_swiglu;
  const layers::MoEConfig& e = m.moe;
  j["moe"] = {{"num_experts", e.num_experts},
              {"top_k", e.top_k},
              {"expert_hidden", e.expert_hidden},
              {"router", e.score == kernels::RouterScore::kSigmoid ? "sigmoid" : "softmax"},
              {"normalize_gates", e.normalize_gates},
              {"aux_loss_coef", e.aux_loss_coef},
              {"z_loss_coef", e.z_loss_coef},
              {"bias_update_rate", e.bias_update_rate},
              {"capacity_factor", e.capacity_factor},
              {"shared_experts", e.shared_experts}};
  return j;
}

layers::ModelConfig model_from_json(const nlohmann::json& j) {
  layers::ModelConfig m;
  m.vocab_size = j.at("vocab_size");
  m.d_model = j.at("d_model");
  m.n_layers = j.at("n_layers");
  m.n_heads = j.at("n_heads");
  m.n_kv_heads = j.at("n_kv_heads");
  m.head_dim = j.at("head_dim");
  m.ffn_hidden = j.at("ffn_hidden");
  m.tie_embeddings = j.at("tie_embeddings");
  m.rope_theta = j.at("rope_theta");
  m.norm_eps = j.at("norm_eps");
  m.qk_norm = j.value("qk_norm", false);  // absent in files written before it existed
  m.init_std = j.at("init_std");
  m.moe_layers = j.at("moe_layers").get<std::vector<int64_t>>();
  m.moe_every = j.at("moe_every");
  m.moe_first = j.at("moe_first");
  m.recompute_swiglu = j.at("recompute_swiglu");
  const auto& e = j.at("moe");
  m.moe.num_experts = e.at("num_experts");
  m.moe.top_k = e.at("top_k");
  m.moe.expert_hidden = e.at("expert_hidden");
  m.moe.score = e.at("router") == "sigmoid" ? kernels::RouterScore::kSigmoid : kernels::RouterScore::kSoftmax;
  m.moe.normalize_gates = e.at("normalize_gates");
  m.moe.aux_loss_coef = e.at("aux_loss_coef");
  m.moe.z_loss_coef = e.at("z_loss_coef");
  m.moe.bias_update_rate = e.at("bias_update_rate");
  m.moe.capacity_factor = e.at("capacity_factor");
  m.moe.shared_experts = e.at("shared_experts");
  return m;
}

std::vector<std::pair<std::string, Tensor*>> all_tensors(layers::Model& model) {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (auto& p : model.parameters()) out.emplace_back(p.name, &p.param->value);
  for (auto& b : model.buffers()) out.emplace_back(b.name, b.tensor);
  return out;
}

Result<nlohmann::json> read_header(std::ifstream& f, const std::string& path, uint64_t& data_start) {
  char magic[8];
  uint64_t len = 0;
  f.read(magic, 8);
  f.read(reinterpret_cast<char*>(&len), 8);
  if (!f || std::memcmp(magic, kMagic, 8) != 0 || len > (1u << 30)) {
    return data_loss("{} is not a train_moe weights file", path);
  }
  std::string text(len, '\0');
  f.read(text.data(), static_cast<std::streamsize>(len));
  if (!f) return data_loss("{}: truncated header", path);
  data_start = 16 + len;
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return data_loss("{}: bad header: {}", path, e.what());
  }
}
}  // namespace

Status save_weights(const std::string& path, layers::Model& model, const WeightsInfo& info) {
  nlohmann::json h;
  h["model"] = model_to_json(model.config());
  h["seq_len"] = info.seq_len;
  h["step"] = info.step;
  auto tensors = all_tensors(model);
  uint64_t off = 0;
  nlohmann::json list = nlohmann::json::array();
  for (auto& [name, t] : tensors) {
    list.push_back({{"name", name}, {"shape", t->shape()}, {"offset", off}});
    off += t->nbytes();
  }
  h["tensors"] = std::move(list);
  const std::string text = h.dump();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return io_error("cannot write {}", tmp);
    const uint64_t len = text.size();
    f.write(kMagic, 8);
    f.write(reinterpret_cast<const char*>(&len), 8);
    f.write(text.data(), static_cast<std::streamsize>(len));
    for (auto& [name, t] : tensors) {
      const Tensor c = t->contiguous();
      f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
    }
    if (!f) return io_error("cannot write {}", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return io_error("cannot rename {} to {}", tmp, path);
  return ok_status();
}

Result<WeightsInfo> read_weights_info(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("weights file {} not found", path);
  uint64_t start = 0;
  TROUPE_ASSIGN_OR_RETURN(nlohmann::json h, read_header(f, path, start));
  WeightsInfo info;
  try {
    info.model = model_from_json(h.at("model"));
    info.seq_len = h.at("seq_len");
    info.step = h.at("step");
  } catch (const std::exception& e) {
    return data_loss("{}: bad header: {}", path, e.what());
  }
  return info;
}

Status load_weights(const std::string& path, layers::Model& model) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("weights file {} not found", path);
  uint64_t start = 0;
  TROUPE_ASSIGN_OR_RETURN(nlohmann::json h, read_header(f, path, start));
  std::map<std::string, nlohmann::json> entries;
  for (const auto& e : h.at("tensors")) entries[e.at("name").get<std::string>()] = e;
  for (auto& [name, t] : all_tensors(model)) {
    auto it = entries.find(name);
    if (it == entries.end()) return data_loss("{}: tensor {} missing", path, name);
    if (it->second.at("shape").get<Shape>() != t->shape()) {
      return data_loss("{}: tensor {} has shape {}, the model wants {}", path, name,
                       shape_to_string(it->second.at("shape").get<Shape>()), shape_to_string(t->shape()));
    }
    f.seekg(static_cast<std::streamoff>(start + it->second.at("offset").get<uint64_t>()));
    f.read(static_cast<char*>(t->data_ptr()), static_cast<std::streamsize>(t->nbytes()));
    if (!f) return data_loss("{}: tensor {} truncated", path, name);
  }
  return ok_status();
}

}  // namespace troupe::train_moe
