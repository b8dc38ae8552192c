// apps/train_moe/model_state.cc — load_model_weights (see model_state.h).
#include "apps/train_moe/model_state.h"

#include "core/config.h"
#include "training/stage/stage_state.h"

namespace troupe::train_moe {

Status load_model_weights(const checkpoint::CheckpointReader& reader, layers::Model& model) {
  const training::SliceSource source = training::slice_source(reader);
  std::vector<std::pair<std::string, Tensor*>> targets;
  for (const auto& p : model.parameters()) targets.emplace_back(p.name, &p.param->value);
  for (const auto& b : model.buffers()) targets.emplace_back(b.name, b.tensor);
  for (auto& [name, t] : targets) {
    TROUPE_CHECK(t->device().is_cpu(), "load_model_weights: {} is not on the host", name);
    Tensor host = Tensor::empty(t->shape(), DType::kF32);
    TROUPE_RETURN_IF_ERROR(source(name, t->shape(), checkpoint::full_slice(t->shape()), host));
    t->copy_from(host);
  }
  return ok_status();
}

Result<layers::TrainConfig> checkpoint_train_config(const checkpoint::CheckpointReader& reader) {
  const checkpoint::Manifest& m = reader.manifest();
  if (m.config_text.empty()) return failed_precondition("checkpoint {} holds no config text", reader.path());
  TROUPE_ASSIGN_OR_RETURN(ConfigTable cfg,
                          ConfigTable::parse_string(m.config_text, reader.path() + "/manifest.json config"));
  for (const auto& v : m.metadata.value("overrides", nlohmann::json::array())) {
    TROUPE_RETURN_IF_ERROR(cfg.set_from_string(v.get<std::string>()));
  }
  // The config the run was started with, already admitted then ([bench]/[test] included).
  return layers::parse_train_config(cfg, layers::TestSections::kAdmit);
}

}  // namespace troupe::train_moe
