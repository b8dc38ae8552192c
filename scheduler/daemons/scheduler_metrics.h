// scheduler/daemons/scheduler_metrics.h — defines SchedulerMetrics: what troupe-scheduler serves
// on /metrics (Prometheus text format; troupe-scheduler --metrics-listen):
//
//   troupe_agents{state="alive"|"dead"}            agents known
//   troupe_slots{state="total"|"used"}             worker slots of live agents
//   troupe_jobs{state="pending"|"running"|...}     jobs by state
//   troupe_job_workers_running{troupe_job}                running workers of the job's epoch
//   troupe_job_restarts{troupe_job}, troupe_job_driver_restarts{troupe_job}, troupe_job_epoch{troupe_job}
//   troupe_heartbeat_latency_seconds               histogram: a beat's wait from arrival to handling
//   troupe_rendezvous_wait_seconds                 histogram: how long parked store get/wait requests
//                                                  waited for their keys (rendezvous)
//   troupe_health_flags_total{troupe_job,worker,node,metric}  the detector's flags
//   troupe_worker_<metric>{troupe_job,worker,node}        each worker's latest health report
//                                                  (observe/metric.h: troupe_worker_proc_run_delay, ...)
//   troupe_worker_flagged{troupe_job,worker,node,metric}  1 while the detector flags it
//
// Threading: the scheduler's loop updates; the Exposer's threads read (prometheus-cpp's
// metrics are thread-safe).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "observe/metrics_server.h"
#include "scheduler/daemons/health_monitor.h"

namespace prometheus {
class Registry;
class Gauge;
class Counter;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace troupe::sched {

class SchedulerMetrics {
 public:
  static Result<std::unique_ptr<SchedulerMetrics>> start(const observe::MetricsServerOptions& o);
  ~SchedulerMetrics();
  const std::string& url() const { return server_->url(); }

  void beat_latency(double seconds);
  void rendezvous_wait(double seconds);
  void health_flag(const std::string& job, const std::string& worker, const std::string& node,
                   const std::string& metric);

  struct JobFigures {
    std::string state;
    int workers_running = 0;
    int restarts = 0;
    int driver_restarts = 0;
    uint64_t epoch = 0;
  };
  // Everything else, once a second: gauges of agents, slots and jobs (`jobs` holds the
  // unfinished ones and those that ended recently; the others' series are removed), and
  // every worker's latest health report.
  void refresh(int agents_alive, int agents_dead, int slots_total, int slots_used,
               const std::map<std::string, int>& jobs_by_state, const std::map<std::string, JobFigures>& jobs,
               const HealthMonitor& health);

 private:
  SchedulerMetrics() = default;
  using Labels = std::map<std::string, std::string>;
  void set_gauge(prometheus::Family<prometheus::Gauge>& f, const Labels& l, double v,
                 std::map<Labels, prometheus::Gauge*>& seen, std::map<Labels, prometheus::Gauge*>& now);
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<observe::MetricsServer> server_;
  prometheus::Family<prometheus::Gauge>* agents_ = nullptr;
  prometheus::Family<prometheus::Gauge>* slots_ = nullptr;
  prometheus::Family<prometheus::Gauge>* jobs_ = nullptr;
  prometheus::Family<prometheus::Gauge>* job_workers_ = nullptr;
  prometheus::Family<prometheus::Gauge>* job_restarts_ = nullptr;
  prometheus::Family<prometheus::Gauge>* job_driver_restarts_ = nullptr;
  prometheus::Family<prometheus::Gauge>* job_epoch_ = nullptr;
  prometheus::Family<prometheus::Gauge>* flagged_ = nullptr;
  prometheus::Family<prometheus::Counter>* flags_ = nullptr;
  prometheus::Histogram* beat_latency_ = nullptr;
  prometheus::Histogram* rendezvous_ = nullptr;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> worker_;  // by health metric
  // The series set at the last refresh, per family: those not set again are removed.
  std::map<void*, std::map<Labels, prometheus::Gauge*>> series_;
};

}  // namespace troupe::sched
