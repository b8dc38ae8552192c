// training/app/preflight.h — defines preflight_check: what a training run checks before
// it writes anything or starts any process, so that input that can never train is refused
// at once (a permanent failure: core/exit_status.h) and leaves no trace:
//   - the data: the train and val shards of data.dir open, each holds more tokens than one
//     sequence (train.seq_len), and every token id is below model.vocab_size;
//   - the memory: a lower bound of what one rank holds (estimate_rank_memory) against the
//     device it trains on (a GPU's memory, or this host's memory and cgroup limit).
// The layout (pp x dp x n against the launcher's worker count) is checked by run_app.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "layers/context.h"
#include "training/run_config.h"

namespace troupe::training {

// A lower bound of one rank's training state: the parameters of its share of the model
// (the non-expert part of a pipeline stage, replicated over n, plus its 1/n of the
// experts; the average stage, so the heaviest is at least this) times 16 bytes (f32
// values, gradients and the two AdamW moments, which every rank keeps for its column).
// Activations, buffers and in-memory copies come on top.
struct MemoryEstimate {
  int64_t rank_params = 0;
  uint64_t rank_bytes = 0;
};
MemoryEstimate estimate_rank_memory(const layers::TrainConfig& tc);

// The memory a rank on `ctx` can have at most, and what it is ("GPU cuda:0", "this host
// (MemTotal)", "this process's cgroup (its memory limit)"). 0 when unknown.
struct DeviceMemory {
  uint64_t bytes = 0;
  std::string what;
};
DeviceMemory device_memory(const layers::Ctx& ctx);

// The checks above, in that order; the first failure is returned (kDataLoss, kNotFound,
// kInvalidArgument or kResourceExhausted, each naming the file, key or both numbers).
Status preflight_check(const layers::TrainConfig& tc, const layers::Ctx& ctx);

}  // namespace troupe::training
