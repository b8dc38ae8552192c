// observe/health.h — defines what a worker reports about its machine each second:
// HostProbe (host and process counters from /proc and the process's cgroup), StepProbe
// (the worker's own step timings, fed by its step loop) and HealthSampler, which joins
// them with NVML's GPU readings into one list of Metric (observe/metric.h).
//
// Rates are per second over the time since the previous sample. Readings a host does not
// offer (no schedstat, no delay accounting, no cgroup quota, no GPU) are left out.
//
// Threading: HostProbe and HealthSampler belong to one thread (the reporter's);
// StepProbe::record may be called from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "observe/metric.h"
#include "observe/nvml.h"

namespace troupe::observe {

class HostProbe {
 public:
  // `proc_root` is /proc (tests point it elsewhere); `pid` the process observed.
  explicit HostProbe(pid_t pid, std::string proc_root = "/proc");
  // host_* and proc_* metrics. The first call only primes the counters (rates need two
  // readings) and returns the gauges.
  std::vector<Metric> sample();

 private:
  using Counters = std::map<std::string, double>;
  Counters read_counters() const;
  pid_t pid_;
  std::string root_;
  std::string cpu_stat_path_;  // the process's cgroup cpu.stat ("" when none)
  bool cpu_stat_v2_ = false;
  Counters prev_;
  std::chrono::steady_clock::time_point prev_at_;
  bool primed_ = false;
};

// The step loop's timings, averaged over the steps recorded since the last take().
class StepProbe {
 public:
  void record_step(double step_ms, double compute_ms, double comm_ms);
  void record_io(double ms);  // a checkpoint (or other storage) write that took `ms`
  // Or around the write: while one runs, its elapsed time counts (a write stuck on a slow
  // disk shows before it ends).
  void begin_io();
  void end_io();
  // step_* metrics of the steps since the last call (none when no step ended), with
  // steps_per_s over `elapsed_s`.
  std::vector<Metric> take(double elapsed_s);

 private:
  std::mutex mu_;
  int steps_ = 0, ios_ = 0;
  double step_ms_ = 0, compute_ms_ = 0, comm_ms_ = 0, io_ms_ = 0;
  std::optional<std::vector<Metric>> last_;  // repeated while a step runs longer than a report
  std::optional<double> last_io_ms_;         // repeated until the next write
  std::optional<std::chrono::steady_clock::time_point> io_since_;
};

struct HealthSamplerOptions {
  pid_t pid = 0;     // 0: this process
  bool gpu = false;  // read NVML (a CUDA worker)
  // The worker's device for Nvml::open; empty: the first entry of CUDA_VISIBLE_DEVICES
  // (the scheduler sets it to the worker's GPU), else "0".
  std::string gpu_device;
  std::string proc_root = "/proc";
};

class HealthSampler {
 public:
  explicit HealthSampler(HealthSamplerOptions o, std::shared_ptr<StepProbe> steps = nullptr);
  std::vector<Metric> sample();
  // Why GPU metrics are missing ("" when they are read or were not asked for); the
  // reporter says it once.
  const std::string& gpu_unavailable() const { return gpu_why_; }

 private:
  HostProbe host_;
  std::shared_ptr<StepProbe> steps_;
  std::unique_ptr<Nvml> nvml_;
  std::string gpu_why_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace troupe::observe
