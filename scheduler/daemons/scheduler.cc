// scheduler/daemons/scheduler.cc — the Scheduler's event loop, job lifecycle and health policy.
#include "scheduler/daemons/scheduler.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/exit_status.h"
#include "core/job_env.h"
#include "core/logging.h"
#include "scheduler/daemons/placement.h"
#include "scheduler/daemons/scheduler_metrics.h"

namespace troupe::sched {
namespace {

using nlohmann::json;

std::shared_ptr<spdlog::logger> log() {
  static auto l = make_logger("sched");
  return l;
}

bool proc_live(const ProcRecord& p) { return p.state == ProcState::kStarting || p.state == ProcState::kRunning; }

std::string worker_name(int rank) { return fmt::format("worker-{}", rank); }

double latency_bound_us(int i) {
  return 10.0 * std::pow(2.0, i / 4.0);
}

}  // namespace

Result<std::unique_ptr<Scheduler>> Scheduler::create(SchedulerOptions opts) {
  std::unique_ptr<Scheduler> s(new Scheduler(std::move(opts)));
  TROUPE_RETURN_IF_ERROR(s->init());
  return s;
}

Scheduler::~Scheduler() = default;

Status Scheduler::init() {
  if (opts_.state_dir.empty()) return invalid_argument("scheduler: --state-dir is required");
  std::error_code ec;
  std::filesystem::create_directories(opts_.state_dir + "/jobs", ec);
  if (ec) return io_error("cannot create state directory {}: {}", opts_.state_dir, ec.message());
  // The state (jobs, their environment, events, keys of `troupe run`) is its owner's only.
  TROUPE_RETURN_IF_ERROR(make_private_dir(opts_.state_dir, "state directory"));
  TROUPE_RETURN_IF_ERROR(make_private_dir(opts_.state_dir + "/jobs", "state directory"));
  TROUPE_ASSIGN_OR_RETURN(store_, StateStore::open(opts_.state_dir + "/scheduler.db"));
  TROUPE_ASSIGN_OR_RETURN(EnvSealer sealer, EnvSealer::create(opts_.security.server_keys, opts_.state_dir));
  sealer_.emplace(sealer);
  rendezvous_ = std::make_unique<RendezvousTable>(store_.get());
  TROUPE_ASSIGN_OR_RETURN(server_, ServerEndpoint::bind(opts_.listen, opts_.security, opts_.io_threads));
  endpoint_ = server_->bound_endpoint();
  advertise_ = opts_.advertise.empty() ? endpoint_ : opts_.advertise;
  if (advertise_.find("0.0.0.0") != std::string::npos) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    advertise_.replace(advertise_.find("0.0.0.0"), 7, host);
  }
  incarnation_ = rng_() | 1;
  TROUPE_RETURN_IF_ERROR(opts_.detector.validate());
  health_ = std::make_unique<HealthMonitor>(opts_.detector);
  if (!opts_.metrics.listen.empty()) {
    TROUPE_ASSIGN_OR_RETURN(metrics_, SchedulerMetrics::start(opts_.metrics));
    log()->info("serving Prometheus metrics on {}", metrics_->url());
  }
  TROUPE_RETURN_IF_ERROR(recover());
  log()->info("scheduler listening on {} (incarnation {:x}, state {}, agent timeout {} ms)", endpoint_,
              incarnation_, opts_.state_dir, opts_.agent_timeout_ms);
  return ok_status();
}

// Loads every job; running jobs keep their processes, which are re-attached when their
// agents register again (or declared lost when they do not come back in time).
Status Scheduler::recover() {
  TROUPE_ASSIGN_OR_RETURN(auto jobs, store_->load_jobs());
  auto now = Clock::now();
  bool any_live = false;
  for (auto& rec : jobs) {
    Job job;
    job.rec = std::move(rec);
    auto lg = EventLog::open(job.rec.job_dir, job.rec.id);
    if (lg.ok()) job.log.emplace(std::move(lg).value());
    if (!job_state_final(job.rec.state)) {
      TROUPE_ASSIGN_OR_RETURN(auto procs, store_->load_procs(job.rec.id));
      for (auto& p : procs) {
        Proc proc;
        proc.rec = std::move(p);
        proc.last_beat = now;
        any_live = any_live || proc_live(proc.rec);
        job.procs.emplace(proc.rec.name, std::move(proc));
      }
      auto placed = store_->load_placements(job.rec.id, job.rec.epoch);
      if (placed.ok()) job.actors = std::move(placed).value();
    }
    std::string id = job.rec.id;
    auto& j = jobs_.emplace(id, std::move(job)).first->second;
    if (!job_state_final(j.rec.state)) event(j, "scheduler_recovered", {{"incarnation", fmt::format("{:x}", incarnation_)}});
  }
  TROUPE_ASSIGN_OR_RETURN(auto agents, store_->load_agents());
  for (auto& a : agents) {
    Agent ag;
    ag.rec = a;
    ag.alive = false;
    agents_.emplace(a.id, std::move(ag));
  }
  if (any_live) {
    recovered_until_ = now + std::chrono::milliseconds(2 * opts_.agent_timeout_ms);
    recovery_cap_ = now + std::chrono::milliseconds(kMaxRecoveryTimeouts * opts_.agent_timeout_ms);
  }
  if (!jobs_.empty()) log()->info("recovered {} job record(s) from {}", jobs_.size(), opts_.state_dir);
  return ok_status();
}

void Scheduler::run() {
  while (!stop_.load()) run_once(std::chrono::milliseconds(opts_.poll_ms));
}

// One turn: what arrived (up to kMaxTurnMessages) is handled in one SQLite transaction, and
// what the turn sends leaves only after the commit, so nothing is acknowledged before it
// is durable.
void Scheduler::run_once(std::chrono::milliseconds timeout) {
  for (auto& in : server_->poll(backlog_.empty() ? timeout : std::chrono::milliseconds(0))) {
    backlog_.push_back(std::move(in));
  }
  Status b = store_->begin_batch();
  if (!b.ok()) log()->error("state store: {}", b.to_string());
  loop_lag_ = {};
  for (size_t n = 0; n < kMaxTurnMessages && !backlog_.empty(); ++n) {
    if (backlog_.front().received != Clock::time_point{}) {
      loop_lag_ = std::max(loop_lag_, Clock::now() - backlog_.front().received);
    }
    dispatch(backlog_.front());
    backlog_.pop_front();
  }
  timers();
  Status c = store_->commit_batch();
  if (!c.ok()) log()->error("cannot commit the scheduler state: {}", c.to_string());
  flush_sends();
  procs_by_agent_built_ = false;
}

void Scheduler::send(const std::string& peer, Message msg) {
  if (peer.rfind(kRelayPeerPrefix, 0) == 0) {
    // A session relayed by an agent: the message goes back through that agent.
    const size_t sep = peer.find('\n', kRelayPeerPrefix.size());
    if (sep == std::string::npos) {
      log()->error("{} to a malformed relayed peer: dropped", payload_name(msg.payload));
      return;
    }
    std::string agent_peer = peer.substr(kRelayPeerPrefix.size(), sep - kRelayPeerPrefix.size());
    outbox_.emplace_back(std::move(agent_peer),
                         Message{0, RelayedMessage{peer.substr(sep + 1), encode_message(msg)}});
    return;
  }
  outbox_.emplace_back(peer, std::move(msg));
}

