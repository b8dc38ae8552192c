// training/tolerant_store.cc — TolerantStore (tolerant_store.h).
#include "training/tolerant_store.h"

#include <fmt/format.h>

#include <cstdio>

namespace troupe::training {

using Clock = std::chrono::steady_clock;

namespace {

constexpr std::chrono::milliseconds kRetryPause{50};
constexpr std::chrono::milliseconds kProbeEvery{1000};
// The watchman's question: a get that the store answers (with the value, or "not set by
// the deadline") within this, when it is up.
constexpr std::chrono::milliseconds kProbeWait{300};
constexpr const char* kProbeKey = "troupe/outage-probe";

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// A call worth repeating: the store did not answer, or answered "not yet".
bool transient(const Status& st) {
  return st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kDeadlineExceeded;
}

}  // namespace

TolerantStore::TolerantStore(comm::RendezvousStore& base, Options o) : base_(base), o_(std::move(o)) {}

TolerantStore::TolerantStore(std::unique_ptr<comm::RendezvousStore> base, Options o)
    : owned_(std::move(base)), base_(*owned_), o_(std::move(o)) {}

TolerantStore::~TolerantStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (watchman_.joinable()) watchman_.join();
}

std::chrono::milliseconds TolerantStore::outage_for() const {
  const int64_t since = outage_since_ns_.load();
  if (since == 0) return std::chrono::milliseconds(0);
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::nanoseconds(now_ns() - since));
}

Status TolerantStore::limit_status() const {
  return failed_precondition(
      "the scheduler{} has been unreachable for {} s, past the job's limit of {} s "
      "(elastic.scheduler_outage_limit_ms)",
      o_.where.empty() ? "" : " at " + o_.where, outage_for().count() / 1000, o_.outage_limit.count() / 1000);
}

void TolerantStore::note(const Status& st, int64_t started_ns) {
  // Only "nothing answered" is evidence of an outage; any answer (a value, "not set by the
  // deadline", "no such job") is evidence of a store that is up.
  if (st.code() != StatusCode::kUnavailable) {
    const int64_t since = outage_since_ns_.exchange(0);
    if (since != 0) {
      outages_ended_.fetch_add(1);
      fmt::print(stderr, "{}: the scheduler{} answers again after {:.1f} s\n", o_.who,
                 o_.where.empty() ? "" : " at " + o_.where, static_cast<double>(now_ns() - since) / 1e9);
      std::fflush(stderr);
    }
    return;
  }
  int64_t expected = 0;
  if (!outage_since_ns_.compare_exchange_strong(expected, started_ns)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || watchman_running_) return;  // a running watchman sees the new outage
  if (watchman_.joinable()) watchman_.join();  // the watchman of an earlier outage: it has returned
  watchman_running_ = true;
  watchman_ = std::thread([this] { watch(); });
}

void TolerantStore::watch() {
  auto next_log = Clock::now();
  bool limit_logged = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    // Checked under mu_: an outage that begins after this sees watchman_running_ false.
    if (!in_outage()) break;
    lock.unlock();
    const auto now = Clock::now();
    if (now >= next_log) {
      fmt::print(stderr,
                 "{}: waiting for the scheduler{} for {} s (the job gives up after {} s: "
                 "elastic.scheduler_outage_limit_ms)\n",
                 o_.who, o_.where.empty() ? "" : " at " + o_.where, outage_for().count() / 1000,
                 o_.outage_limit.count() / 1000);
      std::fflush(stderr);
      next_log = now + o_.log_every;
    }
    if (past_limit() && !limit_logged) {
      limit_logged = true;
      fmt::print(stderr, "{}: {}: giving up\n", o_.who, limit_status().message());
      std::fflush(stderr);
    }
    Result<std::string> r = base_.get(kProbeKey, comm::deadline_in(kProbeWait));
    if (r.status().code() != StatusCode::kUnavailable) {
      note(r.ok() ? ok_status() : r.status(), 0);
      next_log = Clock::now();
      limit_logged = false;
    }
    lock.lock();
    cv_.wait_for(lock, kProbeEvery, [this] { return stopping_; });
  }
  watchman_running_ = false;
}

Status TolerantStore::set(std::string_view key, std::string_view value) {
  while (true) {
    if (past_limit()) return limit_status();
    const int64_t t = now_ns();
    Status st = base_.set(key, value);
    note(st, t);
    if (st.ok() || !transient(st)) return st;
    std::this_thread::sleep_for(kRetryPause);
  }
}

Result<bool> TolerantStore::contains(std::string_view key) {
  while (true) {
    if (past_limit()) return limit_status();
    const int64_t t = now_ns();
    Result<bool> r = base_.contains(key);
    note(r.status(), t);
    if (r.ok() || !transient(r.status())) return r;
    std::this_thread::sleep_for(kRetryPause);
  }
}

Result<std::string> TolerantStore::get(std::string_view key, comm::Deadline deadline) {
  while (true) {
    if (past_limit()) return limit_status();
    const int64_t t = now_ns();
    Result<std::string> r = base_.get(key, deadline);
    note(r.status(), t);
    if (r.ok() || r.status().code() != StatusCode::kUnavailable) return r;
    if (Clock::now() >= deadline)
      return deadline_exceeded("store unavailable until the deadline: {}", r.status().to_string());
    std::this_thread::sleep_for(kRetryPause);
  }
}

Status TolerantStore::wait(const std::vector<std::string>& keys, comm::Deadline deadline) {
  while (true) {
    if (past_limit()) return limit_status();
    const int64_t t = now_ns();
    Status st = base_.wait(keys, deadline);
    note(st, t);
    if (st.ok() || st.code() != StatusCode::kUnavailable) return st;
    if (Clock::now() >= deadline)
      return deadline_exceeded("store unavailable until the deadline: {}", st.to_string());
    std::this_thread::sleep_for(kRetryPause);
  }
}

Status TolerantStore::try_set(std::string_view key, std::string_view value) {
  if (past_limit()) return limit_status();
  const int64_t t = now_ns();
  Status st = base_.set(key, value);
  note(st, t);
  return st;
}

Result<bool> TolerantStore::try_contains(std::string_view key) {
  if (past_limit()) return limit_status();
  const int64_t t = now_ns();
  Result<bool> r = base_.contains(key);
  note(r.status(), t);
  return r;
}

Result<std::string> TolerantStore::try_get(std::string_view key, comm::Deadline deadline) {
  if (past_limit()) return limit_status();
  const int64_t t = now_ns();
  Result<std::string> r = base_.get(key, deadline);
  note(r.status(), t);
  return r;
}

}  // namespace troupe::training
