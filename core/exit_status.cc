// core/exit_status.cc — the permanent/transient classification (exit_status.h).
#include "core/exit_status.h"

namespace troupe {

bool is_permanent_failure(const Status& st) {
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kDataLoss:
    case StatusCode::kPermissionDenied:
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnimplemented:
      return true;
    case StatusCode::kOk:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kUnavailable:
    case StatusCode::kAborted:
    case StatusCode::kCancelled:
    case StatusCode::kInternal:
    case StatusCode::kIoError:
      return false;
  }
  return false;
}

int exit_status_for(const Status& st) {
  if (st.ok()) return 0;
  return is_permanent_failure(st) ? kExitPermanentFailure : 1;
}

}  // namespace troupe