// "relay:<agent's peer>\n<session>": neither part holds a newline (node ids are sanitized,
// session names are printable ASCII, protocol.h).
void Scheduler::on_relay(const Incoming& in, const RelayedMessage& r) {
  auto inner = decode_message(r.msg.data(), r.msg.size());
  if (!inner.ok()) {
    log()->error("relay from {} (session {}): dropped an undecodable message: {}", in.peer, r.session,
                 inner.status().to_string());
    return;
  }
  if (std::holds_alternative<RelayedMessage>(inner->payload) ||
      std::holds_alternative<RegisterAgent>(inner->payload) ||
      std::holds_alternative<AgentHeartbeat>(inner->payload)) {
    log()->error("relay from {} (session {}): dropped a relayed {} (a relayed session is a job process's)",
                 in.peer, r.session, payload_name(inner->payload));
    return;
  }
  if (in.peer.empty() || in.peer.rfind("ask:", 0) == 0 || in.peer.rfind(kRelayPeerPrefix, 0) == 0) {
    log()->error("relay from {}: dropped (only a connected agent relays, with tells)", in.peer);
    return;
  }
  dispatch(Incoming{fmt::format("{}{}\n{}", kRelayPeerPrefix, in.peer, r.session), std::move(inner).value(),
                    in.received});
}

void Scheduler::flush_sends() {
  for (auto& [peer, msg] : outbox_) {
    if (!server_->send(peer, msg)) {
      log()->debug("{} (request {}) to a peer that is gone", payload_name(msg.payload), msg.request_id);
    }
  }
  outbox_.clear();
}

void Scheduler::reply(const std::string& peer, uint64_t request_id, Reply r) {
  send(peer, Message{request_id, std::move(r)});
}

void Scheduler::LatencyHistogram::add(std::chrono::nanoseconds d) {
  const double us = std::max(0.0, std::chrono::duration<double, std::micro>(d).count());
  max_us = std::max(max_us, static_cast<uint64_t>(us));
  int i = 0;
  while (i < kBuckets && us > latency_bound_us(i)) ++i;
  counts[static_cast<size_t>(i)]++;
}

nlohmann::json Scheduler::LatencyHistogram::to_json() const {
  json bounds = json::array();
  for (int i = 0; i < kBuckets; ++i) bounds.push_back(latency_bound_us(i));
  return {{"bounds_us", bounds}, {"counts", counts}, {"max_us", max_us}};
}

void Scheduler::dispatch(const Incoming& in) {
  const auto& m = in.msg;
  if (std::holds_alternative<ProcBeat>(m.payload) || std::holds_alternative<AgentHeartbeat>(m.payload)) {
    const auto now = Clock::now();
    const auto queued = in.received != Clock::time_point{} ? now - in.received : Clock::duration{};
    if (in.received != Clock::time_point{}) {
      beat_latency_.add(queued);
      if (metrics_) metrics_->beat_latency(std::chrono::duration<double>(queued).count());
    }
    // Arrival at our inbox, by our wall clock: the loop's own wait is loop_lag_'s business.
    const int64_t arrived_ms =
        wall_ms() - std::chrono::duration_cast<std::chrono::milliseconds>(queued).count();
    const auto* pb = std::get_if<ProcBeat>(&m.payload);
    const int64_t sent_ms = pb ? pb->sent_at_ms : std::get<AgentHeartbeat>(m.payload).sent_at_ms;
    receive_lag_.add(in.peer, sent_ms, arrived_ms, now);
  }
  std::visit(
      [&](const auto& p) {
        using T = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<T, RegisterAgent>) on_register(in.peer, p);
        else if constexpr (std::is_same_v<T, AgentHeartbeat>) on_agent_heartbeat(in.peer, p);
        else if constexpr (std::is_same_v<T, ProcStarted>) on_proc_started(p.proc);
        else if constexpr (std::is_same_v<T, ProcExited>) on_proc_exited(in.peer, p.proc);
        else if constexpr (std::is_same_v<T, ProcBeat>) on_proc_beat(in.peer, p);
        else if constexpr (std::is_same_v<T, SubmitJob>) on_submit(in.peer, m.request_id, p);
        else if constexpr (std::is_same_v<T, StatusQuery>) on_status(in.peer, m.request_id, p);
        else if constexpr (std::is_same_v<T, CancelJob>) on_cancel(in.peer, m.request_id, p);
        else if constexpr (std::is_same_v<T, LogsQuery>) on_logs(in.peer, m.request_id, p);
        else if constexpr (std::is_same_v<T, StoreRequest>) on_store(in.peer, m.request_id, p);
        else if constexpr (std::is_same_v<T, Reply>) on_reply(m);
        else if constexpr (std::is_same_v<T, PlaceActors>) on_place_actors(in.peer, m.request_id, p);
        else if constexpr (std::is_same_v<T, RelayedMessage>)
          on_relay(in, p);
        else if constexpr (std::is_same_v<T, HealthReport>)
          on_health(p);
        else {
          log()->warn("unexpected {} message from a client: dropped", payload_name(m.payload));
          reply(in.peer, m.request_id, Reply::of(invalid_argument("the scheduler does not accept {} messages",
                                                                  payload_name(m.payload))));
        }
      },
      m.payload);
}

// ------------------------------------------------------------------ agents

