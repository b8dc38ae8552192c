// scheduler/daemons/placement.h — defines place_workers: assigns a job's worker ranks to agents'
// free slots so that each MoE group (ranks g*n .. g*n+n-1 of a ParallelLayout) sits
// inside one node, and place_driver. Pure functions of their inputs.
#pragma once

#include <string>
#include <vector>

#include "core/parallel_layout.h"
#include "core/status.h"

namespace troupe::sched {

struct AgentCapacity {
  std::string agent_id;
  std::vector<int> free_slots;  // slot indices not used by any running job
};

struct SlotAssignment {
  int rank = 0;
  std::string agent_id;
  int slot = -1;
};

// First fit over agents in the given order, one MoE group at a time, so consecutive
// ranks share a node. Fails (kResourceExhausted, naming the free slots per agent) when a
// group fits nowhere; the caller may retry when agents join or jobs end.
Result<std::vector<SlotAssignment>> place_workers(const ParallelLayout& layout,
                                                  const std::vector<AgentCapacity>& agents);

// The driver takes no slot: it goes on the agent that holds rank 0 (close to the workers
// it supervises), or the first agent when there are no workers.
std::string place_driver(const std::vector<SlotAssignment>& workers, const std::vector<AgentCapacity>& agents);

}  // namespace troupe::sched
