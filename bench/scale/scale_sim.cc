// bench/scale/scale_sim.cc — scale_sim: the real troupe-scheduler process against a
// simulated cluster. 1,250 agents of 8 slots and 10,000 worker control
// sessions by default, each a real ZeroMQ DEALER on loopback speaking the real wire
// protocol (comm/control envelopes carrying scheduler/client/protocol.capnp messages, the
// transport's 2 Hz application heartbeats, ZMTP heartbeats), owned by a few threads that
// each poll hundreds to thousands of sockets through one epoll set.
//
// Sessions, as troupe-agent runs them: each simulated agent binds an ipc:// ROUTER (its
// relay; peers admitted by uid through ZAP), its processes' DEALERs connect there, and the
// agent carries their messages over its own CURVE connection to the scheduler in Relay
// messages (scheduler/daemons/agent.h), decoding and encoding each as the real agent does; the
// scheduler's answers come back the same way. So the scheduler sees 1,250 CURVE peers and
// 10,000 relayed sessions. --direct instead connects every process's DEALER to the
// scheduler (with CURVE: 11,250 handshakes), as troupe-agent --no-relay does.
//
// Script (one elastic job of --workers ranks and a driver):
//   agents register, beat at 1 Hz -> a client submits the job -> the scheduler places it
//   and sends spawn requests -> each agent answers with procStarted and starts a worker
//   session (hello, then beats at 1 Hz) -> rendezvous through the scheduler's store:
//   every rank sets rdzv/addr/<rank>, rank 0 sets rdzv/uid, every rank gets rdzv/uid and
//   its ring neighbours' addresses -> steady state: per-step progress (store set
//   progress/<rank>) and latency probes -> 1% of the workers die at once (their agents
//   report procExited, signal 9; the sessions go silent) while the rest keep beating;
//   the driver, which parks a get on every "<job>/elastic/exit/<slot>", must see each
//   exactly once -> kill -9 of the scheduler, restart on the same port and state dir:
//   agents re-register, every job/process record must come back -> cancel.
//
// Figures are printed against the targets. The exit status reflects correctness
// only (every rank rendezvoused, every injected failure seen exactly once and no other,
// every exit acknowledged, the restart recovered every job and process record), never a
// timing: the ctest scale_sim_small runs it at 500 workers on a shared machine.
//
// Processes: the simulated peers live in as few forked processes as the file-descriptor
// limit allows (each DEALER costs a TCP socket and a mailbox eventfd; a relayed session an
// ipc connection with both ends here), at nice 10 (nice 0 with CURVE and --direct: see
// Options::nice) (they stand for other hosts); each process runs --threads / processes
// threads (rounded up), each owning hundreds to thousands of sockets polled through one
// epoll set.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "comm/control/codec.h"
#include "comm/control/curve.h"
#include "comm/control/envelope.h"
#include "core/status.h"
#include "scheduler/client/local_auth.h"
#include "scheduler/client/protocol.h"
#include "scheduler/client/transport.h"

namespace troupe::sched::scale {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using namespace std::chrono_literals;

double secs(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}
double ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

struct Options {
  int workers = 10000;
  int slots = 8;
  int agents = 0;  // 0: workers / slots, rounded up
  int threads = 4;
  int failures = -1;  // -1: 1% of the workers (at least 1)
  int steady_s = 5;
  int beat_ms = 1000;
  int step_ms = 1000;
  double probe_fraction = 0.1;
  int phase_timeout_s = 120;
  std::string scheduler_bin = TROUPE_SCHEDULER_BIN;
  std::string state_dir;
  int processes = 0;  // simulator processes; 0: as few as the file-descriptor limit allows
  // The simulator processes' nice value (the scheduler keeps its own); -1: 10, except 0
  // with CURVE and --direct. There every simulated client's handshake costs as much CPU as
  // the scheduler's side of it, and at nice 10 the simulated agents' own beats fell 2-3 s
  // behind on the simulator side (the row "longest agent beat gap" shows it): the run then
  // measured the simulator starving, not the scheduler.
  int nice = -1;
  bool keep_state = false;
  int io_threads = 0;  // the scheduler's --io-threads; 0: its default
  // The scheduler serves loopback clients with local authentication (CURVE with the
  // user's credential, scheduler/client/local_auth.h): every simulated peer holds it, as real
  // agents and job processes do. --insecure measures the scheduler without it.
  bool insecure = false;
  control::CurveKeyPair credential;
  // Worker and driver sessions connect to the scheduler themselves (one CURVE handshake
  // each) instead of going through their agent's relay (troupe-agent's default: an ipc://
  // ROUTER per agent, peers admitted by uid, sessions carried in Relay messages over the
  // agent's own scheduler connection).
  bool direct = false;
  std::string relay_dir;  // the agents' ipc sockets (a 0700 directory of this run)
};

// kRelay: a simulated agent's local ROUTER (troupe-agent's relay), `agent` its owner.
enum class Kind { kAgent, kWorker, kDriver, kClient, kRelay };

struct Ask {
  enum What {
    kSetAddr,
    kSetUid,
    kGetUid,
    kGetNext,
    kGetPrev,
    kProgress,
    kProbe,
    kExitWatch,
    kSubmit,
    kStatus,
    kCancel
  };
  What what;
  int arg = 0;
  Clock::time_point sent;
};

struct SimThread;

struct Peer {
  Kind kind = Kind::kWorker;
  int index = 0;  // agent number, or rank
  std::string node;
  std::unique_ptr<zmq::socket_t> sock;
  SimThread* thread = nullptr;
  Clock::time_point next_beat{}, next_hb{};
  Clock::time_point last_sent{};  // last envelope other than a transport heartbeat
  Clock::time_point last_beat{};
  double max_gap_ms = 0;
  uint64_t hb_seq = 0;
  std::unordered_map<uint64_t, Ask> asks;
  // agent
  bool registered = false;
  uint64_t incarnation = 0;
  Clock::time_point last_register{};
  std::map<std::string, Peer*> procs;        // name -> its session (live ones)
  std::vector<ProcStatus> unacked;           // exits not yet acknowledged
  std::map<std::string, ProcStatus> status;  // name -> running status (for re-registration)
  // worker / driver
  std::string job;
  std::string name;
  uint64_t epoch = 0;
  int world = 0;
  int pid = 0;
  Peer* agent = nullptr;  // a process's agent; a relay's owner
  Peer* relay = nullptr;  // an agent's relay (none with --direct)
  std::string relay_endpoint;
  bool said_hello = false;
  int gets_left = 3;
  bool dead = false;
};

// What every simulator process reports and is told, in MAP_SHARED memory (one process
// cannot hold 10,000+ sockets under a 20,000 file-descriptor limit: each DEALER takes a
// TCP connection and a mailbox eventfd). Plain atomics and arrays only.
struct Board {
  static constexpr int64_t kMaxProbes = 1 << 20;
  std::atomic<int> registered{0}, spawns{0}, rendezvoused{0}, store_errors{0}, progress_acks{0}, exit_acks{0};
  std::atomic<bool> stepping{false}, probing{false}, track_gaps{false}, stop{false};
  std::atomic<int> fail_gen{0};
  std::atomic<int> started_shards{0};
  std::atomic<int64_t> sent{0}, received{0};
  std::atomic<int64_t> last_spawn_ns{0}, last_rendezvous_ns{0}, last_exit_seen_ns{0};  // steady clock
  std::atomic<int64_t> max_gap_us{0};
  // Between two beats of one registered simulated agent, whole run (the timers call beat()
  // every period also while an agent waits to register again, so the restart's downtime
  // is not counted: only the simulator's own lateness is).
  std::atomic<int64_t> max_agent_gap_us{0};
  std::atomic<int> nerrors{0};
  char errors[16][256];
  std::atomic<int64_t> nprobes{0};
  float probe_ms[kMaxProbes];
};

int64_t steady_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
Clock::time_point from_steady_ns(int64_t ns) {
  return Clock::time_point(std::chrono::nanoseconds(ns));
}
void fetch_max(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while (cur < v && !a.compare_exchange_weak(cur, v)) {
  }
}

// Shared memory that outlives fork(): the children see the same pages.
template <typename T>
T* shared_array(size_t n) {
  void* p = mmap(nullptr, sizeof(T) * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  for (size_t i = 0; i < n; ++i) new (static_cast<T*>(p) + i) T();
  return static_cast<T*>(p);
}

// One process's view: its options, the scheduler's address, the board.
struct Shared {
  Options opt;
  std::string endpoint;
  Board* b = nullptr;
  std::atomic<uint64_t>* agent_inc = nullptr;  // per agent: the incarnation it registered with
  std::atomic<int>* exits_seen = nullptr;      // per slot: times the driver saw its exit
  std::vector<int> victims;                    // ranks that die in the failure phase
  std::mutex mu;                               // client_reply (the parent's client)
  std::optional<Reply> client_reply;
  int client_seq = 0;  // the client's current request: a late answer to an earlier one is dropped
  void error(const std::string& e) {
    int i = b->nerrors.fetch_add(1);
    if (i < 16) std::snprintf(b->errors[i], sizeof(b->errors[i]), "%s", e.c_str());
  }
};

int64_t unix_nanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct SimThread {
  static constexpr size_t kStartsPerTurn = 64;
  Shared* sh = nullptr;
  int id = 0;
  std::unique_ptr<zmq::context_t> ctx;
  // The relays' sockets live in a context of their own (with its ZAP handler): on a real
  // host the agent's relay and each process have their own I/O threads, and libzmq 4.3's
  // timer cancellation is linear in the timers of one I/O thread, so piling the two ends
  // of thousands of local connections onto one thread would measure that, not the relay.
  std::unique_ptr<zmq::context_t> relay_ctx;
  int epfd = -1;
  int cmd_fd = -1;
  std::mutex cmd_mu;
  std::vector<std::function<void()>> cmds;
  std::vector<std::unique_ptr<Peer>> peers;
  std::thread th;
  std::atomic<bool> stop{false};
  uint64_t next_corr = 1;
  std::mt19937_64 rng;
  int fail_gen = 0;  // the board's failure generation this thread has acted on
  std::vector<std::pair<Peer*, SpawnRequest>> starts;  // read, not yet started
  // The ZAP handler of this thread's context: admits the relays' local peers by uid, as
  // troupe-agent's does (control::serve_zap_request_same_uid).
  std::unique_ptr<zmq::socket_t> zap;
  int zap_tag = 0;             // its epoll data.ptr
  std::vector<Peer*> recheck;  // relays sent on: look for input after this turn's events

  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(cmd_mu);
      cmds.push_back(std::move(f));
    }
    uint64_t one = 1;
    ssize_t n = ::write(cmd_fd, &one, sizeof(one));
    (void)n;
  }

