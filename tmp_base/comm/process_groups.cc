// comm/process_groups.cc — make_group_communicator(), make_process_groups().
#include "comm/process_groups.h"

namespace troupe::comm {

Result<std::unique_ptr<Communicator>> make_group_communicator(const CommSpec& base, std::string name,
                                                              const std::vector<int>& ranks, int global_rank,
                                                              const CommFactory& factory) {
  if (!factory) return invalid_argument("group '{}': no communicator factory", name);
  int index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (ranks[i] == ranks[j]) return invalid_argument("group '{}': rank {} listed twice", name, ranks[i]);
    }
    if (ranks[i] == global_rank) index = static_cast<int>(i);
  }
  if (index < 0) return invalid_argument("group '{}': rank {} is not a member", name, global_rank);
  CommSpec spec = base;
  spec.name = std::move(name);
  spec.rank = index;
  spec.size = static_cast<int>(ranks.size());
  return factory(spec);
}

Result<ProcessGroups> make_process_groups(const ParallelLayout& layout, int global_rank, const CommSpec& base,
                                          const CommFactory& factory) {
  if (global_rank < 0 || global_rank >= layout.world_size()) {
    return invalid_argument("rank {} outside layout {}", global_rank, layout.to_string());
  }
  if (!factory) return invalid_argument("make_process_groups: no communicator factory");
  ProcessGroups groups;
  groups.coord = layout.coord(global_rank);
  const int r = global_rank;
  TROUPE_ASSIGN_OR_RETURN(
      groups.dp, make_group_communicator(base, layout.dp_group_name(r), layout.dp_group(r), r, factory));
  TROUPE_ASSIGN_OR_RETURN(
      groups.n, make_group_communicator(base, layout.n_group_name(r), layout.n_group(r), r, factory));
  TROUPE_ASSIGN_OR_RETURN(
      groups.pp, make_group_communicator(base, layout.pp_group_name(r), layout.pp_group(r), r, factory));
  return groups;
}

}  // namespace troupe::comm