void Scheduler::on_register(const std::string& peer, const RegisterAgent& m) {
  if (m.agent_id.empty() || m.slots < 0) {
    reply(peer, 0, Reply::of(invalid_argument("register: bad agent id or slot count")));
    return;
  }
  auto now = Clock::now();
  auto& a = agents_[m.agent_id];
  bool was_alive = a.alive;
  a.rec = AgentRecord{m.agent_id, m.host, m.slots, m.gpus, wall_ms()};
  a.peer = peer;
  a.last_seen = now;
  a.alive = true;
  if (recovered_until_ != Clock::time_point{} && !was_alive) {
    // Agents are still coming back (thousands of them, each with a CURVE handshake, after
    // a restart): the grace for the others runs from the latest return, up to the cap.
    recovered_until_ =
        std::max(recovered_until_,
                 std::min(recovery_cap_, now + std::chrono::milliseconds(2 * opts_.agent_timeout_ms)));
  }
  store_->put_agent(a.rec).ignore();
  send(peer, Message{0, RegisterAck{incarnation_, opts_.agent_heartbeat_ms}});
  log()->info("agent {} ({}) registered: {} slots, {} GPUs, {} process(es){}", m.agent_id, m.host, m.slots, m.gpus,
              m.procs.size(), was_alive ? " (again)" : "");

  // Reconcile what the agent runs with what we believe it runs.
  std::set<std::pair<std::string, std::string>> reported;
  for (const auto& p : m.procs) {
    reported.insert({p.job_id, p.name});
    auto jit = jobs_.find(p.job_id);
    Proc* proc = nullptr;
    if (jit != jobs_.end()) {
      auto pit = jit->second.procs.find(p.name);
      if (pit != jit->second.procs.end() && pit->second.rec.epoch == p.epoch && pit->second.rec.agent_id == m.agent_id) {
        proc = &pit->second;
      }
    }
    if (p.running) {
      if (proc && proc_live(proc->rec) && !job_state_final(jit->second.rec.state)) {
        if (proc->rec.state != ProcState::kRunning || proc->rec.pid != p.pid) {
          proc->rec.state = ProcState::kRunning;
          proc->rec.pid = p.pid;
          save(*proc);
        }
        proc->last_beat = now;
        if (!proc->reattached) {  // an agent repeating its registration is not news
          proc->reattached = true;
          event(jit->second, "proc_reattached", {{"proc", p.name}, {"pid", p.pid}, {"agent", m.agent_id}});
        }
      } else {
        // A process we no longer want (an older epoch, a finished job): stop it.
        log()->info("agent {} runs {}/{} (epoch {}) that is not wanted: killing it", m.agent_id, p.job_id, p.name, p.epoch);
        send(peer, Message{0, KillRequest{p.job_id, p.name, SIGKILL, 0}});
      }
    } else {
      on_proc_exited(peer, p);
    }
  }
  // Processes we placed on this agent that it no longer knows: they ended unseen.
  const auto placed_here = procs_on_agent(m.agent_id);  // a copy: failures may re-place
  for (const auto& [id, name] : placed_here) {
    auto jit = jobs_.find(id);
    if (jit == jobs_.end() || job_state_final(jit->second.rec.state)) continue;
    auto pit = jit->second.procs.find(name);
    if (pit == jit->second.procs.end()) continue;
    Proc& proc = pit->second;
    if (proc.rec.agent_id == m.agent_id && proc_live(proc.rec) && !reported.count({id, name})) {
      proc_failed(jit->second, proc,
                  fmt::format("agent {} no longer knows {} (it ended while unobserved)", m.agent_id, name));
    }
  }
  // Jobs waiting for slots may fit now; processes never spawned (scheduler restart) go out.
  for (auto& [id, job] : jobs_) {
    if (job.rec.state == JobState::kPending || job.rec.state == JobState::kRestarting) try_start(job);
  }
  for (const auto& [id, name] : procs_on_agent(m.agent_id)) {
    auto jit = jobs_.find(id);
    if (jit == jobs_.end() || job_state_final(jit->second.rec.state) ||
        jit->second.rec.state == JobState::kPending || jit->second.rec.state == JobState::kRestarting) {
      continue;
    }
    auto pit = jit->second.procs.find(name);
    if (pit == jit->second.procs.end()) continue;
    if (pit->second.rec.state == ProcState::kPending && pit->second.rec.agent_id == m.agent_id) {
      spawn(jit->second, pit->second).ignore();
    }
  }
}

const std::vector<std::pair<std::string, std::string>>& Scheduler::procs_on_agent(const std::string& agent) {
  if (!procs_by_agent_built_) {
    procs_by_agent_.clear();
    for (const auto& [id, job] : jobs_) {
      if (job_state_final(job.rec.state)) continue;
      for (const auto& [name, proc] : job.procs) procs_by_agent_[proc.rec.agent_id].emplace_back(id, name);
    }
    procs_by_agent_built_ = true;
  }
  static const std::vector<std::pair<std::string, std::string>> kNone;
  auto it = procs_by_agent_.find(agent);
  return it == procs_by_agent_.end() ? kNone : it->second;
}

void Scheduler::on_agent_heartbeat(const std::string& peer, const AgentHeartbeat& m) {
  auto it = agents_.find(m.agent_id);
  if (it == agents_.end() || !it->second.alive || m.incarnation != incarnation_) {
    send(peer, Message{0, Reregister{}});
    return;
  }
  it->second.last_seen = Clock::now();
  it->second.peer = peer;
  it->second.last_beat = m;
}

// ------------------------------------------------------------------ processes

void Scheduler::on_proc_started(const ProcStatus& p) {
  auto jit = jobs_.find(p.job_id);
  if (jit == jobs_.end()) return;
  auto pit = jit->second.procs.find(p.name);
  if (pit == jit->second.procs.end() || pit->second.rec.epoch != p.epoch || !proc_live(pit->second.rec)) return;
  auto& proc = pit->second;
  proc.rec.state = ProcState::kRunning;
  proc.rec.pid = p.pid;
  proc.rec.started_ms = p.time_ms;
  save(proc);
  event(jit->second, "proc_started", {{"proc", p.name}, {"pid", p.pid}, {"epoch", p.epoch}, {"agent", proc.rec.agent_id}});
}

void Scheduler::on_proc_exited(const std::string& peer, const ProcStatus& p) {
  send(peer, Message{0, ExitAck{p.job_id, p.name, p.epoch, p.pid}});
  auto jit = jobs_.find(p.job_id);
  if (jit == jobs_.end()) return;
  Job& job = jit->second;
  auto pit = job.procs.find(p.name);
  if (pit == job.procs.end() || pit->second.rec.epoch != p.epoch) return;  // an older epoch's
  Proc& proc = pit->second;
  if (!proc_live(proc.rec)) return;  // already handled (heartbeat timeout, agent loss, duplicate)
  proc.rec.state = ProcState::kExited;
  proc.rec.exit_code = p.exit_code;
  proc.rec.term_signal = p.term_signal;
  proc.rec.ended_ms = p.time_ms ? p.time_ms : wall_ms();
  if (p.pid) proc.rec.pid = p.pid;
  save(proc);
  health_->forget(job.rec.id, p.name);
  int status = proc.rec.exit_status();
  json ev = {{"proc", p.name}, {"pid", proc.rec.pid}, {"epoch", p.epoch}, {"exit_code", p.exit_code},
             {"signal", p.term_signal}, {"exit_status", status}, {"exited_at_ms", proc.rec.ended_ms}};
  if (!p.error.empty()) ev["error"] = p.error;
  event(job, "proc_exited", ev);
  if (job_state_final(job.rec.state)) return;
  if (status == 0) {
    if (is_elastic(job) && proc.rec.role == "worker") elastic_worker_gone(job, proc, "exited with status 0", false);
    check_completion(job);
    return;
  }
  std::string why = !p.error.empty() ? p.error
                    : p.term_signal ? fmt::format("{} killed by signal {} ({})", p.name, p.term_signal, strsignal(p.term_signal))
                                    : fmt::format("{} exited with status {}", p.name, p.exit_code);
  if (is_elastic(job) && proc.rec.role == "worker") {
    // The driver decides (a worker's permanent failure ends the job there too).
    elastic_worker_gone(job, proc, why, true);
    return;
  }
  if (status == kExitPermanentFailure) {
    // The process says a restart would meet the same failure (core/exit_status.h).
    finish_job(
        job, JobState::kFailed,
        fmt::format("{}: a permanent failure, not restarted (`troupe logs {}{}` says why)", why, job.rec.id,
                    proc.rec.role == "driver" ? "" : fmt::format(" --worker {}", proc.rec.rank)));
    return;
  }
  if (proc.rec.role == "driver") restart_driver(job, why);
  else restart_workers(job, why);
}

void Scheduler::on_proc_beat(const std::string& peer, const ProcBeat& b) {
  auto jit = jobs_.find(b.job_id);
  if (jit == jobs_.end()) return;
  auto pit = jit->second.procs.find(b.name);
  if (pit == jit->second.procs.end() || pit->second.rec.epoch != b.epoch || !proc_live(pit->second.rec)) return;
  auto& proc = pit->second;
  proc.last_beat = Clock::now();
  proc.peer = peer;
  if (!b.endpoint.empty() && (b.endpoint != proc.rec.endpoint || b.actor_node != proc.rec.actor_node)) {
    proc.rec.endpoint = b.endpoint;
    proc.rec.actor_node = b.actor_node;
    save(proc);
  }
  if (!proc.beating) {
    proc.beating = true;
    event(jit->second, "proc_hello", {{"proc", b.name}, {"pid", b.pid}, {"epoch", b.epoch}});
  }
}

