// tests/checkpoint/test_util.h — helpers shared by the checkpoint tests: a temporary
// directory removed at the end, byte-level tensor comparison, and file damage.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>

#include "core/status.h"
#include "core/tensor.h"

namespace troupe {
// Lets EXPECT_*(...) << status print a Status (found by argument-dependent lookup).
inline std::ostream& operator<<(std::ostream& os, const Status& s) {
  return os << s.to_string();
}
}  // namespace troupe

namespace troupe::checkpoint::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "troupe-ckpt-XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    if (p == nullptr) std::abort();
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }

 private:
  std::string path_;
};

// Bitwise equality of two host tensors (same dtype and shape, any strides).
inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return ::testing::AssertionFailure() << a.describe() << " vs " << b.describe();
  }
  Tensor ca = a.contiguous(), cb = b.contiguous();
  if (ca.nbytes() > 0 && std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) != 0) {
    return ::testing::AssertionFailure() << "bytes differ in " << a.describe();
  }
  return ::testing::AssertionSuccess();
}

inline void flip_byte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << path;
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(offset);
  f.write(&c, 1);
}

inline void truncate_to(const std::string& path, uintmax_t size) {
  std::filesystem::resize_file(path, size);
}

}  // namespace troupe::checkpoint::testing
