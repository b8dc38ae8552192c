// core/check.h — defines TROUPE_CHECK* (broken invariants; on in release builds too)
// and TROUPE_DEFINE_ERROR_CHECK, the one template that generates CUDA_CHECK,
// NCCL_CHECK and CUBLAS_CHECK (see core/gpu_check.h).
//
// A failed check logs the condition, file, line and message, then aborts.
#pragma once

#include <fmt/format.h>

#include <string>

namespace troupe::detail {

[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);

inline std::string check_message() {
  return {};
}
template <typename... Args>
std::string check_message(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}

}  // namespace troupe::detail

// TROUPE_CHECK(cond) or TROUPE_CHECK(cond, "fmt {}", args...)
#define TROUPE_CHECK(cond, ...)                                                     \
  do {                                                                              \
    if (__builtin_expect(!(cond), 0)) {                                             \
      ::troupe::detail::check_failed(__FILE__, __LINE__, #cond,                     \
                                     ::troupe::detail::check_message(__VA_ARGS__)); \
    }                                                                               \
  } while (0)

#define TROUPE_CHECK_OP(a, op, b, ...)                                                                       \
  do {                                                                                                       \
    const auto& _troupe_a = (a);                                                                             \
    const auto& _troupe_b = (b);                                                                             \
    if (__builtin_expect(!(_troupe_a op _troupe_b), 0)) {                                                    \
      ::troupe::detail::check_failed(                                                                        \
          __FILE__, __LINE__, #a " " #op " " #b,                                                             \
          fmt::format("({} vs {}) {}", _troupe_a, _troupe_b, ::troupe::detail::check_message(__VA_ARGS__))); \
    }                                                                                                        \
  } while (0)

#define TROUPE_CHECK_EQ(a, b, ...) TROUPE_CHECK_OP(a, ==, b, ##__VA_ARGS__)
#define TROUPE_CHECK_NE(a, b, ...) TROUPE_CHECK_OP(a, !=, b, ##__VA_ARGS__)
#define TROUPE_CHECK_LT(a, b, ...) TROUPE_CHECK_OP(a, <, b, ##__VA_ARGS__)
#define TROUPE_CHECK_LE(a, b, ...) TROUPE_CHECK_OP(a, <=, b, ##__VA_ARGS__)
#define TROUPE_CHECK_GT(a, b, ...) TROUPE_CHECK_OP(a, >, b, ##__VA_ARGS__)
#define TROUPE_CHECK_GE(a, b, ...) TROUPE_CHECK_OP(a, >=, b, ##__VA_ARGS__)

// Marks code that must not be reached.
#define TROUPE_UNREACHABLE(...)                                     \
  ::troupe::detail::check_failed(__FILE__, __LINE__, "unreachable", \
                                 ::troupe::detail::check_message(__VA_ARGS__))

// One template for every library whose calls return an error code:
//   TROUPE_DEFINE_ERROR_CHECK(CUDA_CHECK, cudaError_t, cudaSuccess, cudaGetErrorString)
// defines CUDA_CHECK(call), which aborts naming the call, the error, the file and line.
#define TROUPE_DEFINE_ERROR_CHECK(NAME, ErrorType, kSuccess, describe)                      \
  namespace troupe::detail {                                                                \
  inline void NAME##_failed(ErrorType err, const char* call, const char* file, int line) {  \
    ::troupe::detail::check_failed(                                                         \
        file, line, call,                                                                   \
        fmt::format(#NAME " failed: {} ({})", describe(err), static_cast<long long>(err))); \
  }                                                                                         \
  }
#define TROUPE_ERROR_CHECK_CALL(NAME, ErrorType, kSuccess, call)               \
  do {                                                                         \
    ErrorType _troupe_err = (call);                                            \
    if (__builtin_expect(_troupe_err != (kSuccess), 0))                        \
      ::troupe::detail::NAME##_failed(_troupe_err, #call, __FILE__, __LINE__); \
  } while (0)
