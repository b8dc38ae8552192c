// scheduler/daemons/agent.cc — the Agent's loop (registration, exits, kills, logs) and its
// starter thread (process starts).
#include "scheduler/daemons/agent.h"

#include <arpa/inet.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/control/host_addr.h"
#include "core/env.h"
#include "core/job_env.h"
#include "core/logging.h"
#include "scheduler/daemons/secrets.h"

extern char** environ;

namespace troupe::sched {
namespace {

std::shared_ptr<spdlog::logger> log() {
  static auto l = make_logger("agent");
  return l;
}

// Best effort: a key file already gone (or never written) is no error.
void remove_files(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
}

// Job ids and process names become path parts: keep them to a safe alphabet.
bool safe_name(const std::string& s) {
  if (s.empty() || s.size() > 128 || s == "." || s == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'; });
}

// True when `dir` is a relay directory of this uid whose agent is gone: its socket exists,
// is older than kRelayStaleAge and nothing accepts on it (an agent killed with SIGKILL
// leaves its directory behind). A directory whose agent is still starting is not stale:
// no socket yet, or a socket bound but not yet listening (connect is refused in that
// window too: two agents starting together on one host once removed each other's relay).
constexpr std::chrono::seconds kRelayStaleAge{10};
bool stale_relay_dir(const std::filesystem::path& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) return false;
  const std::string sock = (dir / "relay").string();
  if (::lstat(sock.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  const auto bound_at = std::chrono::system_clock::from_time_t(st.st_mtim.tv_sec);
  if (std::chrono::system_clock::now() - bound_at < kRelayStaleAge) return false;
  sockaddr_un addr{};
  if (sock.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, sock.c_str(), sock.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool refused =
      ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno == ECONNREFUSED;
  ::close(fd);
  return refused;
}

}  // namespace

Result<std::string> interface_address(const std::string& iface) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return io_error("getifaddrs: {}", std::strerror(errno));
  std::string found;
  std::vector<std::string> names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    names.emplace_back(i->ifa_name);
    if (iface != i->ifa_name || !found.empty()) continue;
    char buf[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    found = buf;
  }
  freeifaddrs(list);
  if (found.empty())
    return not_found("no IPv4 address on interface '{}' (interfaces: {})", iface, fmt::join(names, ", "));
  return found;
}

Result<std::unique_ptr<Agent>> Agent::create(AgentOptions opts) {
  std::unique_ptr<Agent> a(new Agent(std::move(opts)));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  a->host_ = host;
  if (a->opts_.agent_id.empty()) a->opts_.agent_id = a->host_;
  if (!safe_name(a->opts_.agent_id)) return invalid_argument("agent id '{}' must be [A-Za-z0-9._-]+", a->opts_.agent_id);
  a->gpus_ = detect_gpus();
  if (a->opts_.slots < 0) {
    a->opts_.slots = a->gpus_ > 0 ? a->gpus_ : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  if (a->opts_.work_dir.empty()) a->opts_.work_dir = std::filesystem::current_path().string() + "/troupe-agent";
  std::error_code ec;
  std::filesystem::create_directories(a->opts_.work_dir, ec);
  if (ec) return io_error("cannot create agent work directory {}: {}", a->opts_.work_dir, ec.message());
  // Job logs and the keys handed to job processes live here: its owner's only.
  TROUPE_RETURN_IF_ERROR(make_private_dir(a->opts_.work_dir, "agent work directory"));
  a->opts_.work_dir = std::filesystem::canonical(a->opts_.work_dir).string();
  TROUPE_ASSIGN_OR_RETURN(std::string ep, normalize_endpoint(a->opts_.scheduler));
  if (!a->opts_.host_addr.empty()) {
    in_addr probe{};
    if (inet_pton(AF_INET, a->opts_.host_addr.c_str(), &probe) != 1) {
      return invalid_argument("--host-addr '{}' is not an IPv4 address", a->opts_.host_addr);
    }
    const bool loopback = a->opts_.host_addr.rfind("127.", 0) == 0;
    if (!loopback && a->opts_.security.server_public_key.empty() && !a->opts_.insecure) {
      return failed_precondition(
          "--host-addr {} is not a loopback address: give CURVE keys (--curve-key, --scheduler-key; job "
          "processes then "
          "get their job's keys) or --insecure for a trusted network",
          a->opts_.host_addr);
    }
  }
  TROUPE_ASSIGN_OR_RETURN(a->conn_, ClientEndpoint::connect(ep, a->opts_.security, "agent:" + a->opts_.agent_id));
  log()->info("agent {} on {}: {} slots, {} GPUs, scheduler {}, logs under {}", a->opts_.agent_id, a->host_,
              a->opts_.slots, a->gpus_, ep, a->opts_.work_dir);
  if (a->opts_.relay) TROUPE_RETURN_IF_ERROR(a->open_relay());
  if (a->opts_.snapshots) {
    // Other nodes' keepers reach this one on the node's address (loopback by default).
    auto k = checkpoint::SnapshotKeeper::start(
        {.node = a->opts_.agent_id,
         .host_addr = a->opts_.host_addr.empty() ? "127.0.0.1" : a->opts_.host_addr});
    if (!k.ok()) return k.status().with_context("agent snapshot keeper");
    a->keeper_ = std::move(k).value();
  }
  a->start_wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (a->start_wake_fd_ < 0) return io_error("agent: eventfd: {}", std::strerror(errno));
  Agent* self = a.get();
  a->starter_ = std::thread([self] { self->starter_loop(); });
  a->send_register();
  return a;
}

Agent::~Agent() {
  if (!children_.empty() || starts_pending()) kill_all(std::chrono::milliseconds(1000));
  if (starter_.joinable()) {
    {
      std::lock_guard lock(start_mu_);
      start_stop_ = true;
    }
    start_cv_.notify_all();
    starter_.join();  // a start it finished after kill_all's bound: its child got PDEATHSIG
    collect_starts();
    if (!children_.empty()) kill_all(std::chrono::milliseconds(0));
    remove_files(removals_);  // key files of processes reaped since
  }
  if (start_wake_fd_ >= 0) ::close(start_wake_fd_);
  keeper_.reset();
  relay_.reset();
  if (!relay_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(relay_dir_, ec);
  }
}

Status Agent::open_relay() {
  const std::string base = env::get_or("TMPDIR", "/tmp");
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (auto it = std::filesystem::directory_iterator(base, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (it->path().filename().string().rfind("troupe-agent-", 0) == 0 && stale_relay_dir(it->path())) {
      stale.push_back(it->path());
    }
  }
  for (const auto& d : stale) {
    std::filesystem::remove_all(d, ec);
    log()->info("removed {}, the relay directory of an agent that is gone", d.string());
  }
  std::string tmpl = base + "/troupe-agent-XXXXXX";
  if (!mkdtemp(tmpl.data()))
    return io_error("cannot create the relay directory under {}: {}", base, std::strerror(errno));
  relay_dir_ = tmpl;  // mkdtemp: mode 0700
  const std::string ep = "ipc://" + relay_dir_ + "/relay";
  constexpr size_t kMaxIpcPath = sizeof(sockaddr_un::sun_path) - 1;
  if (ep.size() - 6 > kMaxIpcPath) {
    return invalid_argument("relay socket path {} is longer than {} bytes: set TMPDIR to a shorter directory",
                            ep.substr(6), kMaxIpcPath);
  }
  auto server = ServerEndpoint::bind(ep, ServerSecurity{}, 1, /*ipc_same_user=*/true);
  if (!server.ok()) return server.status().with_context("agent relay");
  relay_ = std::move(server).value();
  log()->info("agent {}: job processes reach the scheduler through {}", opts_.agent_id,
              relay_->bound_endpoint());
  return ok_status();
}

void Agent::relay_up() {
  if (!relay_) return;
  for (auto& in : relay_->poll(std::chrono::milliseconds(0))) {
    if (in.peer.empty()) continue;  // a message without a sender cannot be answered or attributed
    conn_->send(Message{0, RelayedMessage{std::move(in.peer), encode_message(in.msg)}});
  }
}

void Agent::relay_down(const RelayedMessage& r) {
  if (!relay_) {
    log()->error("a relayed message for session {} but this agent runs no relay: dropped", r.session);
    return;
  }
  auto inner = decode_message(r.msg.data(), r.msg.size());
  if (!inner.ok()) {
    log()->error("relayed message for session {}: dropped: {}", r.session, inner.status().to_string());
    return;
  }
  if (std::holds_alternative<RelayedMessage>(inner->payload)) {
    log()->error("relayed message for session {}: dropped a nested relay", r.session);
    return;
  }
  if (!relay_->send(r.session, *inner))
    log()->debug("relayed {} to session {}: gone", payload_name(inner->payload), r.session);
}

std::string Agent::log_path(const std::string& job, const std::string& name) const {
  return fmt::format("{}/jobs/{}/logs/{}.log", opts_.work_dir, job, name);
}

std::string Agent::job_key_path(const std::string& job, const std::string& name, uint64_t epoch) const {
  return fmt::format("{}/jobs/{}/keys/{}.{}.key", opts_.work_dir, job, name, epoch);
}

void Agent::send_register() {
  RegisterAgent r;
  r.agent_id = opts_.agent_id;
  r.host = host_;
  r.slots = opts_.slots;
  r.gpus = gpus_;
  for (const auto& [pid, c] : children_) {
    ProcStatus s = c.status;
    s.running = true;
    r.procs.push_back(s);
  }
  for (const auto& e : unacked_exits_) r.procs.push_back(e);
  conn_->send(Message{0, std::move(r)});
  last_register_ = Clock::now();
}

void Agent::run() {
  while (!stop_.load()) run_once(std::chrono::milliseconds(opts_.poll_ms));
  kill_all(std::chrono::milliseconds(opts_.stop_grace_ms));
}

void Agent::run_once(std::chrono::milliseconds timeout) {
  // One poll over the scheduler socket and every child's pidfd: an exit wakes us at once.
  std::vector<pollfd> fds;
  fds.push_back({conn_->wake_fd(), POLLIN, 0});
  if (relay_) fds.push_back({relay_->wake_fd(), POLLIN, 0});
  if (start_wake_fd_ >= 0) fds.push_back({start_wake_fd_, POLLIN, 0});
  for (const auto& [pid, c] : children_) {
    if (c.proc.pidfd >= 0) fds.push_back({c.proc.pidfd, POLLIN, 0});
  }
  ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  collect_starts();
  reap();
  // A stopping agent handles nothing more (a job of many processes must not delay it).
  while (!stop_.load()) {
    auto m = conn_->receive(std::chrono::milliseconds(0));
    if (!m) break;
    handle(*m);
  }
  if (!stop_.load()) relay_up();
  reap();

  auto now = Clock::now();
  if (relay_ && now >= next_ask_expiry_) {
    // Relayed asks the scheduler will not answer (lost with its restart) are forgotten
    // once their askers' deadlines have passed.
    relay_->expire_asks();
    next_ask_expiry_ = now + std::chrono::seconds(1);
  }
  if (!registered_ && now - last_register_ > std::chrono::milliseconds(1000)) send_register();
  if (registered_ && now - last_beat_ >= std::chrono::milliseconds(opts_.heartbeat_ms)) {
    AgentHeartbeat hb{opts_.agent_id, incarnation_, wall_ms()};
    if (keeper_) {
      const checkpoint::KeeperTotals t = keeper_->totals();
      hb.snapshot_bytes = t.bytes;
      hb.snapshot_parts = t.parts;
      hb.snapshot_copies = t.copies;
    }
    conn_->send(Message{0, hb});
    last_beat_ = now;
  }
  // Escalate SIGTERM to SIGKILL once the grace period is over.
  for (auto& [pid, c] : children_) {
    if (c.kill_at && now >= *c.kill_at) {
      kill_process_group(pid, SIGKILL).ignore();
      c.kill_at.reset();
    }
  }
}

void Agent::reap() {
  for (auto it = children_.begin(); it != children_.end();) {
    auto exit = try_reap(it->first);
    if (!exit) {
      ++it;
      continue;
    }
    // Whatever the process left in its group (children it did not wait for) goes too.
    kill_process_group(it->first, SIGKILL).ignore();
    ProcStatus s = it->second.status;
    s.running = false;
    s.exit_code = exit->exit_code;
    s.term_signal = exit->term_signal;
    s.time_ms = wall_ms();
    if (it->second.proc.pidfd >= 0) close(it->second.proc.pidfd);
    {
      std::lock_guard lock(live_mu_);
      live_pgids_.erase(it->first);
    }
    log()->info("{}/{} (pid {}) exited with status {}", s.job_id, s.name, s.pid, exit->exit_status());
    {  // its key file, if it had one (by the starter: an unlink may wait on the disk)
      std::lock_guard lock(start_mu_);
      removals_.push_back(job_key_path(s.job_id, s.name, s.epoch));
    }
    start_cv_.notify_all();
    conn_->send(Message{0, ProcExited{s}});
    unacked_exits_.push_back(std::move(s));
    it = children_.erase(it);
  }
}

void Agent::handle(const Message& m) {
  if (auto* ack = std::get_if<RegisterAck>(&m.payload)) {
    if (incarnation_ != ack->incarnation && registered_) log()->info("the scheduler restarted: registered again");
    incarnation_ = ack->incarnation;
    registered_ = true;
    if (ack->heartbeat_ms > 0) opts_.heartbeat_ms = ack->heartbeat_ms;
  } else if (std::holds_alternative<Reregister>(m.payload)) {
    registered_ = false;
    send_register();
  } else if (auto* sp = std::get_if<SpawnRequest>(&m.payload)) {
    on_spawn(*sp);
  } else if (auto* k = std::get_if<KillRequest>(&m.payload)) {
    on_kill(*k);
  } else if (auto* ack2 = std::get_if<ExitAck>(&m.payload)) {
    std::erase_if(unacked_exits_, [&](const ProcStatus& s) {
      return s.job_id == ack2->job_id && s.name == ack2->name && s.epoch == ack2->epoch && s.pid == ack2->pid;
    });
  } else if (auto* lq = std::get_if<AgentLogsQuery>(&m.payload)) {
    on_logs(m.request_id, lq->req);
  } else if (auto* rl = std::get_if<RelayedMessage>(&m.payload)) {
    relay_down(*rl);
  } else {
    log()->warn("unexpected {} message from the scheduler: dropped", payload_name(m.payload));
  }
}

void Agent::on_spawn(const SpawnRequest& req) {
  ProcStatus st;
  st.job_id = req.job_id;
  st.name = req.name;
  st.epoch = req.epoch;
  if (!safe_name(req.job_id) || !safe_name(req.name)) {
    st.exit_code = 127;
    st.error = fmt::format("spawn refused: bad job id '{}' or name '{}'", req.job_id, req.name);
    st.time_ms = wall_ms();
    conn_->send(Message{0, ProcExited{st}});
    return;
  }
  // One process per (job, name): a leftover of an older epoch is killed first, and so is
  // one of this (job, name) still being started.
  for (auto& [pid, c] : children_) {
    if (c.status.job_id == req.job_id && c.status.name == req.name) kill_process_group(pid, SIGKILL).ignore();
  }
  kill_pending(req.job_id, req.name, SIGKILL, 0);
  auto p = std::make_shared<PendingStart>();
  p->status = st;
  SpawnOptions& so = p->options;
  so.argv = req.argv;
  so.work_dir = req.work_dir;
  so.log_path = log_path(req.job_id, req.name);
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos && kv.rfind("TROUPE_", 0) != 0) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : req.env) env[k] = v;
  if (!opts_.key_file.empty()) env[job_env::kCurveKey] = opts_.key_file;
  if (!opts_.host_addr.empty()) env[job_env::kHostAddr] = opts_.host_addr;
  if (opts_.insecure) env[job_env::kInsecure] = "1";
  if (relay_) env[job_env::kAgentRelay] = relay_->bound_endpoint();
  if (keeper_) env[job_env::kSnapshotKeeper] = keeper_->socket_path();
  // The job's CURVE secret key goes to the process as a 0600 file, not in its environment
  // (which /proc/<pid>/environ, core dumps and child processes would carry).
  if (!req.job_secret_key.empty()) {
    p->key_dir = fmt::format("{}/jobs/{}/keys", opts_.work_dir, req.job_id);
    p->key_path = job_key_path(req.job_id, req.name, req.epoch);
    p->key = req.job_secret_key;
    env[job_env::kJobSecretKeyFile] = p->key_path;
  }
  for (const auto& [k, v] : env) so.env.push_back(k + "=" + v);
  {
    std::lock_guard lock(start_mu_);
    start_queue_.push_back(std::move(p));
  }
  start_cv_.notify_all();
}

// The starter thread: one start at a time, in the order the loop queued them.
void Agent::starter_loop() {
  for (;;) {
    std::shared_ptr<PendingStart> p;
    std::vector<std::string> removals;
    {
      std::unique_lock lock(start_mu_);
      start_cv_.wait(lock, [&] { return start_stop_ || !start_queue_.empty() || !removals_.empty(); });
      removals.swap(removals_);
    }
    remove_files(removals);
    {
      std::unique_lock lock(start_mu_);
      if (start_stop_) return;
      if (start_queue_.empty()) continue;
      p = std::move(start_queue_.front());
      start_queue_.pop_front();
      starting_ = p;
    }
    start_one(*p);
    if (p->child) {
      std::lock_guard lock(live_mu_);
      live_pgids_.insert(p->child->pid);
    }
    {
      std::lock_guard lock(start_mu_);
      starting_.reset();
      started_.push_back(std::move(p));
    }
    start_cv_.notify_all();
    const uint64_t one = 1;
    ssize_t n = ::write(start_wake_fd_, &one, sizeof(one));
    (void)n;
  }
}

void Agent::start_one(PendingStart& p) {
  if (!p.key.empty()) {
    Status ks = make_private_dir(p.key_dir, "job key directory");
    if (ks.ok()) ks = write_private_file(p.key_path, p.key);
    if (!ks.ok()) {
      p.error = fmt::format("cannot start {} on {}: {}", p.status.name, opts_.agent_id, ks.message());
      return;
    }
  }
  auto child = spawn_process(p.options);
  if (!child.ok()) {
    p.error =
        fmt::format("cannot start {} on {}: {}", p.status.name, opts_.agent_id, child.status().message());
    return;
  }
  p.child = *child;
}

void Agent::kill_pending(const std::string& job, const std::string& name, int sig, int grace_ms) {
  std::lock_guard lock(start_mu_);
  const auto mark = [&](PendingStart& p) {
    if (p.status.job_id != job || (!name.empty() && p.status.name != name)) return;
    // The strongest signal asked for wins (a SIGKILL is never softened by a later SIGTERM).
    if (p.kill_signal != SIGKILL) {
      p.kill_signal = sig;
      p.kill_grace_ms = grace_ms;
    }
  };
  for (auto& p : start_queue_) mark(*p);
  if (starting_) mark(*starting_);
  for (auto& p : started_) mark(*p);
}

bool Agent::starts_pending() {
  std::lock_guard lock(start_mu_);
  return !start_queue_.empty() || starting_ || !started_.empty();
}

void Agent::quiesce_starts(std::chrono::milliseconds bound) {
  std::unique_lock lock(start_mu_);
  for (auto& p : start_queue_) {
    p->dropped = true;
    started_.push_back(std::move(p));
  }
  start_queue_.clear();
  if (starting_) starting_->kill_signal = SIGKILL;
  if (!start_cv_.wait_for(lock, bound, [&] { return !starting_; })) {
    log()->warn("a process start still under way after {} ms; going on without it", bound.count());
  }
}

void Agent::collect_starts() {
  if (start_wake_fd_ >= 0) {
    uint64_t n = 0;
    ssize_t r = ::read(start_wake_fd_, &n, sizeof(n));
    (void)r;
  }
  std::vector<std::shared_ptr<PendingStart>> done;
  {
    std::lock_guard lock(start_mu_);
    done.swap(started_);
  }
  for (auto& p : done) {
    ProcStatus st = p->status;
    st.time_ms = wall_ms();
    if (p->dropped || !p->child) {
      st.exit_code = 127;
      st.error = p->dropped
                     ? fmt::format("{} was not started: agent {} stopped first", st.name, opts_.agent_id)
                     : p->error;
      log()->warn("{}", st.error);
      conn_->send(Message{0, ProcExited{st}});
      unacked_exits_.push_back(st);
      continue;
    }
    st.pid = p->child->pid;
    st.running = true;
    log()->info("started {}/{} epoch {} as pid {}", st.job_id, st.name, st.epoch, st.pid);
    Child& c = children_[st.pid] = Child{st, *p->child, std::nullopt};
    conn_->send(Message{0, ProcStarted{st}});
    if (p->kill_signal != 0) {  // killed while it was being started: now
      log()->info("{}/{} epoch {} was to be killed while it was being started: signal {} now", st.job_id,
                  st.name, st.epoch, p->kill_signal);
      kill_process_group(st.pid, p->kill_signal).ignore();
      if (p->kill_signal == SIGTERM) kill_process_group(st.pid, SIGCONT).ignore();
      if (p->kill_signal != SIGKILL)
        c.kill_at = Clock::now() + std::chrono::milliseconds(std::max(0, p->kill_grace_ms));
    }
  }
}

void Agent::on_kill(const KillRequest& req) {
  for (auto& [pid, c] : children_) {
    if (c.status.job_id != req.job_id || (!req.name.empty() && c.status.name != req.name)) continue;
    int sig = req.signal > 0 && req.signal < NSIG ? req.signal : SIGKILL;
    kill_process_group(pid, sig).ignore();
    if (sig == SIGTERM) kill_process_group(pid, SIGCONT).ignore();  // a stopped process cannot act on SIGTERM
    if (sig != SIGKILL) c.kill_at = Clock::now() + std::chrono::milliseconds(std::max(0, req.grace_ms));
  }
  kill_pending(req.job_id, req.name, req.signal > 0 && req.signal < NSIG ? req.signal : SIGKILL,
               req.grace_ms);
}

void Agent::on_logs(uint64_t rid, const LogsRequest& req) {
  Reply r;
  if (!safe_name(req.job_id) || !safe_name(req.name)) {
    r = Reply::of(invalid_argument("bad job id or process name"));
  } else {
    std::string path = log_path(req.job_id, req.name);
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      r = Reply::of(not_found("no log for {}/{} on agent {} ({})", req.job_id, req.name, opts_.agent_id, path));
    } else {
      f.seekg(0, std::ios::end);
      int64_t size = f.tellg();
      int64_t off = std::clamp<int64_t>(req.offset, 0, size);
      int64_t n = std::min<int64_t>(size - off, std::clamp(req.max_bytes, 1, 1 << 20));
      r.data.resize(static_cast<size_t>(n));
      f.seekg(off);
      f.read(r.data.data(), n);
      r.offset = off + n;
      r.body = fmt::format("{{\"size\": {}}}", size);
    }
  }
  conn_->send(Message{rid, std::move(r)});
}

void Agent::kill_all_now() {
  std::lock_guard lock(live_mu_);
  for (pid_t pg : live_pgids_) kill_process_group(pg, SIGKILL).ignore();
}

void Agent::kill_all(std::chrono::milliseconds grace) {
  // Starts not yet begun are dropped; the one under way is adopted (and killed) when it ends.
  if (starter_.joinable()) {
    quiesce_starts(std::max(grace, std::chrono::milliseconds(2000)));
    collect_starts();
  }
  for (auto& [pid, c] : children_) {
    kill_process_group(pid, SIGTERM).ignore();
    kill_process_group(pid, SIGCONT).ignore();
  }
  auto deadline = Clock::now() + grace;
  while (!children_.empty() && Clock::now() < deadline) {
    reap();
    if (!children_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto& [pid, c] : children_) kill_process_group(pid, SIGKILL).ignore();
  while (!children_.empty()) {
    reap();
    if (!children_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace troupe::sched
