// interop/safetensors.cc — the safetensors reader (mmap, a checked header) and the layout
// planner of files written by range.
#include "interop/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "checkpoint/file_io.h"

namespace troupe::interop {

namespace {
struct DTypeRow {
  StDType t;
  const char* name;
  size_t size;
};
constexpr DTypeRow kDTypes[] = {
    {StDType::kF32, "F32", 4},        {StDType::kBF16, "BF16", 2},      {StDType::kF16, "F16", 2},
    {StDType::kF64, "F64", 8},        {StDType::kI32, "I32", 4},        {StDType::kI64, "I64", 8},
    {StDType::kF8E4M3, "F8_E4M3", 1}, {StDType::kF8E5M2, "F8_E5M2", 1},
};
// A header larger than this is not a weights file (safetensors itself caps it at 100 MB).
constexpr uint64_t kMaxHeader = 100ull << 20;
}  // namespace

StDType st_dtype_from_name(const std::string& name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return r.t;
  return StDType::kOther;
}

std::string st_dtype_name(StDType t) {
  for (const auto& r : kDTypes)
    if (r.t == t) return r.name;
  return "other";
}

size_t st_dtype_size(StDType t) {
  for (const auto& r : kDTypes)
    if (r.t == t) return r.size;
  return 0;
}

Result<DType> to_dtype(StDType t, const std::string& what) {
  switch (t) {
    case StDType::kF32:
      return DType::kF32;
    case StDType::kBF16:
      return DType::kBF16;
    case StDType::kF16:
      return DType::kF16;
    case StDType::kI32:
      return DType::kI32;
    case StDType::kI64:
      return DType::kI64;
    case StDType::kF8E4M3:
      return DType::kF8E4M3;
    case StDType::kF8E5M2:
      return DType::kF8E5M2;
    default:
      return invalid_argument("{}: dtype {} has no Troupe counterpart", what, st_dtype_name(t));
  }
}

Result<StDType> from_dtype(DType t) {
  switch (t) {
    case DType::kF32:
      return StDType::kF32;
    case DType::kBF16:
      return StDType::kBF16;
    case DType::kF16:
      return StDType::kF16;
    case DType::kI32:
      return StDType::kI32;
    case DType::kI64:
      return StDType::kI64;
    case DType::kF8E4M3:
      return StDType::kF8E4M3;
    case DType::kF8E5M2:
      return StDType::kF8E5M2;
    default:
      return invalid_argument("dtype {} cannot be stored in safetensors", dtype_name(t));
  }
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  TROUPE_ASSIGN_OR_RETURN(checkpoint::FileHandle fh, checkpoint::open_file(path, O_RDONLY));
  struct stat st {};
  if (fstat(fh.fd(), &st) != 0) return checkpoint::errno_status("stat", path, errno);
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return data_loss("{}: {} bytes is too short for a safetensors file", path, size);
  void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fh.fd(), 0);
  if (m == MAP_FAILED) return checkpoint::errno_status("mmap", path, errno);
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->base_ = static_cast<const std::byte*>(m);
  f->size_ = size;
  uint64_t n = 0;
  std::memcpy(&n, f->base_, 8);  // little-endian on every platform Troupe builds for
  if (n > kMaxHeader || n > size - 8) {
    return data_loss("{}: header length {} does not fit the file ({} bytes): not a safetensors file", path, n,
                     size);
  }
  f->data_start_ = 8 + n;
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(reinterpret_cast<const char*>(f->base_ + 8),
                              reinterpret_cast<const char*>(f->base_ + 8 + n));
  } catch (const std::exception& e) {
    return data_loss("{}: the header is not valid JSON: {}", path, e.what());
  }
  if (!h.is_object()) return data_loss("{}: the header is not a JSON object", path);
  const uint64_t data_size = size - f->data_start_;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      f->metadata_ = it.value();
      continue;
    }
    const auto& v = it.value();
    StTensorInfo t;
    try {
      t.dtype_name = v.at("dtype").get<std::string>();
      for (const auto& d : v.at("shape")) {
        const int64_t x = d.get<int64_t>();
        if (x < 0) throw std::runtime_error("negative dimension");
        t.shape.push_back(x);
      }
      const auto& off = v.at("data_offsets");
      if (!off.is_array() || off.size() != 2) throw std::runtime_error("data_offsets is not [begin, end]");
      t.begin = off[0].get<uint64_t>();
      t.end = off[1].get<uint64_t>();
    } catch (const std::exception& e) {
      return data_loss("{}: tensor '{}': bad header entry ({}): {}", path, it.key(), e.what(), v.dump());
    }
    t.dtype = st_dtype_from_name(t.dtype_name);
    if (t.begin > t.end || t.end > data_size) {
      return data_loss(
          "{}: tensor '{}': bytes [{}, {}) lie outside the {} data bytes of the file (truncated?)", path,
          it.key(), t.begin, t.end, data_size);
    }
    const size_t es = st_dtype_size(t.dtype);
    if (es != 0 && t.end - t.begin != static_cast<uint64_t>(t.numel()) * es) {
      return data_loss("{}: tensor '{}': {} bytes for a {} tensor of shape {} ({} expected)", path, it.key(),
                       t.end - t.begin, t.dtype_name, shape_to_string(t.shape),
                       static_cast<uint64_t>(t.numel()) * es);
    }
    if (t.end > t.begin) ranges.emplace_back(t.begin, t.end);
    f->tensors_.emplace(it.key(), std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return data_loss("{}: tensors overlap at bytes [{}, {})", path, ranges[i].first, ranges[i - 1].second);
    }
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) munmap(const_cast<std::byte*>(base_), size_);
}

Result<const StTensorInfo*> SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return not_found("{} holds no tensor '{}'", path_, name);
  return &it->second;
}

SafetensorsLayout SafetensorsLayout::plan(const std::vector<Entry>& tensors, const nlohmann::json& metadata) {
  SafetensorsLayout l;
  l.entries = tensors;
  nlohmann::json h = nlohmann::json::object();
  uint64_t at = 0;
  for (Entry& e : l.entries) {
    e.bytes = static_cast<uint64_t>(shape_numel(e.shape)) * st_dtype_size(e.dtype);
    h[e.name] = {{"dtype", st_dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {at, at + e.bytes}}};
    e.offset = at;
    at += e.bytes;
  }
  if (!metadata.is_null()) h["__metadata__"] = metadata;
  std::string json = h.dump();
  // The data section starts 8-byte aligned (as safetensors writes it): spaces pad the JSON.
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t n = json.size();
  l.header.resize(8);
  std::memcpy(l.header.data(), &n, 8);
  l.header += json;
  for (Entry& e : l.entries) e.offset += l.header.size();
  l.file_size = l.header.size() + at;
  return l;
}

const SafetensorsLayout::Entry* SafetensorsLayout::find(const std::string& name) const {
  for (const Entry& e : entries)
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace troupe::interop
