// scheduler/daemons/scheduler_metrics.cc — SchedulerMetrics (scheduler_metrics.h).
#include "scheduler/daemons/scheduler_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace troupe::sched {

namespace {

prometheus::Histogram::BucketBoundaries exponential(double first, double factor, int n) {
  prometheus::Histogram::BucketBoundaries b;
  double x = first;
  for (int i = 0; i < n; ++i, x *= factor) b.push_back(x);
  return b;
}

}  // namespace

Result<std::unique_ptr<SchedulerMetrics>> SchedulerMetrics::start(const observe::MetricsServerOptions& o) {
  std::unique_ptr<SchedulerMetrics> m(new SchedulerMetrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  auto& r = *m->registry_;
  auto gauge = [&r](const char* name, const char* help) -> prometheus::Family<prometheus::Gauge>* {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r);
  };
  m->agents_ = gauge("troupe_agents", "agents known to the scheduler, by state");
  m->slots_ = gauge("troupe_slots", "worker slots of live agents: total and used");
  m->jobs_ = gauge("troupe_jobs", "jobs by state");
  m->job_workers_ = gauge("troupe_job_workers_running", "running workers of the job's current epoch");
  m->job_restarts_ = gauge("troupe_job_restarts", "times the job's workers were restarted");
  m->job_driver_restarts_ = gauge("troupe_job_driver_restarts", "times the job's driver was restarted");
  m->job_epoch_ = gauge("troupe_job_epoch", "the job's membership epoch");
  m->flagged_ =
      gauge("troupe_worker_flagged", "1 while the faulty-machine detector flags the worker on a metric");
  m->flags_ = &prometheus::BuildCounter()
                   .Name("troupe_health_flags_total")
                   .Help("faulty-machine detector flags raised")
                   .Register(r);
  m->beat_latency_ = &prometheus::BuildHistogram()
                          .Name("troupe_heartbeat_latency_seconds")
                          .Help("heartbeats' wait from arrival at the scheduler to handling")
                          .Register(r)
                          .Add({}, exponential(1e-5, 4, 10));
  m->rendezvous_ = &prometheus::BuildHistogram()
                        .Name("troupe_rendezvous_wait_seconds")
                        .Help("how long parked rendezvous-store get/wait requests waited for their keys")
                        .Register(r)
                        .Add({}, exponential(1e-3, 4, 9));
  for (const observe::MetricInfo& info : observe::kHealthMetrics) {
    const std::string name = "troupe_worker_" + std::string(info.name);
    const std::string help = std::string(info.help) + " (" + std::string(info.unit) + ")";
    m->worker_[std::string(info.name)] = &prometheus::BuildGauge().Name(name).Help(help).Register(r);
  }
  TROUPE_ASSIGN_OR_RETURN(m->server_, observe::MetricsServer::start(o, m->registry_));
  return m;
}

SchedulerMetrics::~SchedulerMetrics() = default;

void SchedulerMetrics::beat_latency(double seconds) {
  beat_latency_->Observe(seconds);
}
void SchedulerMetrics::rendezvous_wait(double seconds) {
  rendezvous_->Observe(seconds);
}

void SchedulerMetrics::health_flag(const std::string& job, const std::string& worker, const std::string& node,
                                   const std::string& metric) {
  flags_->Add({{"troupe_job", job}, {"worker", worker}, {"node", node}, {"metric", metric}}).Increment();
}

void SchedulerMetrics::set_gauge(prometheus::Family<prometheus::Gauge>& f, const Labels& l, double v,
                                 std::map<Labels, prometheus::Gauge*>& seen,
                                 std::map<Labels, prometheus::Gauge*>& now) {
  prometheus::Gauge* g;
  if (auto it = seen.find(l); it != seen.end()) {
    g = it->second;
  } else {
    g = &f.Add(l);
  }
  g->Set(v);
  now[l] = g;
}

void SchedulerMetrics::refresh(int agents_alive, int agents_dead, int slots_total, int slots_used,
                               const std::map<std::string, int>& jobs_by_state,
                               const std::map<std::string, JobFigures>& jobs, const HealthMonitor& health) {
  std::map<void*, std::map<Labels, prometheus::Gauge*>> next;
  auto set = [&](prometheus::Family<prometheus::Gauge>* f, const Labels& l, double v) {
    set_gauge(*f, l, v, series_[f], next[f]);
  };
  set(agents_, {{"state", "alive"}}, agents_alive);
  set(agents_, {{"state", "dead"}}, agents_dead);
  set(slots_, {{"state", "total"}}, slots_total);
  set(slots_, {{"state", "used"}}, slots_used);
  for (const auto& [state, n] : jobs_by_state) set(jobs_, {{"state", state}}, n);
  for (const auto& [job, f] : jobs) {
    set(job_workers_, {{"troupe_job", job}}, f.workers_running);
    set(job_restarts_, {{"troupe_job", job}}, f.restarts);
    set(job_driver_restarts_, {{"troupe_job", job}}, f.driver_restarts);
    set(job_epoch_, {{"troupe_job", job}}, static_cast<double>(f.epoch));
  }
  for (const auto& [job, procs] : health.latest()) {
    for (const auto& [proc, l] : procs) {
      const Labels labels{{"troupe_job", job}, {"worker", proc}, {"node", l.node}};
      for (const auto& [name, value] : l.metrics) {
        auto it = worker_.find(name);
        if (it != worker_.end()) set(it->second, labels, value);
      }
      for (const auto& [metric, rule] : health.options().rules) {
        (void)rule;
        if (health.flagged(job, proc, metric))
          set(flagged_, {{"troupe_job", job}, {"worker", proc}, {"node", l.node}, {"metric", metric}}, 1);
      }
      if (health.flagged(job, proc, "report_gap_s"))
        set(flagged_, {{"troupe_job", job}, {"worker", proc}, {"node", l.node}, {"metric", "report_gap_s"}},
            1);
    }
  }
  // Series not set this time (a finished job, a worker gone, a flag cleared) are removed.
  for (auto& [family, old] : series_) {
    auto& keep = next[family];
    auto* f = static_cast<prometheus::Family<prometheus::Gauge>*>(family);
    for (auto& [labels, g] : old) {
      if (!keep.count(labels)) f->Remove(g);
    }
  }
  series_ = std::move(next);
}

}  // namespace troupe::sched