void Scheduler::proc_failed(Job& job, Proc& proc, const std::string& reason) {
  if (!proc_live(proc.rec)) return;
  proc.rec.state = ProcState::kLost;
  proc.rec.ended_ms = wall_ms();
  save(proc);
  health_->forget(job.rec.id, proc.rec.name);
  kill_procs(job, proc.rec.name, SIGKILL, 0);
  event(job, "proc_lost", {{"proc", proc.rec.name}, {"pid", proc.rec.pid}, {"epoch", proc.rec.epoch}, {"reason", reason}});
  if (job_state_final(job.rec.state)) return;
  if (is_elastic(job) && proc.rec.role == "worker") {
    elastic_worker_gone(job, proc, reason, true);
    return;
  }
  if (proc.rec.role == "driver") restart_driver(job, reason);
  else restart_workers(job, reason);
}

// ------------------------------------------------------------------ job lifecycle

std::vector<AgentCapacity> Scheduler::capacity() const {
  // One pass over the processes (not one per agent): slots held by live or pending ones.
  std::map<std::string, std::vector<bool>> used;
  for (const auto& [id, a] : agents_) {
    if (a.alive) used[id].assign(static_cast<size_t>(std::max(0, a.rec.slots)), false);
  }
  for (const auto& [jid, job] : jobs_) {
    if (job_state_final(job.rec.state)) continue;
    for (const auto& [name, p] : job.procs) {
      if (p.rec.slot < 0 || !(proc_live(p.rec) || p.rec.state == ProcState::kPending)) continue;
      auto it = used.find(p.rec.agent_id);
      if (it != used.end() && p.rec.slot < static_cast<int>(it->second.size())) {
        it->second[static_cast<size_t>(p.rec.slot)] = true;
      }
    }
  }
  std::vector<AgentCapacity> out;
  for (const auto& [id, slots] : used) {
    AgentCapacity c{id, {}};
    for (size_t s = 0; s < slots.size(); ++s) {
      if (!slots[s]) c.free_slots.push_back(static_cast<int>(s));
    }
    out.push_back(std::move(c));
  }
  return out;
}

void Scheduler::try_start(Job& job) {
  if (job.rec.state != JobState::kPending && job.rec.state != JobState::kRestarting) return;
  // Workers of the current epoch still alive keep their slots out of the count.
  auto layout = job.rec.spec.parsed_layout();
  auto cap = capacity();
  auto placed = place_workers(layout, cap);
  if (!placed.ok()) {
    if (job.rec.message != placed.status().message()) {
      job.rec.message = placed.status().message();
      save(job);
      event(job, "waiting_for_slots", {{"reason", job.rec.message}});
    }
    return;
  }
  job.rec.state = JobState::kRunning;
  job.rec.message.clear();
  save(job);
  procs_by_agent_built_ = false;  // new placement
  json placement = json::object();
  for (const auto& a : *placed) {
    Proc& p = job.procs[worker_name(a.rank)];
    p.rec = ProcRecord{};
    p.rec.job_id = job.rec.id;
    p.rec.name = worker_name(a.rank);
    p.rec.role = "worker";
    p.rec.rank = a.rank;
    p.rec.epoch = job.rec.epoch;
    p.rec.agent_id = a.agent_id;
    p.rec.slot = a.slot;
    p.beating = false;
    p.peer.clear();
    placement[p.rec.name] = fmt::format("{}/{}", a.agent_id, a.slot);
  }
  auto dit = job.procs.find("driver");
  bool need_driver = job.rec.spec.driver && (dit == job.procs.end() || !proc_live(dit->second.rec));
  if (need_driver && dit != job.procs.end() && dit->second.rec.state == ProcState::kExited &&
      dit->second.rec.exit_status() == 0) {
    need_driver = false;  // the driver finished its part; a worker restart does not rerun it
  }
  if (need_driver) {
    Proc& d = job.procs["driver"];
    d.rec = ProcRecord{};
    d.rec.job_id = job.rec.id;
    d.rec.name = "driver";
    d.rec.role = "driver";
    d.rec.rank = -1;
    d.rec.epoch = job.rec.epoch;
    d.rec.agent_id = place_driver(*placed, cap);
    d.beating = false;
    placement["driver"] = d.rec.agent_id;
  }
  // The layout only where it is known (--layout, or reported by the job's driver in an
  // earlier epoch): placing nproc workers does not make a job pp=1,dp=nproc,n=1.
  const std::string known = job.known_layout();
  event(job, "placed",
        {{"epoch", job.rec.epoch},
         {"workers", placed->size()},
         {"layout", known.empty() ? json(nullptr) : json(known)},
         {"placement", placement}});
  placing_ranks_.clear();
  for (const auto& [name, p] : job.procs) {
    if (p.rec.role == "worker" && p.rec.epoch == job.rec.epoch)
      placing_ranks_[p.rec.agent_id].push_back(p.rec.rank);
  }
  for (auto& [agent, ranks] : placing_ranks_) std::sort(ranks.begin(), ranks.end());
  for (auto& [name, proc] : job.procs) {
    if (proc.rec.state == ProcState::kPending) spawn(job, proc).ignore();
  }
  placing_ranks_.clear();
}

