// core/status.h — defines Status, StatusCode, Result<T> and the propagation macros
// TROUPE_RETURN_IF_ERROR / TROUPE_ASSIGN_OR_RETURN.
//
// Status is for failures a caller can act on (I/O, comm, scheduler, checkpoint, bad
// input). Broken invariants use the CHECK macros of core/check.h instead.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace troupe {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,  // the caller passed something wrong (bad config, bad CLI flag)
  kNotFound,         // a file, job, key or actor that does not exist
  kAlreadyExists,
  kOutOfRange,
  kFailedPrecondition,  // the system is not in a state where this can run
  kDeadlineExceeded,    // a timeout or deadline passed
  kUnavailable,         // a peer is unreachable / connection lost (retry may help)
  kAborted,             // the operation was aborted (communicator abort, cancel)
  kCancelled,
  kDataLoss,           // corrupt or truncated data (checksum mismatch)
  kPermissionDenied,   // authentication failed
  kResourceExhausted,  // out of memory, message too large
  kUnimplemented,
  kInternal,  // our bug
  kIoError,   // the OS refused a file or socket operation
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "NotFound: checkpoint step_100: manifest.json missing"
  std::string to_string() const;

  // Returns a copy with `context: ` prefixed to the message (keeps the code).
  Status with_context(std::string_view context) const;

  // Explicitly discards a status the caller decided not to act on.
  void ignore() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() {
  return Status();
}

// Factories named after the code: invalid_argument("bad value {} for {}", v, key).
#define TROUPE_DEFINE_STATUS_FACTORY(fn, code)                                    \
  template <typename... Args>                                                     \
  Status fn(fmt::format_string<Args...> f, Args&&... args) {                      \
    return Status(StatusCode::code, fmt::format(f, std::forward<Args>(args)...)); \
  }
TROUPE_DEFINE_STATUS_FACTORY(invalid_argument, kInvalidArgument)
TROUPE_DEFINE_STATUS_FACTORY(not_found, kNotFound)
TROUPE_DEFINE_STATUS_FACTORY(already_exists, kAlreadyExists)
TROUPE_DEFINE_STATUS_FACTORY(out_of_range, kOutOfRange)
TROUPE_DEFINE_STATUS_FACTORY(failed_precondition, kFailedPrecondition)
TROUPE_DEFINE_STATUS_FACTORY(deadline_exceeded, kDeadlineExceeded)
TROUPE_DEFINE_STATUS_FACTORY(unavailable, kUnavailable)
TROUPE_DEFINE_STATUS_FACTORY(aborted, kAborted)
TROUPE_DEFINE_STATUS_FACTORY(cancelled, kCancelled)
TROUPE_DEFINE_STATUS_FACTORY(data_loss, kDataLoss)
TROUPE_DEFINE_STATUS_FACTORY(permission_denied, kPermissionDenied)
TROUPE_DEFINE_STATUS_FACTORY(resource_exhausted, kResourceExhausted)
TROUPE_DEFINE_STATUS_FACTORY(unimplemented, kUnimplemented)
TROUPE_DEFINE_STATUS_FACTORY(internal_error, kInternal)
TROUPE_DEFINE_STATUS_FACTORY(io_error, kIoError)
#undef TROUPE_DEFINE_STATUS_FACTORY

// Result<T>: a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) {
      v_ = Status(StatusCode::kInternal, "Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    check_ok();
    return std::get<T>(v_);
  }
  const T& value() const& {
    check_ok();
    return std::get<T>(v_);
  }
  T&& value() && {
    check_ok();
    return std::get<T>(std::move(v_));
  }
  T value_or(T fallback) const& { return ok() ? std::get<T>(v_) : std::move(fallback); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void check_ok() const;
  std::variant<T, Status> v_;
};

[[noreturn]] void result_value_of_error(const Status& s);

template <typename T>
void Result<T>::check_ok() const {
  if (!ok()) result_value_of_error(std::get<Status>(v_));
}

}  // namespace troupe

template <>
struct fmt::formatter<troupe::Status> : fmt::formatter<std::string> {
  template <typename Ctx>
  auto format(const troupe::Status& s, Ctx& ctx) const {
    return fmt::formatter<std::string>::format(s.to_string(), ctx);
  }
};

#define TROUPE_CONCAT_INNER(a, b) a##b
#define TROUPE_CONCAT(a, b) TROUPE_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define TROUPE_RETURN_IF_ERROR(expr)         \
  do {                                       \
    ::troupe::Status _troupe_st = (expr);    \
    if (!_troupe_st.ok()) return _troupe_st; \
  } while (0)

// TROUPE_ASSIGN_OR_RETURN(auto x, make_x()); — unwraps a Result or returns its status.
#define TROUPE_ASSIGN_OR_RETURN(lhs, expr) \
  TROUPE_ASSIGN_OR_RETURN_IMPL(TROUPE_CONCAT(_troupe_res_, __LINE__), lhs, expr)
#define TROUPE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
