// checkpoint/peer_replica.h — defines in-memory peer replicas of checkpoint shards:
// ReplicaBlob (a rank's shard bytes and manifest part, exactly what it wrote to disk),
// ReplicaChannel (how a blob travels to a data-parallel peer), TcpReplicaChannel (a
// framed, checksummed stream over a connected TCP socket), and PeerReplicaStore (the
// replicas a rank holds for its peers, readable like a checkpoint).
//
// Use: after a save, rank r takes writer.last_snapshot() as a blob and sends it to its
// peer (same stage and n rank, next dp rank); the peer put()s it in its store. When rank r
// is lost, its replacement gets the blob back from the peer and reads its tensors with
// read_replica() — no disk involved. The comm bulk transport will provide another
// ReplicaChannel; the store does not care which channel carried a blob.
//
// Threads: PeerReplicaStore is internally locked. A channel is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/manifest.h"
#include "checkpoint/writer.h"
#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

struct ReplicaBlob {
  ManifestPart part;  // its slices' offsets point into `bytes`
  std::shared_ptr<const std::vector<std::byte>> bytes;
};

// The blob of `writer`'s last completed save (shares the snapshot buffer, no copy).
Result<ReplicaBlob> replica_from_writer(const CheckpointWriter& writer);

// Checks the blob: every slice inside `bytes` and matching its checksum. DataLoss naming
// the owner rank and tensor otherwise.
Status verify_replica(const ReplicaBlob& blob);

// Assembles `box` of tensor `name` from the slices the blob holds (checksums checked);
// DataLoss when the blob does not hold all of the box.
Result<Tensor> read_replica(const ReplicaBlob& blob, const std::string& name, const Slice& box);

// The frame a blob travels in, on every channel: a 32-byte header (magic "TRPREPL1", u64
// part-JSON length, u64 shard length, u64 xxHash64 of part JSON ‖ shard; little-endian),
// the part JSON, then the shard bytes.
inline constexpr size_t kReplicaHeaderBytes = 32;
struct ReplicaFrameHeader {
  uint64_t part_bytes = 0;
  uint64_t shard_bytes = 0;
  uint64_t xxh64 = 0;
};
// Header + part JSON; the shard bytes (blob.bytes) follow them on the wire.
std::string encode_replica_head(const ReplicaBlob& blob);
Result<ReplicaFrameHeader> parse_replica_header(const char* header, uint64_t max_bytes);
// Checks the frame checksum, parses the part and verifies every slice.
Result<ReplicaBlob> finish_replica_decode(const ReplicaFrameHeader& h, const std::string& part,
                                          std::shared_ptr<std::vector<std::byte>> bytes);
// Decodes a whole frame lying in memory (copies the shard bytes out).
Result<ReplicaBlob> decode_replica_frame(const std::byte* data, uint64_t size, uint64_t max_bytes);

class ReplicaChannel {
 public:
  virtual ~ReplicaChannel() = default;
  virtual Status send(const ReplicaBlob& blob) = 0;
  // Waits at most `timeout` for the whole blob; refuses blobs over `max_bytes`.
  virtual Result<ReplicaBlob> receive(std::chrono::milliseconds timeout, uint64_t max_bytes) = 0;
};

// Owns a connected stream socket carrying replica frames (for tests and hosts without
// the comm bulk transport; BulkReplicaEndpoint in bulk_replica.h is the production path).
class TcpReplicaChannel final : public ReplicaChannel {
 public:
  explicit TcpReplicaChannel(int fd) : fd_(fd) {}
  ~TcpReplicaChannel() override;
  TcpReplicaChannel(const TcpReplicaChannel&) = delete;
  TcpReplicaChannel& operator=(const TcpReplicaChannel&) = delete;

  // Connects to host:port (IPv4 dotted or "localhost"), bounded by `timeout`.
  static Result<std::unique_ptr<TcpReplicaChannel>> connect(const std::string& host, int port,
                                                            std::chrono::milliseconds timeout);
  Status send(const ReplicaBlob& blob) override;
  Result<ReplicaBlob> receive(std::chrono::milliseconds timeout, uint64_t max_bytes) override;
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

// A listening TCP socket on 127.0.0.1 with an OS-assigned port.
class TcpReplicaListener {
 public:
  static Result<std::unique_ptr<TcpReplicaListener>> listen_loopback();
  ~TcpReplicaListener();
  TcpReplicaListener(const TcpReplicaListener&) = delete;
  TcpReplicaListener& operator=(const TcpReplicaListener&) = delete;
  int port() const { return port_; }
  Result<std::unique_ptr<TcpReplicaChannel>> accept(std::chrono::milliseconds timeout);

 private:
  TcpReplicaListener(int fd, int port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  int port_ = 0;
};

class PeerReplicaStore {
 public:
  // Verifies and keeps `blob` as the replica of its owner rank, replacing an older step
  // (a blob older than the one held is refused with FailedPrecondition).
  Status put(ReplicaBlob blob);
  Result<ReplicaBlob> get(int owner_rank) const;  // NotFound when none is held
  std::optional<int64_t> step_of(int owner_rank) const;
  void drop(int owner_rank);
  uint64_t bytes_held() const;

 private:
  mutable std::mutex mu_;
  std::map<int, ReplicaBlob> blobs_;
};

}  // namespace troupe::checkpoint
