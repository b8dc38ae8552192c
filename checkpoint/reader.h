// checkpoint/reader.h — defines CheckpointReader: opens one checkpoint directory (or the
// newest valid one of a run directory), verifies it, and assembles any requested slice of
// any global tensor from whichever stored slices overlap it.
//
// Verification: open() always checks the manifest and that every named shard file exists
// and is long enough; with VerifyMode::kChecksums (the default of open_latest_valid) it also
// reads every stored slice and checks its xxHash64. read() checks the checksum of every
// stored slice it uses, whatever the mode. Errors name the checkpoint, file and tensor.
//
// Threads: a reader is immutable after open; read() may be called from several threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "checkpoint/manifest.h"
#include "checkpoint/slice.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

// kManifestOnly: parse the manifest, check nothing on disk (for inspection tools);
// kStructure: also every shard file exists and is long enough; kChecksums: also every
// stored slice's checksum.
enum class VerifyMode { kManifestOnly, kStructure, kChecksums };

class CheckpointReader {
 public:
  // Opens a checkpoint directory (one holding manifest.json).
  static Result<std::unique_ptr<CheckpointReader>> open(const std::string& dir, VerifyMode mode = VerifyMode::kStructure);

  // Opens the newest checkpoint of `run_dir` that passes verification, trying
  // step_<N> directories from the highest N down; each one skipped is logged with the
  // reason and listed in skipped(). NotFound (with every reason) when none is valid.
  // `dir` may also be a checkpoint directory itself, which is then the only candidate.
  static Result<std::unique_ptr<CheckpointReader>> open_latest_valid(const std::string& run_dir,
                                                                     VerifyMode mode = VerifyMode::kChecksums);

  const Manifest& manifest() const { return manifest_; }
  const std::string& path() const { return dir_; }
  int64_t step() const { return manifest_.step; }
  const ParallelLayout& layout() const { return manifest_.layout; }
  // Reasons newer checkpoints were skipped by open_latest_valid.
  const std::vector<std::string>& skipped() const { return skipped_; }

  bool has_tensor(const std::string& name) const { return manifest_.tensors.count(name) > 0; }
  // NotFound naming the tensor and checkpoint when absent.
  Result<const TensorRecord*> tensor(const std::string& name) const;

  // The elements of `box` (global coordinates) of tensor `name` as a new contiguous host
  // tensor of shape slice_shape(box), in the stored dtype.
  Result<Tensor> read(const std::string& name, const Slice& box) const;
  Result<Tensor> read_full(const std::string& name) const;
  // Same, into `dst` (host, contiguous, shape slice_shape(box), the stored dtype).
  Status read_into(const std::string& name, const Slice& box, Tensor& dst) const;

  // Reads and checks every stored slice and the tokenizer copy.
  Status verify_checksums() const;
  // Reads and checks one stored slice of `t`; the error names the file and tensor.
  Status verify_slice(const TensorRecord& t, const StoredSlice& s) const;
  // Checks that every shard file exists and is long enough.
  Status check_files() const;
  // Cross-checks the manifest with the ranks' own records: the run-level step counts and
  // data position (metadata "adam_steps", data_position "next_step") with each rank's
  // state, and each rank's part file (rank_<R>.part.json, when kept) with the manifest's
  // step, rank state and slices. DataLoss naming the first disagreement. open() runs it
  // at kStructure and above, so a mismatch skips to the previous checkpoint like damage.
  Status check_records() const;
  // Copies the tokenizer stored in the checkpoint to `dest` after checking it.
  Status extract_tokenizer(const std::string& dest) const;

 private:
  CheckpointReader(std::string dir, Manifest m) : dir_(std::move(dir)), manifest_(std::move(m)) {}
  // Reads one stored slice into `out` (s.length bytes) and checks its checksum.
  Status read_stored(const TensorRecord& t, const StoredSlice& s, std::byte* out) const;

  std::string dir_;
  Manifest manifest_;
  std::vector<std::string> skipped_;
};

// The checkpoints of a run directory, newest first (complete ones only: step_<N>).
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir);

}  // namespace troupe::checkpoint
