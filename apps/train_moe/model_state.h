// apps/train_moe/model_state.h — reads a training state's weights (the global names of
// actors/training/stage_state.h, saved by any layout's Stages) into one host Model:
// load_model_weights(), what `train_moe sample` runs on.
#pragma once

#include "checkpoint/reader.h"
#include "layers/model.h"

namespace troupe::train_moe {

// Reads the parameters and router biases only (no optimizer moments) from `reader`,
// resharded from whatever layout saved it, into a host (CPU) model: what sampling needs.
Status load_model_weights(const checkpoint::CheckpointReader& reader, layers::Model& model);

}  // namespace troupe::train_moe
