// apps/train_moe/model_state.h — the single-process run's training state in the global
// names of actors/training/stage_state.h (parameters, router biases, AdamW moments stored
// 1-D), so a single-process checkpoint loads into any layout and any layout's checkpoint
// loads here: model_state() for saving, load_model_state() for --resume,
// load_model_weights() and checkpoint_train_config() for `train_moe sample`, `eval` and
// `export` from a checkpoint.
#pragma once

#include "actors/training/stage_state.h"
#include "checkpoint/reader.h"
#include "layers/context.h"
#include "layers/model.h"
#include "layers/optimizer.h"
#include "layers/train_config.h"

namespace troupe::train_moe {

// The whole state after `steps` optimizer steps, as layout 1x1x1 rank 0 slices. Host
// views on the CPU (valid until the next step); host copies of device tensors on a GPU.
training::StageState model_state(const layers::Ctx& c, layers::Model& model, layers::AdamW& opt,
                                 const layers::TrainConfig& tc);

// Reads every parameter, bias and moment from `reader` (resharded from whatever layout
// saved it: each tensor is assembled whole) into the model and optimizer, and sets the
// optimizer's step count. Working copies (GPU) are refreshed.
Status load_model_state(const layers::Ctx& c, const checkpoint::CheckpointReader& reader, layers::Model& model,
                        layers::AdamW& opt);

// The training config a checkpoint was saved with (its config text and overrides): what
// sample, eval and export rebuild the model from.
Result<layers::TrainConfig> checkpoint_train_config(const checkpoint::CheckpointReader& reader);

// Reads the parameters and router biases only (no optimizer moments) from `reader`,
// resharded from whatever layout saved it, into a host (CPU) model: what sampling needs.
Status load_model_weights(const checkpoint::CheckpointReader& reader, layers::Model& model);

}  // namespace troupe::train_moe
