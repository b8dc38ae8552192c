// observe/metrics_server.cc — MetricsServer (metrics_server.h).
#include "observe/metrics_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <sys/stat.h>

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
  const std::string bind = hp.host.find(':') != std::string::npos && hp.host.front() != '['
                               ? fmt::format("[{}]:{}", hp.host, hp.port)
                               : fmt::format("{}:{}", hp.host, hp.port);
  try {
    s->exposer_ = std::make_unique<prometheus::Exposer>(bind, 1);
  } catch (const std::exception& e) {
    return unavailable("metrics: cannot serve /metrics on {}: {}", bind, e.what());
  }
  if (auth) {
    s->exposer_->RegisterAuth(
        [user = auth->first, pass = auth->second](const std::string& u, const std::string& p) {
          return same(u, user) && same(p, pass);
        },
        "troupe");
  }
  s->exposer_->RegisterCollectable(s->registry_);
  const std::vector<int> ports = s->exposer_->GetListeningPorts();
  if (ports.empty()) return unavailable("metrics: {} listens on no port", bind);
  s->port_ = ports[0];
  const std::string host = hp.host.find(':') != std::string::npos && hp.host.front() != '['
                               ? "[" + hp.host + "]"
                               : hp.host;
  s->url_ = fmt::format("http://{}:{}/metrics", host, s->port_);
  return s;
}

MetricsServer::~MetricsServer() = default;

}  // namespace troupe::observe
