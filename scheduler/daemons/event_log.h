// scheduler/daemons/event_log.h — defines EventLog: appends one JSON object per line to
// <job dir>/events.jsonl, each with "ts" (ISO-8601 UTC with milliseconds), "ts_ms" (ms
// since the Unix epoch), "job" and "type", plus the event's own fields.
//
// Each append opens, writes and closes the file (O_APPEND), so lines from a restarted
// scheduler follow the old ones and a crash never leaves a half-buffered line.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "core/status.h"

namespace troupe::sched {

std::string iso8601_utc(int64_t ms_since_epoch);

class EventLog {
 public:
  // Creates `job_dir` when missing.
  static Result<EventLog> open(const std::string& job_dir, const std::string& job_id);

  // `fields` must be a JSON object (or null); ts/ts_ms/job/type are added.
  Status append(const std::string& type, const nlohmann::json& fields, int64_t ts_ms);
  const std::string& path() const { return path_; }

 private:
  EventLog(std::string path, std::string job) : path_(std::move(path)), job_(std::move(job)) {}
  std::string path_;
  std::string job_;
};

}  // namespace troupe::sched
