// apps/train_moe/model_state.h — reads a training state (the global names of
// training/stage/stage_state.h, saved by any layout's Stages) into one host Model:
// load_model_weights(), what `train_moe sample`, `eval` and `export` run on, and
// checkpoint_train_config(), the config a checkpoint was saved with.
#pragma once

#include "checkpoint/reader.h"
#include "layers/model.h"
#include "training/run_config.h"

namespace troupe::train_moe {

// The training config a checkpoint was saved with (its config text and overrides): what
// sample, eval and export rebuild the model from.
Result<layers::TrainConfig> checkpoint_train_config(const checkpoint::CheckpointReader& reader);

// Reads the parameters and router biases only (no optimizer moments) from `reader`,
// resharded from whatever layout saved it, into a host (CPU) model: what sampling needs.
Status load_model_weights(const checkpoint::CheckpointReader& reader, layers::Model& model);

}  // namespace troupe::train_moe
