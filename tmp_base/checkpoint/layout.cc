// checkpoint/layout.cc — the owned/saved slice of each placement.
#include "checkpoint/layout.h"

#include <fmt/format.h>

#include <algorithm>

namespace troupe::checkpoint {

std::string TensorPlacement::to_string() const {
  std::string s = stage == kAllStages ? "all stages" : fmt::format("stage {}", stage);
  if (expert_sharded) s += ", experts over n";
  if (zero_sharded) s += fmt::format(", zero-1 flat at {} of {}", zero_flat_offset, zero_flat_total);
  if (!expert_sharded && !zero_sharded) s += ", replicated";
  return s;
}

Result<Range> expert_range(int64_t num_experts, int n, int n_rank) {
  if (n < 1 || n_rank < 0 || n_rank >= n)
    return invalid_argument("n rank {} outside an MoE group of {}", n_rank, n);
  if (num_experts % n != 0) {
    return invalid_argument("{} experts cannot be split over an MoE group of {} (not divisible)", num_experts,
                            n);
  }
  const int64_t per = num_experts / n;
  return Range{per * n_rank, per};
}

Range dp_flat_shard(int64_t total, int dp, int dp_rank) {
  TROUPE_CHECK(dp >= 1 && dp_rank >= 0 && dp_rank < dp && total >= 0);
  const int64_t chunk = (total + dp - 1) / dp;
  const int64_t lo = std::min(total, chunk * dp_rank);
  const int64_t hi = std::min(total, chunk * (dp_rank + 1));
  return Range{lo, hi - lo};
}

Result<std::optional<Slice>> owned_slice(std::string_view name, const Shape& global, const TensorPlacement& p,
                                         const ParallelLayout& layout, const ParallelCoord& c) {
  TROUPE_RETURN_IF_ERROR(layout.check_coord(c));
  if (p.stage != kAllStages && (p.stage < 0 || p.stage >= layout.pp())) {
    return invalid_argument("tensor '{}' belongs to stage {} but layout {} has {} stages", name, p.stage,
                            layout.to_string(), layout.pp());
  }
  if (p.stage != kAllStages && p.stage != c.pp) return std::optional<Slice>{};
  Slice s = full_slice(global);
  if (!p.zero_sharded) {
    if (p.expert_sharded) {
      if (global.empty())
        return invalid_argument("expert tensor '{}' is a scalar; dim 0 must index experts", name);
      auto r = expert_range(global[0], layout.n(), c.n);
      if (!r.ok())
        return r.status().with_context(fmt::format("tensor '{}' {}", name, shape_to_string(global)));
      s[0] = *r;
    }
    return std::optional<Slice>{s};
  }
  // ZeRO-1: the tensor is 1-D; first the expert block of this n rank, then the overlap
  // with this dp rank's shard of the flat buffer.
  if (global.size() != 1) {
    return invalid_argument("ZeRO-sharded tensor '{}' must be stored 1-D (flattened), got shape {}", name,
                            shape_to_string(global));
  }
  Range local{0, global[0]};
  if (p.expert_sharded) {
    auto r = expert_range(global[0], layout.n(), c.n);
    if (!r.ok())
      return r.status().with_context(fmt::format("ZeRO tensor '{}' {}", name, shape_to_string(global)));
    local = *r;
  }
  if (p.zero_flat_offset < 0 || p.zero_flat_offset + local.length > p.zero_flat_total) {
    return invalid_argument(
        "ZeRO tensor '{}': {} local elements at flat offset {} overflow the flat buffer of {}", name,
        local.length, p.zero_flat_offset, p.zero_flat_total);
  }
  const Range shard = dp_flat_shard(p.zero_flat_total, layout.dp(), c.dp);
  const int64_t lo = std::max(shard.start, p.zero_flat_offset);
  const int64_t hi = std::min(shard.end(), p.zero_flat_offset + local.length);
  if (hi <= lo) return std::optional<Slice>{};
  return std::optional<Slice>{Slice{Range{local.start + (lo - p.zero_flat_offset), hi - lo}}};
}

Result<std::optional<Slice>> save_slice(std::string_view name, const Shape& global, const TensorPlacement& p,
                                        const ParallelLayout& layout, const ParallelCoord& c) {
  Result<std::optional<Slice>> owned = owned_slice(name, global, p, layout, c);
  if (!owned.ok() || !owned->has_value()) return owned;
  // kAllStages tensors: stage 0 saves. Replicated across the MoE group unless
  // expert-sharded: n rank 0 saves. ZeRO shards are already split over dp; everything
  // else is replicated over dp: dp rank 0 saves.
  const bool saves =
      (p.stage != kAllStages || c.pp == 0) && (p.expert_sharded || c.n == 0) && (p.zero_sharded || c.dp == 0);
  if (!saves) return std::optional<Slice>{};
  return owned;
}

}  // namespace troupe::checkpoint
