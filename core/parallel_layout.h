// core/parallel_layout.h — defines ParallelLayout (the pp × dp × n layout, docs/parallelism.md),
// ParallelCoord (a rank's place in it), the one parser of layout
// strings (parse(), parse_layout_items()) and the rank arithmetic every layer shares:
// comm builds its groups from it, checkpoint places tensors with it, the scheduler places
// workers with it and train_moe reads its --parallel flag with it.
//
// Rank order (the contract between the scheduler, the training app and checkpoints): n is
// innermost (the n GPUs of a node hold consecutive ranks), then dp, then pp:
//   rank = (pp * dp_size + dp) * n_size + n.
//
// Text form: "pp=2,dp=2,n=4" (to_string(); parse() reads it back to the same layout).
// parse() also takes the keys in any order with missing ones 1 ("n=2" is pp=1,dp=1,n=2),
// and the short form "2x2x4" (pp x dp x n).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace troupe {

// A rank's coordinates: its pipeline stage, its data-parallel replica and its place in
// the MoE group (sequence-parallel attention, expert-parallel experts).
struct ParallelCoord {
  int pp = 0;
  int dp = 0;
  int n = 0;
  std::string to_string() const;  // "pp 1, dp 0, n 3"
  friend bool operator==(const ParallelCoord&, const ParallelCoord&) = default;
};

// Always valid: pp, dp, n >= 1 and world_size() fits an int (the constructors check).
// A default-constructed layout is one rank, pp=1,dp=1,n=1.
class ParallelLayout {
 public:
  ParallelLayout() = default;
  // For layouts known to be valid (constants, tests): CHECKs validate(). Sizes that come
  // from input (flags, files, messages) go through make() or parse().
  ParallelLayout(int pp, int dp, int n);

  // InvalidArgument naming the part that is not >= 1, or the world size when
  // pp * dp * n does not fit an int.
  static Status validate(int64_t pp, int64_t dp, int64_t n);
  static Result<ParallelLayout> make(int64_t pp, int64_t dp, int64_t n);
  // "pp=P,dp=D,n=N" (any order, each key at most once, missing ones 1) or "PxDxN".
  // InvalidArgument naming the text and what is wrong: empty, an item that is not
  // key=value, an unknown or repeated key, a value that is not a decimal integer, zero,
  // or too large.
  static Result<ParallelLayout> parse(std::string_view text);

  int pp() const { return pp_; }
  int dp() const { return dp_; }
  int n() const { return n_; }
  int world_size() const { return pp_ * dp_ * n_; }

  // OutOfRange naming the rank (coordinates) and this layout when outside it; for ranks
  // and coordinates that come from input (flags, manifests, peers).
  Status check_rank(int rank) const;
  Status check_coord(const ParallelCoord& c) const;
  ParallelCoord coord(int rank) const;        // CHECKs check_rank(rank)
  int rank_of(const ParallelCoord& c) const;  // CHECKs check_coord(c)

  // Global ranks of `rank`'s groups, ordered by the varying coordinate (so the position
  // of a rank in its group is its coordinate).
  std::vector<int> dp_group(int rank) const;  // same pp and n
  std::vector<int> n_group(int rank) const;   // same pp and dp (one node's MoE group)
  std::vector<int> pp_group(int rank) const;  // same dp and n (one pipeline)
  // Global rank of the previous / next pipeline stage, if any.
  std::optional<int> prev_stage(int rank) const;
  std::optional<int> next_stage(int rank) const;

  // Communicator names of `rank`'s groups, the same for every member of a group and
  // different between groups of a kind (unique within a store namespace).
  std::string dp_group_name(int rank) const;  // "dp.pp0.n1"
  std::string n_group_name(int rank) const;   // "n.pp0.dp1"
  std::string pp_group_name(int rank) const;  // "pp.dp0.n1"

  std::string to_string() const;  // "pp=2,dp=2,n=4"
  friend bool operator==(const ParallelLayout&, const ParallelLayout&) = default;

 private:
  int pp_ = 1, dp_ = 1, n_ = 1;
};

// The items of a layout string before they become a layout, for callers whose strings
// carry more than the layout (train_moe's --parallel pp=2,n=2,dispatch=allgather): the
// pp / dp / n values that were given (each a checked integer >= 1; the "PxDxN" form gives
// all three) and every other key=value item, in order, for the caller to judge.
// InvalidArgument for an empty string or item, an item that is not key=value (empty key
// or value included), a repeated key, or a bad pp / dp / n value, naming the text.
struct LayoutItems {
  std::optional<int> pp, dp, n;
  std::vector<std::pair<std::string, std::string>> other;
};
Result<LayoutItems> parse_layout_items(std::string_view text);

}  // namespace troupe
