// checkpoint/writer.h — defines CheckpointWriter (one per rank: snapshot to host memory,
// then a background thread writes the rank's shard file and manifest part into
// `<run>/step_<N>.tmp/`), SaveHandle (wait on a save, read its figures), and
// finalize_checkpoint (the driver's commit: merge the parts into manifest.json, rename the
// temporary directory to `step_<N>`, update `latest`, apply retention).
//
// Atomicity: a checkpoint exists only once `step_<N>` exists, and that name appears by a
// single rename of a directory whose files were all fsynced, manifest.json last. A crash
// at any earlier moment leaves at most a `step_<N>.tmp` directory, which readers ignore and
// the next finalize removes. `latest` is a convenience pointer written after the rename;
// readers trust the directories, not the pointer.
//
// Threads: save() is called from the training thread; it returns after the snapshot (the
// time training is blocked). One save is in flight per writer: a second save() first waits
// for the previous one (that wait counts as blocked time).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/layout.h"
#include "checkpoint/manifest.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

// One tensor slice a rank saves: `tensor` holds the box of `global_shape` that starts at
// `offsets` (its extent is the tensor's own shape). Host tensors, any strides.
struct SaveEntry {
  std::string name;
  Shape global_shape;
  std::vector<int64_t> offsets;  // one per dimension; empty = all zeros
  Tensor tensor;
};

struct SaveStats {
  uint64_t bytes = 0;            // tensor bytes written
  double blocked_seconds = 0;    // inside save(): waiting for the previous save + snapshot copy
  double snapshot_seconds = 0;   // the copy to host memory alone
  double write_seconds = 0;      // background: write + checksum + fsync + part
  double total_seconds = 0;      // from save() entry to the part being durable
};

// Shared between the caller and the writer thread; copyable.
class SaveHandle {
 public:
  SaveHandle() = default;
  // Blocks until the rank's shard file and manifest part are durable; returns the outcome.
  Status wait() const;
  // Like wait() but gives up after `timeout` with DeadlineExceeded (the save goes on).
  Status wait_for(std::chrono::milliseconds timeout) const;
  bool done() const;
  SaveStats stats() const;  // final once done()
  int64_t step() const;

 private:
  friend class CheckpointWriter;
  struct State {
    mutable std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
    SaveStats stats;
    int64_t step = 0;
  };
  std::shared_ptr<State> state_;
};

struct WriterOptions {
  std::string run_dir;          // checkpoints go to <run_dir>/step_<N>
  ParallelLayout layout;        // the layout being saved
  int rank = 0;                 // this rank in `layout` (see layout.h for the numbering)
  bool fsync = true;            // false only for benchmarks of the page cache
  // Background write rate limit (bytes/s; 0 = none), so a save does not starve the
  // training's own I/O (data loading) on a shared disk.
  uint64_t max_bytes_per_second = 0;
  size_t write_chunk_bytes = 8u << 20;
};

class CheckpointWriter {
 public:
  // Checks the options (layout, rank, run_dir non-empty).
  static Result<std::unique_ptr<CheckpointWriter>> create(WriterOptions options);
  ~CheckpointWriter();  // waits for the save in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Snapshots `entries` (copies their bytes into the writer's host buffer, which is kept
  // and reused across saves) and starts the background write of step `step`. `rank_state`
  // (RNG states, the rank's data position, ...) goes into the manifest's rank record.
  // Errors here (bad entry, duplicate name, device tensor) are returned before anything
  // is written; I/O errors come from the handle.
  Result<SaveHandle> save(int64_t step, const std::vector<SaveEntry>& entries,
                          nlohmann::json rank_state = nlohmann::json::object());

  const WriterOptions& options() const { return options_; }
  ParallelCoord coords() const { return coords_; }

 private:
  explicit CheckpointWriter(WriterOptions options, ParallelCoord coords);
  void write_in_background(int64_t step, ManifestPart part, std::chrono::steady_clock::time_point t0,
                           std::shared_ptr<SaveHandle::State> st);

  WriterOptions options_;
  ParallelCoord coords_;
  std::thread thread_;
  // The snapshot buffer, reused by the next save.
  std::shared_ptr<std::vector<std::byte>> buffer_;
  mutable std::mutex mu_;
};

// One rank's shard of step `part->step`, already laid out in memory as its slices say
// (rank_R.bin is data[0, bytes)): written into <run_dir>/step_<N>.tmp, fsynced, then the
// rank's part (its "done" marker: fsynced, renamed into place; the directory's entries are
// fsynced once for every rank by finalize_checkpoint, before the commit). `verify`: every slice's bytes are
// checked against its xxHash64 first, and nothing is written when one does not match (DataLoss). What
// CheckpointWriter's background thread does, and what a worker does with the committed
// in-memory snapshot of its rank (training/checkpointing/snapshots.h).
struct ShardWrite {
  std::string run_dir;
  const ManifestPart* part = nullptr;
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
  bool verify = false;
  bool fsync = true;
  uint64_t max_bytes_per_second = 0;
  size_t chunk_bytes = 8u << 20;
};
Status write_rank_shard(const ShardWrite& w);

struct FinalizeOptions {
  int world_size = 1;
  int keep_last = 3;            // retention: complete checkpoints to keep (>= 1)
  CheckpointInfo info;
  bool fsync = true;  // false only for benchmarks of the page cache (`latest` is fsynced always)
};

struct FinalizeResult {
  std::string path;             // <run_dir>/step_<N>
  uint64_t bytes = 0;
  std::vector<std::string> removed;  // older checkpoints deleted by retention
};

// Polls until the parts of all `world_size` ranks are in `<run_dir>/step_<N>.tmp`, for a
// driver that is not told by messages; DeadlineExceeded names the missing ranks.
Status wait_for_parts(const std::string& run_dir, int64_t step, int world_size, std::chrono::milliseconds timeout);

// The commit of step `step` (call once every rank's save is done): merges and validates
// the parts, places the tokenizer (a hard link to the previous checkpoint's identical copy,
// else a copy), writes manifest.json, renames, updates `latest`,
// deletes checkpoints beyond `keep_last` and stale temporary directories of older steps.
// A missing part fails with NotFound naming the rank and file; nothing is committed then.
Result<FinalizeResult> finalize_checkpoint(const std::string& run_dir, int64_t step, const FinalizeOptions& options);

}  // namespace troupe::checkpoint
