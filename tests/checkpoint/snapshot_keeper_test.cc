// tests/checkpoint/snapshot_keeper_test.cc — the snapshot keeper with real processes and
// sockets: a forked worker writes a part into the segment its node's keeper handed it and
// dies (SIGKILL); the part is still there, whole, for a new session; a commit copies it
// to another node's keeper over TCP, from where a third session fetches it; a byte flipped
// in the keeper's memory is caught by the slice checksums, naming the tensor; release
// drops the part here and at the copy; a malformed request is answered with an error.
#include "checkpoint/snapshot_keeper.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <thread>

#include "checkpoint/snapshot_client.h"
#include "checkpoint/snapshot_segment.h"
#include "checkpoint/snapshot_wire.h"

namespace troupe::checkpoint {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr int64_t kElems = 3000;

// Rank 1 of a dp=2 layout: one tensor "w" of kElems floats (i + 1000 * step) and a
// replicated "b" it does not save (the checkpoint keeps rank 0's).
void write_part(SegmentMap& m, int64_t step) {
  begin_segment(m, step);
  auto* w = reinterpret_cast<float*>(m.data());
  for (int64_t i = 0; i < kElems; ++i) w[i] = static_cast<float>(i) + 1000.0f * static_cast<float>(step);
  auto* b = reinterpret_cast<float*>(m.data() + kElems * 4);
  for (int i = 0; i < 16; ++i) b[i] = -static_cast<float>(i);
  ManifestPart p;
  p.step = step;
  p.rank = 1;
  p.world_size = 2;
  p.layout = ParallelLayout{1, 2, 1};
  p.coords = p.layout.coord(1);
  p.state = {{"step", step}, {"unsaved", {"b"}}};
  p.tensors.push_back(TensorRecord{
      "w",
      DType::kF32,
      {2 * kElems},
      {StoredSlice{shard_file_name(1), 0, kElems * 4, {{kElems, kElems}}, XXH64(w, kElems * 4, 0), 1}}});
  p.tensors.push_back(
      TensorRecord{"b",
                   DType::kF32,
                   {16},
                   {StoredSlice{shard_file_name(1), kElems * 4, 64, {{0, 16}}, XXH64(b, 64, 0), 1}}});
  ASSERT_TRUE(seal_segment(m, p, kElems * 4 + 64, kElems * 4).ok());
}

uint64_t segment_bytes() {
  return segment_size_for(kElems * 4 + 64, 64 * 1024);
}

void expect_part(const std::shared_ptr<const SegmentMap>& m, int64_t step) {
  Result<SnapshotPart> p = read_segment_part(m, "test");
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->part.step, step);
  EXPECT_EQ(p->saved_bytes, static_cast<uint64_t>(kElems * 4));
  ASSERT_TRUE(verify_snapshot_part(*p, 2).ok());
  Tensor dst = Tensor::zeros({10}, DType::kF32);
  int64_t covered = 0;
  ASSERT_TRUE(read_part_region(*p, "w", {{kElems + 5, 10}}, dst, covered).ok());
  EXPECT_EQ(covered, 10);
  EXPECT_EQ(dst.data<float>()[0], 5.0f + 1000.0f * static_cast<float>(step));
  const ManifestPart saved = saved_subset(p->part);
  ASSERT_EQ(saved.tensors.size(), 1u);
  EXPECT_EQ(saved.tensors[0].name, "w");
}

// Waits until `k` holds a part matching `pred`, up to 10 s.
template <class Pred>
bool wait_held(const SnapshotKeeper& k, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    for (const SnapHeld& h : k.held("job-1")) {
      if (pred(h)) return true;
    }
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

class SnapshotKeeperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = SnapshotKeeper::start({.node = "node-a", .host_addr = "127.0.0.1"});
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    a_ = std::move(a).value();
    auto b = SnapshotKeeper::start({.node = "node-b", .host_addr = "127.0.0.1"});
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    b_ = std::move(b).value();
  }
  std::unique_ptr<SnapshotKeeper> a_, b_;
};