  // `via`: the agent relay's endpoint a process's session connects to (no CURVE); empty:
  // the scheduler, with CURVE unless --insecure.
  Peer* open(Kind kind, int index, const std::string& node, const std::string& via = "") {
    auto p = std::make_unique<Peer>();
    p->kind = kind;
    p->index = index;
    p->node = node;
    p->thread = this;
    try {
      p->sock = std::make_unique<zmq::socket_t>(*ctx, zmq::socket_type::dealer);
      auto& s = *p->sock;
      // The options of comm/control's DEALERs (transport.cc), queues unbounded here because
      // one driver parks thousands of asks.
      s.set(zmq::sockopt::linger, 0);
      s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
      s.set(zmq::sockopt::heartbeat_ivl, 1000);
      s.set(zmq::sockopt::heartbeat_timeout, 10000);
      s.set(zmq::sockopt::routing_id, node);
      if (!sh->opt.insecure && via.empty()) {
        s.set(zmq::sockopt::curve_serverkey, sh->opt.credential.public_key);
        s.set(zmq::sockopt::curve_publickey, sh->opt.credential.public_key);
        s.set(zmq::sockopt::curve_secretkey, sh->opt.credential.secret_key);
      }
      s.set(zmq::sockopt::reconnect_ivl, 100);
      s.set(zmq::sockopt::reconnect_ivl_max, 1000);
      s.set(zmq::sockopt::sndhwm, 0);
      s.set(zmq::sockopt::rcvhwm, 0);
      s.connect(via.empty() ? sh->endpoint : via);
      int fd = s.get(zmq::sockopt::fd);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = p.get();
      epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
    } catch (const zmq::error_t& e) {
      sh->error(fmt::format("cannot open a socket for {}: {} (file descriptor limit?)", node, e.what()));
      p->sock.reset();
      p->dead = true;
    }
    auto now = Clock::now();
    p->next_hb = now + std::chrono::milliseconds(rng() % 1000);
    p->next_beat = now + std::chrono::milliseconds(rng() % std::max(1, sh->opt.beat_ms));
    peers.push_back(std::move(p));
    return peers.back().get();
  }

  // A simulated agent's relay: an ipc:// ROUTER whose peers the thread's ZAP handler admits
  // by uid, like troupe-agent's (scheduler/daemons/agent.h).
  void open_relay(Peer& a) {
    auto r = std::make_unique<Peer>();
    r->kind = Kind::kRelay;
    r->index = a.index;
    r->node = fmt::format("relay:sim-{}", a.index);
    r->thread = this;
    r->agent = &a;
    try {
      r->sock = std::make_unique<zmq::socket_t>(*relay_ctx, zmq::socket_type::router);
      auto& s = *r->sock;
      // comm/control's server options: no ZMTP heartbeats of its own (its clients send them).
      s.set(zmq::sockopt::linger, 0);
      s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
      s.set(zmq::sockopt::routing_id, std::string(kSchedulerNode));
      s.set(zmq::sockopt::router_handover, true);
      s.set(zmq::sockopt::zap_domain, "troupe");
      s.set(zmq::sockopt::sndhwm, 0);
      s.set(zmq::sockopt::rcvhwm, 0);
      const std::string ep = fmt::format("ipc://{}/{}", sh->opt.relay_dir, a.index);
      s.bind(ep);
      a.relay_endpoint = ep;
      int fd = s.get(zmq::sockopt::fd);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = r.get();
      epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
    } catch (const zmq::error_t& e) {
      sh->error(fmt::format("cannot open the relay of agent {}: {}", a.index, e.what()));
      return;
    }
    a.relay = r.get();
    peers.push_back(std::move(r));
  }

  // Up: a process's frame on the relay -> a Relay message on the agent's connection
  // (decoded and encoded again, as troupe-agent's ServerEndpoint and relay_up do).
  void drain_relay(Peer& r) {
    while (r.sock && (r.sock->get(zmq::sockopt::events) & ZMQ_POLLIN)) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(*r.sock, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
      sh->b->received.fetch_add(1, std::memory_order_relaxed);
      if (frames.size() != 2) continue;
      auto env = control::decode_envelope(frames[1].data(), frames[1].size());
      if (!env.ok()) {
        sh->error("bad envelope at a relay: " + env.status().to_string());
        continue;
      }
      auto* up = std::get_if<control::UserPayload>(&env->payload);
      if (!up || up->type_id != kSchedWireTypeId) continue;  // transport heartbeats
      auto m = decode_message(up->data.data(), up->data.size());
      if (!m.ok()) {
        sh->error("bad message at a relay: " + m.status().to_string());
        continue;
      }
      const std::string from = frames[0].to_string();
      std::string session =
          env->correlation_id != 0 ? fmt::format("ask:{}@{}", env->correlation_id, from) : from + "/inbox";
      tell(*r.agent, RelayedMessage{std::move(session), encode_message(*m)});
    }
  }

  // Down: the scheduler's Relay message -> the process's session, as a reply to its ask
  // ("ask:<correlation>@<node>") or a tell ("<node>/inbox").
  void relay_down(Peer& a, const RelayedMessage& rm) {
    if (!a.relay || !a.relay->sock) {
      sh->error(fmt::format("agent {} got a relay without one", a.index));
      return;
    }
    auto inner = decode_message(rm.msg.data(), rm.msg.size());
    if (!inner.ok()) {
      sh->error("bad relayed message: " + inner.status().to_string());
      return;
    }
    control::Envelope e;
    e.sender = control::ActorAddress{kSchedulerNode, kSchedulerActor};
    std::string node;
    if (rm.session.rfind("ask:", 0) == 0) {
      const size_t at = rm.session.find('@');
      if (at == std::string::npos) {
        sh->error("bad relay session " + rm.session);
        return;
      }
      e.correlation_id = std::stoull(rm.session.substr(4, at - 4));
      e.is_reply = true;
      node = rm.session.substr(at + 1);
      e.receiver = control::ActorAddress{node, ""};
    } else {
      node = rm.session.substr(0, rm.session.find('/'));
      e.receiver = control::ActorAddress{node, "inbox"};
    }
    e.payload = control::UserPayload{kSchedWireTypeId, encode_message(*inner)};
    auto bytes = control::encode_envelope(e);
    if (!bytes.ok()) {
      sh->error("encode: " + bytes.status().to_string());
      return;
    }
    std::array<zmq::const_buffer, 2> frames = {zmq::buffer(node), zmq::buffer(*bytes)};
    zmq::send_multipart(*a.relay->sock, frames, zmq::send_flags::dontwait);  // a gone process: dropped
    sh->b->sent.fetch_add(1, std::memory_order_relaxed);
    recheck.push_back(a.relay);
  }

