// scheduler/daemons/agent_main.cc — troupe-agent: one per node; runs the job processes the
// scheduler places here.
//
//   troupe-agent --scheduler HOST:7460 [--slots N] [--id NAME] [--work-dir DIR]
//                [--curve-key agent.key --scheduler-key scheduler.pub]
//                [--host-addr ADDR | --iface NAME] [--insecure]
// On SIGINT/SIGTERM it stops every process it started (SIGTERM, then SIGKILL).
#include <signal.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdlib>
#include <filesystem>

#include "core/job_env.h"
#include "core/logging.h"
#include "scheduler/client/local_auth.h"
#include "scheduler/daemons/agent.h"

namespace {
std::atomic<bool> g_stop{false};  // set by the signal handler
void on_signal(int) { g_stop.store(true); }
}  // namespace

int main(int argc, char** argv) {
  // Job logs and key files, and what job processes create (they inherit the mask; a
  // training job sets its own, train.umask), are their owner's only.
  ::umask(077);
  troupe::sched::AgentOptions opts;
  std::string scheduler_key;
  CLI::App app{"troupe-agent: starts, watches and stops Troupe job processes on this node"};
  app.add_option("--scheduler,-s", opts.scheduler, "Scheduler address HOST:PORT")->required();
  app.add_option("--slots", opts.slots, "Worker slots (default: GPUs, or CPUs when there is no GPU)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--id", opts.agent_id, "Agent name (default: the host name)");
  app.add_option("--work-dir", opts.work_dir, "Where process logs go (default ./troupe-agent)");
  app.add_option("--curve-key", opts.key_file, "This agent's CURVE key pair file");
  app.add_option("--scheduler-key", scheduler_key, "The scheduler's public key file: turns CURVE on");
  app.add_option("--heartbeat-ms", opts.heartbeat_ms, "Heartbeat interval")->check(CLI::Range(1, 1000000));
  std::string iface;
  auto* ha =
      app.add_option("--host-addr", opts.host_addr,
                     "This node's IPv4 address: job processes bind and advertise it (TROUPE_HOST_ADDR)");
  app.add_option("--iface", iface, "Take --host-addr from this network interface (e.g. eth0)")->excludes(ha);
  app.add_flag("--insecure", opts.insecure,
               "Allow a non-loopback --host-addr without CURVE (trusted networks only)");
  bool no_relay = false;
  bool no_snapshots = false;
  app.add_flag("--no-snapshots", no_snapshots,
               "do not hold the training workers' in-memory snapshots here (they then live in the workers "
               "and die with them)");
  app.add_flag("--no-relay", no_relay,
               "Job processes connect to the scheduler themselves (default: their sessions go through "
               "this agent's local relay, one scheduler connection per host)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  opts.relay = !no_relay;
  opts.snapshots = !no_snapshots;
  troupe::init_logging(troupe::LoggingOptions{"agent", "", spdlog::level::info});
  if (!iface.empty()) {
    auto addr = troupe::sched::interface_address(iface);
    if (!addr.ok()) {
      std::fprintf(stderr, "troupe-agent: --iface: %s\n", addr.status().message().c_str());
      return 2;
    }
    opts.host_addr = *addr;
  }
  // Our own connection to the scheduler leaves from this address too (transport.cc).
  if (!opts.host_addr.empty()) setenv(troupe::job_env::kHostAddr, opts.host_addr.c_str(), 1);
  if (!scheduler_key.empty() || !opts.key_file.empty()) {
    if (scheduler_key.empty() || opts.key_file.empty()) {
      std::fprintf(stderr, "troupe-agent: CURVE needs both --curve-key and --scheduler-key\n");
      return 2;
    }
    auto server = troupe::sched::read_key_file(scheduler_key);
    auto mine = troupe::sched::read_key_file(opts.key_file);
    if (!server.ok() || !mine.ok()) {
      std::fprintf(stderr, "troupe-agent: %s\n", (!server.ok() ? server.status() : mine.status()).message().c_str());
      return 2;
    }
    opts.security.server_public_key = server->public_key;
    opts.security.client_keys = *mine;
    opts.key_file = std::filesystem::absolute(opts.key_file).string();
  } else if (auto ep = troupe::sched::normalize_endpoint(opts.scheduler);
             ep.ok() && troupe::sched::is_local_endpoint(*ep) && !opts.insecure) {
    // A loopback scheduler started without keys serves this user's credential.
    auto sec = troupe::sched::local_client_security();
    if (!sec.ok()) {
      std::fprintf(stderr, "troupe-agent: %s\n", sec.status().message().c_str());
      return 2;
    }
    opts.security = *sec;
    opts.key_file = troupe::sched::credential_path();
  }
  auto agent = troupe::sched::Agent::create(opts);
  if (!agent.ok()) {
    std::fprintf(stderr, "troupe-agent: %s\n", agent.status().message().c_str());
    return 1;
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGPIPE, SIG_IGN);
  while (!g_stop.load()) (*agent)->run_once(std::chrono::milliseconds(50));
  spdlog::info("troupe-agent stopping: stopping its processes");
  (*agent)->kill_all(std::chrono::milliseconds(2000));
  return 0;
}
