// checkpoint/peer_replica.cc — replica blobs, the TCP channel and the replica store.
#include "checkpoint/peer_replica.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>

namespace troupe::checkpoint {

using Clock = std::chrono::steady_clock;

namespace {

constexpr char kMagic[8] = {'T', 'R', 'P', 'R', 'E', 'P', 'L', '1'};
constexpr uint64_t kMaxPartBytes = 64u << 20;

Status sock_error(std::string_view op, int err) {
  return unavailable("replica {}: {}", op, std::strerror(err));
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

Status send_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return sock_error("send", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return ok_status();
}

Status recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int pr = ::poll(&pfd, 1, remaining_ms(deadline));
    if (pr < 0) {
      if (errno == EINTR) continue;
      return sock_error("poll", errno);
    }
    if (pr == 0) return deadline_exceeded("replica receive: timed out with {} bytes still to come", n);
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return sock_error("recv", errno);
    }
    if (r == 0)
      return unavailable("replica receive: peer closed the connection with {} bytes still to come", n);
    p += r;
    n -= static_cast<size_t>(r);
  }
  return ok_status();
}

void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

Result<ReplicaBlob> replica_from_writer(const CheckpointWriter& writer) {
  TROUPE_ASSIGN_OR_RETURN(auto snap, writer.last_snapshot());
  return ReplicaBlob{std::move(snap.second), std::move(snap.first)};
}

Status verify_replica(const ReplicaBlob& blob) {
  if (!blob.bytes) return invalid_argument("replica of rank {} has no bytes", blob.part.rank);
  for (const TensorRecord& t : blob.part.tensors) {
    for (const StoredSlice& s : t.slices) {
      if (s.offset + s.length > blob.bytes->size()) {
        return data_loss("replica of rank {} (step {}): tensor '{}' slice {} lies beyond its {} bytes",
                         blob.part.rank, blob.part.step, t.name, slice_to_string(s.box), blob.bytes->size());
      }
      const uint64_t h = XXH64(blob.bytes->data() + s.offset, s.length, 0);
      if (h != s.xxh64) {
        return data_loss("replica of rank {} (step {}): checksum mismatch for tensor '{}' slice {}",
                         blob.part.rank, blob.part.step, t.name, slice_to_string(s.box));
      }
    }
  }
  return ok_status();
}

std::string encode_replica_head(const ReplicaBlob& blob) {
  const std::string part = part_to_json(blob.part).dump();
  XXH64_state_t* hs = XXH64_createState();
  XXH64_reset(hs, 0);
  XXH64_update(hs, part.data(), part.size());
  XXH64_update(hs, blob.bytes->data(), blob.bytes->size());
  const uint64_t h = XXH64_digest(hs);
  XXH64_freeState(hs);
  std::string head(kReplicaHeaderBytes, '\0');
  std::memcpy(head.data(), kMagic, 8);
  put_u64(head.data() + 8, part.size());
  put_u64(head.data() + 16, blob.bytes->size());
  put_u64(head.data() + 24, h);
  return head + part;
}

Result<ReplicaFrameHeader> parse_replica_header(const char* header, uint64_t max_bytes) {
  if (std::memcmp(header, kMagic, 8) != 0) return data_loss("replica frame: bad magic");
  ReplicaFrameHeader h{get_u64(header + 8), get_u64(header + 16), get_u64(header + 24)};
  if (h.part_bytes > kMaxPartBytes || h.shard_bytes > max_bytes) {
    return resource_exhausted("replica frame of {} + {} bytes exceeds the limit of {}", h.part_bytes,
                              h.shard_bytes, max_bytes);
  }
  return h;
}

