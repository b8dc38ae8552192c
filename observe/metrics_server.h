// observe/metrics_server.h — defines MetricsServer: a Prometheus /metrics endpoint (HTTP
// GET, the text format of prometheus-cpp's TextSerializer) serving one prometheus-cpp
// Registry, and the rule for where it may listen.
//
// Why not prometheus-cpp's pull Exposer: it runs Debian's civetweb, whose threads have a
// stack fixed at build time (100 KiB), smaller than the static TLS of a process that
// links cuBLASLt (94 KiB), so it cannot start a thread in the training driver
// (pthread_create: EINVAL). This server is one std::thread that answers one scrape at a
// time (a scrape is a few KiB; Prometheus scrapes every few seconds).
//
// Binding follows the control plane's rule: loopback by default; an address other than
// loopback only with credentials — HTTP basic auth from a file holding one line
// "user:password" (mode 0600: readable by its owner alone; Prometheus' scrape config
// takes the same password with basic_auth.password_file) — or with `insecure` (a trusted
// network, as the daemons' --insecure). Basic auth over plain HTTP sends the password in
// clear: keep the network private or put a TLS proxy in front.
//
// Threading: the server's thread serves scrapes; the Registry's metrics are thread-safe,
// so any thread may update them.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "core/status.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace troupe::observe {

struct MetricsServerOptions {
  // "HOST:PORT" (PORT 0: a free port) or "PORT" (on 127.0.0.1).
  std::string listen;
  std::string basic_auth_file;  // required off loopback unless `insecure`
  bool insecure = false;
};

// True for 127.0.0.0/8, ::1 and "localhost".
bool is_loopback_host(const std::string& host);

class MetricsServer {
 public:
  static Result<std::unique_ptr<MetricsServer>> start(const MetricsServerOptions& o,
                                                      std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();
  // The URL Prometheus scrapes, e.g. "http://127.0.0.1:9400/metrics".
  const std::string& url() const { return url_; }
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  void serve();
  void answer(int fd);
  std::shared_ptr<prometheus::Registry> registry_;
  std::optional<std::pair<std::string, std::string>> auth_;  // user, password
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a byte on wake_[1] stops serve()
  std::thread thread_;
  std::string url_;
  int port_ = 0;
};

}  // namespace troupe::observe