  void serve_zap() {
    while (zap && control::serve_zap_request_same_uid(*zap, ::getuid(), *spdlog::default_logger())) {
    }
  }

  void close(Peer& p) {
    if (!p.sock) return;
    int fd = p.sock->get(zmq::sockopt::fd);
    epoll_ctl(epfd, EPOLL_CTL_DEL, fd, nullptr);
    p.sock.reset();
    p.dead = true;
  }

  void send_env(Peer& p, control::Envelope& e) {
    if (!p.sock) return;
    auto bytes = control::encode_envelope(e);
    if (!bytes.ok()) {
      sh->error("encode: " + bytes.status().to_string());
      return;
    }
    p.sock->send(zmq::buffer(*bytes), zmq::send_flags::dontwait);
    sh->b->sent.fetch_add(1, std::memory_order_relaxed);
    drain(p);  // a send may consume the fd's edge: look for input now
  }

  void tell(Peer& p, Payload payload) {
    p.last_sent = Clock::now();
    control::Envelope e;
    e.sender = control::ActorAddress{p.node, "inbox"};
    e.receiver = control::ActorAddress{kSchedulerNode, kSchedulerActor};
    e.payload = control::UserPayload{kSchedWireTypeId, encode_message(Message{0, std::move(payload)})};
    send_env(p, e);
  }

  void ask(Peer& p, Payload payload, Ask a, std::chrono::milliseconds timeout) {
    uint64_t corr = next_corr++;
    a.sent = Clock::now();
    p.last_sent = a.sent;
    p.asks[corr] = a;
    control::Envelope e;
    e.sender = control::ActorAddress{p.node, ""};
    e.receiver = control::ActorAddress{kSchedulerNode, kSchedulerActor};
    e.correlation_id = corr;
    e.deadline_unix_nanos =
        unix_nanos() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
    e.payload = control::UserPayload{kSchedWireTypeId, encode_message(Message{corr, std::move(payload)})};
    send_env(p, e);
  }

  void store(Peer& p, StoreOp op, std::string key, std::string value, Ask::What what, int arg,
             int timeout_ms) {
    StoreRequest r{op, p.job, p.epoch, {std::move(key)}, std::move(value), timeout_ms};
    ask(p, std::move(r), Ask{what, arg, {}}, std::chrono::milliseconds(timeout_ms + 5000));
  }

  void heartbeat(Peer& p) {
    control::Envelope e;
    e.sender = control::ActorAddress{p.node, ""};
    e.receiver = control::ActorAddress{kSchedulerNode, ""};
    e.payload = control::Heartbeat{++p.hb_seq, unix_nanos()};
    send_env(p, e);
  }

  void send_register(Peer& a) {
    RegisterAgent r;
    r.agent_id = fmt::format("sim-{}", a.index);
    r.host = fmt::format("simhost-{}", a.index);
    r.slots = sh->opt.slots;
    r.gpus = 0;
    for (auto& [name, st] : a.status) r.procs.push_back(st);
    for (auto& e : a.unacked) r.procs.push_back(e);
    a.last_register = Clock::now();
    tell(a, std::move(r));
  }

  void beat(Peer& p, Clock::time_point now) {
    if (p.kind == Kind::kWorker && sh->b->track_gaps.load(std::memory_order_relaxed) &&
        p.last_beat != Clock::time_point{}) {
      fetch_max(sh->b->max_gap_us,
                std::chrono::duration_cast<std::chrono::microseconds>(now - p.last_beat).count());
    }
    if (p.kind == Kind::kAgent && p.registered && p.last_beat != Clock::time_point{}) {
      fetch_max(sh->b->max_agent_gap_us,
                std::chrono::duration_cast<std::chrono::microseconds>(now - p.last_beat).count());
    }
    p.last_beat = now;
    if (p.kind == Kind::kAgent) {
      if (p.registered) tell(p, AgentHeartbeat{fmt::format("sim-{}", p.index), p.incarnation, wall_ms()});
      return;
    }
    bool hello = !p.said_hello;
    p.said_hello = true;
    tell(p, ProcBeat{p.job, p.name, p.epoch, p.pid, hello, "", "", wall_ms()});
    if (p.kind == Kind::kWorker && sh->b->probing.load(std::memory_order_relaxed) &&
        std::uniform_real_distribution<double>(0, 1)(rng) < sh->opt.probe_fraction) {
      // Right behind the beat on the same connection: its answer cannot come before the
      // scheduler's loop has handled the beat.
      store(p, StoreOp::kContains, "rdzv/uid", "", Ask::kProbe, 0, 1000);
    }
  }

  // -- agent side of spawn/kill --
  // A spawn request is counted when it is read; the process starts after the thread has
  // read what is waiting on its other sockets (a real agent's fork does not hold up the
  // other agents' reads, as one thread simulating hundreds of agents otherwise would).
  void on_spawn(Peer& a, const SpawnRequest& req) {
    sh->b->spawns.fetch_add(1);
    fetch_max(sh->b->last_spawn_ns, steady_ns(Clock::now()));
    starts.emplace_back(&a, req);
  }

  void start_proc(Peer& a, const SpawnRequest& req) {
    int pid = 100000 + static_cast<int>(rng() % 4000000);
    ProcStatus st{req.job_id, req.name, req.epoch, pid, true, 0, 0, "", wall_ms()};
    a.status[req.name] = st;
    tell(a, ProcStarted{st});
    std::map<std::string, std::string> env(req.env.begin(), req.env.end());
    Kind kind = req.name == "driver" ? Kind::kDriver : Kind::kWorker;
    int rank = kind == Kind::kDriver ? -1 : std::atoi(env["TROUPE_RANK"].c_str());
    Peer* w = open(kind, rank, fmt::format("proc:{}:{}:{}:{}", req.job_id, req.name, req.epoch, pid),
                   a.relay ? a.relay_endpoint : "");
    w->job = req.job_id;
    w->name = req.name;
    w->epoch = req.epoch;
    w->world = std::atoi(env["TROUPE_WORLD_SIZE"].c_str());
    w->pid = pid;
    w->agent = &a;
    a.procs[req.name] = w;
    beat(*w, Clock::now());  // hello at start, like SchedulerSession
    w->next_beat = Clock::now() + std::chrono::milliseconds(sh->opt.beat_ms);
    if (kind == Kind::kWorker) {
      store(*w, StoreOp::kSet, fmt::format("rdzv/addr/{}", rank),
            fmt::format("10.{}.{}.{}:29500", rank >> 16, (rank >> 8) & 255, rank & 255), Ask::kSetAddr, 0,
            10000);
      if (rank == 0) store(*w, StoreOp::kSet, "rdzv/uid", std::string(128, 'u'), Ask::kSetUid, 0, 10000);
      const int n = w->world;
      store(*w, StoreOp::kGet, "rdzv/uid", "", Ask::kGetUid, 0, 60000);
      store(*w, StoreOp::kGet, fmt::format("rdzv/addr/{}", (rank + 1) % n), "", Ask::kGetNext, 0, 60000);
      store(*w, StoreOp::kGet, fmt::format("rdzv/addr/{}", (rank + n - 1) % n), "", Ask::kGetPrev, 0, 60000);
    } else {
      for (int s = 0; s < w->world; ++s) watch_exit(*w, s);
    }
  }

  void watch_exit(Peer& d, int slot) {
    store(d, StoreOp::kGet, fmt::format("{}/elastic/exit/{}", d.job, slot), "", Ask::kExitWatch, slot,
          600000);
  }

