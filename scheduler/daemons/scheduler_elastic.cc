// scheduler/daemons/scheduler_elastic.cc — the scheduler's part in elastic jobs (scheduler.h,
// "Elastic jobs"; docs/elastic.md): it stays the process manager (placement, spawn, exit
// and heartbeat detection through the agents) while the job's driver owns membership.
//   worker ends (any status, or lost)  -> key "<job>/elastic/exit/<slot>" {ts_ms, why}
//   driver sets "<job>/elastic/spawn/<slot>" {epoch, avoid?} -> a worker "worker-<slot>" on
//                                          a free slot, not on agent `avoid` (troupe drain),
//                                          waiting for one if needed,
//                                          rank = slot, TROUPE_ELASTIC_EPOCH set
//   driver sets "<job>/elastic/kill/<slot>" -> that worker is killed (then reported as above)
// A failed worker is "retired": it no longer keeps the job from completing.
#include <fmt/format.h>
#include <signal.h>

#include <cstdlib>

#include "core/job_env.h"
#include "scheduler/daemons/scheduler.h"

namespace troupe::sched {

using nlohmann::json;

namespace {
bool live(const ProcRecord& p) { return p.state == ProcState::kStarting || p.state == ProcState::kRunning; }

bool parse_slot(const std::string& text, int* slot) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 0 || v > 1000000) return false;
  *slot = static_cast<int>(v);
  return true;
}
}  // namespace

bool Scheduler::is_elastic(const Job& job) const { return job.rec.spec.elastic; }

void Scheduler::elastic_worker_gone(Job& job, Proc& proc, const std::string& why, bool retire) {
  if (retire) job.retired.insert(proc.rec.name);
  const int slot = proc.rec.rank;  // an elastic worker's rank is its slot
  StoreRequest set;
  set.op = StoreOp::kSet;
  set.job_id = job.rec.id;
  set.epoch = job.rec.epoch;
  set.keys = {fmt::format("{}/elastic/exit/{}", job.rec.id, slot)};
  set.value = json{{"ts_ms", wall_ms()},
                   {"why", why},
                   {"proc", proc.rec.name},
                   {"exit_status", proc.rec.state == ProcState::kExited ? proc.rec.exit_status() : -1}}
                  .dump();
  rendezvous_->handle(set, next_token_++, Clock::now());
  event(job, "elastic_worker_gone", {{"proc", proc.rec.name}, {"slot", slot}, {"why", why}, {"retired", retire}});
  elastic_place_pending(job);  // its slot may be what a requested replacement waits for
}

void Scheduler::elastic_place_pending(Job& job) {
  for (auto& [name, p] : job.procs) {
    if (p.rec.role != "worker" || p.rec.state != ProcState::kPending || !p.rec.agent_id.empty()) continue;
    std::string agent;
    int agent_slot = -1;
    for (const auto& c : capacity()) {
      if (!c.free_slots.empty() && c.agent_id != p.avoid_agent) {
        agent = c.agent_id;
        agent_slot = c.free_slots.front();
        break;
      }
    }
    if (agent.empty()) return;  // the next worker that ends frees one
    p.rec.agent_id = agent;
    p.rec.slot = agent_slot;
    event(job, "elastic_spawn", {{"proc", name}, {"slot", p.rec.rank}, {"agent", agent}, {"agent_slot", agent_slot}});
    spawn(job, p).ignore();
  }
}

void Scheduler::elastic_on_store(Job& job, const StoreRequest& m) {
  if (m.keys.size() != 1 || job_state_final(job.rec.state)) return;
  const std::string pre = job.rec.id + "/elastic/";
  const std::string& key = m.keys[0];
  if (key.rfind(pre, 0) != 0) return;
  const std::string rest = key.substr(pre.size());
  int slot = -1;
  if (rest.rfind("spawn/", 0) == 0 && parse_slot(rest.substr(6), &slot)) {
    const json v = json::parse(m.value, nullptr, false);
    const uint64_t epoch = v.is_object() ? v.value("epoch", uint64_t{0}) : 0;
    const std::string name = fmt::format("worker-{}", slot);
    auto existing = job.procs.find(name);
    if (existing != job.procs.end() && live(existing->second.rec)) return;  // a repeated request
    Proc& p = job.procs[name];
    p.rec = ProcRecord{};
    p.rec.job_id = job.rec.id;
    p.rec.name = name;
    p.rec.role = "worker";
    p.rec.rank = slot;
    p.rec.epoch = job.rec.epoch;
    p.beating = false;
    p.peer.clear();
    // Its rank is the slot (job_env::kRank); the epoch it joins is the driver's.
    p.extra_env = {{job_env::kMembershipEpoch, std::to_string(epoch)}};
    p.avoid_agent = v.is_object() ? v.value("avoid", "") : "";
    // Placed on a free slot now, or as soon as one frees (a killed worker's slot is free
    // once its agent reports the exit).
    elastic_place_pending(job);
  } else if (rest.rfind("kill/", 0) == 0 && parse_slot(rest.substr(5), &slot)) {
    const std::string name = fmt::format("worker-{}", slot);
    auto it = job.procs.find(name);
    if (it == job.procs.end() || !live(it->second.rec)) return;
    event(job, "elastic_kill", {{"proc", name}, {"slot", slot}});
    kill_procs(job, name, SIGKILL, 0);
  }
}

}  // namespace troupe::sched
