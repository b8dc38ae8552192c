// training/worker/elastic_faults.h — fault injection in an elastic worker process
// (test.inject; the parser parse_faults is in training/parallel/elastic_comm.h): the per-process state
// the worker loop updates and the hook the comm layer calls at its fault points.
// Included by the elastic worker's files only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "training/worker/elastic.h"

namespace troupe::training {

// Fault injection state (one worker process).
struct FaultState {
  std::vector<FaultSpec> specs;
  std::vector<bool> fired;
  std::vector<int64_t> slowed_step;  // kSlow: the last step it slept in
  std::atomic<int64_t> step{0};
  int slot = 0;
  comm::RendezvousStore* store = nullptr;
  std::string job;
  std::function<void()> cut;          // aborts this worker's communicators
  std::function<void()> cut_control;  // closes its control-plane connection (may be empty)
  std::function<void()> corrupt;      // damages the newest intact snapshot part it holds
};
// The worker process's fault state (null: no injection). Set by run_elastic_worker before
// the worker runs, cleared after; the step thread updates `step`.
extern FaultState* g_faults;
// The comm layer's fault point hook (set_fault_hook) while g_faults is set.
void fault_hook(std::string_view what);

}  // namespace troupe::training
