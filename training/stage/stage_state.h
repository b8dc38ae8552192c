// training/stage/stage_state.h — defines the training state of one rank as named slices
// of global tensors (StageState), the names those tensors carry (shared by every Stage
// and `train_moe sample`, so any layout loads any other), and SliceSource, where an
// import reads slices from (a checkpoint, another rank's exported state, or a Hugging
// Face model directory).
//
// The global tensors of a training state:
//   <parameter name>            the model parameters, full global shapes ("embedding.weight",
//                               "blocks.3.moe.experts.w1" [E, ...], ...)
//   blocks.<i>.moe.router.bias  the router's balancing bias (a buffer)
//   opt.m.<parameter name>      AdamW first moment, stored 1-D (flattened), because a ZeRO-1
//   opt.v.<parameter name>      shard is a contiguous range of the flattened elements
// Scalars travel in the rank state JSON: {"step", "adam_steps", "data": {...}, "rng": {...}}.
// Training uses no stateful random generator: initialisation and data order are
// counter-based functions of (seed, name or step), so "rng" records the seed and "data"
// the next step to read; restoring the step restores both.
//
// Stage's export_state / import_state / load_checkpoint (defined in stage_state.cc) use
// checkpoint::owned_slice / save_slice with these placements:
//   parameter: replicated(stage), or experts(stage) for expert weights (dim 0 over n);
//   router bias: replicated(stage);
//   moments: zero(stage, expert, offset in the rank's flat buffer, flat buffer size).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/layout.h"
#include "checkpoint/slice.h"
#include "checkpoint/writer.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {
class CheckpointReader;
}
namespace troupe::interop {
class HfCheckpoint;
}
namespace troupe::layers {
struct TrainConfig;
}

namespace troupe::training {

std::string opt_m_name(const std::string& param);  // "opt.m.<param>"
std::string opt_v_name(const std::string& param);  // "opt.v.<param>"

// kSave: each element of each global tensor once over the world (what a checkpoint
// writes: dp rank 0 for dp-replicated tensors, n rank 0 for n-replicated ones, the first
// stage for a tied embedding). kHeld: everything this rank holds in memory (what a peer
// needs to rebuild this rank).
enum class StateScope { kSave, kHeld };

// One rank's state. `slices` are SaveEntry records (global name, global shape, box
// offsets, a host tensor holding the box), ready for CheckpointWriter::save.
struct StageState {
  int64_t step = 0;  // optimizer steps done
  ParallelLayout layout;
  ParallelCoord coords;
  int rank = 0;
  std::vector<checkpoint::SaveEntry> slices;
  nlohmann::json rank_state = nlohmann::json::object();
};

// Fills `dst` (host, contiguous, f32, shape slice_shape(box)) with the elements `box` of
// the global tensor `name`, whose global shape the caller expects to be `global`. An
// error names the tensor (and the source).
using SliceSource =
    std::function<Status(const std::string& name, const Shape& global, const checkpoint::Slice& box, Tensor& dst)>;

// A source reading a checkpoint (checksums of every stored slice used are verified; a
// tensor missing or of another shape is an error naming it and the checkpoint).
SliceSource slice_source(const checkpoint::CheckpointReader& reader);
// A source reading a Hugging Face model directory (train.init_from): the parameters from
// its safetensors files (each box reads only its own bytes of the mapped files), zeros for
// the state a fresh run starts from (AdamW moments, router biases).
SliceSource slice_source(const interop::HfCheckpoint& ckpt);

class Stage;
// train.init_from: a fresh Stage's parameters from that directory, checked against the
// run's model first (each rank reads its own slices; steps done = 0). No-op without it.
// Called wherever a Stage starts with no state to restore.
Status init_from_hf(Stage& stage, const layers::TrainConfig& tc);

// A source assembling boxes from exported states (e.g. of data-parallel peers, kHeld):
// every element of the box must be covered by their slices, else NotFound.
SliceSource slice_source(const std::vector<const StageState*>& states);

}  // namespace troupe::training