Status Scheduler::spawn(Job& job, Proc& proc) {
  const auto& spec = job.rec.spec;
  if (job_state_final(job.rec.state)) return failed_precondition("job {} has ended", job.rec.id);
  auto ait = agents_.find(proc.rec.agent_id);
  if (ait == agents_.end() || !ait->second.alive) {
    return unavailable("agent {} is not connected", proc.rec.agent_id);  // retried when it registers
  }
  // The job's environment is stored sealed (secrets.h); it is opened only for the spawn.
  std::vector<std::pair<std::string, std::string>> job_env;
  for (const auto& [k, v] : spec.env) {
    if (!EnvSealer::is_sealed(v)) {  // a record written before values were sealed
      job_env.emplace_back(k, v);
      continue;
    }
    Result<std::string> open = sealer_->unseal(v);
    if (!open.ok()) {
      const std::string why = fmt::format("cannot open the environment value {} of job {}: {}", k, job.rec.id,
                                          open.status().message());
      log()->error("{}", why);
      finish_job(job, JobState::kFailed, why);
      return open.status();
    }
    job_env.emplace_back(k, std::move(open).value());
  }
  SpawnRequest req;
  req.job_id = job.rec.id;
  req.name = proc.rec.name;
  req.epoch = proc.rec.epoch;
  req.argv = spec.argv;
  req.work_dir = spec.work_dir;
  for (auto& [k, v] : job_env) req.env.emplace_back(k, std::move(v));
  int local_rank = 0, local_size = 0;
  if (auto pr = placing_ranks_.find(proc.rec.agent_id);
      pr != placing_ranks_.end() && proc.rec.role == "worker") {
    const auto& ranks = pr->second;  // try_start's placement: the same count, without a scan
    local_rank =
        static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), proc.rec.rank) - ranks.begin());
    local_size = static_cast<int>(ranks.size());
  } else {
    for (const auto& [n, p] : job.procs) {
      if (p.rec.role != "worker" || p.rec.agent_id != proc.rec.agent_id || p.rec.epoch != proc.rec.epoch)
        continue;
      if (p.rec.rank < proc.rec.rank) ++local_rank;
      ++local_size;
    }
  }
  auto add = [&](const char* k, std::string v) { req.env.emplace_back(k, std::move(v)); };
  namespace je = job_env;
  add(je::kRole, proc.rec.role);
  add(je::kRank, std::to_string(proc.rec.rank));
  add(je::kWorldSize, std::to_string(spec.nproc));
  add(je::kLocalRank, std::to_string(proc.rec.role == "worker" ? local_rank : -1));
  add(je::kLocalWorldSize, std::to_string(local_size));
  add(je::kJobId, job.rec.id);
  add(je::kProcName, proc.rec.name);
  add(je::kEpoch, std::to_string(proc.rec.epoch));
  add(je::kRestarts, std::to_string(job.rec.restarts));
  add(je::kDriverRestarts, std::to_string(job.rec.driver_restarts));
  add(je::kScheduler, advertise_);
  // The layout only when the job was submitted with one: the app then runs it (or refuses
  // a different one of its own); without, the app's config decides.
  if (!spec.layout.empty()) add(je::kLayout, spec.parsed_layout().to_string());
  add(je::kBackend, spec.backend);
  add(je::kNode, proc.rec.agent_id);
  add(je::kDeviceSlot, std::to_string(proc.rec.slot));
  add(je::kHeartbeatMs, std::to_string(std::max(50, spec.heartbeat_timeout_ms / 6)));
  add(je::kHeartbeatTimeoutMs, std::to_string(spec.heartbeat_timeout_ms));
  if (!spec.checkpoint_dir.empty()) add(je::kCheckpointDir, spec.checkpoint_dir);
  if (opts_.security.server_keys) {
    add(je::kSchedulerPublicKey, opts_.security.server_keys->public_key);
    // The job's own key pair: its processes' control planes accept only each other. The
    // secret travels in its own field; the agent writes it to a 0600 file.
    if (auto jk = derive_job_keypair(*opts_.security.server_keys, job.rec.id); jk.ok()) {
      add(je::kJobPublicKey, jk->public_key);
      req.job_secret_key = jk->secret_key;
    } else {
      log()->error("job {}: {}", job.rec.id, jk.status().to_string());
    }
  }
  if (spec.backend == "cuda" && proc.rec.slot >= 0)
    add("CUDA_VISIBLE_DEVICES", std::to_string(proc.rec.slot));
  for (const auto& [k, v] : proc.extra_env) add(k.c_str(), v);
  proc.rec.state = ProcState::kStarting;
  proc.rec.pid = 0;
  proc.rec.exit_code = 0;
  proc.rec.term_signal = 0;
  proc.rec.started_ms = wall_ms();
  proc.rec.ended_ms = 0;
  proc.last_beat = Clock::now();
  proc.beating = false;
  save(proc);
  send(ait->second.peer, Message{0, std::move(req)});
  return ok_status();
}

void Scheduler::kill_procs(Job& job, const std::string& name, int signal, int grace_ms) {
  std::set<std::string> agents;
  if (!name.empty()) {  // one process: a lookup, not a scan (a mass failure kills thousands)
    if (auto it = job.procs.find(name); it != job.procs.end()) agents.insert(it->second.rec.agent_id);
  } else {
    for (const auto& [n, p] : job.procs) agents.insert(p.rec.agent_id);
  }
  for (const auto& id : agents) {
    auto it = agents_.find(id);
    if (it == agents_.end() || !it->second.alive) continue;
    send(it->second.peer, Message{0, KillRequest{job.rec.id, name, signal, grace_ms}});
  }
}

void Scheduler::restart_workers(Job& job, const std::string& reason) {
  if (job.rec.restarts >= job.rec.spec.max_restarts) {
    finish_job(job, JobState::kFailed,
               fmt::format("{}; no restarts left (max_restarts={})", reason, job.rec.spec.max_restarts));
    return;
  }
  // Every worker of the failed epoch goes; their late exits are ignored (older epoch).
  for (auto& [name, p] : job.procs) {
    if (p.rec.role != "worker") continue;
    if (proc_live(p.rec)) kill_procs(job, name, SIGKILL, 0);
    p.rec.state = ProcState::kExited;
  }
  job.rec.restarts++;
  job.rec.epoch++;
  job.actors.clear();  // the driver places the actors again in the new epoch
  job.rec.state = JobState::kRestarting;
  save(job);
  event(job, "job_restarting", {{"reason", reason}, {"restart", job.rec.restarts}, {"epoch", job.rec.epoch}});
  log()->warn("job {}: {}; restarting its workers (restart {}/{}, epoch {})", job.rec.id, reason, job.rec.restarts,
              job.rec.spec.max_restarts, job.rec.epoch);
  try_start(job);
}

void Scheduler::restart_driver(Job& job, const std::string& reason) {
  auto it = job.procs.find("driver");
  if (it == job.procs.end()) return;
  if (job.rec.driver_restarts >= job.rec.spec.max_driver_restarts) {
    finish_job(job, JobState::kFailed,
               fmt::format("{}; no driver restarts left (max_driver_restarts={})", reason,
                           job.rec.spec.max_driver_restarts));
    return;
  }
  if (is_elastic(job)) {
    // The driver held the membership (which worker has which state, the step in flight):
    // a new driver starts over from the job's newest valid checkpoint with new workers.
    // The old workers go; everything runs again in a new epoch (fresh store keys), with
    // TROUPE_DRIVER_RESTARTS telling the new driver it is one (training/driver/trainer.cc).
    job.rec.driver_restarts++;
    for (auto& [name, p] : job.procs) {
      if (p.rec.role != "worker") continue;
      if (proc_live(p.rec)) kill_procs(job, name, SIGKILL, 0);
      p.rec.state = ProcState::kExited;
    }
    job.retired.clear();
    job.rec.epoch++;
    job.actors.clear();
    job.rec.state = JobState::kRestarting;
    save(job);
    event(job, "driver_restarting",
          {{"reason", reason},
           {"driver_restart", job.rec.driver_restarts},
           {"epoch", job.rec.epoch},
           {"workers", "restarted with it"}});
    log()->warn(
        "job {}: {}; restarting the driver and its workers from the newest checkpoint ({}/{}, epoch {})",
        job.rec.id, reason, job.rec.driver_restarts, job.rec.spec.max_driver_restarts, job.rec.epoch);
    try_start(job);
    return;
  }
  job.rec.driver_restarts++;
  save(job);
  Proc& d = it->second;
  auto cap = capacity();
  if (auto ait = agents_.find(d.rec.agent_id); ait == agents_.end() || !ait->second.alive) {
    d.rec.agent_id = cap.empty() ? d.rec.agent_id : cap.front().agent_id;
  }
  d.rec.state = ProcState::kPending;
  d.rec.epoch = job.rec.epoch;
  procs_by_agent_built_ = false;  // the driver may have moved
  event(job, "driver_restarting", {{"reason", reason}, {"driver_restart", job.rec.driver_restarts}, {"agent", d.rec.agent_id}});
  log()->warn("job {}: {}; restarting the driver ({}/{})", job.rec.id, reason, job.rec.driver_restarts,
              job.rec.spec.max_driver_restarts);
  spawn(job, d).ignore();
}

