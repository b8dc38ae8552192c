// observe/metrics_server.cc — MetricsServer (metrics_server.h).
#include "observe/metrics_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace troupe::observe {

namespace {

struct HostPort {
  std::string host;
  std::string port;
};

Result<HostPort> split_listen(const std::string& listen) {
  if (listen.empty()) return invalid_argument("metrics: empty listen address");
  const auto all_digits = [](const std::string& s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
  };
  if (all_digits(listen)) return HostPort{"127.0.0.1", listen};
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || !all_digits(listen.substr(colon + 1)))
    return invalid_argument("metrics: listen address '{}' is not HOST:PORT (e.g. 127.0.0.1:9400)", listen);
  HostPort hp{listen.substr(0, colon), listen.substr(colon + 1)};
  if (std::stol(hp.port) > 65535) return invalid_argument("metrics: port {} is out of range", hp.port);
  return hp;
}

// "user:password" from a file only its owner can read.
Result<std::pair<std::string, std::string>> read_basic_auth(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return not_found("metrics: basic-auth file {} not found", path);
  if ((st.st_mode & 077) != 0)
    return permission_denied("metrics: basic-auth file {} is readable by others (chmod 600 {})", path, path);
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) line.pop_back();
  const size_t colon = line.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == line.size())
    return invalid_argument("metrics: basic-auth file {} must hold one line 'user:password'", path);
  return std::make_pair(line.substr(0, colon), line.substr(colon + 1));
}

bool same(const std::string& a, const std::string& b) {  // constant time in the longer input
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i)
    diff |= static_cast<unsigned>(i < a.size() ? a[i] : 0) ^ static_cast<unsigned>(i < b.size() ? b[i] : 0);
  return diff == 0;
}

std::string base64_decode(const std::string& in) {
  static const std::string kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t buf = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const size_t v = kAlphabet.find(c);
    if (v == std::string::npos) return "";
    buf = (buf << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((buf >> bits) & 0xff));
    }
  }
  return out;
}

void send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

std::string response(const char* status, const std::string& type, const std::string& body,
                     const std::string& extra = "") {
  return fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n{}",
                     status, type, body.size(), extra, body);
}

}  // namespace

bool is_loopback_host(const std::string& host) {
  std::string h = host;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h == "localhost" || h == "::1") return true;
  in_addr a{};
  return inet_pton(AF_INET, h.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const MetricsServerOptions& o,
                                                            std::shared_ptr<prometheus::Registry> registry) {
  TROUPE_ASSIGN_OR_RETURN(HostPort hp, split_listen(o.listen));
  const bool loopback = is_loopback_host(hp.host);
  std::optional<std::pair<std::string, std::string>> auth;
  if (!o.basic_auth_file.empty()) {
    TROUPE_ASSIGN_OR_RETURN(auto a, read_basic_auth(o.basic_auth_file));
    auth = std::move(a);
  }
  if (!loopback && !auth && !o.insecure) {
    return permission_denied(
        "metrics: {} is not a loopback address: serving /metrics there needs a basic-auth file "
        "(user:password, mode 0600) or --insecure for a trusted network",
        o.listen);
  }
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->registry_ = std::move(registry);
  s->auth_ = std::move(auth);
  std::string host = hp.host;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), hp.port.c_str(), &hints, &res); rc != 0)
    return invalid_argument("metrics: cannot resolve '{}': {}", host, gai_strerror(rc));
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool bound = fd >= 0 && bind(fd, res->ai_addr, res->ai_addrlen) == 0 && listen(fd, 16) == 0;
  const int err = errno;
  freeaddrinfo(res);
  if (!bound) {
    if (fd >= 0) close(fd);
    return unavailable("metrics: cannot serve /metrics on {}: {}", o.listen, std::strerror(err));
  }
  s->listen_fd_ = fd;
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  s->port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (pipe2(s->wake_, O_CLOEXEC) != 0) return io_error("metrics: pipe: {}", std::strerror(errno));
  s->url_ = fmt::format("http://{}:{}/metrics", host.find(':') != std::string::npos ? "[" + host + "]" : host,
                        s->port_);
  s->thread_ = std::thread([p = s.get()] { p->serve(); });
  return s;
}

MetricsServer::~MetricsServer() {
  if (thread_.joinable()) {
    const char b = 0;
    if (write(wake_[1], &b, 1) < 0) {
    }
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void MetricsServer::serve() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    // A client that sends nothing holds the (single) server for at most 2 s.
    timeval tv{2, 0};
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    answer(c);
    close(c);
  }
}

void MetricsServer::answer(int fd) {
  std::string req;
  char buf[2048];
  while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return;
    req.append(buf, static_cast<size_t>(n));
  }
  const size_t eol = req.find("\r\n");
  const std::string line = req.substr(0, eol);
  const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) {
    send_all(fd, response("400 Bad Request", "text/plain", "bad request\n"));
    return;
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  if (auth_) {
    std::string given;
    for (size_t at = eol; at != std::string::npos && at < req.size();) {
      const size_t next = req.find("\r\n", at + 2);
      const std::string h = req.substr(at + 2, next == std::string::npos ? std::string::npos : next - at - 2);
      if (h.size() > 21 && strncasecmp(h.c_str(), "Authorization: Basic ", 21) == 0)
        given = base64_decode(h.substr(21));
      at = next;
    }
    const size_t colon = given.find(':');
    if (colon == std::string::npos || !same(given.substr(0, colon), auth_->first) ||
        !same(given.substr(colon + 1), auth_->second)) {
      send_all(fd, response("401 Unauthorized", "text/plain", "credentials required\n",
                            "WWW-Authenticate: Basic realm=\"troupe\"\r\n"));
      return;
    }
  }
  if (method != "GET" && method != "HEAD") {
    send_all(fd, response("405 Method Not Allowed", "text/plain", "GET only\n"));
    return;
  }
  if (path != "/metrics") {
    send_all(fd, response("404 Not Found", "text/plain", "only /metrics is served here\n"));
    return;
  }
  const std::string body = prometheus::TextSerializer().Serialize(registry_->Collect());
  send_all(fd, response("200 OK", "text/plain; version=0.0.4; charset=utf-8", method == "HEAD" ? "" : body));
}

}  // namespace troupe::observe
