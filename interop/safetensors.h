// interop/safetensors.h — defines the safetensors file format (Hugging Face's weights
// files): SafetensorsFile, a memory-mapped reader, and SafetensorsLayout, which plans a
// file (header and every tensor's byte range) so that writers can fill the ranges in any
// order, from any thread or process, with pwrite.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON
// {"<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"format": "pt"}} (padded with spaces so the data starts 8-byte
// aligned), then the tensors' bytes, row-major, little-endian; offsets are relative to
// the end of the header. Readers check that every range lies inside the file, matches its
// shape and dtype, and that no two ranges overlap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace troupe::interop {

// The safetensors dtypes Troupe reads and writes. Others (I8, U16, F64, F8_E4M3 with
// scales, ...) are named in the error of whatever needs them.
enum class StDType { kF32, kBF16, kF16, kF64, kI32, kI64, kF8E4M3, kF8E5M2, kOther };
StDType st_dtype_from_name(const std::string& name);
std::string st_dtype_name(StDType t);  // "F32", "BF16", ...
size_t st_dtype_size(StDType t);       // 0 for kOther
// Troupe's DType of a safetensors dtype, if it has one (F64 has none).
Result<DType> to_dtype(StDType t, const std::string& what);
Result<StDType> from_dtype(DType t);

struct StTensorInfo {
  std::string dtype_name;  // as the file spells it
  StDType dtype = StDType::kOther;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range relative to the data section
  int64_t numel() const { return shape_numel(shape); }
};

// A read-only, memory-mapped safetensors file. Threads: immutable after open.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, StTensorInfo>& tensors() const { return tensors_; }
  const nlohmann::json& metadata() const { return metadata_; }
  // NotFound naming the tensor and file when absent.
  Result<const StTensorInfo*> info(const std::string& name) const;
  // The tensor's bytes (length end - begin) inside the mapping; valid while the file lives.
  const std::byte* data(const StTensorInfo& t) const { return base_ + data_start_ + t.begin; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const std::byte* base_ = nullptr;
  size_t size_ = 0;
  uint64_t data_start_ = 0;
  std::map<std::string, StTensorInfo> tensors_;
  nlohmann::json metadata_;
};

// A planned file: the header bytes and, per tensor, its absolute byte offset in the file.
// Tensors are laid out in the order given.
struct SafetensorsLayout {
  struct Entry {
    std::string name;
    StDType dtype = StDType::kF32;
    Shape shape;
    uint64_t offset = 0;  // absolute offset of the first byte in the file
    uint64_t bytes = 0;
  };
  std::string header;  // the 8-byte length and the padded JSON: the file's first bytes
  std::vector<Entry> entries;
  uint64_t file_size = 0;

  static SafetensorsLayout plan(const std::vector<Entry>& tensors, const nlohmann::json& metadata);
  const Entry* find(const std::string& name) const;
};

}  // namespace troupe::interop
