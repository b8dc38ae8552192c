// comm/bulk_transport.h — defines BulkTransport, the one-sided host-memory transport that
// carries checkpoint replicas between peers: register a buffer, write a region of it into
// a peer's registered buffer with a tag, poll completions. Two implementations: TCP (real
// sockets, a full mesh) and libibverbs (RC queue pairs, RDMA write with immediate; the
// queue-pair and buffer descriptors travel through the RendezvousStore). make_bulk_transport
// picks verbs only when ibv_get_device_list finds a device, else TCP.
//
// Contract:
// - Creation is collective over `size` ranks (like a communicator) and bounded by
//   BulkSpec::timeout.
// - register_buffer(id, ...) publishes the buffer so peers may write into it; the memory
//   must stay valid until the transport is destroyed. Ids are < 256 (verbs carries the id
//   in the immediate); a peer's write to an id not (yet) registered waits for it up to the
//   timeout, then fails.
// - write() is asynchronous. The writer gets a kWriteDone completion once the data is in
//   the peer's memory (TCP: the peer acknowledged it; verbs: the RC write completed), and
//   the target gets a kReceived completion naming the peer, buffer, tag (< 2^24) and size.
// - One verbs write moves at most 2 GiB (RC message limit): larger replicas are chunked.
// - A broken peer gives error completions (status not OK), never a hang.
// Thread safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/control/host_addr.h"
#include "comm/rendezvous_store.h"

namespace troupe::comm {

struct BulkCompletion {
  enum class Kind : uint8_t { kWriteDone, kReceived };
  Kind kind = Kind::kWriteDone;
  int peer = -1;
  uint32_t buffer = 0;  // kWriteDone: the destination buffer id; kReceived: ours
  uint32_t tag = 0;
  uint64_t bytes = 0;
  Status status;
};

class BulkTransport {
 public:
  static constexpr uint32_t kMaxBuffers = 256;
  static constexpr uint32_t kMaxTag = (1u << 24) - 1;

  virtual ~BulkTransport() = default;
  virtual std::string_view kind() const = 0;  // "tcp" or "verbs"
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual Status register_buffer(uint32_t id, void* data, uint64_t bytes) = 0;
  // Copies [src_offset, src_offset + bytes) of our buffer `src_buffer` to
  // [dst_offset, dst_offset + bytes) of `peer`'s buffer `dst_buffer`.
  virtual Status write(int peer, uint32_t src_buffer, uint64_t src_offset, uint32_t dst_buffer,
                       uint64_t dst_offset, uint64_t bytes, uint32_t tag) = 0;
  // Returns the completions available (at most `max`), waiting until at least one exists
  // or `deadline` passes (then an empty vector).
  virtual Result<std::vector<BulkCompletion>> poll(Deadline deadline, size_t max = 64) = 0;
};

struct BulkSpec {
  RendezvousStore* store = nullptr;  // not owned; used during creation (verbs: also for buffer lookup)
  StoreNamespace ns;
  std::string name = "bulk";
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{30000};
  std::string hostname =
      control::host_addr();  // TCP: listen on and advertise ($TROUPE_HOST_ADDR or 127.0.0.1)
};

enum class BulkKind : uint8_t { kAuto, kTcp, kVerbs };

// Number of RDMA devices ibv_get_device_list reports (0 when the kernel has no RDMA
// subsystem: the call returns NULL with ENOSYS there).
int rdma_device_count();

// kAuto: verbs if rdma_device_count() > 0, else TCP. kVerbs without a device fails with
// kUnavailable naming the reason.
Result<std::unique_ptr<BulkTransport>> make_bulk_transport(const BulkSpec& spec,
                                                           BulkKind kind = BulkKind::kAuto);
Result<std::unique_ptr<BulkTransport>> make_tcp_transport(const BulkSpec& spec);
Result<std::unique_ptr<BulkTransport>> make_verbs_transport(const BulkSpec& spec);

}  // namespace troupe::comm