  // The agent's view of a process ending: the session goes, procExited goes out.
  void end_proc(Peer& a, const std::string& name, int signal) {
    auto it = a.procs.find(name);
    if (it == a.procs.end()) return;
    Peer* w = it->second;
    close(*w);
    a.procs.erase(it);
    ProcStatus st = a.status[name];
    a.status.erase(name);
    st.running = false;
    st.term_signal = signal;
    st.time_ms = wall_ms();
    a.unacked.push_back(st);
    tell(a, ProcExited{st});
  }

  void on_kill(Peer& a, const KillRequest& k) {
    std::vector<std::string> names;
    for (auto& [name, w] : a.procs) {
      if (w->job == k.job_id && (k.name.empty() || k.name == name)) names.push_back(name);
    }
    for (auto& n : names) end_proc(a, n, k.signal);
  }

  // -- replies --
  void on_reply(Peer& p, uint64_t corr, const Reply& r) {
    auto it = p.asks.find(corr);
    if (it == p.asks.end()) return;
    Ask a = it->second;
    p.asks.erase(it);
    auto now = Clock::now();
    if (p.kind == Kind::kClient) {
      std::lock_guard<std::mutex> lk(sh->mu);
      if (a.arg == sh->client_seq) sh->client_reply = r;
      return;
    }
    if (a.what == Ask::kExitWatch) {
      if (r.code == StatusCode::kOk) {
        if (a.arg >= 0 && a.arg < sh->opt.workers) sh->exits_seen[a.arg].fetch_add(1);
        fetch_max(sh->b->last_exit_seen_ns, steady_ns(now));
      } else if (r.code == StatusCode::kDeadlineExceeded && !p.dead) {
        watch_exit(p, a.arg);
      }
      return;
    }
    if (a.what == Ask::kProbe) {
      const int64_t i = sh->b->nprobes.fetch_add(1);
      if (i < Board::kMaxProbes) sh->b->probe_ms[i] = static_cast<float>(ms(now - a.sent));
      if (std::getenv("SCALE_SIM_DEBUG") && ms(now - a.sent) > 200) {
        fmt::print(stderr, "slow probe: thread {} peer {} sent at {:.3f} rtt {:.1f} ms\n", id, p.index,
                   secs(a.sent.time_since_epoch()), ms(now - a.sent));
      }
      return;
    }
    if (r.code != StatusCode::kOk) {
      sh->b->store_errors.fetch_add(1);
      sh->error(fmt::format("{} store ask {}: {}", p.name, static_cast<int>(a.what), r.message));
      return;
    }
    if (a.what == Ask::kProgress) {
      sh->b->progress_acks.fetch_add(1, std::memory_order_relaxed);
    } else if (a.what == Ask::kGetUid || a.what == Ask::kGetNext || a.what == Ask::kGetPrev) {
      if (--p.gets_left == 0) {
        sh->b->rendezvoused.fetch_add(1);
        fetch_max(sh->b->last_rendezvous_ns, steady_ns(now));
      }
    }
  }

  void on_message(Peer& p, const Message& m) {
    if (p.kind != Kind::kAgent) {
      sh->error(fmt::format("{} got an unexpected {}", p.node, payload_name(m.payload)));
      return;
    }
    if (auto* ack = std::get_if<RegisterAck>(&m.payload)) {
      bool first = !p.registered && p.incarnation == 0;
      p.registered = true;
      p.incarnation = ack->incarnation;
      if (first) sh->b->registered.fetch_add(1);
      sh->agent_inc[p.index].store(ack->incarnation);
    } else if (std::holds_alternative<Reregister>(m.payload)) {
      p.registered = false;
      send_register(p);
    } else if (auto* sp = std::get_if<SpawnRequest>(&m.payload)) {
      on_spawn(p, *sp);
    } else if (auto* k = std::get_if<KillRequest>(&m.payload)) {
      on_kill(p, *k);
    } else if (auto* rm = std::get_if<RelayedMessage>(&m.payload)) {
      relay_down(p, *rm);
    } else if (auto* ea = std::get_if<ExitAck>(&m.payload)) {
      auto before = p.unacked.size();
      std::erase_if(p.unacked, [&](const ProcStatus& s) {
        return s.job_id == ea->job_id && s.name == ea->name && s.epoch == ea->epoch && s.pid == ea->pid;
      });
      if (p.unacked.size() != before) sh->b->exit_acks.fetch_add(1);
    } else {
      sh->error(fmt::format("agent {} got an unexpected {}", p.index, payload_name(m.payload)));
    }
  }

  void drain(Peer& p) {
    if (p.kind == Kind::kRelay) {
      drain_relay(p);
      return;
    }
    while (p.sock && (p.sock->get(zmq::sockopt::events) & ZMQ_POLLIN)) {
      zmq::message_t msg;
      if (!p.sock->recv(msg, zmq::recv_flags::dontwait)) break;
      sh->b->received.fetch_add(1, std::memory_order_relaxed);
      auto env = control::decode_envelope(msg.data(), msg.size());
      if (!env.ok()) {
        sh->error("bad envelope: " + env.status().to_string());
        continue;
      }
      if (std::holds_alternative<control::Heartbeat>(env->payload)) continue;
      if (auto* er = std::get_if<control::ErrorReply>(&env->payload)) {
        if (env->is_reply)
          on_reply(p, env->correlation_id, Reply{static_cast<StatusCode>(er->code), er->message, {}, {}, 0});
        continue;
      }
      auto* up = std::get_if<control::UserPayload>(&env->payload);
      if (!up || up->type_id != kSchedWireTypeId) continue;
      auto m = decode_message(up->data.data(), up->data.size());
      if (!m.ok()) {
        sh->error("bad message: " + m.status().to_string());
        continue;
      }
      if (env->is_reply) {
        if (auto* r = std::get_if<Reply>(&m->payload)) on_reply(p, env->correlation_id, *r);
        continue;
      }
      on_message(p, *m);
    }
  }

  void timers(Clock::time_point now) {
    const bool stepping = sh->b->stepping.load(std::memory_order_relaxed);
    if (const int g = sh->b->fail_gen.load(); g != fail_gen) {
      fail_gen = g;
      inject_failures();
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      Peer& p = *peers[i];
      if (!p.sock || p.kind == Kind::kRelay) continue;
      if (now >= p.next_hb) {  // comm/control's heartbeat: 1 Hz, only after a second of silence
        if (now - p.last_sent >= 1000ms) heartbeat(p);
        p.next_hb = now + 1000ms;
      }
      if (p.kind == Kind::kClient) continue;
      if (now >= p.next_beat) {
        beat(p, now);
        p.next_beat += std::chrono::milliseconds(sh->opt.beat_ms);
        if (p.next_beat < now) p.next_beat = now + std::chrono::milliseconds(sh->opt.beat_ms);
        if (stepping && p.kind == Kind::kWorker && p.gets_left == 0) {
          // One training step per beat period: its progress goes to the job's store.
          store(p, StoreOp::kSet, fmt::format("progress/{}", p.index),
                fmt::format("{{\"step\":{}}}", p.hb_seq), Ask::kProgress, 0, 10000);
        }
      }
      if (p.kind == Kind::kAgent && !p.registered && now - p.last_register > 1000ms) send_register(p);
    }
  }

  // The failure phase: the victims' sessions go silent and their agents report them
  // killed by signal 9, as troupe-agent does when a worker dies.
  void inject_failures() {
    std::set<int> v(sh->victims.begin(), sh->victims.end());
    for (size_t i = 0; i < peers.size(); ++i) {
      Peer& a = *peers[i];
      if (a.kind != Kind::kAgent) continue;
      std::vector<std::string> names;
      for (auto& [name, w] : a.procs) {
        if (w->kind == Kind::kWorker && v.count(w->index)) names.push_back(name);
      }
      for (auto& n : names) end_proc(a, n, SIGKILL);
    }
  }

