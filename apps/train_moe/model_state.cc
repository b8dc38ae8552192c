// apps/train_moe/model_state.cc — model_state / load_model_state (see model_state.h).
#include "apps/train_moe/model_state.h"

#include <fmt/format.h>

#include "core/config.h"

namespace troupe::train_moe {

namespace {

// Every state tensor of the single process: global name, the live tensor, and the global
// shape it is stored with (moments flattened).
struct Item {
  std::string name;
  Tensor* tensor;
  Shape global;
};

std::vector<Item> items(layers::Model& model, layers::AdamW& opt) {
  std::vector<Item> out;
  const std::vector<layers::NamedParameter> params = model.parameters();
  for (const auto& p : params) out.push_back({p.name, &p.param->value, p.param->value.shape()});
  for (const auto& b : model.buffers()) out.push_back({b.name, b.tensor, b.tensor->shape()});
  // AdamW::state(): "<param>.adam_m", "<param>.adam_v" per parameter, in parameter order.
  const std::vector<layers::NamedBuffer> moments = opt.state();
  TROUPE_CHECK(moments.size() == 2 * params.size(), "AdamW holds {} moments for {} parameters", moments.size(),
               params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Shape flat{params[i].param->value.numel()};
    out.push_back({training::opt_m_name(params[i].name), moments[2 * i].tensor, flat});
    out.push_back({training::opt_v_name(params[i].name), moments[2 * i + 1].tensor, flat});
  }
  return out;
}

}  // namespace

training::StageState model_state(const layers::Ctx& c, layers::Model& model, layers::AdamW& opt,
                                 const layers::TrainConfig& tc) {
  model.sync_master_values(c);  // split masters: values up to date before they are copied
  training::StageState st;
  st.step = opt.steps_done();
  for (const Item& it : items(model, opt)) {
    checkpoint::SaveEntry e;
    e.name = it.name;
    e.global_shape = it.global;
    e.tensor = c.to_host(*it.tensor).view(it.global);
    st.slices.push_back(std::move(e));
  }
  st.rank_state = nlohmann::json{
      {"step", st.step},
      {"adam_steps", st.step},
      {"data", {{"next_step", st.step + 1}, {"seed", tc.train.seed}, {"dp_rank", 0},
                {"micro_batch_size", tc.train.micro_batch_size}, {"grad_accum", tc.train.grad_accum}}},
      {"rng", {{"kind", "counter-based (splitmix64 of seed, name, index)"}, {"seed", tc.train.seed}}}};
  return st;
}

Status load_model_state(const layers::Ctx& c, const checkpoint::CheckpointReader& reader, layers::Model& model,
                        layers::AdamW& opt) {
  const training::SliceSource source = training::slice_source(reader);
  for (const Item& it : items(model, opt)) {
    Tensor host = Tensor::empty(it.global, DType::kF32);
    TROUPE_RETURN_IF_ERROR(source(it.name, it.global, checkpoint::full_slice(it.global), host));
    Tensor shaped = host.view(it.tensor->shape());
    if (it.tensor->device().is_cpu()) {
      it.tensor->copy_from(shaped);
    } else {
      c.copy_to_device(shaped, *it.tensor);
    }
  }
  opt.set_steps_done(reader.manifest().metadata.value("adam_steps", reader.step()));
  model.refresh_working_copies(c);
  return ok_status();
}

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
  return layers::parse_train_config(cfg);
}

}  // namespace troupe::train_moe