Result<ReplicaBlob> finish_replica_decode(const ReplicaFrameHeader& h, const std::string& part,
                                          std::shared_ptr<std::vector<std::byte>> bytes) {
  XXH64_state_t* hs = XXH64_createState();
  XXH64_reset(hs, 0);
  XXH64_update(hs, part.data(), part.size());
  XXH64_update(hs, bytes->data(), bytes->size());
  const uint64_t got = XXH64_digest(hs);
  XXH64_freeState(hs);
  if (got != h.xxh64)
    return data_loss("replica frame: checksum mismatch ({} vs {})", xxh64_hex(got), xxh64_hex(h.xxh64));
  nlohmann::json j = nlohmann::json::parse(part, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return data_loss("replica frame: manifest part is not valid JSON");
  TROUPE_ASSIGN_OR_RETURN(ManifestPart p, part_from_json(j, "replica frame"));
  ReplicaBlob blob{std::move(p), std::move(bytes)};
  TROUPE_RETURN_IF_ERROR(verify_replica(blob));
  return blob;
}

Result<ReplicaBlob> decode_replica_frame(const std::byte* data, uint64_t size, uint64_t max_bytes) {
  if (size < kReplicaHeaderBytes)
    return data_loss("replica frame of {} bytes is shorter than its header", size);
  TROUPE_ASSIGN_OR_RETURN(ReplicaFrameHeader h,
                          parse_replica_header(reinterpret_cast<const char*>(data), max_bytes));
  if (size != kReplicaHeaderBytes + h.part_bytes + h.shard_bytes) {
    return data_loss("replica frame: {} bytes, its header says {}", size,
                     kReplicaHeaderBytes + h.part_bytes + h.shard_bytes);
  }
  std::string part(reinterpret_cast<const char*>(data) + kReplicaHeaderBytes, h.part_bytes);
  const std::byte* shard = data + kReplicaHeaderBytes + h.part_bytes;
  auto bytes = std::make_shared<std::vector<std::byte>>(shard, shard + h.shard_bytes);
  return finish_replica_decode(h, part, std::move(bytes));
}

Result<Tensor> read_replica(const ReplicaBlob& blob, const std::string& name, const Slice& box) {
  const TensorRecord* rec = nullptr;
  for (const TensorRecord& t : blob.part.tensors) {
    if (t.name == name) rec = &t;
  }
  if (rec == nullptr)
    return not_found("replica of rank {} (step {}) has no tensor '{}'", blob.part.rank, blob.part.step, name);
  TROUPE_RETURN_IF_ERROR(check_slice_within(box, rec->shape, fmt::format("replica tensor '{}'", name)));
  Tensor out = Tensor::empty(slice_shape(box), rec->dtype);
  auto* dst = static_cast<std::byte*>(out.numel() > 0 ? out.data_ptr() : nullptr);
  int64_t covered = 0;
  for (const StoredSlice& s : rec->slices) {
    auto region = intersect(s.box, box);
    if (!region || slice_numel(*region) == 0) continue;
    if (s.offset + s.length > blob.bytes->size() ||
        XXH64(blob.bytes->data() + s.offset, s.length, 0) != s.xxh64) {
      return data_loss("replica of rank {}: tensor '{}' slice {} is damaged", blob.part.rank, name,
                       slice_to_string(s.box));
    }
    copy_region(blob.bytes->data() + s.offset, s.box, dst, box, *region, dtype_size(rec->dtype));
    covered += slice_numel(*region);
  }
  if (covered != slice_numel(box)) {
    return data_loss("replica of rank {}: tensor '{}' slice {}: holds {} of {} elements", blob.part.rank,
                     name, slice_to_string(box), covered, slice_numel(box));
  }
  return out;
}

// ---- TCP -------------------------------------------------------------------------------

TcpReplicaChannel::~TcpReplicaChannel() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<TcpReplicaChannel>> TcpReplicaChannel::connect(const std::string& host, int port,
                                                                      std::chrono::milliseconds timeout) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string h = host == "localhost" ? "127.0.0.1" : host;
  if (::inet_pton(AF_INET, h.c_str(), &addr.sin_addr) != 1)
    return invalid_argument("replica: bad IPv4 address '{}'", host);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return sock_error("socket", errno);
  auto ch = std::make_unique<TcpReplicaChannel>(fd);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS) return sock_error(fmt::format("connect {}:{}", host, port), errno);
    pollfd pfd{fd, POLLOUT, 0};
    const int pr = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
    if (pr == 0)
      return deadline_exceeded("replica: connect to {}:{} timed out after {} ms", host, port,
                               timeout.count());
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (pr < 0 || err != 0) return sock_error(fmt::format("connect {}:{}", host, port), pr < 0 ? errno : err);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return ch;
}

