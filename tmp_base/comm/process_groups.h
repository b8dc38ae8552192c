// comm/process_groups.h — defines ProcessGroups and make_process_groups(), which creates
// one sub-communicator per group kind (dp, n, pp) of a ParallelLayout (core/parallel_layout.h:
// the rank order, the groups and their names) through any backend factory, and
// make_group_communicator() for an arbitrary group.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/parallel_layout.h"

namespace troupe::comm {

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
