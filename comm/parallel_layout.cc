// comm/parallel_layout.cc — ParallelLayout coordinates and groups, make_process_groups().
#include "comm/parallel_layout.h"

#include "core/check.h"

namespace troupe::comm {

Result<ParallelLayout> ParallelLayout::make(int pp, int dp, int n) {
  if (pp < 1 || dp < 1 || n < 1) return invalid_argument("parallel layout pp={} dp={} n={}: each must be >= 1", pp, dp, n);
  ParallelLayout l;
  l.pp_ = pp;
  l.dp_ = dp;
  l.n_ = n;
  return l;
}

ParallelCoord ParallelLayout::coord(int rank) const {
  TROUPE_CHECK(rank >= 0 && rank < world_size(), "rank {} outside layout {}", rank, to_string());
  return ParallelCoord{rank / (dp_ * n_), (rank / n_) % dp_, rank % n_};
}

int ParallelLayout::rank_of(const ParallelCoord& c) const {
  TROUPE_CHECK(c.pp >= 0 && c.pp < pp_ && c.dp >= 0 && c.dp < dp_ && c.n >= 0 && c.n < n_,
               "coordinate ({}, {}, {}) outside layout {}", c.pp, c.dp, c.n, to_string());
  return (c.pp * dp_ + c.dp) * n_ + c.n;
}

std::vector<int> ParallelLayout::dp_group(int rank) const {
  ParallelCoord c = coord(rank);
  std::vector<int> g;
  for (int d = 0; d < dp_; ++d) g.push_back(rank_of({c.pp, d, c.n}));
  return g;
}

std::vector<int> ParallelLayout::n_group(int rank) const {
  ParallelCoord c = coord(rank);
  std::vector<int> g;
  for (int i = 0; i < n_; ++i) g.push_back(rank_of({c.pp, c.dp, i}));
  return g;
}

std::vector<int> ParallelLayout::pp_group(int rank) const {
  ParallelCoord c = coord(rank);
  std::vector<int> g;
  for (int p = 0; p < pp_; ++p) g.push_back(rank_of({p, c.dp, c.n}));
  return g;
}

std::optional<int> ParallelLayout::prev_stage(int rank) const {
  ParallelCoord c = coord(rank);
  if (c.pp == 0) return std::nullopt;
  return rank_of({c.pp - 1, c.dp, c.n});
}

std::optional<int> ParallelLayout::next_stage(int rank) const {
  ParallelCoord c = coord(rank);
  if (c.pp + 1 == pp_) return std::nullopt;
  return rank_of({c.pp + 1, c.dp, c.n});
}

std::string ParallelLayout::dp_group_name(int rank) const {
  ParallelCoord c = coord(rank);
  return fmt::format("dp.pp{}.n{}", c.pp, c.n);
}

std::string ParallelLayout::n_group_name(int rank) const {
  ParallelCoord c = coord(rank);
  return fmt::format("n.pp{}.dp{}", c.pp, c.dp);
}

std::string ParallelLayout::pp_group_name(int rank) const {
  ParallelCoord c = coord(rank);
  return fmt::format("pp.dp{}.n{}", c.dp, c.n);
}

std::string ParallelLayout::to_string() const { return fmt::format("pp{} x dp{} x n{}", pp_, dp_, n_); }

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
  TROUPE_ASSIGN_OR_RETURN(groups.dp,
                          make_group_communicator(base, layout.dp_group_name(r), layout.dp_group(r), r, factory));
  TROUPE_ASSIGN_OR_RETURN(groups.n,
                          make_group_communicator(base, layout.n_group_name(r), layout.n_group(r), r, factory));
  TROUPE_ASSIGN_OR_RETURN(groups.pp,
                          make_group_communicator(base, layout.pp_group_name(r), layout.pp_group(r), r, factory));
  return groups;
}

}  // namespace troupe::comm
