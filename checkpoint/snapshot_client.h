// checkpoint/snapshot_client.h — defines SnapshotClient, a worker's session with the
// snapshot keeper of its node (snapshot_keeper.h): it takes the two generation segments
// of its rank, announces what it writes and what landed, passes commits on, and fetches
// the part a restore needs (from this keeper or, through it, from another node's).
//
// Threads: every method may be called from any thread (one request at a time on the
// session: a mutex orders them).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/snapshot_protocol.h"
#include "checkpoint/snapshot_segment.h"
#include "core/status.h"

namespace troupe::checkpoint {

class SnapshotClient {
 public:
  // Connects to the keeper socket at `path` (what TROUPE_SNAPSHOT_KEEPER names).
  static Result<std::unique_ptr<SnapshotClient>> connect(const std::string& path);

  struct Generations {
    std::string node, endpoint;           // the keeper's
    std::unique_ptr<SegmentMap> maps[2];  // writable
    SnapGen gens[2];                      // what each held when attached
  };
  // The two generations of (job, rank), each of at least `bytes` (a larger size replaces
  // them; their landed parts stay with the keeper as copies).
  Result<Generations> attach(const std::string& job, int rank, uint64_t bytes);
  Status begin(const std::string& job, int rank, uint32_t gen, int64_t step);
  Status landed(const std::string& job, int rank, uint32_t gen, int64_t step);
  Status commit(const std::string& job, int rank, int64_t step, const std::string& replicate_to);
  // The segment holding the part of (job, rank) after `step`, mapped read-only: from this
  // keeper, or copied by it from the first of `sources` that holds it. Bounded by `timeout`.
  struct Fetched {
    std::shared_ptr<const SegmentMap> map;
    std::string served_by;  // this node's keeper
    bool copy = false;      // a copy of another node's part ...
    std::string from_node;  // ... made there (or the node of the worker that wrote it)
  };
  Result<Fetched> fetch(const std::string& job, int rank, int64_t step,
                        const std::vector<std::string>& sources, std::chrono::milliseconds timeout);
  Result<SnapReply> query(const std::string& job);
  Status release(const std::string& job, int rank);

 private:
  explicit SnapshotClient(FileHandle fd) : fd_(std::move(fd)) {}
  struct Answer {
    SnapReply reply;
    std::vector<FileHandle> fds;
  };
  Result<Answer> call(const SnapRequest& req, std::chrono::milliseconds timeout);

  std::mutex mu_;
  FileHandle fd_;
};

}  // namespace troupe::checkpoint
