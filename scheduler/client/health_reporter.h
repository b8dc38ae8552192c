// scheduler/client/health_reporter.h — defines HealthReporter: a job process's thread that
// samples its machine every second (observe::HealthSampler: /proc, its cgroup, NVML, its
// step timings) and sends the sample to the scheduler as a HealthReport over a session of
// its own (through its agent's relay when there is one). The scheduler keeps the latest
// report of every worker (`troupe status --health`, `troupe top`, Prometheus) and runs
// the peer-comparison detector over them (scheduler/daemons/health_monitor.h).
//
// Threading: start() launches the thread; the destructor stops and joins it. The
// StepProbe handed in is fed by the step loop from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "core/status.h"
#include "observe/health.h"
#include "scheduler/client/job_context.h"

namespace troupe::sched {

struct HealthReporterOptions {
  std::chrono::milliseconds interval{1000};
  observe::HealthSamplerOptions sampler;
};

class HealthReporter {
 public:
  static Result<std::unique_ptr<HealthReporter>> start(const JobContext& ctx, HealthReporterOptions o,
                                                       std::shared_ptr<observe::StepProbe> steps = nullptr);
  ~HealthReporter();
  HealthReporter(const HealthReporter&) = delete;
  HealthReporter& operator=(const HealthReporter&) = delete;

 private:
  HealthReporter() = default;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace troupe::sched