  void run() {
    epoll_event evs[256];
    auto next_timers = Clock::now();
    auto next_sweep = Clock::now();
    const bool debug = std::getenv("SCALE_SIM_DEBUG") != nullptr;
    while (!stop.load()) {
      auto now = Clock::now();
      const auto turn_start = now;
      int wait =
          starts.empty()
              ? static_cast<int>(std::clamp<int64_t>(
                    std::chrono::duration_cast<std::chrono::milliseconds>(next_timers - now).count(), 0, 10))
              : 0;
      int n = epoll_wait(epfd, evs, 256, wait);
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.ptr == &zap_tag) {
          serve_zap();
          continue;
        }
        if (evs[i].data.ptr == nullptr) {
          uint64_t v;
          ssize_t r = ::read(cmd_fd, &v, sizeof(v));
          (void)r;
          std::vector<std::function<void()>> c;
          {
            std::lock_guard<std::mutex> lk(cmd_mu);
            c.swap(cmds);
          }
          for (auto& f : c) f();
          continue;
        }
        drain(*static_cast<Peer*>(evs[i].data.ptr));
      }
      while (!recheck.empty()) {
        std::vector<Peer*> r;
        r.swap(recheck);
        for (Peer* p : r) drain(*p);
      }
      // At most kStartsPerTurn process starts per turn: this thread also beats for its
      // agents, and a real agent's beats do not wait for the other hosts' thousands of
      // process starts (each a socket, a connection and, with CURVE, a handshake).
      if (!starts.empty()) {
        const size_t k = std::min(starts.size(), kStartsPerTurn);
        std::vector<std::pair<Peer*, SpawnRequest>> batch(std::make_move_iterator(starts.begin()),
                                                          std::make_move_iterator(starts.begin() + k));
        starts.erase(starts.begin(), starts.begin() + k);
        for (auto& [agent, req] : batch) start_proc(*agent, req);
      }
      now = Clock::now();
      if (now >= next_timers) {
        timers(now);
        next_timers = now + 10ms;
      }
      if (now >= next_sweep) {  // a safety net for a missed edge of ZMQ_FD
        serve_zap();
        for (size_t i = 0; i < peers.size(); ++i) drain(*peers[i]);  // drain may open peers
        next_sweep = now + 250ms;
      }
      if (debug && Clock::now() - turn_start > 300ms) {
        fmt::print(stderr, "sim thread {}: a turn took {:.0f} ms ({} events, {} peers)\n", id,
                   ms(Clock::now() - turn_start), n, peers.size());
      }
    }
  }

  void start(Shared* s, int i) {
    sh = s;
    id = i;
    rng.seed(0x5ca1e + static_cast<uint64_t>(i));
    ctx = std::make_unique<zmq::context_t>(1);
    zmq_ctx_set(ctx->handle(), ZMQ_MAX_SOCKETS, 65536);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    cmd_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;
    epoll_ctl(epfd, EPOLL_CTL_ADD, cmd_fd, &ev);
    if (!s->opt.direct) {
      relay_ctx = std::make_unique<zmq::context_t>(1);
      zmq_ctx_set(relay_ctx->handle(), ZMQ_MAX_SOCKETS, 65536);
      zap = std::make_unique<zmq::socket_t>(*relay_ctx, zmq::socket_type::rep);
      zap->set(zmq::sockopt::linger, 0);
      zap->bind("inproc://zeromq.zap.01");
      epoll_event zev{};
      zev.events = EPOLLIN;
      zev.data.ptr = &zap_tag;
      epoll_ctl(epfd, EPOLL_CTL_ADD, zap->get(zmq::sockopt::fd), &zev);
    }
    th = std::thread([this] { run(); });
  }

  void join() {
    stop.store(true);
    post([] {});
    if (th.joinable()) th.join();
    for (auto& p : peers) p->sock.reset();
    zap.reset();
    ::close(epfd);
    relay_ctx.reset();
    ::close(cmd_fd);
  }

  // Runs `f` on this thread and waits for it.
  template <typename F>
  auto call(F f) -> decltype(f()) {
    std::promise<decltype(f())> pr;
    auto fut = pr.get_future();
    post([&] {
      if constexpr (std::is_void_v<decltype(f())>) {
        f();
        pr.set_value();
      } else {
        pr.set_value(f());
      }
    });
    return fut.get();
  }
};

// ------------------------------------------------------------------ scheduler process

struct ProcStats {
  double cpu_s = 0;  // utime + stime
  double rss_mib = 0;
};

