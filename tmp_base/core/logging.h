// core/logging.h — defines init_logging (one sink set for the process, levels from
// SPDLOG_LEVEL, e.g. SPDLOG_LEVEL=info,comm=debug) and make_logger (a named component
// logger sharing those sinks). Cache the returned pointer; spdlog::get takes a mutex.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace troupe {

struct LoggingOptions {
  std::string process_tag;  // printed in every line, e.g. "worker 3" or "scheduler"
  std::string file;         // also log to this file when non-empty
  spdlog::level::level_enum level = spdlog::level::info;  // before SPDLOG_LEVEL overrides
};

// Call once from main(); safe to call again (later calls replace the sinks).
void init_logging(const LoggingOptions& opts);

// Returns the logger for `component` ("comm", "sched", ...), creating it on first use.
std::shared_ptr<spdlog::logger> make_logger(const std::string& component);

}  // namespace troupe
