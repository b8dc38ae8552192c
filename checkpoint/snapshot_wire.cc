// checkpoint/snapshot_wire.cc — sockets of the snapshot protocols.
#include "checkpoint/snapshot_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace troupe::checkpoint::wire {

namespace {

constexpr size_t kMaxDatagram = 1 << 20;
constexpr int kMaxFds = 4;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

// Waits until `fd` is readable (or writable); DeadlineExceeded past `deadline`.
Status wait_fd(int fd, short events, Clock::time_point deadline, const char* what) {
  while (true) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r > 0) return ok_status();
    if (r == 0) return deadline_exceeded("snapshot {}: timed out", what);
    if (errno != EINTR) return unavailable("snapshot {}: poll: {}", what, std::strerror(errno));
  }
}

bool parse_endpoint(const std::string& ep, sockaddr_in& addr) {
  const size_t colon = ep.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  const std::string host = ep.substr(0, colon), port = ep.substr(colon + 1);
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p <= 0 || p > 65535) return false;
  addr = sockaddr_in{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(p));
  return ::inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr) == 1;
}

}  // namespace

Status send_datagram(int fd, const std::string& bytes, const std::vector<int>& fds) {
  if (fds.size() > kMaxFds)
    return invalid_argument("snapshot datagram: {} descriptors (at most {})", fds.size(), kMaxFds);
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  while (true) {
    if (::sendmsg(fd, &msg, MSG_NOSIGNAL) >= 0) return ok_status();
    if (errno == EINTR) continue;
    return unavailable("snapshot datagram: send: {}", std::strerror(errno));
  }
}

Result<Datagram> recv_datagram(int fd, Clock::time_point deadline) {
  TROUPE_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline, "receive"));
  Datagram d;
  d.bytes.resize(kMaxDatagram);
  iovec iov{d.bytes.data(), d.bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return unavailable("snapshot datagram: receive: {}", std::strerror(errno));
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      d.fds.emplace_back(f);
    }
  }
  if (n == 0) return unavailable("snapshot datagram: the peer closed the connection");
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) return data_loss("snapshot datagram: truncated");
  d.bytes.resize(static_cast<size_t>(n));
  return d;
}

Status send_bytes(int fd, const void* data, uint64_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, static_cast<size_t>(std::min<uint64_t>(n, 64u << 20)), MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return unavailable("snapshot stream: send: {}", std::strerror(errno));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
  }
  return ok_status();
}

Status recv_bytes(int fd, void* data, uint64_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    TROUPE_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline, "stream receive"));
    const ssize_t r = ::recv(fd, p, static_cast<size_t>(std::min<uint64_t>(n, 64u << 20)), 0);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return unavailable("snapshot stream: receive: {}", std::strerror(errno));
    }
    if (r == 0)
      return unavailable("snapshot stream: the peer closed the connection with {} bytes to come", n);
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return ok_status();
}

Status send_frame(int fd, const std::string& bytes) {
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((bytes.size() >> (8 * i)) & 0xff);
  TROUPE_RETURN_IF_ERROR(send_bytes(fd, len, sizeof(len)));
  return send_bytes(fd, bytes.data(), bytes.size());
}

Result<std::string> recv_frame(int fd, Clock::time_point deadline, uint64_t max_bytes) {
  unsigned char len[8];
  TROUPE_RETURN_IF_ERROR(recv_bytes(fd, len, sizeof(len), deadline));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (n > max_bytes) return data_loss("snapshot stream: a frame of {} bytes (at most {})", n, max_bytes);
  std::string out(static_cast<size_t>(n), '\0');
  TROUPE_RETURN_IF_ERROR(recv_bytes(fd, out.data(), n, deadline));
  return out;
}

Result<FileHandle> connect_tcp(const std::string& endpoint, std::chrono::milliseconds timeout) {
  sockaddr_in addr{};
  if (!parse_endpoint(endpoint, addr))
    return invalid_argument("snapshot keeper endpoint '{}' is not addr:port", endpoint);
  FileHandle fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return io_error("snapshot keeper: socket: {}", std::strerror(errno));
  if (::connect(fd.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS)
      return unavailable("snapshot keeper {}: connect: {}", endpoint, std::strerror(errno));
    TROUPE_RETURN_IF_ERROR(wait_fd(fd.fd(), POLLOUT, Clock::now() + timeout, "connect"));
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return unavailable("snapshot keeper {}: connect: {}", endpoint, std::strerror(err));
  }
  const int flags = ::fcntl(fd.fd(), F_GETFL);
  ::fcntl(fd.fd(), F_SETFL, flags & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

Result<FileHandle> listen_tcp(const std::string& addr, int& port) {
  sockaddr_in a{};
  if (!parse_endpoint(addr + ":1", a))
    return invalid_argument("snapshot keeper: '{}' is not an IPv4 address", addr);
  a.sin_port = 0;
  FileHandle fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return io_error("snapshot keeper: socket: {}", std::strerror(errno));
  int one = 1;
  ::setsockopt(fd.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.fd(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd.fd(), 64) != 0) {
    return io_error("snapshot keeper: listen on {}: {}", addr, std::strerror(errno));
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd.fd(), reinterpret_cast<sockaddr*>(&a), &len);
  port = ntohs(a.sin_port);
  return fd;
}

Result<FileHandle> connect_unix(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path))
    return invalid_argument("snapshot keeper socket path {} is too long", path);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  FileHandle fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return io_error("snapshot keeper: socket: {}", std::strerror(errno));
  if (::connect(fd.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return unavailable("snapshot keeper at {}: connect: {}", path, std::strerror(errno));
  }
  return fd;
}

}  // namespace troupe::checkpoint::wire
