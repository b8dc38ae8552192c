// comm/tcp_transport.cc — TcpTransport: BulkTransport over a full mesh of TCP sockets.
//
// Each ordered pair (a, b) has one connection opened by a: a's writes to b travel on it
// (header + payload), and b's acknowledgements come back on it. One sender thread writes
// queued requests in order; one I/O thread poll()s every socket, reads incoming writes
// straight into the registered buffer, acknowledges them and turns acknowledgements into
// kWriteDone completions. A socket error or EOF fails every pending write to that peer.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "comm/bulk_transport.h"

namespace troupe::comm {
namespace {

constexpr uint32_t kHelloMagic = 0x54524f55;  // "TROU"
constexpr uint32_t kWriteMagic = 0x424c4b57;  // "BLKW"

struct Hello {
  uint32_t magic;
  int32_t rank;
};

struct WriteHeader {
  uint32_t magic;
  uint32_t buffer;
  uint32_t tag;
  uint32_t reserved;
  uint64_t offset;
  uint64_t bytes;
  uint64_t seq;
};

struct Ack {
  uint64_t seq;
  int32_t code;  // StatusCode of the receiver's handling
  int32_t reserved;
};

std::string errno_text() {
  return std::strerror(errno);
}

// Full-length blocking I/O; false on EOF or error (errno set, 0 for EOF).
bool read_full(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r == 0) {
      errno = 0;
      return false;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool write_full(int fd, const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t r = ::send(fd, c, n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void set_timeouts(int fd, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = t.count() / 1000;
  tv.tv_usec = (t.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

Result<sockaddr_storage> resolve(const std::string& host, uint16_t port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr)
    return unavailable("bulk tcp: cannot resolve '{}': {}", host, gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

struct Buffer {
  char* data = nullptr;
  uint64_t bytes = 0;
};

struct PendingWrite {
  int peer;
  uint32_t src_buffer;
  uint64_t src_offset;
  uint32_t dst_buffer;
  uint64_t dst_offset;
  uint64_t bytes;
  uint32_t tag;
  uint64_t seq;
};

class TcpTransport final : public BulkTransport {
 public:
  TcpTransport(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout), out_fd_(size, -1), in_fd_(size, -1), peer_error_(size) {}

  ~TcpTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (int fd : out_fd_)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    for (int fd : in_fd_)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    if (wake_[1] >= 0) {
      char b = 1;
      [[maybe_unused]] auto n = ::write(wake_[1], &b, 1);
    }
    if (sender_.joinable()) sender_.join();
    if (io_.joinable()) io_.join();
    for (int fd : out_fd_)
      if (fd >= 0) ::close(fd);
    for (int fd : in_fd_)
      if (fd >= 0) ::close(fd);
    for (int fd : wake_)
      if (fd >= 0) ::close(fd);
  }

  Status connect_mesh(const BulkSpec& spec) {
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) return io_error("bulk tcp: pipe: {}", errno_text());
    PrefixStore store(*spec.store, spec.ns.key(spec.name) + "/");
    const Deadline deadline = deadline_in(spec.timeout);
    // Listen on an OS-assigned port and publish it.
    socklen_t len = 0;
    TROUPE_ASSIGN_OR_RETURN(sockaddr_storage addr, resolve(spec.hostname, 0, &len));
    int lfd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0) return io_error("bulk tcp: socket: {}", errno_text());
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{lfd};
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(lfd, 256) != 0) {
      return io_error("bulk tcp: bind/listen on {}: {}", spec.hostname, errno_text());
    }
    sockaddr_storage bound{};
    socklen_t blen = sizeof(bound);
    ::getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &blen);
    uint16_t port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                                     : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    TROUPE_RETURN_IF_ERROR(
        store.set(fmt::format("addr/{}", rank_), fmt::format("{}:{}", spec.hostname, port)));

    // Connect to every peer (their listen backlog holds us until they accept).
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      TROUPE_ASSIGN_OR_RETURN(std::string where, store.get(fmt::format("addr/{}", p), deadline));
      auto colon = where.rfind(':');
      if (colon == std::string::npos) return data_loss("bulk tcp: bad address '{}' for rank {}", where, p);
      socklen_t plen = 0;
      TROUPE_ASSIGN_OR_RETURN(
          sockaddr_storage paddr,
          resolve(where.substr(0, colon), static_cast<uint16_t>(std::stoi(where.substr(colon + 1))), &plen));
      int fd = ::socket(paddr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return io_error("bulk tcp: socket: {}", errno_text());
      out_fd_[p] = fd;
      set_timeouts(fd, spec.timeout);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&paddr), plen) != 0) {
        return unavailable("bulk tcp: connect to rank {} at {}: {}", p, where, errno_text());
      }
      Hello h{kHelloMagic, rank_};
      if (!write_full(fd, &h, sizeof(h)))
        return unavailable("bulk tcp: hello to rank {}: {}", p, errno_text());
    }
    // Accept one connection from every peer.
    for (int accepted = 0; accepted < size_ - 1;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0)
        return deadline_exceeded("bulk tcp: {} of {} peers connected before the deadline", accepted,
                                 size_ - 1);
      pollfd pfd{lfd, POLLIN, 0};
      int rc = ::poll(&pfd, 1, static_cast<int>(left));
      if (rc < 0 && errno != EINTR) return io_error("bulk tcp: poll: {}", errno_text());
      if (rc <= 0) continue;
      int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      set_timeouts(fd, spec.timeout);
      Hello h{};
      if (!read_full(fd, &h, sizeof(h)) || h.magic != kHelloMagic || h.rank < 0 || h.rank >= size_ ||
          h.rank == rank_ || in_fd_[h.rank] >= 0) {
        ::close(fd);  // a stranger or a duplicate: not one of our peers
        continue;
      }
      in_fd_[h.rank] = fd;
      ++accepted;
    }
    sender_ = std::thread([this] { sender_loop(); });
    io_ = std::thread([this] { io_loop(); });
    return ok_status();
  }

  std::string_view kind() const override { return "tcp"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status register_buffer(uint32_t id, void* data, uint64_t bytes) override {
    if (id >= kMaxBuffers) return invalid_argument("bulk buffer id {} >= {}", id, kMaxBuffers);
    if (data == nullptr && bytes > 0) return invalid_argument("bulk buffer {}: null data", id);
    std::lock_guard<std::mutex> lock(mu_);
    if (buffers_.count(id)) return already_exists("bulk buffer {} already registered", id);
    buffers_[id] = Buffer{static_cast<char*>(data), bytes};
    cv_.notify_all();
    return ok_status();
  }

  Status write(int peer, uint32_t src_buffer, uint64_t src_offset, uint32_t dst_buffer, uint64_t dst_offset,
               uint64_t bytes, uint32_t tag) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return invalid_argument("bulk write: bad peer {}", peer);
    if (tag > kMaxTag) return invalid_argument("bulk write: tag {} > {}", tag, kMaxTag);
    if (dst_buffer >= kMaxBuffers)
      return invalid_argument("bulk write: buffer id {} >= {}", dst_buffer, kMaxBuffers);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buffers_.find(src_buffer);
    if (it == buffers_.end()) return not_found("bulk write: source buffer {} not registered", src_buffer);
    if (src_offset > it->second.bytes || bytes > it->second.bytes - src_offset) {
      return out_of_range("bulk write: [{}, +{}) outside source buffer {} of {} bytes", src_offset, bytes,
                          src_buffer, it->second.bytes);
    }
    if (!peer_error_[peer].ok()) return peer_error_[peer];
    queue_.push_back(
        PendingWrite{peer, src_buffer, src_offset, dst_buffer, dst_offset, bytes, tag, next_seq_++});
    cv_.notify_all();
    return ok_status();
  }

  Result<std::vector<BulkCompletion>> poll(Deadline deadline, size_t max) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return !completions_.empty(); });
    std::vector<BulkCompletion> out;
    while (!completions_.empty() && out.size() < max) {
      out.push_back(std::move(completions_.front()));
      completions_.pop_front();
    }
    return out;
  }

 private:
  // Fails every write in flight to `peer` (call with mu_ held).
  void fail_peer_locked(int peer, const Status& st) {
    if (peer_error_[peer].ok()) peer_error_[peer] = st;
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      if (it->second.peer == peer) {
        completions_.push_back(BulkCompletion{BulkCompletion::Kind::kWriteDone, peer, it->second.dst_buffer,
                                              it->second.tag, it->second.bytes, st});
        it = in_flight_.erase(it);
      } else {
        ++it;
      }
    }
    cv_.notify_all();
  }

  void sender_loop() {
    for (;;) {
      PendingWrite w;
      const char* src = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        w = queue_.front();
        queue_.pop_front();
        if (!peer_error_[w.peer].ok()) {
          completions_.push_back(BulkCompletion{BulkCompletion::Kind::kWriteDone, w.peer, w.dst_buffer, w.tag,
                                                w.bytes, peer_error_[w.peer]});
          cv_.notify_all();
          continue;
        }
        src = buffers_[w.src_buffer].data + w.src_offset;
        in_flight_[w.seq] = w;
      }
      WriteHeader h{kWriteMagic, w.dst_buffer, w.tag, 0, w.dst_offset, w.bytes, w.seq};
      int fd = out_fd_[w.peer];
      if (!write_full(fd, &h, sizeof(h)) || !write_full(fd, src, w.bytes)) {
        std::lock_guard<std::mutex> lock(mu_);
        fail_peer_locked(w.peer, unavailable("bulk tcp: send to rank {}: {}", w.peer,
                                             errno ? errno_text() : std::string("connection closed")));
      }
    }
  }

  // Handles one incoming write from `peer` on `fd`; false if the connection broke.
  bool receive_write(int peer, int fd) {
    WriteHeader h{};
    if (!read_full(fd, &h, sizeof(h))) return false;
    if (h.magic != kWriteMagic) {
      errno = EPROTO;
      return false;
    }
    char* dst = nullptr;
    StatusCode code = StatusCode::kOk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A peer may write before we registered the buffer: wait for it within the timeout.
      cv_.wait_for(lock, timeout_, [&] { return stop_ || buffers_.count(h.buffer) > 0; });
      auto it = buffers_.find(h.buffer);
      if (it == buffers_.end()) {
        code = StatusCode::kNotFound;
      } else if (h.offset > it->second.bytes || h.bytes > it->second.bytes - h.offset) {
        code = StatusCode::kOutOfRange;
      } else {
        dst = it->second.data + h.offset;
      }
    }
    if (dst != nullptr) {
      if (!read_full(fd, dst, h.bytes)) return false;
    } else {
      // Drain the payload so the stream stays in step, then report the error.
      std::vector<char> scratch(1 << 16);
      for (uint64_t left = h.bytes; left > 0;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
        if (!read_full(fd, scratch.data(), n)) return false;
        left -= n;
      }
    }
    Ack ack{h.seq, static_cast<int32_t>(code), 0};
    if (!write_full(fd, &ack, sizeof(ack))) return false;
    Status st =
        code == StatusCode::kOk
            ? ok_status()
            : Status(code, fmt::format("bulk tcp: rank {} wrote [{}, +{}) into buffer {}: not registered or "
                                       "out of range",
                                       peer, h.offset, h.bytes, h.buffer));
    std::lock_guard<std::mutex> lock(mu_);
    completions_.push_back(
        BulkCompletion{BulkCompletion::Kind::kReceived, peer, h.buffer, h.tag, h.bytes, st});
    cv_.notify_all();
    return true;
  }

  bool receive_ack(int peer, int fd) {
    Ack a{};
    if (!read_full(fd, &a, sizeof(a))) return false;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(a.seq);
    if (it == in_flight_.end() || it->second.peer != peer) return true;  // already failed
    Status st = a.code == 0 ? ok_status()
                            : Status(static_cast<StatusCode>(a.code),
                                     fmt::format("bulk tcp: rank {} rejected the write into its buffer {}",
                                                 peer, it->second.dst_buffer));
    completions_.push_back(BulkCompletion{BulkCompletion::Kind::kWriteDone, peer, it->second.dst_buffer,
                                          it->second.tag, it->second.bytes, st});
    in_flight_.erase(it);
    cv_.notify_all();
    return true;
  }

  void io_loop() {
    std::vector<bool> broken(size_, false);
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<std::pair<int, bool>> who;  // (peer, is incoming)
      fds.push_back({wake_[0], POLLIN, 0});
      who.push_back({-1, false});
      for (int p = 0; p < size_; ++p) {
        if (p == rank_ || broken[p]) continue;
        fds.push_back({in_fd_[p], POLLIN, 0});
        who.push_back({p, true});
        fds.push_back({out_fd_[p], POLLIN, 0});
        who.push_back({p, false});
      }
      int rc = ::poll(fds.data(), fds.size(), 200);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
      }
      if (rc <= 0) continue;
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto [peer, incoming] = who[i];
        if (broken[peer]) continue;
        bool ok = incoming ? receive_write(peer, fds[i].fd) : receive_ack(peer, fds[i].fd);
        if (!ok) {
          broken[peer] = true;
          std::string why = errno ? errno_text() : std::string("connection closed by peer");
          std::lock_guard<std::mutex> lock(mu_);
          if (stop_) return;
          fail_peer_locked(peer, unavailable("bulk tcp: rank {}: {}", peer, why));
        }
      }
    }
  }

  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  std::vector<int> out_fd_, in_fd_;
  int wake_[2] = {-1, -1};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<uint32_t, Buffer> buffers_;
  std::deque<PendingWrite> queue_;
  std::map<uint64_t, PendingWrite> in_flight_;
  std::deque<BulkCompletion> completions_;
  std::vector<Status> peer_error_;
  uint64_t next_seq_ = 1;
  std::thread sender_, io_;
};

}  // namespace

Result<std::unique_ptr<BulkTransport>> make_tcp_transport(const BulkSpec& spec) {
  if (spec.store == nullptr) return invalid_argument("bulk transport: no rendezvous store");
  if (spec.size < 1 || spec.rank < 0 || spec.rank >= spec.size) {
    return invalid_argument("bulk transport: rank {} of {}", spec.rank, spec.size);
  }
  auto t = std::make_unique<TcpTransport>(spec.rank, spec.size, spec.timeout);
  TROUPE_RETURN_IF_ERROR(t->connect_mesh(spec));
  return std::unique_ptr<BulkTransport>(std::move(t));
}

}  // namespace troupe::comm
