// core/env.h — the one reader of environment variables: typed reads whose errors name the
// variable and its value ("TROUPE_RANK='x' is not an integer"). Every getenv of the code
// base goes through here (tests and benches aside); core/job_env.h names the variables a
// launcher hands a job's processes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/status.h"

namespace troupe::env {

// The value of `name`; nullopt when it is unset or empty (an empty value means unset
// everywhere in Troupe).
std::optional<std::string> get(const char* name);
// The value, or `fallback` when unset or empty.
std::string get_or(const char* name, const std::string& fallback = "");
// A decimal integer in [min, max]; `fallback` when unset or empty. Anything else (text,
// trailing characters, out of range) is InvalidArgument naming the variable and value.
Result<int64_t> get_int(const char* name, int64_t fallback, int64_t min = INT64_MIN, int64_t max = INT64_MAX);
// "1"/"true"/"yes"/"on" or "0"/"false"/"no"/"off"; `fallback` when unset or empty; else
// InvalidArgument.
Result<bool> get_bool(const char* name, bool fallback);

}  // namespace troupe::env
