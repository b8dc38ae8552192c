// scheduler/daemons/spawner.h — defines spawn_process (fork + exec of a job process in its own
// process group, stdout/stderr appended to a log file, stdin from /dev/null, optional
// death with its parent), ChildProcess (the pid and a pidfd that becomes readable the
// moment the process exits, for poll()), try_reap and kill_process_group.
//
// Contract: spawn_process returns only after the child has exec'ed (or failed to: then
// the error names the step, e.g. "exec /x/y: No such file or directory"). It is safe in a
// multi-threaded process: the child runs only async-signal-safe calls before exec.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace troupe::sched {

struct SpawnOptions {
  std::vector<std::string> argv;      // argv[0] without '/' is looked up in PATH
  std::vector<std::string> env;       // complete environment, "K=V"
  std::string work_dir;               // empty: inherit
  std::string log_path;               // stdout+stderr appended here (directories created)
  bool die_with_parent = true;        // PR_SET_PDEATHSIG=SIGKILL: no orphans if we die
};

struct ChildProcess {
  pid_t pid = 0;   // also the process group id
  int pidfd = -1;  // -1 when the kernel has no pidfd_open; then poll with a timeout
};

struct ExitInfo {
  int exit_code = 0;
  int term_signal = 0;
  int exit_status() const { return term_signal ? 128 + term_signal : exit_code; }
};

Result<ChildProcess> spawn_process(const SpawnOptions& opts);
// Non-blocking: the exit of `pid` if it has ended (and reaps it), else nullopt.
std::optional<ExitInfo> try_reap(pid_t pid);
// Sends `sig` to the process group `pgid` (the whole tree the child did not move out of).
Status kill_process_group(pid_t pgid, int sig);
// Looks `name` up the way execvp would, using `path_env` (a PATH value).
Result<std::string> resolve_program(const std::string& name, const std::string& path_env);

}  // namespace troupe::sched
