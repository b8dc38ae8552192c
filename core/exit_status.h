// core/exit_status.h — defines how a Troupe process's final Status becomes its exit status,
// and which failures are permanent: retrying them (restarting the process, the driver or
// the job) cannot succeed, so supervisors fail the job at once instead.
//
// The contract with troupe-scheduler (docs/cluster.md, "Failure handling"): a job process
// that exits with kExitPermanentFailure is not restarted; its job fails with that status.
// Every other non-zero status follows the job's restart policy.
#pragma once

#include "core/status.h"

namespace troupe {

// sysexits.h's EX_CONFIG ("configuration error"): the process refused or failed for a
// reason a restart would meet again (bad config or data, a layout that cannot run, a
// named checkpoint that is damaged, a disk that stays full, a model larger than the device).
inline constexpr int kExitPermanentFailure = 78;

// The classification by status code: bad input (kInvalidArgument, kNotFound,
// kAlreadyExists, kOutOfRange, kFailedPrecondition, kDataLoss, kPermissionDenied,
// kResourceExhausted, kUnimplemented) is permanent; timeouts, lost peers, aborts, I/O
// errors and our own bugs (kDeadlineExceeded, kUnavailable, kAborted, kCancelled, kIoError,
// kInternal) may pass, so a retry is worth it. OK is neither.
bool is_permanent_failure(const Status& st);

// 0 for OK, kExitPermanentFailure for a permanent failure, else 1.
int exit_status_for(const Status& st);

}  // namespace troupe
