// apps/train_moe/weights_io.h — the app's interim weights file (until the checkpoint
// module replaces it): save_weights / load_weights of a Model's parameters and buffers,
// with the model config and the training sequence length so `sample` can rebuild it.
//
// File "model.bin": magic "TRPWTS01", u64 header length, a JSON header
// {"model": {...ModelConfig...}, "seq_len": S, "step": N, "tensors": [{"name", "shape",
// "offset"}]}, then the f32 tensors at their byte offsets (relative to the data start).
#pragma once

#include <string>

#include "core/status.h"
#include "layers/model.h"

namespace troupe::train_moe {

struct WeightsInfo {
  layers::ModelConfig model;
  int64_t seq_len = 0;
  int64_t step = 0;
};

Status save_weights(const std::string& path, layers::Model& model, const WeightsInfo& info);
// Reads only the header.
Result<WeightsInfo> read_weights_info(const std::string& path);
// Loads every tensor into `model`, whose config must match the file's.
Status load_weights(const std::string& path, layers::Model& model);

}  // namespace troupe::train_moe
