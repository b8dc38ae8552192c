// scheduler/daemons/health_monitor.cc — HealthMonitor (health_monitor.h).
#include "scheduler/daemons/health_monitor.h"

namespace troupe::sched {

void HealthMonitor::on_report(const std::string& job, const std::string& proc, const std::string& node,
                              bool judged, const HealthReport& r, Clock::time_point now) {
  Latest& l = latest_[job][proc];
  l.node = node;
  l.pid = r.pid;
  l.sent_at_ms = r.sent_at_ms;
  l.at = now;
  l.metrics.clear();
  std::vector<observe::Metric> ms;
  for (const auto& [name, value] : r.metrics) {
    if (observe::find_metric_info(name) == nullptr) continue;
    l.metrics.emplace_back(name, value);
    ms.push_back({name, value});
  }
  if (judged) detectors_.try_emplace(job, opts_).first->second.report(proc, node, ms, now);
}

void HealthMonitor::forget(const std::string& job, const std::string& proc) {
  if (auto it = latest_.find(job); it != latest_.end()) it->second.erase(proc);
  if (auto it = detectors_.find(job); it != detectors_.end()) it->second.forget(proc);
}

void HealthMonitor::forget_job(const std::string& job) {
  latest_.erase(job);
  detectors_.erase(job);
}

std::vector<HealthMonitor::JobVerdict> HealthMonitor::evaluate(Clock::time_point now, int64_t wall_ms) {
  std::vector<JobVerdict> out;
  for (auto& [job, d] : detectors_) {
    for (auto& v : d.evaluate(now, wall_ms)) out.push_back({job, std::move(v)});
  }
  return out;
}

bool HealthMonitor::flagged(const std::string& job, const std::string& proc,
                            const std::string& metric) const {
  auto it = detectors_.find(job);
  return it != detectors_.end() && it->second.flagged().count({proc, metric}) > 0;
}

nlohmann::json HealthMonitor::job_json(const std::string& job, Clock::time_point now) const {
  nlohmann::json workers = nlohmann::json::array();
  auto it = latest_.find(job);
  auto dit = detectors_.find(job);
  if (it != latest_.end()) {
    for (const auto& [proc, l] : it->second) {
      nlohmann::json metrics = nlohmann::json::object();
      for (const auto& [name, value] : l.metrics) metrics[name] = value;
      nlohmann::json flags = nlohmann::json::array();
      if (dit != detectors_.end()) {
        for (const auto& [w, metric] : dit->second.flagged()) {
          if (w == proc) flags.push_back(metric);
        }
      }
      workers.push_back({{"name", proc},
                         {"node", l.node},
                         {"pid", l.pid},
                         {"age_s", std::chrono::duration<double>(now - l.at).count()},
                         {"metrics", std::move(metrics)},
                         {"flags", std::move(flags)}});
    }
  }
  return {{"detector", opts_.describe()}, {"workers", std::move(workers)}};
}

}  // namespace troupe::sched
