// scheduler/daemons/health_monitor.h — defines HealthMonitor, the scheduler's view of its
// workers' health: the latest HealthReport of every job process, and one PeerDetector
// (observe/peer_detector.h) per job over its workers, whose flags the scheduler turns
// into events and into the job's policy (scheduler.cc: flag, replace, drain).
//
// Threading: the scheduler's loop only.
#pragma once

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "observe/peer_detector.h"
#include "scheduler/client/protocol.h"

namespace troupe::sched {

class HealthMonitor {
 public:
  using Clock = std::chrono::steady_clock;
  explicit HealthMonitor(observe::DetectorOptions o) : opts_(std::move(o)) {}

  // A report of `proc` (a worker when `judged`: only workers are compared with each
  // other) of `job`, running on agent `node`. Metrics whose names observe/metric.h does
  // not know are dropped (a newer worker's: shown nowhere, judged never).
  void on_report(const std::string& job, const std::string& proc, const std::string& node, bool judged,
                 const HealthReport& r, Clock::time_point now);
  void forget(const std::string& job, const std::string& proc);
  void forget_job(const std::string& job);

  struct JobVerdict {
    std::string job;
    observe::Verdict v;
  };
  // The detectors' evaluations due by `now`.
  std::vector<JobVerdict> evaluate(Clock::time_point now, int64_t wall_ms);

  struct Latest {
    std::string node;
    int32_t pid = 0;
    int64_t sent_at_ms = 0;
    Clock::time_point at{};
    std::vector<std::pair<std::string, double>> metrics;
  };
  // job -> process -> its latest report.
  const std::map<std::string, std::map<std::string, Latest>>& latest() const { return latest_; }
  bool flagged(const std::string& job, const std::string& proc, const std::string& metric) const;
  // {"detector": "...", "workers": [{name, node, pid, age_s, metrics: {...}, flags: [...]}]}
  nlohmann::json job_json(const std::string& job, Clock::time_point now) const;
  const observe::DetectorOptions& options() const { return opts_; }

 private:
  observe::DetectorOptions opts_;
  std::map<std::string, std::map<std::string, Latest>> latest_;
  std::map<std::string, observe::PeerDetector> detectors_;
};

}  // namespace troupe::sched
