// scheduler/daemons/spawner.cc — fork/exec with process groups, log redirection and pidfds.
#include "scheduler/daemons/spawner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace troupe::sched {
namespace {

// Steps reported by the child through the error pipe before exec.
enum ChildStep : int { kStepSetpgid = 1, kStepDup, kStepChdir, kStepExec, kStepParent };

const char* step_name(int step) {
  switch (step) {
    case kStepSetpgid: return "setpgid";
    case kStepDup: return "redirecting output";
    case kStepChdir: return "chdir";
    case kStepExec: return "exec";
    case kStepParent: return "parent died";
  }
  return "?";
}

void child_fail(int fd, int step) {
  int buf[2] = {step, errno};
  ssize_t n = write(fd, buf, sizeof(buf));
  (void)n;
  _exit(127);
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  long fd = syscall(SYS_pidfd_open, pid, 0);
  return fd < 0 ? -1 : static_cast<int>(fd);
#else
  (void)pid;
  return -1;
#endif
}

}  // namespace

Result<std::string> resolve_program(const std::string& name, const std::string& path_env) {
  if (name.empty()) return invalid_argument("empty program name");
  if (name.find('/') != std::string::npos) return name;  // relative to the work dir, checked by exec
  size_t start = 0;
  for (;;) {
    size_t colon = path_env.find(':', start);
    std::string dir = path_env.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    std::string cand = fmt::format("{}/{}", dir.empty() ? std::string_view(".") : std::string_view(dir), name);
    struct stat st;
    if (stat(cand.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(cand.c_str(), X_OK) == 0) return cand;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return not_found("program '{}' not found in PATH ({})", name, path_env);
}

Result<ChildProcess> spawn_process(const SpawnOptions& opts) {
  if (opts.argv.empty()) return invalid_argument("spawn: empty argv");
  std::string path_env = "/usr/local/bin:/usr/bin:/bin";
  for (const auto& e : opts.env) {
    if (e.rfind("PATH=", 0) == 0) path_env = e.substr(5);
  }
  TROUPE_ASSIGN_OR_RETURN(std::string program, resolve_program(opts.argv[0], path_env));

  // Everything the child needs is prepared here: after fork only async-signal-safe calls.
  std::vector<char*> argv, envp;
  for (const auto& a : opts.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : opts.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int log_fd = -1;
  if (!opts.log_path.empty()) {
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::path(opts.log_path).parent_path();
    // A process's output may hold anything it printed (tokens, paths, data): a directory made
    // here is its owner's only; one that existed keeps its mode (the file itself is 0600).
    if (std::filesystem::create_directories(dir, ec)) ::chmod(dir.c_str(), 0700);
    log_fd = open(opts.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (log_fd < 0) return io_error("cannot open log file {}: {}", opts.log_path, std::strerror(errno));
  }
  int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    if (log_fd >= 0) close(log_fd);
    if (null_fd >= 0) close(null_fd);
    return io_error("pipe2: {}", std::strerror(errno));
  }
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);  // no handler may run in the child before exec
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    // Child.
    if (setpgid(0, 0) != 0) child_fail(err_pipe[1], kStepSetpgid);
    if (opts.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) child_fail(err_pipe[1], kStepParent);
    }
    for (int s = 1; s < NSIG; ++s) {
      if (s == SIGKILL || s == SIGSTOP) continue;
      struct sigaction sa;
      std::memset(&sa, 0, sizeof(sa));
      sa.sa_handler = SIG_DFL;
      sigaction(s, &sa, nullptr);
    }
    if (null_fd >= 0 && dup2(null_fd, 0) < 0) child_fail(err_pipe[1], kStepDup);
    if (log_fd >= 0 && (dup2(log_fd, 1) < 0 || dup2(log_fd, 2) < 0)) child_fail(err_pipe[1], kStepDup);
    if (!opts.work_dir.empty() && chdir(opts.work_dir.c_str()) != 0) child_fail(err_pipe[1], kStepChdir);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(program.c_str(), argv.data(), envp.data());
    child_fail(err_pipe[1], kStepExec);
  }
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  close(err_pipe[1]);
  if (log_fd >= 0) close(log_fd);
  if (null_fd >= 0) close(null_fd);
  if (pid < 0) {
    close(err_pipe[0]);
    return io_error("fork: {}", std::strerror(fork_errno));
  }
  // Also set the group from the parent, so a kill right after return reaches it.
  setpgid(pid, pid);
  int buf[2] = {0, 0};
  ssize_t n;
  do {
    n = read(err_pipe[0], buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  close(err_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof(buf))) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    std::string what = buf[0] == kStepExec ? program : buf[0] == kStepChdir ? opts.work_dir : std::string();
    return failed_precondition("{} {}: {}", step_name(buf[0]), what, std::strerror(buf[1]));
  }
  return ChildProcess{pid, open_pidfd(pid)};
}

std::optional<ExitInfo> try_reap(pid_t pid) {
  int status = 0;
  pid_t r = waitpid(pid, &status, WNOHANG);
  if (r != pid) {
    if (r < 0 && errno == ECHILD) return ExitInfo{255, 0};  // reaped elsewhere: report unknown
    return std::nullopt;
  }
  ExitInfo e;
  if (WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) e.term_signal = WTERMSIG(status);
  return e;
}

Status kill_process_group(pid_t pgid, int sig) {
  if (pgid <= 1) return invalid_argument("refusing to signal process group {}", pgid);
  if (::kill(-pgid, sig) != 0 && errno != ESRCH) {
    return io_error("kill(-{}, {}): {}", pgid, sig, std::strerror(errno));
  }
  return ok_status();
}

}  // namespace troupe::sched
