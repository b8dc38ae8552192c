// checkpoint/snapshot_client.cc — a worker's session with its node's snapshot keeper.
#include "checkpoint/snapshot_client.h"

#include "checkpoint/snapshot_wire.h"

namespace troupe::checkpoint {

namespace {
constexpr std::chrono::milliseconds kCallTimeout{60000};
}

Result<std::unique_ptr<SnapshotClient>> SnapshotClient::connect(const std::string& path) {
  TROUPE_ASSIGN_OR_RETURN(FileHandle fd, wire::connect_unix(path));
  return std::unique_ptr<SnapshotClient>(new SnapshotClient(std::move(fd)));
}

Result<SnapshotClient::Answer> SnapshotClient::call(const SnapRequest& req,
                                                    std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  if (!fd_.valid()) return unavailable("the snapshot keeper session is closed");
  Status st = wire::send_datagram(fd_.fd(), encode_snap_request(req));
  Result<wire::Datagram> d =
      st.ok() ? wire::recv_datagram(fd_.fd(), wire::Clock::now() + timeout) : Result<wire::Datagram>(st);
  if (!d.ok()) {
    fd_ = FileHandle();  // a lost or late answer leaves the session out of step
    return d.status().with_context("snapshot keeper");
  }
  TROUPE_ASSIGN_OR_RETURN(SnapReply r, decode_snap_reply(d->bytes));
  TROUPE_RETURN_IF_ERROR(r.status());
  return Answer{std::move(r), std::move(d->fds)};
}

Result<SnapshotClient::Generations> SnapshotClient::attach(const std::string& job, int rank, uint64_t bytes) {
  TROUPE_ASSIGN_OR_RETURN(Answer a, call(SnapAttach{job, rank, bytes}, kCallTimeout));
  if (a.fds.size() != 2 || a.reply.gens.size() != 2) {
    return data_loss("snapshot keeper: attach answered with {} descriptors and {} generations", a.fds.size(),
                     a.reply.gens.size());
  }
  Generations g;
  g.node = a.reply.node;
  g.endpoint = a.reply.endpoint;
  for (int i = 0; i < 2; ++i) {
    TROUPE_ASSIGN_OR_RETURN(g.maps[i], SegmentMap::map(a.fds[i].fd(), /*writable=*/true));
    if (g.maps[i]->size() < bytes)
      return data_loss("snapshot keeper: generation {} has {} bytes, {} asked for", i, g.maps[i]->size(),
                       bytes);
    g.gens[i] = a.reply.gens[i];
  }
  return g;
}

Status SnapshotClient::begin(const std::string& job, int rank, uint32_t gen, int64_t step) {
  return call(SnapBegin{job, rank, gen, step}, kCallTimeout).status();
}

Status SnapshotClient::landed(const std::string& job, int rank, uint32_t gen, int64_t step) {
  return call(SnapLanded{job, rank, gen, step}, kCallTimeout).status();
}

Status SnapshotClient::commit(const std::string& job, int rank, int64_t step,
                              const std::string& replicate_to) {
  return call(SnapCommit{job, rank, step, replicate_to}, kCallTimeout).status();
}

Result<SnapshotClient::Fetched> SnapshotClient::fetch(const std::string& job, int rank, int64_t step,
                                                      const std::vector<std::string>& sources,
                                                      std::chrono::milliseconds timeout) {
  TROUPE_ASSIGN_OR_RETURN(Answer a, call(SnapFetch{job, rank, step, sources}, timeout));
  if (a.fds.size() != 1)
    return data_loss("snapshot keeper: fetch answered with {} descriptors", a.fds.size());
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<SegmentMap> m, SegmentMap::map(a.fds[0].fd(), /*writable=*/false));
  Fetched f;
  f.map = std::move(m);
  f.served_by = a.reply.node;
  if (!a.reply.held.empty()) {
    f.copy = a.reply.held[0].replica;
    f.from_node = a.reply.held[0].from_node;
  }
  return f;
}

Result<SnapReply> SnapshotClient::query(const std::string& job) {
  TROUPE_ASSIGN_OR_RETURN(Answer a, call(SnapQuery{job}, kCallTimeout));
  return std::move(a.reply);
}

Status SnapshotClient::release(const std::string& job, int rank) {
  return call(SnapRelease{job, rank}, kCallTimeout).status();
}

}  // namespace troupe::checkpoint