ProcStats proc_stats(pid_t pid) {
  ProcStats out;
  std::ifstream st(fmt::format("/proc/{}/stat", pid));
  std::string line;
  std::getline(st, line);
  auto rp = line.rfind(')');
  if (rp != std::string::npos) {
    std::istringstream is(line.substr(rp + 2));
    std::vector<std::string> f;
    std::string x;
    while (is >> x) f.push_back(x);
    // fields after the name start at field 3 (state): utime is field 14, stime 15
    if (f.size() > 13)
      out.cpu_s = (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  std::ifstream ss(fmt::format("/proc/{}/status", pid));
  while (std::getline(ss, line)) {
    if (line.rfind("VmRSS:", 0) == 0) out.rss_mib = std::stod(line.substr(6)) / 1024.0;
  }
  return out;
}

pid_t start_scheduler(const Options& o, const std::string& listen, const std::string& endpoint_file) {
  std::filesystem::remove(endpoint_file);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the simulator
    std::string log = o.state_dir + "/scheduler.log";
    FILE* f = std::fopen(log.c_str(), "a");
    if (f) {
      dup2(fileno(f), 1);
      dup2(fileno(f), 2);
    }
    std::vector<std::string> args = {o.scheduler_bin,
                                     "--listen",
                                     listen,
                                     "--state-dir",
                                     o.state_dir,
                                     "--endpoint-file",
                                     endpoint_file,
                                     "--agent-heartbeat-ms",
                                     std::to_string(o.beat_ms)};
    if (o.insecure) args.push_back("--insecure");
    if (o.io_threads > 0) {
      args.push_back("--io-threads");
      args.push_back(std::to_string(o.io_threads));
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

std::string wait_endpoint(pid_t pid, const std::string& file, std::chrono::seconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    std::ifstream f(file);
    std::string ep;
    if (f >> ep && !ep.empty()) return ep;
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return "";
    std::this_thread::sleep_for(5ms);
  }
  return "";
}

bool wait_for(const std::function<bool()>& pred, std::chrono::seconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

// scheduler.beat_latency of a status reply: cumulative counts per bucket.
struct Hist {
  std::vector<double> bounds_us;
  std::vector<uint64_t> counts;
  uint64_t max_us = 0;
};

Hist hist_of(const std::optional<Reply>& r) {
  Hist h;
  if (!r || r->code != StatusCode::kOk) return h;
  auto doc = json::parse(r->body, nullptr, false);
  if (!doc.is_object() || !doc["scheduler"].contains("beat_latency")) return h;
  auto& b = doc["scheduler"]["beat_latency"];
  h.bounds_us = b["bounds_us"].get<std::vector<double>>();
  h.counts = b["counts"].get<std::vector<uint64_t>>();
  h.max_us = b["max_us"].get<uint64_t>();
  return h;
}

// The q-quantile of the heartbeats counted between two snapshots, as the upper bound of
// its bucket (so never understated); infinity when it lies above every bound.
double hist_quantile_ms(const Hist& a, const Hist& b, double q, uint64_t* n) {
  std::vector<uint64_t> d(b.counts.size(), 0);
  uint64_t total = 0;
  for (size_t i = 0; i < b.counts.size(); ++i) {
    const uint64_t before = i < a.counts.size() ? a.counts[i] : 0;
    if (b.counts[i] < before || a.counts.size() != b.counts.size()) {  // not two snapshots of one histogram
      *n = 0;
      return std::numeric_limits<double>::quiet_NaN();
    }
    d[i] = b.counts[i] - before;
    total += d[i];
  }
  *n = total;
  if (std::getenv("SCALE_SIM_DEBUG")) {
    for (size_t i = 0; i < d.size(); ++i) {
      if (d[i])
        fmt::print(stderr, "latency bucket {} (<= {} us): {}\n", i,
                   i < b.bounds_us.size() ? b.bounds_us[i] : -1.0, d[i]);
    }
  }
  if (total == 0) return 0;
  uint64_t acc = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    acc += d[i];
    if (static_cast<double>(acc) >= q * static_cast<double>(total)) {
      return i < b.bounds_us.size() ? b.bounds_us[i] / 1000.0 : std::numeric_limits<double>::infinity();
    }
  }
  return std::numeric_limits<double>::infinity();
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

struct Row {
  std::string what, value, target;
  int pass = -1;  // -1: no target
};

// A simulator process ("shard"): its threads own the agents a with a % shards == shard
// and the sessions those agents start. Runs until the board says stop.
[[noreturn]] void run_shard(Shared& sh, int shard, int shards, int threads) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The simulated cluster stands for 1,250 other hosts: on this one it must not take the
  // CPU the scheduler would have on its own host, so it runs at a lower priority.
  const int nice = sh.opt.nice >= 0 ? sh.opt.nice : (!sh.opt.insecure && sh.opt.direct ? 0 : 10);
  if (nice > 0 && setpriority(PRIO_PROCESS, 0, nice) != 0) sh.error("setpriority failed");
  std::vector<std::unique_ptr<SimThread>> ts;
  for (int i = 0; i < threads; ++i) {
    ts.push_back(std::make_unique<SimThread>());
    ts.back()->start(&sh, shard * threads + i);
  }
  for (int t = 0; t < threads; ++t) {
    SimThread* tp = ts[static_cast<size_t>(t)].get();
    tp->post([tp, &sh, shard, shards, threads, t] {
      for (int a = shard; a < sh.opt.agents; a += shards) {
        if ((a / shards) % threads != t) continue;
        Peer* p = tp->open(Kind::kAgent, a, fmt::format("agent:sim-{}", a));
        if (!sh.opt.direct) tp->open_relay(*p);
        tp->send_register(*p);
      }
    });
  }
  sh.b->started_shards.fetch_add(1);
  while (!sh.b->stop.load()) std::this_thread::sleep_for(20ms);
  for (auto& t : ts) t->join();
  _exit(0);
}

int run(Options o) {
  if (o.agents <= 0) o.agents = (o.workers + o.slots - 1) / o.slots;
  if (o.failures < 0) o.failures = std::max(1, o.workers / 100);
  if (static_cast<int64_t>(o.agents) * o.slots < o.workers) {
    fmt::print(stderr, "scale_sim: {} agents x {} slots cannot hold {} workers\n", o.agents, o.slots,
               o.workers);
    return 2;
  }
  if (o.failures < 1 || o.failures >= o.workers) {
    fmt::print(stderr, "scale_sim: --failures must be in 1..{}\n", o.workers - 1);
    return 2;
  }
  // 10k+ sockets: each DEALER holds a TCP connection and a mailbox eventfd. Take what the
  // hard limit allows and spread the sockets over enough processes to stay under it.
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  // Direct: a DEALER per agent and process (a TCP connection + a mailbox eventfd each).
  // Relay: per agent also a ROUTER (mailbox + listening socket), per process an ipc
  // connection with both ends in the simulator (3 fds with its mailbox).
  const int64_t fds = o.direct ? 2 * (o.workers + o.agents + 1) : 3 * (o.workers + 1) + 4 * o.agents;
  const int64_t per_process = std::max<int64_t>(512, (static_cast<int64_t>(rl.rlim_cur) - 512) * 8 / 10);
  const int shards = std::max(o.processes, static_cast<int>((fds + per_process - 1) / per_process));
  const int threads_per_shard = std::max(1, (o.threads + shards - 1) / shards);
  bool own_dir = false;
  if (o.state_dir.empty()) {
    char tmpl[] = "/tmp/troupe-scale-XXXXXX";
    if (!mkdtemp(tmpl)) return 2;
    o.state_dir = tmpl;
    own_dir = true;
  }
  std::filesystem::create_directories(o.state_dir);
  const std::string epfile = o.state_dir + "/endpoint";
  if (!o.direct) {
    char rt[] = "/tmp/troupe-sim-relay-XXXXXX";  // short: an ipc path has at most 107 bytes
    if (!mkdtemp(rt)) return 2;
    o.relay_dir = rt;
  }
  if (!o.insecure) {
    // A credential of this run only (the scheduler child inherits the directory).
    setenv("TROUPE_CONFIG_DIR", (o.state_dir + "/config").c_str(), 1);
    Result<control::CurveKeyPair> cred = load_or_create_credential();
    if (!cred.ok()) {
      fmt::print(stderr, "scale_sim: {}\n", cred.status().to_string());
      return 2;
    }
    o.credential = *cred;
  }

  Shared sh;
  sh.opt = o;
  sh.b = shared_array<Board>(1);
  sh.agent_inc = shared_array<std::atomic<uint64_t>>(static_cast<size_t>(o.agents));
  sh.exits_seen = shared_array<std::atomic<int>>(static_cast<size_t>(o.workers));
  if (!sh.b || !sh.agent_inc || !sh.exits_seen) {
    fmt::print(stderr, "scale_sim: mmap failed\n");
    return 2;
  }
  for (int i = 0; i < o.failures; ++i) {
    sh.victims.push_back(
        static_cast<int>((static_cast<int64_t>(i) * o.workers) / o.failures + (o.workers / o.failures) / 2));
  }
  Board& b = *sh.b;
  std::vector<Row> rows;
  const std::string load_start = loadavg();
  auto fail = [&](const std::string& what) { sh.error(what); };

  pid_t spid = start_scheduler(o, "tcp://127.0.0.1:0", epfile);
  sh.endpoint = wait_endpoint(spid, epfile, 20s);
  if (sh.endpoint.empty()) {
    fmt::print(stderr, "scale_sim: the scheduler did not start (see {}/scheduler.log)\n", o.state_dir);
    return 1;
  }
  fmt::print(
      "scale_sim: scheduler pid {} at {}; {} agents x {} slots, {} workers; {} simulator process(es) x {} "
      "thread(s) (fd limit {}); state {}; {}\n",
      spid, sh.endpoint, o.agents, o.slots, o.workers, shards, threads_per_shard, rl.rlim_cur, o.state_dir,
      o.direct ? "process sessions direct" : "process sessions relayed by their agents");
  std::fflush(stdout);
  std::fflush(stderr);

  // ---- agents register (the shards start them)
  auto t0 = Clock::now();
  std::vector<pid_t> shard_pids;
  for (int s = 0; s < shards; ++s) {
    pid_t c = fork();
    if (c == 0) run_shard(sh, s, shards, threads_per_shard);
    shard_pids.push_back(c);
  }
  const auto timeout = std::chrono::seconds(o.phase_timeout_s);
  SimThread client_thread;  // the parent's one peer: the client (submit, status, cancel)
  client_thread.start(&sh, 1000);
  auto cleanup = [&] {
    b.stop = true;
    for (pid_t c : shard_pids) waitpid(c, nullptr, 0);
    client_thread.join();
  };
  if (!wait_for([&] { return b.registered.load() == o.agents; }, timeout)) fail("not every agent registered");
  const double t_register = secs(Clock::now() - t0);
  fmt::print("scale_sim: {} agents registered in {:.2f} s\n", b.registered.load(), t_register);
  std::fflush(stdout);

  // ---- submit
  auto& th0 = client_thread;
  Peer* client =
      th0.call([&] { return th0.open(Kind::kClient, 0, fmt::format("cli:scale-sim:{}", getpid())); });
  auto client_ask = [&](Payload pl, std::chrono::seconds to) -> std::optional<Reply> {
    int seq;
    {
      std::lock_guard<std::mutex> lk(sh.mu);
      sh.client_reply.reset();
      seq = ++sh.client_seq;
    }
    th0.call([&] {
      th0.ask(*client, pl, Ask{Ask::kStatus, seq, {}},
              std::chrono::duration_cast<std::chrono::milliseconds>(to));
    });
    std::optional<Reply> r;
    wait_for(
        [&] {
          std::lock_guard<std::mutex> lk(sh.mu);
          r = sh.client_reply;
          return r.has_value();
        },
        to);
    return r;
  };
  json spec = {
      {"name", "scale-sim"},
      {"argv", {"scale-sim-worker"}},
      {"nproc", o.workers},
      {"layout", o.workers % o.slots == 0 ? fmt::format("dp={},n={}", o.workers / o.slots, o.slots) : ""},
      {"driver", true},
      {"elastic", true},
      {"heartbeat_timeout_ms", 6 * o.beat_ms}};
  // CPU seconds of the scheduler and of the simulator (its shards and this process) from
  // submit to the last rank's rendezvous: who the rendezvous waited on.
  auto sim_cpu = [&] {
    double s = proc_stats(getpid()).cpu_s;
    for (pid_t c : shard_pids) s += proc_stats(c).cpu_s;
    return s;
  };
  const double sched_cpu_submit = proc_stats(spid).cpu_s, sim_cpu_submit = sim_cpu();
  const auto t_submit = Clock::now();
  auto sub = client_ask(SubmitJob{spec.dump()}, 60s);
  const auto t_submit_reply = Clock::now();
  if (!sub || sub->code != StatusCode::kOk) {
    fmt::print(stderr, "scale_sim: submit failed: {}\n", sub ? sub->message : "no reply");
    kill(spid, SIGKILL);
    waitpid(spid, nullptr, 0);
    cleanup();
    return 1;
  }
  const std::string job_id = json::parse(sub->body)["job_id"].get<std::string>();
  if (!wait_for([&] { return b.spawns.load() >= o.workers + 1; }, timeout))
    fail("not every process was spawned");
  const double t_place = secs(from_steady_ns(b.last_spawn_ns.load()) - t_submit);
  if (!wait_for([&] { return b.rendezvoused.load() == o.workers; }, timeout)) {
    fail(fmt::format("only {} of {} ranks rendezvoused", b.rendezvoused.load(), o.workers));
  }
  const double t_rdzv = secs(from_steady_ns(b.last_rendezvous_ns.load()) - t_submit);
  const double sched_cpu_rdzv = proc_stats(spid).cpu_s - sched_cpu_submit,
               sim_cpu_rdzv = sim_cpu() - sim_cpu_submit;
  fmt::print(
      "scale_sim: job {}: submit answered in {:.3f} s, last spawn at {:.3f} s, {} ranks rendezvoused at "
      "{:.3f} s\n",
      job_id, secs(t_submit_reply - t_submit), t_place, b.rendezvoused.load(), t_rdzv);
  std::fflush(stdout);

  // ---- steady state: steps, beats, probes
  b.stepping = true;
  b.probing = true;
  std::this_thread::sleep_for(1500ms);  // everyone's hello is in; per-step reports flowing
  // Snapshots of the scheduler's heartbeat latency histogram come from a status query for
  // no job ("-"): a full status of 10,000 processes would itself delay the beats behind it.
  const Hist h0 = hist_of(client_ask(StatusQuery{"-"}, 60s));
  auto cpu0 = proc_stats(spid);
  auto ts0 = Clock::now();
  int64_t msgs0 = b.sent.load() + b.received.load();
  int prog0 = b.progress_acks.load();
  std::this_thread::sleep_for(std::chrono::seconds(o.steady_s));
  auto cpu1 = proc_stats(spid);
  const double window = secs(Clock::now() - ts0);
  const double msg_rate = static_cast<double>(b.sent.load() + b.received.load() - msgs0) / window;
  const double prog_rate = (b.progress_acks.load() - prog0) / window;
  const double cpu_frac = (cpu1.cpu_s - cpu0.cpu_s) / window;
  fmt::print(
      "scale_sim: steady state {:.1f} s: {:.0f} messages/s through the simulator, {:.0f} progress reports/s, "
      "scheduler CPU {:.1f}% of a core, RSS {:.1f} MiB\n",
      window, msg_rate, prog_rate, 100 * cpu_frac, cpu1.rss_mib);
  std::fflush(stdout);

  // ---- 1% failure
  b.stepping = false;
  b.max_gap_us = 0;
  b.track_gaps = true;
  const auto t_fail = Clock::now();
  b.fail_gen.fetch_add(1);
  auto seen_count = [&] {
    int n = 0;
    for (int i = 0; i < o.workers; ++i) n += sh.exits_seen[i].load() > 0;
    return n;
  };
  if (!wait_for([&] { return seen_count() >= o.failures; }, timeout)) {
    fail(fmt::format("the driver saw {} of {} injected failures", seen_count(), o.failures));
  }
  const double t_failure = secs(from_steady_ns(b.last_exit_seen_ns.load()) - t_fail);
  std::this_thread::sleep_for(std::chrono::milliseconds(2 * o.beat_ms + 500));  // healthy ones keep beating
  b.track_gaps = false;
  const double max_gap = static_cast<double>(b.max_gap_us.load()) / 1000.0;
  // What the scheduler believes now: exactly the victims gone, every other worker running.
  int running = -1, gone = -1, bad_gone = 0;
  const Hist h1 = hist_of(client_ask(StatusQuery{"-"}, 60s));
  auto st = client_ask(StatusQuery{job_id}, 60s);
  std::set<int> vset(sh.victims.begin(), sh.victims.end());
  if (st && st->code == StatusCode::kOk) {
    auto j = json::parse(st->body)["jobs"][0];
    running = 0;
    gone = 0;
    for (auto& p : j["procs"]) {
      if (p["role"] != "worker") continue;
      if (p["state"] == "running") {
        ++running;
      } else {
        ++gone;
        const std::string name = p["name"];
        if (!vset.count(std::atoi(name.c_str() + 7))) ++bad_gone;
      }
    }
  } else {
    fail("status after the failure: no answer");
  }
  int dup_seen = 0, wrong_seen = 0;
  for (int i = 0; i < o.workers; ++i) {
    const int n = sh.exits_seen[i].load();
    if (n > 1) ++dup_seen;
    if (n > 0 && !vset.count(i)) ++wrong_seen;
  }
  if (running != o.workers - o.failures || gone != o.failures || bad_gone != 0 || dup_seen || wrong_seen) {
    fail(fmt::format(
        "after the failure: {} running, {} gone ({} not injected), {} seen twice, {} seen but not injected",
        running, gone, bad_gone, dup_seen, wrong_seen));
  }
  wait_for([&] { return b.exit_acks.load() >= o.failures; }, 10s);
  if (b.exit_acks.load() != o.failures)
    fail(fmt::format("{} exit acks for {} exits", b.exit_acks.load(), o.failures));
  fmt::print(
      "scale_sim: {} workers died at once; the driver saw the last at {:.3f} s; scheduler: {} running, {} "
      "gone; "
      "longest beat gap of a healthy worker {:.0f} ms\n",
      o.failures, t_failure, running, gone, max_gap);
  std::fflush(stdout);

  // ---- kill -9 and restart
  b.probing = false;                // latency figures cover steady state and the failure, not the restart
  std::this_thread::sleep_for(1s);  // probes in flight come back
  auto stats_before = proc_stats(spid);
  const auto t_kill = Clock::now();
  kill(spid, SIGKILL);
  waitpid(spid, nullptr, 0);
  const auto t_restart = Clock::now();
  spid = start_scheduler(o, sh.endpoint, epfile);
  if (wait_endpoint(spid, epfile, 30s).empty()) fail("the scheduler did not restart");
  bool recovered = false;
  std::string recover_detail;
  auto rdeadline = Clock::now() + timeout;
  while (Clock::now() < rdeadline) {
    auto r = client_ask(StatusQuery{job_id}, 10s);
    if (!r || r->code != StatusCode::kOk) continue;
    auto doc = json::parse(r->body);
    const uint64_t inc = std::stoull(doc["scheduler"]["incarnation"].get<std::string>(), nullptr, 16);
    int back = 0;
    for (int a = 0; a < o.agents; ++a) back += sh.agent_inc[a].load() == inc;
    int alive = 0;
    for (auto& a : doc["agents"]) alive += a["alive"].get<bool>();
    auto& j = doc["jobs"][0];
    const int procs = static_cast<int>(j["procs"].size());
    const int run_w = j["running_workers"].get<int>();
    recover_detail = fmt::format("{} of {} agents back, {} process records, {} running workers, job {}", back,
                                 o.agents, procs, run_w, j["state"].get<std::string>());
    if (alive == o.agents && back == o.agents && procs == o.workers + 1 && run_w == o.workers - o.failures &&
        j["state"] == "running") {
      recovered = true;
      break;
    }
    std::this_thread::sleep_for(100ms);
  }
  const auto t_recovered = Clock::now();
  if (!recovered) fail("restart: not recovered: " + recover_detail);
  fmt::print("scale_sim: kill -9 + restart: {} in {:.3f} s ({:.3f} s after the new process started)\n",
             recover_detail, secs(t_recovered - t_kill), secs(t_recovered - t_restart));
  std::fflush(stdout);

  // ---- cancel and stop
  auto c = client_ask(CancelJob{job_id}, 60s);
  if (!c || c->code != StatusCode::kOk) fail("cancel failed");
  kill(spid, SIGTERM);
  waitpid(spid, nullptr, 0);
  cleanup();

  // ---- report
  std::vector<double> probes;
  for (int64_t i = 0; i < std::min(b.nprobes.load(), Board::kMaxProbes); ++i) probes.push_back(b.probe_ms[i]);
  auto target = [&](const std::string& what, double v, const char* fmtv, double limit,
                    const std::string& tgt) {
    rows.push_back(Row{what, fmt::format(fmt::runtime(fmtv), v), tgt, v < limit ? 1 : 0});
  };
  const double p50 = percentile(probes, 0.5), p99 = percentile(probes, 0.99);
  uint64_t nbeats = 0;
  const double h50 = hist_quantile_ms(h0, h1, 0.5, &nbeats), h99 = hist_quantile_ms(h0, h1, 0.99, &nbeats);
  target("rendezvous: submit -> every rank holds uid + ring peers", t_rdzv, "{:.3f} s", 5.0, "< 5 s");
  rows.push_back(Row{"CPU from submit to rendezvous: scheduler / simulator",
                     fmt::format("{:.1f} / {:.1f} s", sched_cpu_rdzv, sim_cpu_rdzv), "", -1});
  target("placement: submit -> last spawn request at its agent", t_place, "{:.3f} s", 1.0, "< 1 s");
  {
    // The scheduler's own part, from the job's events.jsonl: submitted -> placed (every
    // rank assigned a slot, just before the spawn requests go out).
    int64_t submitted = -1, placed = -1;
    std::ifstream ev(o.state_dir + "/jobs/" + job_id + "/events.jsonl");
    std::string line;
    while (std::getline(ev, line) && (submitted < 0 || placed < 0)) {
      auto e = json::parse(line, nullptr, false);
      if (!e.is_object()) continue;
      if (e["type"] == "submitted" && submitted < 0) submitted = e["ts_ms"].get<int64_t>();
      if (e["type"] == "placed" && placed < 0) placed = e["ts_ms"].get<int64_t>();
    }
    if (submitted >= 0 && placed >= 0) {
      rows.push_back(Row{"placement decision (events.jsonl: submitted -> placed)",
                         fmt::format("{} ms", placed - submitted), "", -1});
    }
  }
  target(fmt::format("heartbeat handling p50 (scheduler inbox -> handled, {} beats)", nbeats), h50,
         "<= {:.2f} ms", 10, "< 10 ms");
  target("heartbeat handling p99 (steady state + failure)", h99, "<= {:.2f} ms", 10, "< 10 ms");
  rows.push_back(
      Row{fmt::format("probe round trip p50 / p99 / max ({} probes, incl. the simulator)", probes.size()),
          fmt::format("{:.1f} / {:.1f} / {:.0f} ms", p50, p99, percentile(probes, 1.0)), "", -1});
  target(fmt::format("{} workers die at once -> driver saw every exit", o.failures), t_failure, "{:.3f} s",
         2.0, "< 2 s");
  rows.push_back(
      Row{"healthy workers lost during the failure", std::to_string(bad_gone), "0", bad_gone == 0 ? 1 : 0});
  target("longest beat gap of a healthy worker (simulator side)", max_gap, "{:.0f} ms", 2.0 * o.beat_ms,
         fmt::format("< {} ms", 2 * o.beat_ms));
  // Not a target of the scheduler's: whether the simulator kept its agents' beats (the
  // scheduler declares an agent dead after 3 s of silence). Over it, a lost agent is the
  // simulator's failure, and the run says nothing about the scheduler.
  target("longest agent beat gap, simulator side (a validity check)",
         static_cast<double>(b.max_agent_gap_us.load()) / 1000.0, "{:.0f} ms", 3000.0, "< 3000 ms");
  target("kill -9 -> restarted, every agent back, every record recovered", secs(t_recovered - t_kill),
         "{:.3f} s", 10, "< 10 s");
  rows.push_back(Row{
      "scheduler CPU, steady state (1 Hz beats + steps)",
      fmt::format("{:.1f}% of a core = {:.1f} us/s per worker", 100 * cpu_frac, 1e6 * cpu_frac / o.workers),
      "", -1});
  rows.push_back(Row{"scheduler RSS before the kill",
                     fmt::format("{:.1f} MiB = {:.1f} KiB per worker", stats_before.rss_mib,
                                 stats_before.rss_mib * 1024 / o.workers),
                     "", -1});
  rows.push_back(Row{"agent registration (all agents)", fmt::format("{:.3f} s", t_register), "", -1});
  rows.push_back(
      Row{"messages through the simulator, steady state", fmt::format("{:.0f}/s", msg_rate), "", -1});
  fmt::print(
      "\nscale_sim results: {} workers, {} agents x {} slots, {} simulator process(es) x {} thread(s); "
      "{}, {}; {} CPUs, load average {} at the start, {} at the end\n",
      o.workers, o.agents, o.slots, shards, threads_per_shard, o.insecure ? "no CURVE" : "CURVE",
      o.direct ? "process sessions direct" : "process sessions relayed by their agents",
      std::thread::hardware_concurrency(), load_start, loadavg());
  for (auto& r : rows) {
    fmt::print("  {:<66} {:>32}  {:<8} {}\n", r.what, r.value, r.target,
               r.pass < 0 ? ""
               : r.pass   ? "ok"
                          : "MISSED");
  }
  const int nerr = b.nerrors.load();
  for (int i = 0; i < std::min(nerr, 16); ++i) fmt::print("  ERROR: {}\n", b.errors[i]);
  if (b.store_errors.load() > 0) fmt::print("  ERROR: {} store requests failed\n", b.store_errors.load());
  const bool correct = nerr == 0 && b.store_errors.load() == 0;
  fmt::print(
      "correctness: {} (every rank rendezvoused, every failure seen once, restart recovered every record)\n",
      correct ? "ok" : "FAILED");
  if (own_dir && !o.keep_state && correct) std::filesystem::remove_all(o.state_dir);
  if (!o.relay_dir.empty()) std::filesystem::remove_all(o.relay_dir);
  return correct ? 0 : 1;
}

}  // namespace
}  // namespace troupe::sched::scale

int main(int argc, char** argv) {
  troupe::sched::scale::Options o;
  CLI::App app{"scale_sim: the real troupe-scheduler against a simulated cluster (bench/README.md)"};
  app.add_option("--workers", o.workers, "Worker ranks of the job")->check(CLI::Range(2, 1000000));
  app.add_option("--slots", o.slots, "Slots per simulated agent")->check(CLI::Range(1, 1024));
  app.add_option("--agents", o.agents, "Simulated agents (default: workers / slots)");
  app.add_option("--threads", o.threads, "Simulator threads")->check(CLI::Range(1, 64));
  app.add_option("--failures", o.failures, "Workers that die at once (default 1%)");
  app.add_option("--steady-s", o.steady_s, "Seconds of steady state measured")->check(CLI::Range(1, 3600));
  app.add_option("--beat-ms", o.beat_ms, "Heartbeat period of every peer")->check(CLI::Range(100, 60000));
  app.add_option("--probe-fraction", o.probe_fraction, "Share of worker beats followed by a latency probe")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--phase-timeout-s", o.phase_timeout_s, "Give up on a phase after this long");
  app.add_option("--scheduler", o.scheduler_bin, "troupe-scheduler executable");
  app.add_option("--state-dir", o.state_dir, "Scheduler state directory (default: a temporary one)");
  app.add_option("--nice", o.nice,
                 "Nice value of the simulator processes (the scheduler keeps 0); default 10, or 0 with CURVE "
                 "and --direct")
      ->check(CLI::Range(0, 19));
  app.add_option("--processes", o.processes, "Simulator processes (default: as few as the fd limit allows)")
      ->check(CLI::Range(0, 64));
  app.add_option("--io-threads", o.io_threads,
                 "The scheduler's ZeroMQ I/O threads (default: its own default)")
      ->check(CLI::Range(0, 64));
  app.add_flag("--keep-state", o.keep_state, "Keep the temporary state directory");
  app.add_flag("--insecure", o.insecure, "Run the scheduler without local authentication (no CURVE)");
  app.add_flag("--direct", o.direct,
               "Worker and driver sessions connect to the scheduler themselves (default: through their "
               "agent's relay, as troupe-agent does)");
  CLI11_PARSE(app, argc, argv);
  signal(SIGPIPE, SIG_IGN);
  return troupe::sched::scale::run(o);
}
