// scheduler/daemons/placement.cc — place_workers / place_driver.
#include "scheduler/daemons/placement.h"

namespace troupe::sched {

Result<std::vector<SlotAssignment>> place_workers(const ParallelLayout& layout,
                                                  const std::vector<AgentCapacity>& agents) {
  std::vector<size_t> used(agents.size(), 0);  // how many of each agent's free slots we took
  std::vector<SlotAssignment> out;
  const int n = layout.n();
  const int groups = layout.world_size() / n;
  for (int g = 0; g < groups; ++g) {
    bool placed = false;
    for (size_t a = 0; a < agents.size() && !placed; ++a) {
      if (agents[a].free_slots.size() - used[a] < static_cast<size_t>(n)) continue;
      for (int i = 0; i < n; ++i) {
        out.push_back(SlotAssignment{g * n + i, agents[a].agent_id, agents[a].free_slots[used[a]++]});
      }
      placed = true;
    }
    if (!placed) {
      std::string free;
      for (size_t a = 0; a < agents.size(); ++a) {
        free += fmt::format("{}{}: {}", free.empty() ? "" : ", ", agents[a].agent_id, agents[a].free_slots.size());
      }
      return resource_exhausted(
          "placement: {} workers in groups of {} (one group per node) do not fit; free slots: {}",
          layout.world_size(), n, free.empty() ? std::string("no agent") : free);
    }
  }
  return out;
}

std::string place_driver(const std::vector<SlotAssignment>& workers, const std::vector<AgentCapacity>& agents) {
  for (const auto& w : workers) {
    if (w.rank == 0) return w.agent_id;
  }
  return agents.empty() ? std::string() : agents.front().agent_id;
}

}  // namespace troupe::sched
