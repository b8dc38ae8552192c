// tests/interop/interop_test_util.h — what the interop tests share: the fixture
// directory (made by transformers: tests/interop/make_fixtures.py), a temporary directory
// that removes itself, JSON and reference-file readers.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "interop/safetensors.h"

namespace troupe::test {

inline std::string fixtures() {
  return TROUPE_INTEROP_FIXTURES;
}
inline std::string fixture(const std::string& family) {
  return fixtures() + "/" + family;
}

// mkdtemp under the test temp dir; removed with everything in it on destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix) {
    std::string t = ::testing::TempDir() + "/" + prefix + "-XXXXXX";
    char* p = mkdtemp(t.data());
    EXPECT_NE(p, nullptr);
    path_ = t;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return nlohmann::json::parse(f);
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// The reference logits [rows, positions, vocab] and tokens [rows, positions] that
// transformers computed (reference.safetensors).
struct Reference {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
  int64_t rows = 0, positions = 0, vocab = 0;
  double loss = 0, loss_row0 = 0;
};

inline Reference read_reference(const std::string& family) {
  Reference r;
  auto f = interop::SafetensorsFile::open(fixture(family) + "/reference.safetensors");
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  const interop::StTensorInfo* lg = *(*f)->info("logits");
  const interop::StTensorInfo* tk = *(*f)->info("tokens");
  r.rows = lg->shape[0];
  r.positions = lg->shape[1];
  r.vocab = lg->shape[2];
  r.logits.resize(static_cast<size_t>(lg->numel()));
  std::memcpy(r.logits.data(), (*f)->data(*lg), r.logits.size() * 4);
  r.tokens.resize(static_cast<size_t>(tk->numel()));
  std::memcpy(r.tokens.data(), (*f)->data(*tk), r.tokens.size() * 4);
  const nlohmann::json j = read_json_file(fixture(family) + "/reference.json");
  r.loss = j.at("loss").get<double>();
  r.loss_row0 = j.at("loss_row0").get<double>();
  return r;
}

}  // namespace troupe::test
