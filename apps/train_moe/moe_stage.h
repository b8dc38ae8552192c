// apps/train_moe/moe_stage.h — defines train_moe's stage program (StageProgram,
// training/stage/stage_program.h): the MoE language model of layers/ (embedding, dense
// and MoE blocks, tied LM head) cut into pipeline stages, with Ulysses attention
// (AttentionShard) and expert parallelism (ExpertGroup) over the n-group, the router's
// auxiliary loss and per-expert loads as step statistics, and the routers' balancing
// biases as state beyond the parameters.
#pragma once

#include "training/app/app.h"
#include "training/stage/stage_program.h"

namespace troupe::train_moe {

// The program factory every train_moe worker (and the tests building a Stage) uses.
training::ProgramFactory moe_stage_program();
// train_moe as a framework app: its program (MFU comes from the framework's one FLOPs
// formula, layers::ModelConfig::train_flops_per_token).
training::App moe_app();

}  // namespace troupe::train_moe
