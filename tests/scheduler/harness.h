// tests/scheduler/harness.h — defines the multi-process test harness of the scheduler
// tests: a Cluster of real troupe-scheduler and troupe-agent processes on loopback (a
// random free port, a temporary state dir), running the troupe CLI, reading
// events.jsonl, and the /proc scan that proves no process of a test is left behind
// (every job process carries TW_TAG=<unique tag> in its environment).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "scheduler/client/transport.h"

namespace troupe::sched::test {

// Paths of the executables under test (set by CMake).
std::string scheduler_bin();
std::string agent_bin();
std::string cli_bin();
std::string worker_bin();

int free_port();
std::string make_temp_dir(const std::string& what);
// Points `env`'s TMPDIR at `dir` (replacing any): the temporary folders of the processes it
// starts (a `troupe run`'s state directory) go with the test's own folder.
void set_tmpdir(std::vector<std::string>& env, const std::string& dir);
bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout,
                std::chrono::milliseconds step = std::chrono::milliseconds(20));
// Pids of live processes whose environment holds TW_TAG=<tag>.
std::vector<pid_t> procs_with_tag(const std::string& tag);
bool pid_alive(pid_t pid);  // false once it is a zombie or gone
std::vector<nlohmann::json> read_events(const std::string& path);

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};
// Runs `troupe <args>` and waits (bounded) for it.
CliResult run_cli(const std::vector<std::string>& args, std::chrono::milliseconds timeout = std::chrono::seconds(20));

// A daemon process in its own process group that dies with the test (PDEATHSIG).
class Daemon {
 public:
  Daemon() = default;
  Daemon(const std::vector<std::string>& argv, const std::string& log, const std::vector<std::string>& extra_env = {});
  ~Daemon() { stop(); }
  Daemon(Daemon&& o) noexcept : pid_(o.pid_), log_(std::move(o.log_)) { o.pid_ = 0; }
  Daemon& operator=(Daemon&& o) noexcept {
    stop();
    pid_ = o.pid_;
    log_ = std::move(o.log_);
    o.pid_ = 0;
    return *this;
  }
  pid_t pid() const { return pid_; }
  const std::string& log() const { return log_; }
  // Sends `sig` to the daemon (not its group) and waits for it; SIGKILL after 5 s.
  int stop(int sig = SIGTERM);
  std::string log_text() const;

 private:
  pid_t pid_ = 0;
  std::string log_;
};

class Cluster {
 public:
  struct Options {
    int agents = 2;
    int slots_per_agent = 2;
    bool curve = false;
    int agent_timeout_ms = 3000;
    // "Hosts" on one machine: the scheduler listens on scheduler_host; agent i runs with
    // --host-addr agent_hosts[i] when given (its processes bind and advertise it).
    std::string scheduler_host = "127.0.0.1";
    std::vector<std::string> agent_hosts;
    std::vector<std::string> scheduler_args;  // added to troupe-scheduler's command line
  };
  explicit Cluster(Options opts);
  ~Cluster();

  void start_scheduler();
  void restart_scheduler(int sig);
  void stop_scheduler(int sig);  // sends `sig` and waits for it to end (an outage until start_scheduler)
  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  std::vector<std::string> conn_args() const;  // --scheduler and, with CURVE, the key flags
  std::string client_key() const { return dir_ + "/keys/client.key"; }
  std::string scheduler_pub() const { return dir_ + "/keys/scheduler.pub"; }

  // `troupe <args[0]> <conn_args()> <args[1..]>`: a CLI command against this cluster.
  CliResult cli(const std::vector<std::string>& args,
                std::chrono::milliseconds timeout = std::chrono::seconds(20)) const;
  // `troupe submit <flags> --env TW_TAG=<tag> -- <argv>` (the tag lets the harness find
  // every process of the job); EXPECTs success and returns the job id.
  std::string submit_command(const std::vector<std::string>& flags, const std::vector<std::string>& argv);
  // `troupe submit` with the test worker; returns the job id.
  std::string submit(int nproc, const std::vector<std::string>& flags, const std::map<std::string, std::string>& env);
  nlohmann::json status(const std::string& job);   // one job's status document (library client)
  nlohmann::json proc(const std::string& job, const std::string& name);
  std::string job_state(const std::string& job);
  bool wait_state(const std::string& job, const std::string& state, std::chrono::milliseconds timeout);
  // Waits until every named process of `job` runs in `epoch` and has said hello.
  bool wait_running(const std::string& job, const std::vector<std::string>& names, uint64_t epoch,
                    std::chrono::milliseconds timeout);
  std::vector<nlohmann::json> events(const std::string& job);
  std::string tag() const { return tag_; }
  std::string out_dir() const { return dir_ + "/out"; }
  std::string logs_of_daemons() const;
  Daemon& agent(size_t i) { return agents_.at(i); }

 private:
  Options opts_;
  std::string dir_;
  std::string address_;
  std::string tag_;
  Daemon scheduler_;
  std::vector<Daemon> agents_;
};

}  // namespace troupe::sched::test
