// checkpoint/snapshot_wire.h — defines the socket plumbing of the snapshot protocols
// (snapshot_keeper.h): datagrams with attached descriptors on a Unix seqpacket socket,
// length-prefixed frames and bulk bytes on a TCP stream, and connecting to "addr:port".
// Every call is bounded by its deadline and reports the peer's failure as a Status
// (Unavailable for a closed or broken connection, DeadlineExceeded for silence).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "core/status.h"

namespace troupe::checkpoint::wire {

using Clock = std::chrono::steady_clock;

// Seqpacket: one message per datagram, with up to 4 descriptors (SCM_RIGHTS).
Status send_datagram(int fd, const std::string& bytes, const std::vector<int>& fds = {});
struct Datagram {
  std::string bytes;
  std::vector<FileHandle> fds;
};
// Waits for the next datagram until `deadline`; Unavailable when the peer closed.
Result<Datagram> recv_datagram(int fd, Clock::time_point deadline);

// TCP frames: u64 little-endian length, then that many bytes (at most `max_bytes`).
Status send_frame(int fd, const std::string& bytes);
Result<std::string> recv_frame(int fd, Clock::time_point deadline, uint64_t max_bytes = 4u << 20);
// Raw bytes on a stream (the segment after a put / a get's reply).
Status send_bytes(int fd, const void* data, uint64_t n);
Status recv_bytes(int fd, void* data, uint64_t n, Clock::time_point deadline);

// A TCP connection to "addr:port" (IPv4), bounded by `timeout`; TCP_NODELAY set.
Result<FileHandle> connect_tcp(const std::string& endpoint, std::chrono::milliseconds timeout);
// A listening TCP socket on `addr` with an OS-assigned port; the bound port in `port`.
Result<FileHandle> listen_tcp(const std::string& addr, int& port);
// A Unix seqpacket connection to `path`.
Result<FileHandle> connect_unix(const std::string& path);

}  // namespace troupe::checkpoint::wire
