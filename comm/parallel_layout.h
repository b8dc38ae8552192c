// comm/parallel_layout.h — defines ParallelLayout (the pp × dp × n layout of DESIGN.md:
// rank -> (pp, dp, n) coordinates, the data-parallel group, the n-group inside a node,
// pipeline neighbours) and make_process_groups(), which creates one sub-communicator per
// group kind through any backend factory.
//
// Rank order: n is innermost (the n GPUs of a node hold consecutive ranks), then dp, then
// pp: rank = (pp * dp_size + dp) * n_size + n.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace troupe::comm {

struct ParallelCoord {
  int pp = 0;
  int dp = 0;
  int n = 0;
  friend bool operator==(const ParallelCoord&, const ParallelCoord&) = default;
};

class ParallelLayout {
 public:
  // pp, dp, n >= 1.
  static Result<ParallelLayout> make(int pp, int dp, int n);

  int pp() const { return pp_; }
  int dp() const { return dp_; }
  int n() const { return n_; }
  int world_size() const { return pp_ * dp_ * n_; }

  ParallelCoord coord(int rank) const;  // CHECKs 0 <= rank < world_size
  int rank_of(const ParallelCoord& c) const;

  // Global ranks of `rank`'s groups, ordered by the varying coordinate (so the position
  // of a rank in its group is its coordinate).
  std::vector<int> dp_group(int rank) const;  // same pp and n
  std::vector<int> n_group(int rank) const;   // same pp and dp (one node's MoE group)
  std::vector<int> pp_group(int rank) const;  // same dp and n (one pipeline)
  // Global rank of the previous / next pipeline stage, if any.
  std::optional<int> prev_stage(int rank) const;
  std::optional<int> next_stage(int rank) const;

  // Communicator names of `rank`'s groups, unique per group within a store namespace.
  std::string dp_group_name(int rank) const;
  std::string n_group_name(int rank) const;
  std::string pp_group_name(int rank) const;

  std::string to_string() const;  // "pp2 x dp2 x n4"

 private:
  int pp_ = 1, dp_ = 1, n_ = 1;
};

// One communicator per group kind of this rank; the rank inside each is its coordinate.
// pp.send/recv to prev/next stage: peer = coord.pp -/+ 1.
struct ProcessGroups {
  ParallelCoord coord;
  std::unique_ptr<Communicator> dp;
  std::unique_ptr<Communicator> n;
  std::unique_ptr<Communicator> pp;
};

// Creates a communicator for `spec` (a backend's make_*_communicator bound to its options).
using CommFactory = std::function<Result<std::unique_ptr<Communicator>>(const CommSpec&)>;

// A communicator over an arbitrary group: `ranks` (global ranks, all distinct) in group
// order; this process is `global_rank` and gets rank = its index in `ranks`. Collective
// over the group's members, who pass the same `name` and `ranks`.
Result<std::unique_ptr<Communicator>> make_group_communicator(const CommSpec& base, std::string name,
                                                              const std::vector<int>& ranks, int global_rank,
                                                              const CommFactory& factory);

// Collective over the world: every rank calls it with the same layout, `base.store`,
// `base.ns` and `base.options` (base.name/rank/size are ignored). Groups are created in a
// fixed order (dp, n, pp) so no rank waits on a peer busy with another group.
Result<ProcessGroups> make_process_groups(const ParallelLayout& layout, int global_rank, const CommSpec& base,
                                          const CommFactory& factory);

}  // namespace troupe::comm
