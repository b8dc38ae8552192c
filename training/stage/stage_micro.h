// training/stage/stage_micro.h — Stage's private micro-batch records (Stage::Micro,
// Stage::HostBatch), shared by the files that define Stage's pipeline and its step
// (stage_pipeline.cc, stage_step.cc). Included by nothing else.
#pragma once

#include <memory>
#include <vector>

#include "training/stage/stage.h"

namespace troupe::training {

struct Stage::Micro {
  Tensor ids, targets;                                      // local slices, i32 [B*S/n]
  int64_t tokens = 0;                                       // tokens with a target in the whole micro-batch
  std::vector<std::unique_ptr<StageProgram::Saved>> saved;  // per block
  Tensor head_dx;                                           // last stage: gradient from the LM head
};

// A step's training micro-batches as the loader gives them (first and last stage: the
// rank's slices of the sequences; other stages read no data).
struct Stage::HostBatch {
  std::vector<Tensor> ids, targets;  // per micro-batch, i32 [B*S/n] (host)
  std::vector<int64_t> tokens;       // per micro-batch: tokens with a target in the whole micro-batch
};

}  // namespace troupe::training
