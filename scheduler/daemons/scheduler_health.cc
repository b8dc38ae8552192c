// scheduler/daemons/scheduler_health.cc — the Scheduler's part of worker health: HealthReports in,
// the faulty-machine detector's verdicts out as events and the job's health_policy, and
// the Prometheus refresh (scheduler.h, health_monitor.h, scheduler_metrics.h).
#include <fmt/format.h>

#include "core/logging.h"
#include "scheduler/daemons/scheduler.h"
#include "scheduler/daemons/scheduler_metrics.h"

namespace troupe::sched {

using json = nlohmann::json;

namespace {
std::shared_ptr<spdlog::logger> log() {
  static auto l = make_logger("sched");
  return l;
}
bool proc_live(const ProcRecord& p) {
  return p.state == ProcState::kStarting || p.state == ProcState::kRunning;
}
}  // namespace

std::string Scheduler::metrics_url() const {
  return metrics_ ? metrics_->url() : std::string();
}

void Scheduler::on_health(const HealthReport& r) {
  auto jit = jobs_.find(r.job_id);
  if (jit == jobs_.end() || job_state_final(jit->second.rec.state)) return;
  auto pit = jit->second.procs.find(r.name);
  if (pit == jit->second.procs.end() || pit->second.rec.epoch != r.epoch || !proc_live(pit->second.rec))
    return;
  const Proc& proc = pit->second;
  // A worker retired by its driver (replaced) may report until it is gone: not judged.
  const bool judged = proc.rec.role == "worker" && !jit->second.retired.count(r.name);
  health_->on_report(r.job_id, r.name, proc.rec.agent_id, judged, r, Clock::now());
}

void Scheduler::on_health_verdict(Job& job, const observe::Verdict& v) {
  const std::string& policy = job.rec.spec.health_policy;
  json ev = {{"proc", v.worker},
             {"agent", v.node},
             {"metric", v.metric},
             {"value", v.value},
             {"peer_median", v.peer_median},
             {"score", v.score}};
  if (v.cleared) {
    event(job, "health_clear", ev);
    log()->info("job {}: {} on {} no longer deviates on {}", job.rec.id, v.worker, v.node, v.metric);
    return;
  }
  ev["first_deviation_ms"] = v.first_deviation_ms;
  ev["policy"] = policy;
  event(job, "health_flag", ev);
  log()->warn(
      "job {}: {} on {} flagged: {} = {:.4g} against its peers' median {:.4g} ({:.1f} spreads; policy {})",
      job.rec.id, v.worker, v.node, v.metric, v.value, v.peer_median, v.score, policy);
  if (metrics_) metrics_->health_flag(job.rec.id, v.worker, v.node, v.metric);
  if (policy == "flag") return;
  if (!is_elastic(job)) {
    event(
        job, "health_policy_skipped",
        {{"proc", v.worker}, {"policy", policy}, {"why", "the job's driver does not supervise its workers"}});
    return;
  }
  if (!health_acted_.insert({job.rec.id, policy == "drain" ? v.node : v.worker}).second) return;
  auto pit = job.procs.find(v.worker);
  if (pit == job.procs.end()) return;
  if (policy == "replace") {
    elastic_request(job, json{{"op", "replace"}, {"slot", pit->second.rec.rank}});
    event(job, "health_replace_requested", {{"proc", v.worker}, {"slot", pit->second.rec.rank}});
    return;
  }
  // drain: every live worker of the job's epoch on that agent, placed elsewhere.
  for (auto& [name, p] : job.procs) {
    if (p.rec.role != "worker" || p.rec.agent_id != v.node || !proc_live(p.rec) || job.retired.count(name))
      continue;
    elastic_request(job, json{{"op", "replace"}, {"slot", p.rec.rank}, {"avoid", v.node}});
    event(job, "health_drain_requested", {{"proc", name}, {"slot", p.rec.rank}, {"agent", v.node}});
  }
}

void Scheduler::elastic_request(Job& job, const json& req) {
  const std::string pre = job.rec.id + "/elastic/request/";
  // The first free request number, as `troupe replace` finds it (the driver takes them in order).
  for (int64_t k = 0;; ++k) {
    StoreRequest probe{StoreOp::kContains, job.rec.id, 0, {pre + std::to_string(k)}, {}, 0};
    auto r = rendezvous_->handle(probe, next_token_++, Clock::now());
    if (r && !r->data.empty() && r->data[0] == '1') continue;
    StoreRequest set{StoreOp::kSet, job.rec.id, 0, {pre + std::to_string(k)}, req.dump(), 0};
    auto done = rendezvous_->handle(set, next_token_++, Clock::now());
    if (done && !done->status().ok())
      log()->error("job {}: cannot write request {}: {}", job.rec.id, k, done->status().to_string());
    elastic_on_store(job, set);
    return;
  }
}

void Scheduler::refresh_metrics() {
  int alive = 0, dead = 0, total = 0, used = 0;
  for (const auto& [id, a] : agents_) {
    (a.alive ? alive : dead) += 1;
    if (a.alive) total += a.rec.slots;
  }
  std::map<std::string, int> by_state;
  std::map<std::string, SchedulerMetrics::JobFigures> figures;
  const int64_t now_ms = wall_ms();
  for (const auto& [id, job] : jobs_) {
    by_state[job_state_name(job.rec.state)] += 1;
    int running = 0;
    for (const auto& [n, p] : job.procs) {
      if (p.rec.role == "worker" && proc_live(p.rec)) ++used;
      if (p.rec.role == "worker" && p.rec.epoch == job.rec.epoch && p.rec.state == ProcState::kRunning)
        ++running;
    }
    // Finished jobs stay in the figures for 10 minutes (a last scrape sees how they ended).
    if (job_state_final(job.rec.state) && now_ms - job.rec.updated_ms > 600'000) continue;
    figures[id] = {job_state_name(job.rec.state), running, job.rec.restarts, job.rec.driver_restarts,
                   job.rec.epoch};
  }
  metrics_->refresh(alive, dead, total, used, by_state, figures, *health_);
}

}  // namespace troupe::sched
