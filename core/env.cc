// core/env.cc — typed reads of environment variables (env.h).
#include "core/env.h"

#include <charconv>
#include <cstdlib>

namespace troupe::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::string get_or(const char* name, const std::string& fallback) {
  std::optional<std::string> v = get(name);
  return v ? *v : fallback;
}

Result<int64_t> get_int(const char* name, int64_t fallback, int64_t min, int64_t max) {
  std::optional<std::string> v = get(name);
  if (!v) return fallback;
  int64_t x = 0;
  auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
  if (ec != std::errc() || p != v->data() + v->size()) {
    return invalid_argument("environment variable {}='{}' is not an integer", name, *v);
  }
  if (x < min || x > max) {
    return invalid_argument("environment variable {}={} is out of range [{}, {}]", name, x, min, max);
  }
  return x;
}

Result<bool> get_bool(const char* name, bool fallback) {
  std::optional<std::string> v = get(name);
  if (!v) return fallback;
  if (*v == "1" || *v == "true" || *v == "yes" || *v == "on") return true;
  if (*v == "0" || *v == "false" || *v == "no" || *v == "off") return false;
  return invalid_argument("environment variable {}='{}' is not a boolean (1 or 0)", name, *v);
}

}  // namespace troupe::env
