// scheduler/daemons/scheduler_main.cc — troupe-scheduler: the cluster's scheduler daemon.
//
//   troupe-scheduler --listen tcp://0.0.0.0:7460 --state-dir /var/lib/troupe
//                    [--curve-key scheduler.key --allow-keys keys/]
// On a loopback address without --curve-key (and without --insecure) it serves CURVE
// with the credential of the user who started it (scheduler/client/local_auth.h).
// Stops on SIGINT/SIGTERM; job processes keep running (their agents own them), and a
// scheduler started again on the same state dir re-attaches to them.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdlib>

#include "core/env.h"
#include "core/logging.h"
#include "scheduler/client/local_auth.h"
#include "scheduler/client/transport.h"
#include "scheduler/daemons/scheduler.h"

namespace {
std::atomic<bool> g_stop{false};  // set by the signal handler
void on_signal(int) { g_stop.store(true); }
}  // namespace

int main(int argc, char** argv) {
  // Everything the scheduler writes (its database, events, keys) is its owner's only.
  ::umask(077);
  troupe::sched::SchedulerOptions opts;
  opts.listen = troupe::sched::kDefaultSchedulerAddress;
  opts.state_dir = "troupe-state";
  std::string curve_key;
  std::vector<std::string> allow_keys;
  CLI::App app{"troupe-scheduler: places and supervises Troupe jobs"};
  app.add_option("--listen,-l", opts.listen, "Address to bind (tcp://HOST:PORT; port 0 picks one)");
  app.add_option("--advertise", opts.advertise, "Address job processes use to reach us (default: the bound one)");
  app.add_option("--state-dir", opts.state_dir, "SQLite state and per-job events.jsonl");
  app.add_option("--curve-key", curve_key, "The scheduler's CURVE key pair file: turns CURVE on");
  app.add_option("--allow-keys", allow_keys, "Client public keys allowed in (files or directories of .pub/.key)");
  app.add_option("--agent-timeout-ms", opts.agent_timeout_ms, "An agent silent this long is dead")->check(CLI::Range(1, 1000000));
  app.add_option("--agent-heartbeat-ms", opts.agent_heartbeat_ms, "Heartbeat period told to agents")
      ->check(CLI::Range(10, 600000));
  app.add_option("--io-threads", opts.io_threads,
                 "ZeroMQ I/O threads (CURVE handshakes and encryption run on them; default 1)")
      ->check(CLI::Range(1, 64));
  app.add_flag("--insecure", opts.security.allow_insecure_non_loopback,
               "Allow a non-loopback --listen address without CURVE (trusted networks only)");
  std::vector<std::string> detector;
  app.add_option("--metrics-listen", opts.metrics.listen,
                 "Serve Prometheus /metrics on HOST:PORT (default: not served; off loopback it needs "
                 "--metrics-auth-file or --insecure)");
  app.add_option("--metrics-auth-file", opts.metrics.basic_auth_file,
                 "HTTP basic auth for /metrics: a file with one line user:password, mode 0600");
  app.add_option("--detector", detector,
                 "A faulty-machine detector threshold KEY=VALUE (docs/elastic.md); repeatable");
  std::string endpoint_file;
  app.add_option("--endpoint-file", endpoint_file, "Write the bound address here once listening");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  troupe::init_logging(troupe::LoggingOptions{"scheduler", "", spdlog::level::info});
  // Every `troupe` command is a short-lived control-plane peer; the transport's
  // "peer up" lines for them would drown the scheduler's own log. Warnings (a peer gone,
  // a refused CURVE key) still show; SPDLOG_LEVEL=control=info brings the rest back.
  if (!troupe::env::get("SPDLOG_LEVEL")) troupe::make_logger("control")->set_level(spdlog::level::warn);
  auto norm = troupe::sched::normalize_endpoint(opts.listen);
  if (!norm.ok()) {
    std::fprintf(stderr, "troupe-scheduler: %s\n", norm.status().message().c_str());
    return 2;
  }
  opts.listen = *norm;
  opts.metrics.insecure = opts.security.allow_insecure_non_loopback;
  for (const std::string& kv : detector) {
    if (auto ds = opts.detector.set(kv); !ds.ok()) {
      std::fprintf(stderr, "troupe-scheduler: %s\n", ds.message().c_str());
      return 2;
    }
  }
  if (!curve_key.empty()) {
    auto keys = troupe::sched::read_key_file(curve_key);
    auto allowed = troupe::sched::read_public_keys(allow_keys);
    if (!keys.ok() || !allowed.ok()) {
      std::fprintf(stderr, "troupe-scheduler: %s\n", (!keys.ok() ? keys.status() : allowed.status()).message().c_str());
      return 2;
    }
    if (keys->secret_key.empty()) {
      std::fprintf(stderr, "troupe-scheduler: %s holds no secret key\n", curve_key.c_str());
      return 2;
    }
    opts.security.server_keys = *keys;
    opts.security.allowed_client_keys = *allowed;
  } else if (!opts.security.allow_insecure_non_loopback && troupe::sched::is_local_endpoint(opts.listen)) {
    // Local authentication: only holders of this user's credential get in.
    auto cred = troupe::sched::load_or_create_credential();
    auto allowed = troupe::sched::read_public_keys(allow_keys);
    if (!cred.ok() || !allowed.ok()) {
      std::fprintf(stderr, "troupe-scheduler: %s\n",
                   (!cred.ok() ? cred.status() : allowed.status()).message().c_str());
      return 2;
    }
    opts.security.server_keys = *cred;
    opts.security.allowed_client_keys = *allowed;
    opts.security.allowed_client_keys.push_back(cred->public_key);
    spdlog::info("local authentication: clients must hold the credential {} (or a key under --allow-keys)",
                 troupe::sched::credential_path());
  } else if (!allow_keys.empty()) {
    std::fprintf(stderr, "troupe-scheduler: --allow-keys needs --curve-key\n");
    return 2;
  }
  // One connection (one fd) per agent and per job process: thousands at cluster scale.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  auto sched = troupe::sched::Scheduler::create(opts);
  if (!sched.ok()) {
    std::fprintf(stderr, "troupe-scheduler: %s\n", sched.status().message().c_str());
    return 1;
  }
  if (!endpoint_file.empty()) {
    FILE* f = std::fopen(endpoint_file.c_str(), "w");
    if (f) {
      std::fprintf(f, "%s\n", (*sched)->endpoint().c_str());
      std::fclose(f);
    }
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGPIPE, SIG_IGN);
  while (!g_stop.load()) (*sched)->run_once(std::chrono::milliseconds(20));
  spdlog::info("troupe-scheduler stopping");
  return 0;
}
