// checkpoint/reader.cc — opening, verification and slice assembly.
#include "checkpoint/reader.h"

#include <fcntl.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "checkpoint/file_io.h"
#include "core/logging.h"

namespace troupe::checkpoint {

namespace fs = std::filesystem;

namespace {
std::shared_ptr<spdlog::logger> logger() {
  static auto l = make_logger("ckpt");
  return l;
}

// Uninitialised bytes (std::vector would zero them first, a full extra pass).
class ScratchBuffer {
 public:
  void reset(size_t n) {
    p_.reset(new std::byte[n]);
    n_ = n;
  }
  std::byte* data() { return p_.get(); }
  size_t size() const { return n_; }

 private:
  std::unique_ptr<std::byte[]> p_;
  size_t n_ = 0;
};
}  // namespace

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(run_dir, ec)) {
    if (auto s = parse_step_dir_name(de.path().filename().string()); s && de.is_directory(ec)) {
      out.emplace_back(*s, de.path().string());
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::open(const std::string& dir, VerifyMode mode) {
  const std::string mpath = (fs::path(dir) / kManifestFile).string();
  auto text = read_whole_file(mpath);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return not_found("checkpoint {}: manifest {} is missing (an unfinished or damaged checkpoint)", dir, mpath);
    }
    return text.status().with_context(fmt::format("checkpoint {}", dir));
  }
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return data_loss("checkpoint {}: {} is not valid JSON", dir, mpath);
  TROUPE_ASSIGN_OR_RETURN(Manifest m, manifest_from_json(j, mpath));
  std::unique_ptr<CheckpointReader> r(new CheckpointReader(dir, std::move(m)));
  if (mode != VerifyMode::kManifestOnly) TROUPE_RETURN_IF_ERROR(r->check_records());
  if (mode != VerifyMode::kManifestOnly) TROUPE_RETURN_IF_ERROR(r->check_files());
  if (mode == VerifyMode::kChecksums) TROUPE_RETURN_IF_ERROR(r->verify_checksums());
  return r;
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::open_latest_valid(const std::string& run_dir,
                                                                              VerifyMode mode) {
  std::error_code ec;
  if (fs::exists(fs::path(run_dir) / kManifestFile, ec)) return open(run_dir, mode);
  if (!fs::is_directory(run_dir, ec)) return not_found("run directory {} does not exist", run_dir);
  const auto candidates = list_checkpoints(run_dir);
  if (auto latest = read_whole_file((fs::path(run_dir) / kLatestFile).string()); latest.ok() && !candidates.empty()) {
    std::string name = *latest;
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name != fs::path(candidates.front().second).filename().string()) {
      logger()->info("{}: 'latest' says {} but the newest committed checkpoint is {}; trying the newest first",
                     run_dir, name, candidates.front().second);
    }
  }
  std::vector<std::string> skipped;
  for (const auto& [step, path] : candidates) {
    auto r = open(path, mode);
    if (r.ok()) {
      (*r)->skipped_ = skipped;
      if (!skipped.empty()) logger()->warn("{}: using checkpoint {} (step {})", run_dir, path, step);
      return r;
    }
    logger()->warn("skipping checkpoint {}: {}", path, r.status().to_string());
    skipped.push_back(fmt::format("{}: {}", path, r.status().to_string()));
  }
  std::string why;
  for (const std::string& s : skipped) why += "\n  " + s;
  return not_found("run directory {} has no valid checkpoint ({} candidates){}", run_dir, candidates.size(), why);
}

