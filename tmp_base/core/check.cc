// core/check.cc — the failure path of TROUPE_CHECK.
#include "core/check.h"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>

namespace troupe::detail {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  // Written to stderr directly as well: the logger may be asynchronous or not set up.
  std::fprintf(stderr, "%s:%d: check failed: %s %s\n", file, line, cond, msg.c_str());
  std::fflush(stderr);
  spdlog::critical("{}:{}: check failed: {} {}", file, line, cond, msg);
  spdlog::shutdown();
  std::abort();
}

}  // namespace troupe::detail