Status TcpReplicaChannel::send(const ReplicaBlob& blob) {
  if (!blob.bytes) return invalid_argument("replica send: blob of rank {} has no bytes", blob.part.rank);
  const std::string head = encode_replica_head(blob);
  TROUPE_RETURN_IF_ERROR(send_all(fd_, head.data(), head.size()));
  return send_all(fd_, blob.bytes->data(), blob.bytes->size());
}

Result<ReplicaBlob> TcpReplicaChannel::receive(std::chrono::milliseconds timeout, uint64_t max_bytes) {
  const auto deadline = Clock::now() + timeout;
  char header[kReplicaHeaderBytes];
  TROUPE_RETURN_IF_ERROR(recv_all(fd_, header, sizeof header, deadline));
  TROUPE_ASSIGN_OR_RETURN(ReplicaFrameHeader h, parse_replica_header(header, max_bytes));
  std::string part(h.part_bytes, '\0');
  TROUPE_RETURN_IF_ERROR(recv_all(fd_, part.data(), part.size(), deadline));
  auto bytes = std::make_shared<std::vector<std::byte>>(h.shard_bytes);
  TROUPE_RETURN_IF_ERROR(recv_all(fd_, bytes->data(), bytes->size(), deadline));
  return finish_replica_decode(h, part, std::move(bytes));
}

Result<std::unique_ptr<TcpReplicaListener>> TcpReplicaListener::listen_loopback() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return sock_error("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0) {
    const int err = errno;
    ::close(fd);
    return sock_error("bind/listen on 127.0.0.1", err);
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<TcpReplicaListener>(new TcpReplicaListener(fd, ntohs(addr.sin_port)));
}

TcpReplicaListener::~TcpReplicaListener() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<TcpReplicaChannel>> TcpReplicaListener::accept(std::chrono::milliseconds timeout) {
  pollfd pfd{fd_, POLLIN, 0};
  const int pr = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
  if (pr == 0)
    return deadline_exceeded("replica: no connection on port {} within {} ms", port_, timeout.count());
  if (pr < 0) return sock_error("poll", errno);
  const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return sock_error("accept", errno);
  return std::make_unique<TcpReplicaChannel>(fd);
}

// ---- store -----------------------------------------------------------------------------

Status PeerReplicaStore::put(ReplicaBlob blob) {
  TROUPE_RETURN_IF_ERROR(verify_replica(blob));
  std::lock_guard lock(mu_);
  auto it = blobs_.find(blob.part.rank);
  if (it != blobs_.end() && it->second.part.step > blob.part.step) {
    return failed_precondition("replica of rank {}: holding step {}, refusing older step {}", blob.part.rank,
                               it->second.part.step, blob.part.step);
  }
  blobs_[blob.part.rank] = std::move(blob);
  return ok_status();
}

Result<ReplicaBlob> PeerReplicaStore::get(int owner_rank) const {
  std::lock_guard lock(mu_);
  auto it = blobs_.find(owner_rank);
  if (it == blobs_.end()) return not_found("no replica of rank {} held here", owner_rank);
  return it->second;
}

std::optional<int64_t> PeerReplicaStore::step_of(int owner_rank) const {
  std::lock_guard lock(mu_);
  auto it = blobs_.find(owner_rank);
  if (it == blobs_.end()) return std::nullopt;
  return it->second.part.step;
}

void PeerReplicaStore::drop(int owner_rank) {
  std::lock_guard lock(mu_);
  blobs_.erase(owner_rank);
}

uint64_t PeerReplicaStore::bytes_held() const {
  std::lock_guard lock(mu_);
  uint64_t n = 0;
  for (const auto& [r, b] : blobs_) n += b.bytes ? b.bytes->size() : 0;
  return n;
}

}  // namespace troupe::checkpoint
