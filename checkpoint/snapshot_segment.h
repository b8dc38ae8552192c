// checkpoint/snapshot_segment.h — defines the memory a snapshot part lives in: a segment
// (an anonymous shared-memory file, memfd, owned by the node's snapshot keeper and mapped
// by the worker that writes it), its header, and SnapshotPart, a landed part read in place.
//
// A segment holds one rank's part of one snapshot, in the checkpoint format's terms
// (manifest.h): the shard bytes (every tensor slice the rank holds, row-major, 64-byte
// aligned, the slices a checkpoint saves first: a disk checkpoint writes the prefix
// `saved_bytes` as rank_R.bin) and the rank's ManifestPart as JSON (each slice with its
// xxHash64, and the rank state: step, data position, RNG). Layout:
//   [0, 4096)                     SegmentHeader
//   [4096, 4096 + data_bytes)     shard bytes (slice offsets in the part are relative to 4096)
//   [part_offset, + part_bytes)   the part's JSON
// A part is complete only when the header's state is kLanded: the writer fills the data
// and the JSON, then stores the header with a release fence (seal_segment); a reader
// checks the state, the JSON's checksum and, before using the bytes, every slice's.
//
// Threads: a SegmentMap is a plain mapping; who writes when is the keeper protocol's
// contract (snapshot_keeper.h): one writer per generation, readers only of landed parts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/slice.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

enum class SegmentState : uint32_t { kEmpty = 0, kWriting = 1, kLanded = 2 };
const char* segment_state_name(uint32_t state);

inline constexpr uint64_t kSegmentDataOffset = 4096;

struct SegmentHeader {
  char magic[8];         // "TRPSNAP1"
  uint32_t version;      // 1
  uint32_t state;        // SegmentState
  int64_t step;          // the optimizer steps the part's state is after
  uint64_t data_bytes;   // shard bytes at kSegmentDataOffset
  uint64_t saved_bytes;  // the prefix of them a checkpoint saves (each element once over the job)
  uint64_t part_offset;  // the part's JSON
  uint64_t part_bytes;
  uint64_t part_xxh64;  // of the JSON (each slice carries its own checksum inside it)
};

// The size of a segment for `data_bytes` of shard and a part JSON of at most
// `part_capacity` bytes (page-aligned: device copies and pinning want whole pages).
uint64_t segment_size_for(uint64_t data_bytes, uint64_t part_capacity);

// A new shared-memory file of `bytes` (memfd named `name`, zero-filled, close-on-exec).
Result<FileHandle> create_segment(const std::string& name, uint64_t bytes);

// A mapping of a segment file (MAP_SHARED). Move-only; unmaps on destruction.
class SegmentMap {
 public:
  // Maps the whole file `fd` (its size from fstat); `writable`: PROT_WRITE too.
  static Result<std::unique_ptr<SegmentMap>> map(int fd, bool writable);
  ~SegmentMap();
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;

  std::byte* base() const { return base_; }
  uint64_t size() const { return size_; }
  std::byte* data() const { return base_ + kSegmentDataOffset; }
  uint64_t data_capacity() const;  // bytes from kSegmentDataOffset to the end
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  // The header as it is now (an acquire load of the state first).
  SegmentHeader read_header() const;

 private:
  SegmentMap(std::byte* base, uint64_t size) : base_(base), size_(size) {}
  std::byte* base_ = nullptr;
  uint64_t size_ = 0;
};

// Marks the segment as being written for `step` (a reader then ignores it).
void begin_segment(SegmentMap& m, int64_t step);
// Completes a part whose shard bytes are in place: writes the part's JSON after them, then
// the header (state kLanded) with a release fence. Fails when the JSON does not fit.
Status seal_segment(SegmentMap& m, const ManifestPart& part, uint64_t data_bytes, uint64_t saved_bytes);

// A landed part, read in place from a mapped segment (the mapping is kept alive by `keep`).
struct SnapshotPart {
  ManifestPart part;
  const std::byte* data = nullptr;  // the shard bytes; slice offsets are relative to it
  uint64_t data_bytes = 0;
  uint64_t saved_bytes = 0;
  uint64_t part_xxh64 = 0;
  std::shared_ptr<const SegmentMap> keep;
};

// The part a segment holds: the header must say kLanded, the JSON must match its checksum
// and parse, and every slice must lie inside the shard bytes. DataLoss naming `where`
// otherwise. The slices' own bytes are not checked here (verify_snapshot_part).
Result<SnapshotPart> read_segment_part(std::shared_ptr<const SegmentMap> m, const std::string& where);
// Checks every slice's bytes against its xxHash64: DataLoss naming the rank, step, tensor
// and slice of the first mismatch. Reads the whole part (threads: up to `threads`).
Status verify_snapshot_part(const SnapshotPart& p, int threads = 1);
// Copies the elements `box` of tensor `name` held by the part into `dst` (host, contiguous,
// shape slice_shape(box), the tensor's dtype), counting how many of them the part holds
// in `covered` (0 when it holds no slice of the tensor: not an error).
Status read_part_region(const SnapshotPart& p, const std::string& name, const Slice& box, Tensor& dst,
                        int64_t& covered);

// The names of the tensors of `p` a checkpoint saves: the part's "unsaved" list (state)
// is left out. The part of a checkpoint written from a snapshot (the saved prefix).
ManifestPart saved_subset(const ManifestPart& p);

}  // namespace troupe::checkpoint