Status CheckpointReader::check_records() const {
  const nlohmann::json& md = manifest_.metadata;
  const nlohmann::json& pos = manifest_.data_position;
  for (const RankRecord& r : manifest_.ranks) {
    if (md.is_object() && md.contains("adam_steps") && r.state.is_object() &&
        r.state.contains("adam_steps") && md["adam_steps"] != r.state["adam_steps"]) {
      return data_loss("checkpoint {}: the manifest says adam_steps {} but rank {} saved {}", dir_,
                       md["adam_steps"].dump(), r.rank, r.state["adam_steps"].dump());
    }
    if (pos.is_object() && pos.contains("next_step") && r.state.is_object() && r.state.contains("data") &&
        r.state["data"].is_object() && r.state["data"].contains("next_step") &&
        pos["next_step"] != r.state["data"]["next_step"]) {
      return data_loss("checkpoint {}: the manifest's data position is step {} but rank {} saved {}", dir_,
                       pos["next_step"].dump(), r.rank, r.state["data"]["next_step"].dump());
    }
    if (r.state.is_object() && r.state.contains("step") &&
        r.state["step"] != nlohmann::json(manifest_.step)) {
      return data_loss("checkpoint {}: the manifest is of step {} but rank {} saved step {}", dir_,
                       manifest_.step, r.rank, r.state["step"].dump());
    }
  }
  // Each rank's own part, as it wrote it: the manifest must say the same.
  std::error_code ec;
  for (const RankRecord& r : manifest_.ranks) {
    const std::string path = (fs::path(dir_) / part_file_name(r.rank)).string();
    if (!fs::exists(path, ec)) continue;  // parts are kept for inspection, not required
    TROUPE_ASSIGN_OR_RETURN(std::string text, read_whole_file(path));
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return data_loss("checkpoint {}: {} is not valid JSON", dir_, path);
    TROUPE_ASSIGN_OR_RETURN(ManifestPart p, part_from_json(j, path));
    if (p.step != manifest_.step || p.rank != r.rank || p.state != r.state) {
      return data_loss(
          "checkpoint {}: the manifest's record of rank {} (step {}) differs from the rank's own {} "
          "(step {})",
          dir_, r.rank, manifest_.step, path, p.step);
    }
    for (const TensorRecord& t : p.tensors) {
      auto it = manifest_.tensors.find(t.name);
      for (const StoredSlice& s : t.slices) {
        const bool listed =
            it != manifest_.tensors.end() &&
            std::any_of(it->second.slices.begin(), it->second.slices.end(), [&](const StoredSlice& m) {
              return m.file == s.file && m.offset == s.offset && m.length == s.length && m.xxh64 == s.xxh64 &&
                     m.box == s.box;
            });
        if (!listed) {
          return data_loss(
              "checkpoint {}: rank {} saved tensor '{}' slice {} ({} at {}), which the manifest does "
              "not list as saved",
              dir_, r.rank, t.name, slice_to_string(s.box), s.file, s.offset);
        }
      }
    }
  }
  return ok_status();
}

Status CheckpointReader::check_files() const {
  std::map<std::string, uint64_t> need;  // file -> bytes needed
  std::map<std::string, std::string> need_by;  // file -> a tensor that needs them, for the message
  for (const auto& [name, t] : manifest_.tensors) {
    for (const StoredSlice& s : t.slices) {
      uint64_t& n = need[s.file];
      if (s.offset + s.length >= n) {
        n = s.offset + s.length;
        need_by[s.file] = name;
      }
    }
  }
  for (const auto& [file, bytes] : need) {
    const std::string path = (fs::path(dir_) / file).string();
    auto size = file_size(path);
    if (!size.ok()) {
      return not_found("checkpoint {}: shard file {} (holding tensor '{}') is missing: {}", dir_, path,
                       need_by[file], size.status().message());
    }
    if (*size < bytes) {
      return data_loss("checkpoint {}: shard file {} is truncated: {} bytes, tensor '{}' needs {}", dir_, path, *size,
                       need_by[file], bytes);
    }
  }
  if (manifest_.tokenizer) {
    const std::string path = (fs::path(dir_) / manifest_.tokenizer->file).string();
    auto size = file_size(path);
    if (!size.ok()) return not_found("checkpoint {}: tokenizer copy {} is missing", dir_, path);
    if (*size != manifest_.tokenizer->bytes) {
      return data_loss("checkpoint {}: tokenizer copy {} has {} bytes, the manifest says {}", dir_, path, *size,
                       manifest_.tokenizer->bytes);
    }
  }
  return ok_status();
}

Status CheckpointReader::read_stored(const TensorRecord& t, const StoredSlice& s, std::byte* out) const {
  const std::string path = (fs::path(dir_) / s.file).string();
  TROUPE_ASSIGN_OR_RETURN(FileHandle f, open_file(path, O_RDONLY));
  Status st = pread_all(f.fd(), out, s.length, s.offset, path);
  if (!st.ok()) return st.with_context(fmt::format("checkpoint {}: tensor '{}' slice {}", dir_, t.name, slice_to_string(s.box)));
  const uint64_t h = XXH64(out, s.length, 0);
  if (h != s.xxh64) {
    return data_loss("checkpoint {}: checksum mismatch in {} for tensor '{}' slice {} (bytes {}..{}): stored {}, "
                     "computed {}",
                     dir_, path, t.name, slice_to_string(s.box), s.offset, s.offset + s.length, xxh64_hex(s.xxh64),
                     xxh64_hex(h));
  }
  return ok_status();
}

Result<const TensorRecord*> CheckpointReader::tensor(const std::string& name) const {
  auto it = manifest_.tensors.find(name);
  if (it == manifest_.tensors.end()) return not_found("checkpoint {} has no tensor '{}'", dir_, name);
  return &it->second;
}