void Scheduler::finish_job(Job& job, JobState state, const std::string& message) {
  int worst = 0;
  for (const auto& [n, p] : job.procs) {
    if (p.rec.epoch != job.rec.epoch && p.rec.role == "worker") continue;
    if (state == JobState::kSucceeded && job.retired.count(n)) continue;  // elastic: replaced
    if (p.rec.state == ProcState::kExited) worst = std::max(worst, p.rec.exit_status());
    if (p.rec.state == ProcState::kLost) worst = std::max(worst, 128 + SIGKILL);
  }
  if (state == JobState::kCancelled && worst == 0) worst = 128 + SIGINT;
  if (state == JobState::kFailed && worst == 0) worst = 1;
  job.rec.state = state;
  job.rec.exit_code = worst;
  job.rec.message = message;
  save(job);
  kill_procs(job, "", SIGTERM, 2000);
  event(job, "job_finished", {{"state", job_state_name(state)}, {"exit_code", worst}, {"message", message}});
  log()->info("job {} {} (exit {}){}{}", job.rec.id, job_state_name(state), worst, message.empty() ? "" : ": ", message);
  rendezvous_->drop_job(job.rec.id);
  health_->forget_job(job.rec.id);
}

void Scheduler::check_completion(Job& job) {
  if (job.rec.state != JobState::kRunning) return;
  for (const auto& [n, p] : job.procs) {
    if (job.retired.count(n)) continue;  // elastic: replaced by the driver
    if (p.rec.state != ProcState::kExited) return;
    if (p.rec.exit_status() != 0) return;  // handled by the failure path
  }
  finish_job(job, JobState::kSucceeded, "");
}

// ------------------------------------------------------------------ timers

void Scheduler::timers() {
  auto now = Clock::now();
  for (auto& [token, r] : rendezvous_->take_ready(now)) {
    if (auto pit = parked_at_.find(token); pit != parked_at_.end()) {
      if (metrics_) metrics_->rendezvous_wait(std::chrono::duration<double>(now - pit->second).count());
      parked_at_.erase(pit);
    }
    auto it = store_waiters_.find(token);
    if (it == store_waiters_.end()) continue;
    reply(it->second.peer, it->second.request_id, std::move(r));
    store_waiters_.erase(it);
  }
  // The faulty-machine detector: its evaluations are due once a second. Reports waiting in
  // the backlog are the scheduler's delay, not the workers': no verdict until they are in.
  if (backlog_.empty() && loop_lag_ <= kMaxLoopLag) {
    for (const auto& jv : health_->evaluate(now, wall_ms())) {
      auto jit = jobs_.find(jv.job);
      if (jit != jobs_.end() && !job_state_final(jit->second.rec.state)) on_health_verdict(jit->second, jv.v);
    }
  }
  if (metrics_ && now >= next_metrics_refresh_) {
    next_metrics_refresh_ = now + std::chrono::seconds(1);
    refresh_metrics();
  }
  if (now >= next_ask_expiry_) {  // asks whose asker gave up (e.g. lost with an agent)
    server_->expire_asks();
    next_ask_expiry_ = now + std::chrono::seconds(1);
  }
  // Timeouts are seconds long: scanning every agent and process every 100 ms (or poll
  // period) is enough, not once per message batch (thousands a second at cluster scale).
  // Silence is judged only once everything that arrived has been handled and the loop is
  // keeping up: beats waiting in the backlog are our delay, not the peers'.
  if (now < next_health_scan_ || !backlog_.empty() || loop_lag_ > kMaxLoopLag) return;
  next_health_scan_ = now + std::chrono::milliseconds(std::max(opts_.poll_ms, 100));
  if (now >= next_lag_prune_) {
    next_lag_prune_ = now + std::chrono::seconds(10);
    receive_lag_.prune(wall_ms(), 60'000);
  }
  receive_lag_now_ = receive_lag_.lag(now);
  // Held from over kMaxLoopLag until under 80% of it, so a lag hovering at the threshold
  // does not flip (and log) every scan.
  if (receive_lag_now_ > (verdicts_held_ ? kMaxLoopLag * 8 / 10 : kMaxLoopLag)) {
    if (!verdicts_held_) {
      log()->warn(
          "beats reach the scheduler {} ms late (median): no silence verdicts until that is under {} ms",
          receive_lag_now_.count(), (kMaxLoopLag * 8 / 10).count());
    }
    verdicts_held_ = true;
    return;
  }
  if (verdicts_held_)
    log()->info("beats arrive on time again ({} ms late): silence verdicts resume", receive_lag_now_.count());
  verdicts_held_ = false;
  scan_health(now);
}

void Scheduler::scan_health(Clock::time_point now) {
  // Agents that stopped heartbeating: everything they ran is lost.
  for (auto& [id, a] : agents_) {
    if (!a.alive || now - a.last_seen < std::chrono::milliseconds(opts_.agent_timeout_ms)) continue;
    a.alive = false;
    log()->warn("agent {} missed its heartbeats for {} ms: declared dead", id, opts_.agent_timeout_ms);
    for (auto& [jid, job] : jobs_) {
      if (job_state_final(job.rec.state)) continue;
      for (auto& [name, proc] : job.procs) {
        if (proc.rec.agent_id == id && proc_live(proc.rec)) {
          event(job, "agent_lost", {{"agent", id}, {"proc", name}});
          proc_failed(job, proc, fmt::format("agent {} lost (no heartbeat for {} ms)", id, opts_.agent_timeout_ms));
          if (job_state_final(job.rec.state)) break;
        }
      }
    }
  }
  // After a scheduler restart, processes whose agent never came back are lost.
  if (recovered_until_ != Clock::time_point{} && now > recovered_until_) {
    recovered_until_ = {};
    for (auto& [jid, job] : jobs_) {
      if (job_state_final(job.rec.state)) continue;
      for (auto& [name, proc] : job.procs) {
        auto ait = agents_.find(proc.rec.agent_id);
        if (proc_live(proc.rec) && (ait == agents_.end() || !ait->second.alive)) {
          proc_failed(job, proc, fmt::format("agent {} did not return after the scheduler restarted", proc.rec.agent_id));
          if (job_state_final(job.rec.state)) break;
        }
      }
    }
  }
  // Job processes that said hello and then went silent (hung, stopped, partitioned).
  for (auto& [jid, job] : jobs_) {
    if (job_state_final(job.rec.state)) continue;
    auto limit = std::chrono::milliseconds(job.rec.spec.heartbeat_timeout_ms);
    for (auto& [name, proc] : job.procs) {
      if (!proc.beating || !proc_live(proc.rec) || now - proc.last_beat < limit) continue;
      auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - proc.last_beat).count();
      event(job, "proc_heartbeat_timeout", {{"proc", name}, {"pid", proc.rec.pid}, {"silent_ms", silent},
                                            {"timeout_ms", job.rec.spec.heartbeat_timeout_ms}});
      proc_failed(job, proc, fmt::format("{} missed heartbeats for {} ms", name, silent));
      if (job_state_final(job.rec.state)) break;
    }
  }
}

