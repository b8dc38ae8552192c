// checkpoint/snapshot_keeper.cc — SnapshotKeeper: generations, copies, the worker and
// keeper protocols, and the pusher.
#include "checkpoint/snapshot_keeper.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "checkpoint/snapshot_segment.h"
#include "checkpoint/snapshot_wire.h"
#include "core/env.h"
#include "core/logging.h"

namespace troupe::checkpoint {

namespace {

using Clock = std::chrono::steady_clock;
using Key = std::pair<std::string, int>;  // (job, rank)

constexpr uint64_t kMaxSegmentBytes = uint64_t{1} << 42;  // 4 TiB: a sanity bound on a peer's put
constexpr uint64_t kChunk = 8u << 20;                     // push granularity (cancellation points)
constexpr size_t kCopiesKept = 2;

std::shared_ptr<spdlog::logger> logger() {
  static auto l = make_logger("snapshot");
  return l;
}

std::string key_text(const Key& k) {
  return fmt::format("{} rank {}", k.first, k.second);
}

bool safe_job(const std::string& s) {
  return !s.empty() && s.size() <= 128 && std::all_of(s.begin(), s.end(), [](char c) {
    return isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
}

Result<FileHandle> dup_fd(int fd) {
  const int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return io_error("snapshot keeper: dup: {}", std::strerror(errno));
  return FileHandle(d);
}

}  // namespace

struct SnapshotKeeper::Impl {
  struct Segment {
    FileHandle fd;
    std::shared_ptr<const SegmentMap> map;  // the keeper's own read-only mapping
    uint64_t size = 0;
  };
  struct Copy {
    int64_t step = -1;
    Segment seg;
    std::string from_node;
  };
  struct Entry {
    Clock::time_point touched = Clock::now();
    Segment gens[2];
    int64_t committed = -1;
    std::string replicate_to;
    int64_t replicated = -1;
    std::deque<Copy> copies;  // oldest first
  };
  struct Push {
    Key key;
    int gen = 0;
    int64_t step = -1;
    std::string to;
    std::shared_ptr<const SegmentMap> map;
  };

  KeeperOptions o;
  std::string dir, sock_path, endpoint;
  FileHandle unix_listen, tcp_listen;
  int stop_pipe[2] = {-1, -1};
  std::atomic<bool> stop{false};
  std::thread unix_accept, tcp_accept, pusher;
  std::mutex threads_mu;
  struct Session {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Session> sessions;
  std::set<int> session_fds;  // shut down on stop

  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<Key, Entry> entries;
  std::deque<Push> pushes;
  bool pushing = false;
  Key push_key;
  int push_gen = -1;
  std::atomic<bool> cancel_push{false};

  // ---- helpers (mu held) ----
  static std::optional<int64_t> landed_step(const Segment& s) {
    if (!s.map) return std::nullopt;
    const SegmentHeader h = s.map->read_header();
    if (h.state != static_cast<uint32_t>(SegmentState::kLanded)) return std::nullopt;
    return h.step;
  }
  void add_copy(Entry& e, Copy c) {
    std::erase_if(e.copies, [&](const Copy& x) { return x.step == c.step; });
    e.copies.push_back(std::move(c));
    std::sort(e.copies.begin(), e.copies.end(), [](const Copy& a, const Copy& b) { return a.step < b.step; });
    while (e.copies.size() > kCopiesKept) e.copies.pop_front();
  }
  Result<Segment> new_segment(const std::string& name, uint64_t bytes, bool writable_map,
                              std::shared_ptr<SegmentMap>* writable) {
    TROUPE_ASSIGN_OR_RETURN(FileHandle fd, create_segment(name, bytes));
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<SegmentMap> m, SegmentMap::map(fd.fd(), writable_map));
    Segment s;
    s.size = bytes;
    std::shared_ptr<SegmentMap> shared(std::move(m));
    if (writable != nullptr) *writable = shared;
    s.map = shared;
    s.fd = std::move(fd);
    return s;
  }

  // ---- the worker protocol ----
  SnapReply attach(const SnapAttach& a, std::vector<FileHandle>& fds) {
    if (!safe_job(a.job) || a.rank < 0)
      return SnapReply::of(invalid_argument("attach: bad job '{}' or rank {}", a.job, a.rank));
    if (a.bytes < kSegmentDataOffset || a.bytes > kMaxSegmentBytes)
      return SnapReply::of(invalid_argument("attach: a segment of {} bytes", a.bytes));
    std::unique_lock lock(mu);
    const Key k{a.job, a.rank};
    // Nothing may read a generation while it is replaced (the lock is free while waiting).
    for (int g = 0; g < 2; ++g) wait_not_pushing(lock, k, g);
    Entry& e = entries[k];
    e.touched = Clock::now();
    for (int g = 0; g < 2; ++g) {
      Segment& s = e.gens[g];
      if (s.fd.valid() && s.size >= a.bytes) continue;
      // A new layout needs more room: a landed part stays available as a copy.
      if (std::optional<int64_t> st = landed_step(s)) {
        Copy c;
        c.step = *st;
        c.seg = std::move(s);
        c.from_node = o.node;
        add_copy(e, std::move(c));
      }
      Result<Segment> ns =
          new_segment(fmt::format("troupe-snap:{}:r{}:g{}", a.job, a.rank, g), a.bytes, false, nullptr);
      if (!ns.ok()) return SnapReply::of(ns.status());
      s = std::move(ns).value();
    }
    SnapReply r;
    r.node = o.node;
    r.endpoint = endpoint;
    for (int g = 0; g < 2; ++g) {
      const SegmentHeader h = e.gens[g].map->read_header();
      r.gens.push_back(
          SnapGen{h.state == static_cast<uint32_t>(SegmentState::kEmpty) ? -1 : h.step, h.state});
      Result<FileHandle> d = dup_fd(e.gens[g].fd.fd());
      if (!d.ok()) return SnapReply::of(d.status());
      fds.push_back(std::move(d).value());
    }
    return r;
  }

  // Waits until generation `g` of `k` is not being pushed, cancelling such a push.
  void wait_not_pushing(std::unique_lock<std::mutex>& lock, const Key& k, int g) {
    std::erase_if(pushes, [&](const Push& p) { return p.key == k && p.gen == g; });
    if (pushing && push_key == k && push_gen == g) cancel_push = true;
    cv.wait(lock, [&] { return !(pushing && push_key == k && push_gen == g); });
  }

  SnapReply begin(const SnapBegin& b) {
    std::unique_lock lock(mu);
    const Key k{b.job, b.rank};
    auto it = entries.find(k);
    if (it == entries.end() || b.gen > 1 || !it->second.gens[b.gen].fd.valid())
      return SnapReply::of(
          failed_precondition("begin: {} has no generation {} (attach first)", key_text(k), b.gen));
    wait_not_pushing(lock, k, static_cast<int>(b.gen));
    return SnapReply{};
  }

  SnapReply landed(const SnapLanded& l) {
    std::lock_guard lock(mu);
    const Key k{l.job, l.rank};
    auto it = entries.find(k);
    if (it == entries.end() || l.gen > 1 || !it->second.gens[l.gen].fd.valid())
      return SnapReply::of(failed_precondition("landed: {} has no generation {}", key_text(k), l.gen));
    const std::optional<int64_t> st = landed_step(it->second.gens[l.gen]);
    if (st != l.step) {
      return SnapReply::of(
          data_loss("landed: {} generation {} holds {}, not the landed part of step {}", key_text(k), l.gen,
                    st ? fmt::format("step {}", *st) : std::string("no landed part"), l.step));
    }
    return SnapReply{};
  }

  SnapReply commit(const SnapCommit& c) {
    std::lock_guard lock(mu);
    const Key k{c.job, c.rank};
    auto it = entries.find(k);
    if (it == entries.end()) return SnapReply::of(not_found("commit: nothing held for {}", key_text(k)));
    Entry& e = it->second;
    e.touched = Clock::now();
    int gen = -1;
    for (int g = 0; g < 2; ++g) {
      if (landed_step(e.gens[g]) == c.step) gen = g;
    }
    if (gen < 0)
      return SnapReply::of(not_found("commit: {} holds no landed part of step {}", key_text(k), c.step));
    e.committed = std::max(e.committed, c.step);
    if (!c.replicate_to.empty() && c.replicate_to != endpoint) {
      e.replicate_to = c.replicate_to;
      // The newest committed part supersedes any queued older one.
      std::erase_if(pushes, [&](const Push& p) { return p.key == k; });
      pushes.push_back(Push{k, gen, c.step, c.replicate_to, e.gens[gen].map});
      cv.notify_all();
    }
    return SnapReply{};
  }

  // The segment holding (k, step): a landed generation or a copy; nullptr when none.
  // `copy_from`: the node a copy came from (empty for a generation of a local worker).
  const Segment* find_locked(const Key& k, int64_t step, std::string* copy_from = nullptr) {
    auto it = entries.find(k);
    if (it == entries.end()) return nullptr;
    it->second.touched = Clock::now();
    for (const Segment& s : it->second.gens) {
      if (landed_step(s) == step) return &s;
    }
    for (const Copy& c : it->second.copies) {
      if (c.step != step) continue;
      if (copy_from != nullptr) *copy_from = c.from_node;
      return &c.seg;
    }
    return nullptr;
  }

  SnapReply fetch(const SnapFetch& f, std::vector<FileHandle>& fds) {
    const Key k{f.job, f.rank};
    {
      std::lock_guard lock(mu);
      std::string copy_from;
      if (const Segment* s = find_locked(k, f.step, &copy_from)) {
        Result<FileHandle> d = dup_fd(s->fd.fd());
        if (!d.ok()) return SnapReply::of(d.status());
        fds.push_back(std::move(d).value());
        SnapReply r;
        r.node = o.node;
        r.endpoint = endpoint;
        r.bytes = s->size;
        r.held.push_back(SnapHeld{k.first, k.second, f.step, s->size, !copy_from.empty(),
                                  copy_from.empty() ? o.node : copy_from, true, "", -1});
        return r;
      }
    }
    std::string tried;
    for (const std::string& src : f.sources) {
      if (src.empty() || src == endpoint) continue;
      Result<Copy> c = get_remote(src, k, f.step);
      if (!c.ok()) {
        tried += fmt::format("{}{}: {}", tried.empty() ? "" : "; ", src, c.status().message());
        continue;
      }
      std::lock_guard lock(mu);
      Result<FileHandle> d = dup_fd(c->seg.fd.fd());
      if (!d.ok()) return SnapReply::of(d.status());
      SnapReply r;
      r.node = o.node;
      r.endpoint = endpoint;
      r.bytes = c->seg.size;
      r.held.push_back(SnapHeld{k.first, k.second, f.step, c->seg.size, true, c->from_node, true, src, -1});
      add_copy(entries[k], std::move(c).value());
      fds.push_back(std::move(d).value());
      return r;
    }
    return SnapReply::of(not_found("no keeper holds the part of {} after step {} (this one: none{}{})",
                                   key_text(k), f.step, tried.empty() ? "" : "; ", tried));
  }

  std::vector<SnapHeld> held(const std::string& job) const {
    std::lock_guard lock(mu);
    std::vector<SnapHeld> out;
    for (const auto& [k, e] : entries) {
      if (!job.empty() && k.first != job) continue;
      for (const Segment& s : e.gens) {
        const std::optional<int64_t> st = landed_step(s);
        if (!st) continue;
        out.push_back(SnapHeld{k.first, k.second, *st, s.size, false, o.node, *st <= e.committed,
                               e.replicate_to, e.replicated});
      }
      for (const Copy& c : e.copies) {
        out.push_back(SnapHeld{k.first, k.second, c.step, c.seg.size, true, c.from_node, true, "", -1});
      }
    }
    return out;
  }

  KeeperTotals totals() const {
    std::lock_guard lock(mu);
    KeeperTotals t;
    std::set<std::string> jobs;
    for (const auto& [k, e] : entries) {
      jobs.insert(k.first);
      for (const Segment& s : e.gens) {
        t.bytes += s.size;
        if (landed_step(s)) ++t.parts;
      }
      for (const Copy& c : e.copies) {
        t.bytes += c.seg.size;
        ++t.copies;
      }
    }
    t.jobs = static_cast<int>(jobs.size());
    return t;
  }

  // Drops what matches; returns the replica targets of the dropped local parts.
  std::set<std::string> release(const SnapRelease& r) {
    std::unique_lock lock(mu);
    std::set<std::string> targets;
    std::vector<Key> gone;
    for (auto& [k, e] : entries) {
      if (k.first != r.job || (r.rank >= 0 && k.second != r.rank)) continue;
      if (!e.replicate_to.empty()) targets.insert(e.replicate_to);
      gone.push_back(k);
    }
    for (const Key& k : gone) {
      for (int g = 0; g < 2; ++g) wait_not_pushing(lock, k, g);
      entries.erase(k);
    }
    return targets;
  }

  // ---- the keeper protocol (client side) ----
  Result<Copy> get_remote(const std::string& src, const Key& k, int64_t step) {
    TROUPE_ASSIGN_OR_RETURN(FileHandle fd, wire::connect_tcp(src, o.connect_timeout));
    TROUPE_RETURN_IF_ERROR(wire::send_frame(fd.fd(), encode_snap_request(SnapGet{k.first, k.second, step})));
    TROUPE_ASSIGN_OR_RETURN(std::string rb, wire::recv_frame(fd.fd(), Clock::now() + o.peer_timeout));
    TROUPE_ASSIGN_OR_RETURN(SnapReply rep, decode_snap_reply(rb));
    TROUPE_RETURN_IF_ERROR(rep.status());
    if (rep.bytes < kSegmentDataOffset || rep.bytes > kMaxSegmentBytes)
      return data_loss("keeper {} answered with a segment of {} bytes", src, rep.bytes);
    std::shared_ptr<SegmentMap> w;
    TROUPE_ASSIGN_OR_RETURN(Segment seg, new_segment(fmt::format("troupe-snap:{}:r{}:s{}:from-{}", k.first,
                                                                 k.second, step, rep.node),
                                                     rep.bytes, true, &w));
    TROUPE_RETURN_IF_ERROR(receive_segment(fd.fd(), *w, rep.bytes));
    TROUPE_ASSIGN_OR_RETURN(SnapshotPart p, read_segment_part(seg.map, fmt::format("the copy from {}", src)));
    if (p.part.step != step) return data_loss("keeper {} sent step {} for step {}", src, p.part.step, step);
    Copy c;
    c.step = step;
    c.seg = std::move(seg);
    c.from_node = rep.node;
    return c;
  }

  Status receive_segment(int fd, SegmentMap& m, uint64_t bytes) {
    for (uint64_t off = 0; off < bytes; off += kChunk) {
      const uint64_t n = std::min(kChunk, bytes - off);
      TROUPE_RETURN_IF_ERROR(wire::recv_bytes(fd, m.base() + off, n, Clock::now() + o.peer_timeout));
    }
    return ok_status();
  }

  // ---- the keeper protocol (server side) ----
  void serve_peer(FileHandle fd) {
    while (!stop) {
      Result<std::string> f = wire::recv_frame(fd.fd(), Clock::now() + std::chrono::hours(24 * 365));
      if (!f.ok()) return;
      Result<SnapRequest> req = decode_snap_request(*f);
      if (!req.ok()) {
        logger()->warn("a keeper connection sent a malformed message: {}", req.status().to_string());
        return;
      }
      if (auto* p = std::get_if<SnapPut>(&*req)) {
        SnapReply r = SnapReply::of(take_put(fd.fd(), *p));
        if (r.code == static_cast<uint16_t>(StatusCode::kUnavailable)) return;  // the stream broke
        if (!wire::send_frame(fd.fd(), encode_snap_reply(r)).ok()) return;
        if (r.code != 0) return;  // the stream may be out of step: close it
      } else if (auto* g = std::get_if<SnapGet>(&*req)) {
        std::shared_ptr<const SegmentMap> m;
        uint64_t size = 0;
        {
          std::lock_guard lock(mu);
          if (const Segment* s = find_locked({g->job, g->rank}, g->step)) {
            m = s->map;
            size = s->size;
          }
        }
        SnapReply r;
        if (!m)
          r = SnapReply::of(not_found("keeper {} holds no part of {} after step {}", o.node,
                                      key_text({g->job, g->rank}), g->step));
        r.node = o.node;
        r.bytes = size;
        if (!wire::send_frame(fd.fd(), encode_snap_reply(r)).ok()) return;
        if (m && !wire::send_bytes(fd.fd(), m->base(), size).ok()) return;
      } else if (auto* rl = std::get_if<SnapRelease>(&*req)) {
        release(*rl);
        if (!wire::send_frame(fd.fd(), encode_snap_reply(SnapReply{})).ok()) return;
      } else {
        (void)wire::send_frame(fd.fd(),
                               encode_snap_reply(SnapReply::of(invalid_argument("not a keeper request"))));
        return;
      }
    }
  }

  Status take_put(int fd, const SnapPut& p) {
    if (!safe_job(p.job) || p.rank < 0 || p.bytes < kSegmentDataOffset || p.bytes > kMaxSegmentBytes)
      return invalid_argument("put: bad job '{}', rank {} or size {}", p.job, p.rank, p.bytes);
    std::shared_ptr<SegmentMap> w;
    TROUPE_ASSIGN_OR_RETURN(Segment seg, new_segment(fmt::format("troupe-snap:{}:r{}:s{}:from-{}", p.job,
                                                                 p.rank, p.step, p.from_node),
                                                     p.bytes, true, &w));
    TROUPE_RETURN_IF_ERROR(receive_segment(fd, *w, p.bytes));
    Result<SnapshotPart> part = read_segment_part(seg.map, fmt::format("the copy from {}", p.from_node));
    if (!part.ok()) return part.status();
    if (part->part.step != p.step)
      return data_loss("put: the part is of step {}, not {}", part->part.step, p.step);
    std::lock_guard lock(mu);
    Copy c;
    c.step = p.step;
    c.seg = std::move(seg);
    c.from_node = p.from_node;
    Entry& e = entries[{p.job, p.rank}];
    e.touched = Clock::now();
    add_copy(e, std::move(c));
    return ok_status();
  }

  // Parts of a job nobody used for idle_release go (a job that ended without releasing).
  void drop_idle_locked() {
    const auto now = Clock::now();
    std::erase_if(entries, [&](const auto& kv) {
      const bool idle = now - kv.second.touched > o.idle_release && !(pushing && push_key == kv.first);
      if (idle)
        logger()->info("dropped the snapshots of {}: unused for {} s", key_text(kv.first),
                       std::chrono::duration_cast<std::chrono::seconds>(o.idle_release).count());
      return idle;
    });
  }

  // ---- the pusher ----
  void push_loop() {
    std::map<std::string, FileHandle> conns;
    while (true) {
      Push p;
      {
        std::unique_lock lock(mu);
        while (!stop && pushes.empty()) {
          cv.wait_for(lock, std::chrono::minutes(1));
          drop_idle_locked();
        }
        if (stop) return;
        p = std::move(pushes.front());
        pushes.pop_front();
        pushing = true;
        push_key = p.key;
        push_gen = p.gen;
        cancel_push = false;
      }
      const Status st = push_one(conns, p);
      std::lock_guard lock(mu);
      if (st.ok()) {
        auto it = entries.find(p.key);
        if (it != entries.end()) it->second.replicated = std::max(it->second.replicated, p.step);
      } else if (!cancel_push) {
        logger()->warn("the copy of {} step {} to {} failed: {}", key_text(p.key), p.step, p.to,
                       st.to_string());
      }
      pushing = false;
      cv.notify_all();
    }
  }

  Status push_one(std::map<std::string, FileHandle>& conns, const Push& p) {
    auto it = conns.find(p.to);
    if (it == conns.end()) {
      TROUPE_ASSIGN_OR_RETURN(FileHandle fd, wire::connect_tcp(p.to, o.connect_timeout));
      it = conns.emplace(p.to, std::move(fd)).first;
    }
    const int fd = it->second.fd();
    const uint64_t bytes = p.map->size();
    Status st =
        wire::send_frame(fd, encode_snap_request(SnapPut{p.key.first, p.key.second, p.step, bytes, o.node}));
    for (uint64_t off = 0; st.ok() && off < bytes; off += kChunk) {
      if (cancel_push || stop) {
        st = aborted("cancelled");
        break;
      }
      st = wire::send_bytes(fd, p.map->base() + off, std::min(kChunk, bytes - off));
    }
    if (st.ok()) {
      Result<std::string> rb = wire::recv_frame(fd, Clock::now() + o.peer_timeout);
      if (!rb.ok()) {
        st = rb.status();
      } else {
        Result<SnapReply> rep = decode_snap_reply(*rb);
        st = rep.ok() ? rep->status() : rep.status();
      }
    }
    if (!st.ok()) conns.erase(p.to);  // a broken or cancelled stream is out of step
    return st;
  }

  void forward_release(const std::set<std::string>& targets, const SnapRelease& r) {
    for (const std::string& t : targets) {
      if (t == endpoint) continue;
      Result<FileHandle> fd = wire::connect_tcp(t, std::chrono::milliseconds(1000));
      if (!fd.ok()) continue;  // best effort: a keeper that is gone holds nothing
      if (wire::send_frame(fd->fd(), encode_snap_request(r)).ok())
        (void)wire::recv_frame(fd->fd(), Clock::now() + std::chrono::milliseconds(1000));
    }
  }

  // ---- sessions ----
  void serve_worker(FileHandle fd) {
    while (!stop) {
      Result<wire::Datagram> d = wire::recv_datagram(fd.fd(), Clock::now() + std::chrono::hours(24 * 365));
      if (!d.ok()) return;
      Result<SnapRequest> req = decode_snap_request(d->bytes);
      SnapReply r;
      std::vector<FileHandle> fds;
      if (!req.ok()) {
        r = SnapReply::of(req.status());
      } else if (auto* a = std::get_if<SnapAttach>(&*req)) {
        r = attach(*a, fds);
      } else if (auto* b = std::get_if<SnapBegin>(&*req)) {
        r = begin(*b);
      } else if (auto* l = std::get_if<SnapLanded>(&*req)) {
        r = landed(*l);
      } else if (auto* c = std::get_if<SnapCommit>(&*req)) {
        r = commit(*c);
      } else if (auto* f = std::get_if<SnapFetch>(&*req)) {
        r = fetch(*f, fds);
      } else if (auto* q = std::get_if<SnapQuery>(&*req)) {
        r.node = o.node;
        r.endpoint = endpoint;
        r.held = held(q->job);
      } else if (auto* rl = std::get_if<SnapRelease>(&*req)) {
        forward_release(release(*rl), *rl);
      } else {
        r = SnapReply::of(invalid_argument("not a worker request"));
      }
      if (r.code != 0 && !fds.empty()) fds.clear();
      std::vector<int> raw;
      for (const FileHandle& f : fds) raw.push_back(f.fd());
      if (!wire::send_datagram(fd.fd(), encode_snap_reply(r), raw).ok()) return;
    }
  }

  void spawn_session(FileHandle fd, bool peer) {
    std::lock_guard lock(threads_mu);
    if (stop) return;
    // Sessions that ended (a worker gone, a peer's connection closed) are joined here: an
    // agent lives through many jobs.
    std::erase_if(sessions, [](Session& s) {
      if (!s.done->load()) return false;
      s.thread.join();
      return true;
    });
    const int raw = fd.fd();
    session_fds.insert(raw);
    auto done = std::make_shared<std::atomic<bool>>(false);
    sessions.push_back(Session{std::thread([this, raw, peer, done, f = std::move(fd)]() mutable {
                                 if (peer) {
                                   serve_peer(std::move(f));
                                 } else {
                                   serve_worker(std::move(f));
                                 }
                                 std::lock_guard l(threads_mu);
                                 session_fds.erase(raw);
                                 *done = true;
                               }),
                               done});
  }

  void accept_loop(int lfd, bool peer) {
    while (!stop) {
      pollfd p[2] = {{lfd, POLLIN, 0}, {stop_pipe[0], POLLIN, 0}};
      if (::poll(p, 2, -1) < 0 && errno != EINTR) return;
      if (stop) return;
      if (!(p[0].revents & POLLIN)) continue;
      FileHandle fd(::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC));
      if (!fd.valid()) continue;
      if (!peer) {
        ucred cred{};
        socklen_t len = sizeof(cred);
        if (::getsockopt(fd.fd(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::getuid()) {
          logger()->warn("refused a snapshot session from uid {} (this keeper serves uid {} only)", cred.uid,
                         ::getuid());
          continue;
        }
      }
      spawn_session(std::move(fd), peer);
    }
  }

  void shutdown() {
    {
      std::lock_guard lock(mu);
      stop = true;
      cv.notify_all();
    }
    if (stop_pipe[1] >= 0) {
      const char b = 1;
      [[maybe_unused]] ssize_t n = ::write(stop_pipe[1], &b, 1);
    }
    if (unix_accept.joinable()) unix_accept.join();
    if (tcp_accept.joinable()) tcp_accept.join();
    if (pusher.joinable()) pusher.join();
    std::vector<Session> ts;
    {
      std::lock_guard lock(threads_mu);
      for (int fd : session_fds) ::shutdown(fd, SHUT_RDWR);
      ts = std::move(sessions);
    }
    for (Session& t : ts) t.thread.join();
    for (int& fd : stop_pipe) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    std::error_code ec;
    if (!dir.empty()) std::filesystem::remove_all(dir, ec);
  }
};

SnapshotKeeper::SnapshotKeeper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SnapshotKeeper::~SnapshotKeeper() {
  impl_->shutdown();
}

Result<std::unique_ptr<SnapshotKeeper>> SnapshotKeeper::start(KeeperOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->o = std::move(options);
  if (impl->o.node.empty()) return invalid_argument("snapshot keeper: no node name");
  std::string base = impl->o.dir_base;
  if (base.empty()) {
    base = env::get_or("TMPDIR", "/tmp");
  }
  std::string tmpl = base + "/troupe-snap-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr)
    return io_error("snapshot keeper: cannot create a directory under {}: {}", base, std::strerror(errno));
  impl->dir = tmpl;  // mkdtemp: mode 0700
  std::unique_ptr<SnapshotKeeper> k(new SnapshotKeeper(std::move(impl)));
  Impl& m = *k->impl_;
  m.sock_path = m.dir + "/snap.sock";
  sockaddr_un addr{};
  if (m.sock_path.size() >= sizeof(addr.sun_path)) {
    return invalid_argument(
        "snapshot keeper socket path {} is longer than {} bytes: set TMPDIR to a shorter directory",
        m.sock_path, sizeof(addr.sun_path) - 1);
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, m.sock_path.c_str(), m.sock_path.size());
  m.unix_listen = FileHandle(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!m.unix_listen.valid() ||
      ::bind(m.unix_listen.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(m.unix_listen.fd(), 64) != 0) {
    return io_error("snapshot keeper: cannot listen on {}: {}", m.sock_path, std::strerror(errno));
  }
  if (::pipe2(m.stop_pipe, O_CLOEXEC) != 0)
    return io_error("snapshot keeper: pipe: {}", std::strerror(errno));
  if (!m.o.host_addr.empty()) {
    int port = 0;
    TROUPE_ASSIGN_OR_RETURN(m.tcp_listen, wire::listen_tcp(m.o.host_addr, port));
    m.endpoint = fmt::format("{}:{}", m.o.host_addr, port);
    m.tcp_accept = std::thread([&m] { m.accept_loop(m.tcp_listen.fd(), true); });
  }
  m.unix_accept = std::thread([&m] { m.accept_loop(m.unix_listen.fd(), false); });
  m.pusher = std::thread([&m] { m.push_loop(); });
  logger()->info("snapshot keeper of node {}: workers at {}{}", m.o.node, m.sock_path,
                 m.endpoint.empty() ? std::string() : ", keepers at " + m.endpoint);
  return k;
}

const std::string& SnapshotKeeper::node() const {
  return impl_->o.node;
}
std::string SnapshotKeeper::socket_path() const {
  return impl_->sock_path;
}
std::string SnapshotKeeper::endpoint() const {
  return impl_->endpoint;
}
std::vector<SnapHeld> SnapshotKeeper::held(const std::string& job) const {
  return impl_->held(job);
}
KeeperTotals SnapshotKeeper::totals() const {
  return impl_->totals();
}
void SnapshotKeeper::release(const std::string& job) {
  impl_->release(SnapRelease{job, -1});
}

std::string keeper_totals_text(const KeeperTotals& t) {
  if (t.bytes == 0) return "-";
  const double mib = static_cast<double>(t.bytes) / (1024.0 * 1024.0);
  return fmt::format("{} part{} + {} cop{}, {:.1f} MiB", t.parts, t.parts == 1 ? "" : "s", t.copies,
                     t.copies == 1 ? "y" : "ies", mib);
}

}  // namespace troupe::checkpoint