Result<Tensor> CheckpointReader::read(const std::string& name, const Slice& box) const {
  TROUPE_ASSIGN_OR_RETURN(const TensorRecord* t, tensor(name));
  Tensor out = Tensor::empty(slice_shape(box), t->dtype);
  TROUPE_RETURN_IF_ERROR(read_into(name, box, out));
  return out;
}

Result<Tensor> CheckpointReader::read_full(const std::string& name) const {
  TROUPE_ASSIGN_OR_RETURN(const TensorRecord* t, tensor(name));
  return read(name, full_slice(t->shape));
}

Status CheckpointReader::read_into(const std::string& name, const Slice& box, Tensor& dst) const {
  TROUPE_ASSIGN_OR_RETURN(const TensorRecord* t, tensor(name));
  TROUPE_RETURN_IF_ERROR(check_slice_within(box, t->shape, fmt::format("checkpoint {}: tensor '{}'", dir_, name)));
  if (!dst.defined() || !dst.device().is_cpu() || !dst.is_contiguous() || dst.dtype() != t->dtype ||
      dst.shape() != slice_shape(box)) {
    return invalid_argument("checkpoint {}: tensor '{}': destination {} must be a contiguous host {} tensor of shape {}",
                            dir_, name, dst.defined() ? dst.describe() : "undefined", dtype_name(t->dtype),
                            shape_to_string(slice_shape(box)));
  }
  const size_t esize = dtype_size(t->dtype);
  auto* dst_bytes = static_cast<std::byte*>(dst.numel() > 0 ? dst.data_ptr() : nullptr);
  int64_t covered = 0;
  std::vector<const Slice*> used;  // identical replicas are read once
  ScratchBuffer buf;
  for (const StoredSlice& s : t->slices) {
    auto region = intersect(s.box, box);
    if (!region || slice_numel(*region) == 0) continue;
    if (std::any_of(used.begin(), used.end(), [&](const Slice* b) { return *b == s.box; })) continue;
    used.push_back(&s.box);
    if (s.box == box) {
      // The stored slice is exactly the request (same layout, or a whole tensor saved by
      // one rank): read straight into the destination.
      TROUPE_RETURN_IF_ERROR(read_stored(*t, s, dst_bytes));
    } else {
      if (buf.size() < s.length) buf.reset(s.length);
      TROUPE_RETURN_IF_ERROR(read_stored(*t, s, buf.data()));
      copy_region(buf.data(), s.box, dst_bytes, box, *region, esize);
    }
    covered += slice_numel(*region);
  }
  if (covered != slice_numel(box)) {
    return data_loss("checkpoint {}: tensor '{}' slice {}: only {} of {} elements are stored", dir_, name,
                     slice_to_string(box), covered, slice_numel(box));
  }
  return ok_status();
}

Status CheckpointReader::verify_slice(const TensorRecord& t, const StoredSlice& s) const {
  ScratchBuffer buf;
  buf.reset(s.length);
  return read_stored(t, s, buf.data());
}

Status CheckpointReader::verify_checksums() const {
  ScratchBuffer buf;
  for (const auto& [name, t] : manifest_.tensors) {
    for (const StoredSlice& s : t.slices) {
      if (buf.size() < s.length) buf.reset(s.length);
      TROUPE_RETURN_IF_ERROR(read_stored(t, s, buf.data()));
    }
  }
  if (manifest_.tokenizer) {
    const std::string path = (fs::path(dir_) / manifest_.tokenizer->file).string();
    TROUPE_ASSIGN_OR_RETURN(std::string bytes, read_whole_file(path));
    if (XXH64(bytes.data(), bytes.size(), 0) != manifest_.tokenizer->xxh64) {
      return data_loss("checkpoint {}: checksum mismatch in tokenizer copy {}", dir_, path);
    }
  }
  return ok_status();
}

Status CheckpointReader::extract_tokenizer(const std::string& dest) const {
  if (!manifest_.tokenizer) return not_found("checkpoint {} holds no tokenizer", dir_);
  const std::string path = (fs::path(dir_) / manifest_.tokenizer->file).string();
  TROUPE_ASSIGN_OR_RETURN(std::string bytes, read_whole_file(path));
  if (XXH64(bytes.data(), bytes.size(), 0) != manifest_.tokenizer->xxh64) {
    return data_loss("checkpoint {}: checksum mismatch in tokenizer copy {}", dir_, path);
  }
  return write_file_durably(dest, bytes);
}

}  // namespace troupe::checkpoint
