// checkpoint/layout.h — defines TensorPlacement (how one tensor is spread over a
// ParallelLayout, core/parallel_layout.h) and the functions that answer "which slice of
// this global tensor does this rank own / save".
//
// Saving and loading call the same functions with their own layouts: a rank saves the
// slice save_slice() gives it under the saved layout, and later asks the reader for the
// slice owned_slice() gives it under the new layout. Nothing else about the old layout is
// needed to load, which is what makes any pp × dp × n load into any other.
//
// Rank numbering is ParallelLayout's (the contract with the training app): n is innermost,
// then dp, then pp: rank = (pp * dp_size + dp) * n_size + n. A rank's pipeline stage is
// its coordinate pp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "checkpoint/slice.h"
#include "core/parallel_layout.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

inline constexpr int kAllStages = -1;

// How one global tensor is held by the ranks of a layout. Combinations:
//  - replicated on its stage (attention, norms, router, router bias): expert_sharded=false,
//    zero_sharded=false;
//  - expert weights: expert_sharded=true: dim 0 (the expert index) is split into n equal
//    contiguous blocks, n-rank k holds experts [k*E/n, (k+1)*E/n);
//  - ZeRO-1 optimizer state: zero_sharded=true; the tensor is stored 1-D (its flattened
//    elements). The rank's local part (all of it, or its expert block when expert_sharded)
//    sits at zero_flat_offset inside a flat buffer of zero_flat_total elements that the
//    stage's dp ranks split with dp_flat_shard(); a rank owns the overlap of its dp shard
//    with this tensor's elements (possibly nothing).
// stage is the pipeline stage that owns the tensor; kAllStages means every stage holds it
// (e.g. the step counter), and stage 0 saves it.
struct TensorPlacement {
  int stage = kAllStages;
  bool expert_sharded = false;
  bool zero_sharded = false;
  int64_t zero_flat_offset = 0;
  int64_t zero_flat_total = 0;

  static TensorPlacement replicated(int stage = kAllStages) { return TensorPlacement{stage}; }
  static TensorPlacement experts(int stage) { return TensorPlacement{stage, true}; }
  static TensorPlacement zero(int stage, bool expert_sharded, int64_t flat_offset, int64_t flat_total) {
    return TensorPlacement{stage, expert_sharded, true, flat_offset, flat_total};
  }
  std::string to_string() const;
};

// The experts n-rank `n_rank` holds when `num_experts` are split over n.
Result<Range> expert_range(int64_t num_experts, int n, int n_rank);

// ZeRO-1 split of a flat buffer of `total` elements over dp ranks: each gets
// ceil(total/dp) elements, the last ones fewer (or none), so the shards tile [0, total).
Range dp_flat_shard(int64_t total, int dp, int dp_rank);

// The slice of `global` that the rank at `coords` holds in memory under `layout`, or
// nullopt when it holds none of it (another stage, or an empty ZeRO overlap).
// InvalidArgument when the placement does not fit (experts not divisible by n, stage out
// of range, ZeRO tensor not 1-D or outside its flat buffer), naming `name`.
Result<std::optional<Slice>> owned_slice(std::string_view name, const Shape& global, const TensorPlacement& p,
                                         const ParallelLayout& layout, const ParallelCoord& coords);

// The slice this rank writes when saving: owned_slice() with replicas removed, so that
// exactly one rank saves each element: dp rank 0 unless ZeRO-sharded (a ZeRO shard has
// one dp owner), n rank 0 unless expert-sharded (the n ranks hold the same copy of
// non-expert tensors and of their ZeRO shards), stage 0 for kAllStages tensors.
Result<std::optional<Slice>> save_slice(std::string_view name, const Shape& global, const TensorPlacement& p,
                                        const ParallelLayout& layout, const ParallelCoord& coords);

}  // namespace troupe::checkpoint