// ------------------------------------------------------------------ client requests

void Scheduler::on_submit(const std::string& peer, uint64_t rid, const SubmitJob& m) {
  auto spec = JobSpec::from_json(m.spec_json);
  if (!spec.ok()) return reply(peer, rid, Reply::of(spec.status()));
  Status v = spec->validate();
  if (!v.ok()) return reply(peer, rid, Reply::of(v));
  // More workers than every registered agent has slots can never start: refused at once
  // (with no agent registered yet the job waits for them).
  if (!agents_.empty()) {
    int total = 0;
    std::string per_agent;
    for (const auto& [aid, a] : agents_) {
      total += a.rec.slots;
      per_agent += fmt::format("{}{}: {}", per_agent.empty() ? "" : ", ", aid, a.rec.slots);
    }
    if (spec->nproc > total) {
      return reply(
          peer, rid,
          Reply::of(invalid_argument("--nproc {} is more than the {} worker slots of all agents ({})",
                                     spec->nproc, total, per_agent)));
    }
  }
  auto seq = store_->next_job_seq();
  if (!seq.ok()) return reply(peer, rid, Reply::of(seq.status()));
  Job job;
  job.rec.id = fmt::format("job-{}", *seq);
  job.rec.spec = std::move(spec).value();
  // Never stored in the clear (the database, its WAL, the events): every value is sealed.
  for (auto& [k, v] : job.rec.spec.env) v = sealer_->seal(v);
  job.rec.state = JobState::kPending;
  job.rec.created_ms = job.rec.updated_ms = wall_ms();
  job.rec.job_dir = opts_.state_dir + "/jobs/" + job.rec.id;
  auto lg = EventLog::open(job.rec.job_dir, job.rec.id);
  if (!lg.ok()) return reply(peer, rid, Reply::of(lg.status()));
  job.log.emplace(std::move(lg).value());
  std::string id = job.rec.id;
  Job& j = jobs_.emplace(id, std::move(job)).first->second;
  save(j);
  json submitted = json::parse(j.rec.spec.to_json());
  for (auto& [k, v] : submitted["env"].items()) v = "(sealed)";
  event(j, "submitted", {{"spec", std::move(submitted)}});
  log()->info("job {} submitted: {} workers{} of '{}'", id, j.rec.spec.nproc, j.rec.spec.driver ? " + driver" : "",
              j.rec.spec.argv[0]);
  try_start(j);
  Reply r;
  r.body = json{{"job_id", id}, {"job_dir", j.rec.job_dir}, {"state", job_state_name(j.rec.state)}}.dump();
  reply(peer, rid, std::move(r));
}

json Scheduler::job_json(const Job& job, bool with_procs) const {
  const auto& r = job.rec;
  int running = 0, running_workers = 0;
  for (const auto& [n, p] : job.procs) {
    if (proc_live(p.rec)) ++running;
    if (p.rec.role == "worker" && p.rec.epoch == r.epoch && p.rec.state == ProcState::kRunning) ++running_workers;
  }
  json j = {{"id", r.id},
            {"name", r.spec.name},
            {"state", job_state_name(r.state)},
            {"epoch", r.epoch},
            {"restarts", r.restarts},
            {"driver_restarts", r.driver_restarts},
            {"exit_code", r.exit_code},
            {"message", r.message},
            {"created_ms", r.created_ms},
            {"updated_ms", r.updated_ms},
            {"job_dir", r.job_dir},
            {"nproc", r.spec.nproc},
            {"layout", job.known_layout()},
            {"max_restarts", r.spec.max_restarts},
            {"argv", r.spec.argv},
            {"running_procs", running},
            {"running_workers", running_workers},
            {"elastic", r.spec.elastic}};
  j["checkpoint_dir"] = r.spec.checkpoint_dir;
  j["work_dir"] = r.spec.work_dir;
  if (with_procs) {
    json procs = json::array();
    for (const auto& [n, p] : job.procs) {
      procs.push_back({{"name", p.rec.name}, {"role", p.rec.role}, {"rank", p.rec.rank}, {"epoch", p.rec.epoch},
                       {"agent", p.rec.agent_id}, {"slot", p.rec.slot}, {"pid", p.rec.pid},
                       {"state", proc_state_name(p.rec.state)}, {"exit_status", p.rec.exit_status()},
                       {"started_ms", p.rec.started_ms}, {"ended_ms", p.rec.ended_ms},
                       {"heartbeating", p.beating}, {"actor_node", p.rec.actor_node},
                       {"endpoint", p.rec.endpoint}});
    }
    j["procs"] = std::move(procs);
    json actors = json::array();
    for (const auto& [actor, proc] : job.actors) actors.push_back({{"actor", actor}, {"proc", proc}});
    j["actors"] = std::move(actors);
  }
  return j;
}

void Scheduler::on_status(const std::string& peer, uint64_t rid, const StatusQuery& m) {
  json out;
  if (m.job_id == "-") {  // no job: the scheduler's own figures and its agents (cheap at any scale)
    out["jobs"] = json::array();
  } else if (!m.job_id.empty()) {
    auto it = jobs_.find(m.job_id);
    if (it == jobs_.end()) return reply(peer, rid, Reply::of(not_found("unknown job '{}'", m.job_id)));
    out["jobs"] = json::array({job_json(it->second, true)});
    out["jobs"][0]["health"] = health_->job_json(m.job_id, Clock::now());
  } else {
    out["jobs"] = json::array();
    for (const auto& [id, job] : jobs_) out["jobs"].push_back(job_json(job, true));
  }
  json agents = json::array();
  for (const auto& [id, a] : agents_) {
    agents.push_back({{"id", id},
                      {"host", a.rec.host},
                      {"slots", a.rec.slots},
                      {"gpus", a.rec.gpus},
                      {"alive", a.alive},
                      {"snapshots",
                       {{"bytes", a.last_beat.snapshot_bytes},
                        {"parts", a.last_beat.snapshot_parts},
                        {"copies", a.last_beat.snapshot_copies}}}});
  }
  out["agents"] = std::move(agents);
  out["scheduler"] = {{"endpoint", endpoint_},
                      {"metrics_url", metrics_url()},
                      {"incarnation", fmt::format("{:x}", incarnation_)},
                      {"beat_latency", beat_latency_.to_json()},
                      {"receive_lag_ms", receive_lag_now_.count()},
                      {"state_dir", opts_.state_dir}};
  Reply r;
  r.body = out.dump();
  reply(peer, rid, std::move(r));
}

void Scheduler::on_cancel(const std::string& peer, uint64_t rid, const CancelJob& m) {
  auto it = jobs_.find(m.job_id);
  if (it == jobs_.end()) return reply(peer, rid, Reply::of(not_found("unknown job '{}'", m.job_id)));
  Job& job = it->second;
  Reply r;
  if (job_state_final(job.rec.state)) {
    r.message = fmt::format("job {} had already ended ({})", job.rec.id, job_state_name(job.rec.state));
  } else {
    event(job, "cancel_requested", json::object());
    finish_job(job, JobState::kCancelled, "cancelled by a client");
    r.message = fmt::format("job {} cancelled", job.rec.id);
  }
  r.body = job_json(job, false).dump();
  reply(peer, rid, std::move(r));
}

