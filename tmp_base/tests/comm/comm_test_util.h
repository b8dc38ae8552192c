// tests/comm/comm_test_util.h — helpers for the multi-process data-plane tests: a temporary
// directory, run_ranks() (one forked process per rank, every wait bounded, every child
// reaped or killed), and CHILD_CHECK (a check usable inside a child, where gtest's
// assertions would be invisible to the parent).
#pragma once

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace troupe::comm::testing {

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("troupe-comm-{}-{:x}", ::getpid(), (uint64_t{rd()} << 32) | rd());
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Failures counted in the current (child) process.
inline std::atomic<int>& child_failures() {
  static std::atomic<int> n{0};
  return n;
}

#define CHILD_CHECK(cond, ...)                                                                             \
  do {                                                                                                     \
    if (!(cond)) {                                                                                         \
      ::troupe::comm::testing::child_failures()++;                                                         \
      std::fprintf(stderr, "[pid %d] %s:%d: CHECK failed: %s %s\n", ::getpid(), __FILE__, __LINE__, #cond, \
                   fmt::format("" __VA_ARGS__).c_str());                                                   \
    }                                                                                                      \
  } while (0)

#define CHILD_CHECK_OK(expr)                                                                         \
  do {                                                                                               \
    auto _st = (expr);                                                                               \
    if (!_st.ok()) {                                                                                 \
      ::troupe::comm::testing::child_failures()++;                                                   \
      std::fprintf(stderr, "[pid %d] %s:%d: %s failed: %s\n", ::getpid(), __FILE__, __LINE__, #expr, \
                   _st.to_string().c_str());                                                         \
    }                                                                                                \
  } while (0)

struct ChildExit {
  int rank = 0;
  bool exited = false;  // normal exit (else signalled or killed at the timeout)
  int code = -1;        // exit code if exited
  int signal = 0;       // terminating signal otherwise
  bool timed_out = false;
};

// Forks `n` children; child r runs fn(r) and _exit()s with its return value (1 if it
// recorded CHILD_CHECK failures). Waits at most `timeout` in total, then SIGKILLs and
// reaps whatever is left. The caller must hold no threads that a child would need.
inline std::vector<ChildExit> run_ranks(int n, const std::function<int(int)>& fn,
                                        std::chrono::milliseconds timeout) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(n, -1);
  std::vector<ChildExit> out(n);
  for (int r = 0; r < n; ++r) {
    out[r].rank = r;
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = 1;
      try {
        code = fn(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] uncaught exception: %s\n", r, e.what());
        code = 3;
      }
      if (code == 0 && child_failures() > 0) code = 1;
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    pids[r] = pid;
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got == pids[r]) {
        if (WIFEXITED(status)) {
          out[r].exited = true;
          out[r].code = WEXITSTATUS(status);
        } else if (WIFSIGNALED(status)) {
          out[r].signal = WTERMSIG(status);
        }
        pids[r] = -1;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (int r = 0; r < n; ++r) {
        if (pids[r] <= 0) continue;
        ::kill(pids[r], SIGKILL);
        int status = 0;
        ::waitpid(pids[r], &status, 0);
        out[r].timed_out = true;
        out[r].signal = SIGKILL;
        pids[r] = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return out;
}

inline std::string describe(const ChildExit& c) {
  if (c.timed_out) return fmt::format("rank {} timed out (killed)", c.rank);
  if (c.exited) return fmt::format("rank {} exited with {}", c.rank, c.code);
  return fmt::format("rank {} killed by signal {}", c.rank, c.signal);
}

}  // namespace troupe::comm::testing
