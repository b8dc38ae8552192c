// checkpoint/bulk_replica.h — defines BulkReplicaEndpoint: peer replicas carried by comm's
// BulkTransport (TCP mesh or RDMA verbs), and BulkReplicaLink, a ReplicaChannel bound to
// one peer of an endpoint.
//
// Protocol (one-sided writes into registered buffers):
//  - every rank registers a receive buffer, a send staging buffer (both `capacity` bytes)
//    and an 8-byte acknowledgement buffer, under the ids of BulkReplicaOptions;
//  - send_to(peer): waits for the peer's acknowledgement of the previous frame sent to
//    it (so its receive buffer is free), copies the frame into the staging buffer, writes
//    it into the peer's receive buffer (tag = sequence number) and waits until it landed;
//  - receive_from(peer): waits for a frame from `peer`, decodes and verifies it (copying
//    the shard out), then writes an acknowledgement back.
// A rank receives from one peer at a time (the data-parallel ring: dp rank d sends to
// d+1): two senders into one receive buffer are refused. Because send_to() returns once
// the frame is in the peer's memory, a ring of "send, then receive" on every rank cannot
// deadlock.
// Threads: the endpoint is internally locked; send_to and receive_from may run on
// different threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "checkpoint/layout.h"
#include "checkpoint/peer_replica.h"
#include "comm/bulk_transport.h"

namespace troupe::checkpoint {

struct BulkReplicaOptions {
  uint64_t capacity = 0;          // largest frame (shard + part + 32) accepted
  uint32_t recv_buffer_id = 240;  // BulkTransport buffer ids (< 256) used here
  uint32_t send_buffer_id = 241;
  uint32_t ack_buffer_id = 242;
  std::chrono::milliseconds timeout{30000};  // per send_to / receive_from
};

class BulkReplicaEndpoint {
 public:
  // Registers the buffers on `transport` (not owned; must outlive the endpoint, and the
  // endpoint must outlive the transport's use of the buffers: destroy the transport first
  // or keep the endpoint alive as long as the transport).
  static Result<std::unique_ptr<BulkReplicaEndpoint>> create(comm::BulkTransport& transport,
                                                             BulkReplicaOptions options);

  Status send_to(int peer, const ReplicaBlob& blob);
  Result<ReplicaBlob> receive_from(int peer, std::chrono::milliseconds timeout);
  int rank() const { return transport_.rank(); }

 private:
  BulkReplicaEndpoint(comm::BulkTransport& t, BulkReplicaOptions o);
  // Waits for a completion matching `match`, keeping the others for later waiters.
  Result<comm::BulkCompletion> wait_for(const std::function<bool(const comm::BulkCompletion&)>& match,
                                        comm::Deadline deadline, std::string_view what);

  comm::BulkTransport& transport_;
  BulkReplicaOptions options_;
  std::unique_ptr<std::byte[]> recv_;
  std::unique_ptr<std::byte[]> send_;
  uint64_t ack_ = 0;
  std::mutex send_mu_;  // one send at a time (the staging buffer)
  std::mutex poll_mu_;  // completions queue and polling
  std::deque<comm::BulkCompletion> pending_;
  std::map<int, uint32_t> sent_seq_;   // last tag sent to each peer
  std::map<int, uint32_t> acked_seq_;  // last tag each peer acknowledged
};

// A ReplicaChannel bound to `peer` of an endpoint (the endpoint outlives the link).
class BulkReplicaLink final : public ReplicaChannel {
 public:
  BulkReplicaLink(BulkReplicaEndpoint& endpoint, int peer) : endpoint_(endpoint), peer_(peer) {}
  Status send(const ReplicaBlob& blob) override { return endpoint_.send_to(peer_, blob); }
  Result<ReplicaBlob> receive(std::chrono::milliseconds timeout, uint64_t max_bytes) override;

 private:
  BulkReplicaEndpoint& endpoint_;
  int peer_;
};

}  // namespace troupe::checkpoint