TEST_F(SnapshotKeeperTest, APartOutlivesItsWorkerAndIsCopiedToAnotherNode) {
  // The keeper's directory is private to this user.
  const fs::perms perms = fs::status(fs::path(a_->socket_path()).parent_path()).permissions();
  EXPECT_EQ(perms & fs::perms::all, fs::perms::owner_all);

  // The worker: a forked process that attaches, writes step 4 and is killed before it
  // says anything else.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto c = SnapshotClient::connect(a_->socket_path());
    if (!c.ok()) _exit(2);
    auto g = (*c)->attach("job-1", 1, segment_bytes());
    if (!g.ok() || !(*c)->begin("job-1", 1, 0, 4).ok()) _exit(3);
    write_part(*g->maps[0], 4);
    if (!(*c)->landed("job-1", 1, 0, 4).ok()) _exit(4);
    const char x = 1;
    if (::write(ready[1], &x, 1) != 1) _exit(5);
    ::pause();
    _exit(0);
  }
  ::close(ready[1]);
  char x = 0;
  ASSERT_EQ(::read(ready[0], &x, 1), 1);
  ::close(ready[0]);
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));

  // A new session (the replacement) finds the part whole.
  auto c = SnapshotClient::connect(a_->socket_path());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto m = (*c)->fetch("job-1", 1, 4, {}, 10s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  expect_part(m->map, 4);
  EXPECT_FALSE(m->copy);
  EXPECT_EQ(m->served_by, "node-a");
  EXPECT_EQ(a_->totals().parts, 1);
  EXPECT_GE(a_->totals().bytes, 2 * segment_bytes());
  EXPECT_NE(keeper_totals_text(a_->totals()).find("1 part"), std::string::npos);
  // Not committed: no copy yet; a part of a step nobody holds is NotFound.
  EXPECT_TRUE(b_->held("job-1").empty());
  EXPECT_EQ((*c)->fetch("job-1", 1, 5, {}, 10s).status().code(), StatusCode::kNotFound);
  // A commit with a replica target copies it to node b.
  ASSERT_TRUE((*c)->commit("job-1", 1, 4, b_->endpoint()).ok());
  ASSERT_TRUE(
      wait_held(*b_, [](const SnapHeld& h) { return h.replica && h.step == 4 && h.from_node == "node-a"; }));
  ASSERT_TRUE(wait_held(*a_, [&](const SnapHeld& h) {
    return !h.replica && h.replicated_step == 4 && h.replicated_to == b_->endpoint();
  }));
  // Node a is gone: a worker on node b gets its copy from b's memory...
  auto cb = SnapshotClient::connect(b_->socket_path());
  ASSERT_TRUE(cb.ok());
  auto mb = (*cb)->fetch("job-1", 1, 4, {a_->endpoint()}, 10s);
  ASSERT_TRUE(mb.ok()) << mb.status().to_string();
  expect_part(mb->map, 4);
  EXPECT_TRUE(mb->copy);
  EXPECT_EQ(mb->served_by, "node-b");
  EXPECT_EQ(mb->from_node, "node-a");
  // ... and a third node's keeper copies it from b on demand.
  auto k3 = SnapshotKeeper::start({.node = "node-c", .host_addr = "127.0.0.1"});
  ASSERT_TRUE(k3.ok());
  auto c3 = SnapshotClient::connect((*k3)->socket_path());
  ASSERT_TRUE(c3.ok());
  auto m3 = (*c3)->fetch("job-1", 1, 4, {"127.0.0.1:1", b_->endpoint()}, 10s);
  ASSERT_TRUE(m3.ok()) << m3.status().to_string();
  expect_part(m3->map, 4);
  EXPECT_TRUE(m3->copy);
  EXPECT_EQ((*k3)->totals().copies, 1);
  // Release drops the part here and the copy at b.
  ASSERT_TRUE((*c)->release("job-1", -1).ok());
  EXPECT_TRUE(a_->held("job-1").empty());
  EXPECT_TRUE(b_->held("job-1").empty());
}

TEST_F(SnapshotKeeperTest, AFlippedByteIsCaughtByTheSliceChecksum) {
  auto c = SnapshotClient::connect(a_->socket_path());
  ASSERT_TRUE(c.ok());
  auto g = (*c)->attach("job-1", 1, segment_bytes());
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  ASSERT_TRUE((*c)->begin("job-1", 1, 1, 6).ok());
  write_part(*g->maps[1], 6);
  ASSERT_TRUE((*c)->landed("job-1", 1, 1, 6).ok());
  // A landed message for a generation that holds something else is refused.
  EXPECT_EQ((*c)->landed("job-1", 1, 0, 6).code(), StatusCode::kDataLoss);
  // Damage the keeper's copy through its descriptor, as a stray write would.
  std::string path;
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = fs::read_symlink(e.path(), ec).string();
    if (target.find("troupe-snap:job-1:r1:g1") != std::string::npos) path = e.path().string();
  }
  ASSERT_FALSE(path.empty());
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const char bad = 0x5a;
  ASSERT_EQ(::pwrite(fd, &bad, 1, static_cast<off_t>(kSegmentDataOffset + 4 * 100 + 1)), 1);
  ::close(fd);
  auto m = (*c)->fetch("job-1", 1, 6, {}, 10s);
  ASSERT_TRUE(m.ok());
  Result<SnapshotPart> p = read_segment_part(m->map, "test");
  ASSERT_TRUE(p.ok());
  const Status st = verify_snapshot_part(*p, 2);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("'w'"), std::string::npos) << st.to_string();
}

TEST_F(SnapshotKeeperTest, MalformedRequestsAreRefusedAndTheKeeperGoesOn) {
  Result<FileHandle> fd = wire::connect_unix(a_->socket_path());
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(wire::send_datagram(fd->fd(), std::string(13, '\x7f')).ok());
  auto d = wire::recv_datagram(fd->fd(), std::chrono::steady_clock::now() + 5s);
  ASSERT_TRUE(d.ok());
  auto r = decode_snap_reply(d->bytes);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status().code(), StatusCode::kDataLoss);
  // A keeper connection sending garbage is closed; the keeper still serves.
  Result<FileHandle> t = wire::connect_tcp(a_->endpoint(), 5s);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(wire::send_frame(t->fd(), std::string(24, '\x01')).ok());
  auto c = SnapshotClient::connect(a_->socket_path());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->attach("../x", 0, segment_bytes()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((*c)->attach("job-2", 0, segment_bytes()).ok());
}

}  // namespace
}  // namespace troupe::checkpoint