void Scheduler::on_logs(const std::string& peer, uint64_t rid, const LogsQuery& m) {
  auto it = jobs_.find(m.req.job_id);
  if (it == jobs_.end()) return reply(peer, rid, Reply::of(not_found("unknown job '{}'", m.req.job_id)));
  std::string name = m.req.name.empty() ? (it->second.procs.count("driver") ? "driver" : "worker-0") : m.req.name;
  std::string agent_id;
  // The process record names the agent; finished jobs keep their last records in SQLite.
  if (auto pit = it->second.procs.find(name); pit != it->second.procs.end()) {
    agent_id = pit->second.rec.agent_id;
  } else {
    auto procs = store_->load_procs(m.req.job_id);
    if (procs.ok()) {
      for (const auto& p : *procs) {
        if (p.name == name) agent_id = p.agent_id;
      }
    }
  }
  if (agent_id.empty()) {
    return reply(peer, rid, Reply::of(not_found("job {} has no process '{}' (driver, worker-0, ...)", m.req.job_id, name)));
  }
  auto ait = agents_.find(agent_id);
  if (ait == agents_.end() || !ait->second.alive) {
    return reply(peer, rid, Reply::of(unavailable("the logs of {}/{} are on agent {}, which is not connected",
                                                  m.req.job_id, name, agent_id)));
  }
  uint64_t fwd = next_token_++;
  log_forwards_[fwd] = PendingReply{peer, rid};
  LogsRequest req = m.req;
  req.name = name;
  send(ait->second.peer, Message{fwd, AgentLogsQuery{req}});
}

void Scheduler::on_reply(const Message& m) {
  auto it = log_forwards_.find(m.request_id);
  if (it == log_forwards_.end()) return;
  reply(it->second.peer, it->second.request_id, std::get<Reply>(m.payload));
  log_forwards_.erase(it);
}

// The driver says which actor runs on which process in this epoch; the answer gives
// each actor's address (the process's actor-system node and endpoint, once it said hello
// with one). Workers read their share from the job's status and spawn those actors.
void Scheduler::on_place_actors(const std::string& peer, uint64_t rid, const PlaceActors& m) {
  auto it = jobs_.find(m.job_id);
  if (it == jobs_.end()) return reply(peer, rid, Reply::of(not_found("unknown job '{}'", m.job_id)));
  Job& job = it->second;
  if (job_state_final(job.rec.state)) {
    return reply(peer, rid, Reply::of(failed_precondition("job {} has ended ({})", job.rec.id, job_state_name(job.rec.state))));
  }
  if (m.epoch != job.rec.epoch) {
    return reply(peer, rid, Reply::of(failed_precondition("placement for epoch {}, but job {} is in epoch {}", m.epoch,
                                                          job.rec.id, job.rec.epoch)));
  }
  std::set<std::string> names;
  for (const auto& [actor, proc] : m.placements) {
    if (actor.empty() || actor.find('/') != std::string::npos || !names.insert(actor).second) {
      return reply(peer, rid, Reply::of(invalid_argument("actor name '{}' is empty, has '/', or is repeated", actor)));
    }
    auto pit = job.procs.find(proc);
    if (pit == job.procs.end() || (pit->second.rec.role == "worker" && pit->second.rec.epoch != job.rec.epoch)) {
      return reply(peer, rid, Reply::of(invalid_argument("actor {}: job {} has no process '{}' in epoch {}", actor,
                                                         job.rec.id, proc, job.rec.epoch)));
    }
  }
  if (!m.layout.empty()) {
    Result<ParallelLayout> l = ParallelLayout::parse(m.layout);
    if (!l.ok()) return reply(peer, rid, Reply::of(l.status().with_context("actor placement")));
    if (l->world_size() != job.rec.spec.nproc) {
      return reply(
          peer, rid,
          Reply::of(invalid_argument("actor placement: layout {} has {} workers, job {} has {}",
                                     l->to_string(), l->world_size(), job.rec.id, job.rec.spec.nproc)));
    }
    job.reported_layout = l->to_string();
  }
  Status s = store_->put_placements(job.rec.id, job.rec.epoch, m.placements);
  if (!s.ok()) return reply(peer, rid, Reply::of(s));
  job.actors = m.placements;
  const std::string known = job.known_layout();
  event(job, "actors_placed",
        {{"epoch", job.rec.epoch},
         {"actors", m.placements.size()},
         {"layout", known.empty() ? json(nullptr) : json(known)}});
  json out = {{"epoch", job.rec.epoch}, {"actors", json::array()}};
  for (const auto& [actor, proc] : m.placements) {
    const auto& p = job.procs.at(proc).rec;
    out["actors"].push_back({{"actor", actor}, {"proc", proc}, {"agent", p.agent_id}, {"node", p.actor_node},
                             {"endpoint", p.endpoint}});
  }
  Reply r;
  r.body = out.dump();
  reply(peer, rid, std::move(r));
}

void Scheduler::on_store(const std::string& peer, uint64_t rid, const StoreRequest& m) {
  auto it = jobs_.find(m.job_id);
  if (it == jobs_.end()) return reply(peer, rid, Reply::of(not_found("store: unknown job '{}'", m.job_id)));
  uint64_t token = next_token_++;
  auto r = rendezvous_->handle(m, token, Clock::now());
  if (m.op == StoreOp::kSet) {
    Job& job = it->second;
    // The job's driver takes over the supervision of its workers (training/driver/trainer.h):
    // from now on a lost worker is reported to it instead of restarting every worker.
    if (!is_elastic(job) && m.keys.size() == 1 && m.keys[0] == job.rec.id + "/elastic/claim" &&
        !job_state_final(job.rec.state)) {
      job.rec.spec.elastic = true;
      save(job);
      // The claim may name the driver's run directory (where `troupe run` keeps this log).
      json claimed{{"by", "driver"}};
      const json claim = json::parse(m.value, nullptr, false);
      if (claim.is_object() && claim.contains("run_dir") && claim["run_dir"].is_string())
        claimed["run_dir"] = claim["run_dir"];
      event(job, "supervision_claimed", claimed);
      log()->info("job {}: its driver supervises the workers (elastic)", job.rec.id);
    }
    if (is_elastic(job)) elastic_on_store(job, m);
  }
  if (r) return reply(peer, rid, std::move(*r));
  store_waiters_[token] = PendingReply{peer, rid};
  if (metrics_) parked_at_[token] = Clock::now();
}

// ------------------------------------------------------------------ persistence

void Scheduler::event(Job& job, const std::string& type, json fields) {
  int64_t ts = wall_ms();
  if (job.log) {
    Status s = job.log->append(type, fields, ts);
    if (!s.ok()) log()->warn("events.jsonl of {}: {}", job.rec.id, s.to_string());
  }
  store_->add_event(job.rec.id, ts, type, fields.dump()).ignore();
}

void Scheduler::save(Job& job) {
  job.rec.updated_ms = wall_ms();
  Status s = store_->put_job(job.rec);
  if (!s.ok()) log()->error("cannot save job {}: {}", job.rec.id, s.to_string());
}

void Scheduler::save(Proc& proc) {
  Status s = store_->put_proc(proc.rec);
  if (!s.ok()) log()->error("cannot save process {}/{}: {}", proc.rec.job_id, proc.rec.name, s.to_string());
}

}  // namespace troupe::sched
