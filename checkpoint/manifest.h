// checkpoint/manifest.h — defines the checkpoint format: StoredSlice, TensorRecord,
// ManifestPart (what one rank wrote) and Manifest (the merged, authoritative index of a
// checkpoint directory), their JSON form, validation and merging.
//
// Directory layout of a finished checkpoint `<run>/step_<N>/`:
//   manifest.json             this Manifest (written last inside the directory)
//   rank_<RRRRR>.bin          shard file of rank R: the raw bytes of its stored slices
//   rank_<RRRRR>.part.json    rank R's ManifestPart (kept for inspection)
//   <tokenizer file>          a copy of the tokenizer, checksummed in the manifest
// Slices are row-major (C order) over their own box; every slice carries an xxHash64
// (seed 0) of its bytes.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/layout.h"
#include "checkpoint/slice.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

// Version 2: the manifest carries "checksum", the xxHash64 of its own canonical JSON text
// (every other field, the slices' checksums included), verified before any of it is used.
// Version 1 (no checksum) is still read.
inline constexpr int kFormatVersion = 2;
inline constexpr int kOldestFormatVersion = 1;
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kLatestFile = "latest";

std::string shard_file_name(int rank);      // "rank_00003.bin"
std::string part_file_name(int rank);       // "rank_00003.part.json"
std::string step_dir_name(int64_t step);    // "step_100"
std::string tmp_dir_name(int64_t step);     // "step_100.tmp"
// Parses "step_<N>" (not ".tmp"); nullopt for anything else.
std::optional<int64_t> parse_step_dir_name(std::string_view name);

// One stored box of a tensor.
struct StoredSlice {
  std::string file;      // relative to the checkpoint directory
  uint64_t offset = 0;   // byte offset in `file`
  uint64_t length = 0;   // bytes = slice_numel(box) * dtype size
  Slice box;             // index ranges in the global tensor
  uint64_t xxh64 = 0;    // of the `length` bytes
  int rank = 0;          // the rank that wrote it
};

struct TensorRecord {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;           // global shape
  std::vector<StoredSlice> slices;
};

struct TokenizerRecord {
  std::string file;      // copied into the checkpoint directory under this name
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

struct RankRecord {
  int rank = 0;
  ParallelCoord coords;
  nlohmann::json state;  // per-rank state: RNG states, data position of the rank, ...
};

// What one rank wrote into the temporary directory.
struct ManifestPart {
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
  ParallelLayout layout;
  ParallelCoord coords;
  nlohmann::json state = nlohmann::json::object();
  std::vector<TensorRecord> tensors;  // each with only this rank's slices
};

// Run-level facts the driver supplies when it finalizes a checkpoint.
struct CheckpointInfo {
  nlohmann::json data_position = nlohmann::json::object();  // e.g. {"epoch":0,"sample":1024}
  std::string config_text;                                   // the run's config (TOML text)
  std::string tokenizer_path;                                // copied in when non-empty
  nlohmann::json metadata = nlohmann::json::object();        // free form
};

struct Manifest {
  int format_version = kFormatVersion;
  int64_t step = 0;
  ParallelLayout layout;
  int world_size = 1;
  int64_t created_unix_ms = 0;
  nlohmann::json data_position = nlohmann::json::object();
  std::string config_text;
  std::optional<TokenizerRecord> tokenizer;
  nlohmann::json metadata = nlohmann::json::object();
  std::vector<RankRecord> ranks;
  std::map<std::string, TensorRecord> tensors;

  uint64_t total_bytes() const;  // sum of stored slice lengths
};

std::string xxh64_hex(uint64_t h);

nlohmann::json part_to_json(const ManifestPart& p);
// `where` names the source (a path) in errors.
Result<ManifestPart> part_from_json(const nlohmann::json& j, std::string_view where);
// Written with the current format version and its checksum.
nlohmann::json manifest_to_json(const Manifest& m);
// Verifies the checksum of a version-2 manifest first: DataLoss ("edited or damaged") when
// it does not match, before anything in it is used.
Result<Manifest> manifest_from_json(const nlohmann::json& j, std::string_view where);
// The checksum a manifest's JSON carries ("checksum": every field but itself, as dumped).
std::string manifest_checksum(const nlohmann::json& j);

// Structural checks of one tensor record: dtype known, slices inside the shape, lengths
// match the boxes, and (when require_coverage) the stored slices tile the whole tensor
// (exact duplicates allowed, partial overlaps refused).
Status validate_tensor_record(const TensorRecord& t, bool require_coverage, std::string_view where);

// Merges the parts of all ranks (parts[r] from rank r) into a Manifest: the parts must
// agree on step, world size and layout; a tensor must have one dtype and global shape
// everywhere; every tensor must be fully covered.
Result<Manifest> merge_parts(const std::vector<ManifestPart>& parts, const CheckpointInfo& info);

}  // namespace troupe::checkpoint
