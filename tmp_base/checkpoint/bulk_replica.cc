// checkpoint/bulk_replica.cc — replica frames over comm's bulk transport.
#include "checkpoint/bulk_replica.h"

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <thread>

#include "core/logging.h"

namespace troupe::checkpoint {

using comm::BulkCompletion;
using Kind = comm::BulkCompletion::Kind;

Result<std::unique_ptr<BulkReplicaEndpoint>> BulkReplicaEndpoint::create(comm::BulkTransport& transport,
                                                                         BulkReplicaOptions options) {
  if (options.capacity <= kReplicaHeaderBytes) {
    return invalid_argument("bulk replica endpoint: capacity {} bytes is too small", options.capacity);
  }
  std::unique_ptr<BulkReplicaEndpoint> e(new BulkReplicaEndpoint(transport, options));
  TROUPE_RETURN_IF_ERROR(transport.register_buffer(options.recv_buffer_id, e->recv_.get(), options.capacity));
  TROUPE_RETURN_IF_ERROR(transport.register_buffer(options.send_buffer_id, e->send_.get(), options.capacity));
  TROUPE_RETURN_IF_ERROR(transport.register_buffer(options.ack_buffer_id, &e->ack_, sizeof e->ack_));
  return e;
}

BulkReplicaEndpoint::BulkReplicaEndpoint(comm::BulkTransport& t, BulkReplicaOptions o)
    : transport_(t), options_(o), recv_(new std::byte[o.capacity]), send_(new std::byte[o.capacity]) {}

Result<BulkCompletion> BulkReplicaEndpoint::wait_for(const std::function<bool(const BulkCompletion&)>& match,
                                                     comm::Deadline deadline, std::string_view what) {
  for (;;) {
    {
      std::lock_guard lock(poll_mu_);
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (match(*it)) {
          BulkCompletion c = *it;
          pending_.erase(it);
          if (!c.status.ok()) return c.status.with_context(what);
          return c;
        }
      }
      if (comm::Clock::now() >= deadline) {
        return deadline_exceeded("replica {}: nothing after {} ms", what, options_.timeout.count());
      }
      // Poll in short slices so a waiter on another thread gets its turn.
      auto got = transport_.poll(std::min(deadline, comm::deadline_in(std::chrono::milliseconds(10))));
      if (!got.ok()) return got.status().with_context(what);
      for (BulkCompletion& c : *got) {
        // Our acknowledgements landing at the peer need no waiter; keep only failures.
        if (c.kind == Kind::kWriteDone && c.buffer == options_.ack_buffer_id && c.status.ok()) continue;
        pending_.push_back(std::move(c));
      }
    }
    std::this_thread::yield();
  }
}

Status BulkReplicaEndpoint::send_to(int peer, const ReplicaBlob& blob) {
  if (!blob.bytes) return invalid_argument("replica send: blob of rank {} has no bytes", blob.part.rank);
  if (peer < 0 || peer >= transport_.size() || peer == transport_.rank()) {
    return invalid_argument("replica send: bad peer {} (rank {} of {})", peer, transport_.rank(),
                            transport_.size());
  }
  std::lock_guard lock(send_mu_);
  const auto deadline = comm::deadline_in(options_.timeout);
  const std::string what = fmt::format("send to rank {}", peer);
  // The peer's receive buffer is free once it acknowledged our previous frame.
  const uint32_t prev = sent_seq_[peer];
  if (prev != 0 && acked_seq_[peer] != prev) {
    auto ack = wait_for(
        [&](const BulkCompletion& c) {
          return c.kind == Kind::kReceived && c.peer == peer && c.buffer == options_.ack_buffer_id &&
                 c.tag == prev;
        },
        deadline, what + " (waiting for the previous frame's acknowledgement)");
    if (!ack.ok()) return ack.status();
    acked_seq_[peer] = prev;
  }
  const std::string head = encode_replica_head(blob);
  const uint64_t size = head.size() + blob.bytes->size();
  if (size > options_.capacity) {
    return resource_exhausted("replica of rank {} is {} bytes, the replica buffers hold {}", blob.part.rank,
                              size, options_.capacity);
  }
  std::memcpy(send_.get(), head.data(), head.size());
  std::memcpy(send_.get() + head.size(), blob.bytes->data(), blob.bytes->size());
  const uint32_t seq = prev % comm::BulkTransport::kMaxTag + 1;
  TROUPE_RETURN_IF_ERROR(
      transport_.write(peer, options_.send_buffer_id, 0, options_.recv_buffer_id, 0, size, seq));
  sent_seq_[peer] = seq;
  auto done = wait_for(
      [&](const BulkCompletion& c) {
        return c.kind == Kind::kWriteDone && c.peer == peer && c.buffer == options_.recv_buffer_id &&
               c.tag == seq;
      },
      deadline, what);
  return done.status();
}

Result<ReplicaBlob> BulkReplicaEndpoint::receive_from(int peer, std::chrono::milliseconds timeout) {
  const std::string what = fmt::format("receive from rank {}", peer);
  auto got = wait_for(
      [&](const BulkCompletion& c) {
        return c.kind == Kind::kReceived && c.buffer == options_.recv_buffer_id;
      },
      comm::deadline_in(timeout), what);
  if (!got.ok()) return got.status();
  if (got->peer != peer) {
    return failed_precondition(
        "replica {}: rank {} wrote into the replica buffer instead (one sender per receiver)", what,
        got->peer);
  }
  auto blob = decode_replica_frame(recv_.get(), got->bytes, options_.capacity);
  // Acknowledge even a bad frame: the buffer is free again either way.
  Status ack =
      transport_.write(peer, options_.ack_buffer_id, 0, options_.ack_buffer_id, 0, sizeof ack_, got->tag);
  if (!blob.ok()) return blob.status().with_context(what);
  // The frame is intact and verified; a failed acknowledgement only means the sender is
  // gone, which its next send_to (if any) will notice.
  if (!ack.ok()) make_logger("ckpt")->warn("replica {}: acknowledgement not sent: {}", what, ack.to_string());
  return blob;
}

Result<ReplicaBlob> BulkReplicaLink::receive(std::chrono::milliseconds timeout, uint64_t max_bytes) {
  TROUPE_ASSIGN_OR_RETURN(ReplicaBlob b, endpoint_.receive_from(peer_, timeout));
  if (b.bytes->size() > max_bytes) {
    return resource_exhausted("replica of rank {} is {} bytes, more than the {} accepted", b.part.rank,
                              b.bytes->size(), max_bytes);
  }
  return b;
}

}  // namespace troupe::checkpoint
