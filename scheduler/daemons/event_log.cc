// scheduler/daemons/event_log.cc — EventLog.
#include "scheduler/daemons/event_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>

namespace troupe::sched {

std::string iso8601_utc(int64_t ms) {
  time_t secs = static_cast<time_t>(ms / 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  char buf[32];
  strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, static_cast<int>(ms % 1000));
}

Result<EventLog> EventLog::open(const std::string& job_dir, const std::string& job_id) {
  std::error_code ec;
  // A job's events name its command and processes: a directory made here is its owner's only.
  const bool created = std::filesystem::create_directories(job_dir, ec);
  if (ec) return io_error("cannot create job directory {}: {}", job_dir, ec.message());
  if (created) ::chmod(job_dir.c_str(), 0700);
  return EventLog(job_dir + "/events.jsonl", job_id);
}

Status EventLog::append(const std::string& type, const nlohmann::json& fields, int64_t ts_ms) {
  nlohmann::json j = nlohmann::json::object();
  j["ts"] = iso8601_utc(ts_ms);
  j["ts_ms"] = ts_ms;
  j["job"] = job_;
  j["type"] = type;
  if (fields.is_object()) {
    for (auto it = fields.begin(); it != fields.end(); ++it) j[it.key()] = it.value();
  }
  std::string line = j.dump() + "\n";
  int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) return io_error("cannot open {}: {}", path_, std::strerror(errno));
  ssize_t n = ::write(fd, line.data(), line.size());
  ::close(fd);
  if (n != static_cast<ssize_t>(line.size())) return io_error("short write to {}", path_);
  return ok_status();
}

}  // namespace troupe::sched
