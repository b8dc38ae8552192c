// tests/checkpoint/peer_replica_test.cc — a rank's shard travels to a data-parallel peer
// over a real loopback TCP connection, is kept in the peer's store, and restores the
// tensors bitwise; damaged, cut-off or late transfers are refused with a reason.
#include "checkpoint/peer_replica.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <numeric>

#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

using namespace std::chrono_literals;

Tensor iota(const Shape& s, float base) {
  std::vector<float> v(static_cast<size_t>(shape_numel(s)));
  std::iota(v.begin(), v.end(), base);
  return Tensor::from_floats(s, v);
}

// Rank 1 of a dp=2 layout saves its expert block and attention copy.
ReplicaBlob make_blob(const std::string& run, int64_t step, std::unique_ptr<CheckpointWriter>& keep) {
  auto w = CheckpointWriter::create(WriterOptions{run, ParallelLayout{1, 2, 1}, 1});
  EXPECT_TRUE(w.ok());
  const Tensor experts = iota({4, 3, 5}, 100.0f * static_cast<float>(step));
  auto h = (*w)->save(step, {SaveEntry{"experts", {8, 3, 5}, {4, 0, 0}, experts},
                             SaveEntry{"attn", {6}, {}, iota({6}, 1.0f)}});
  EXPECT_TRUE(h.ok());
  EXPECT_TRUE(h->wait().ok());
  auto blob = replica_from_writer(**w);
  EXPECT_TRUE(blob.ok()) << blob.status();
  keep = std::move(*w);
  return *blob;
}

TEST(PeerReplica, TravelsOverTcpAndRestoresBitwise) {
  testing::TempDir dir;
  std::unique_ptr<CheckpointWriter> w;
  ReplicaBlob blob = make_blob(dir.sub("run"), 4, w);
  auto listener = TcpReplicaListener::listen_loopback();
  ASSERT_TRUE(listener.ok()) << listener.status();
  const int port = (*listener)->port();
  auto sender = std::async(std::launch::async, [&]() -> Status {
    auto ch = TcpReplicaChannel::connect("127.0.0.1", port, 2s);
    if (!ch.ok()) return ch.status();
    return (*ch)->send(blob);
  });
  auto ch = (*listener)->accept(5s);
  ASSERT_TRUE(ch.ok()) << ch.status();
  auto got = (*ch)->receive(5s, 1u << 30);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(sender.get().ok());

  PeerReplicaStore store;
  ASSERT_TRUE(store.put(*got).ok());
  EXPECT_EQ(store.step_of(1), 4);
  EXPECT_FALSE(store.step_of(0).has_value());
  EXPECT_EQ(store.bytes_held(), blob.bytes->size());
  auto held = store.get(1);
  ASSERT_TRUE(held.ok());
  auto experts = read_replica(*held, "experts", Slice{{4, 4}, {0, 3}, {0, 5}});
  ASSERT_TRUE(experts.ok()) << experts.status();
  EXPECT_TRUE(testing::bitwise_equal(*experts, iota({4, 3, 5}, 400.0f)));
  auto one = read_replica(*held, "experts", Slice{{6, 1}, {1, 1}, {0, 5}});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(testing::bitwise_equal(*one, iota({4, 3, 5}, 400.0f).narrow(0, 2, 1).narrow(1, 1, 1)));
  // The replica holds only experts 4..7.
  EXPECT_EQ(read_replica(*held, "experts", Slice{{0, 8}, {0, 3}, {0, 5}}).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(read_replica(*held, "nope", Slice{{0, 1}}).status().code(), StatusCode::kNotFound);

  // A newer step replaces it; an older one is refused.
  std::unique_ptr<CheckpointWriter> w2;
  ASSERT_TRUE(store.put(make_blob(dir.sub("run2"), 6, w2)).ok());
  EXPECT_EQ(store.step_of(1), 6);
  EXPECT_EQ(store.put(blob).code(), StatusCode::kFailedPrecondition);
  store.drop(1);
  EXPECT_EQ(store.get(1).status().code(), StatusCode::kNotFound);
}

TEST(PeerReplica, DamagedBlobIsRefused) {
  testing::TempDir dir;
  std::unique_ptr<CheckpointWriter> w;
  ReplicaBlob blob = make_blob(dir.sub("run"), 4, w);
  auto damaged = std::make_shared<std::vector<std::byte>>(*blob.bytes);
  (*damaged)[3] ^= std::byte{0x40};
  ReplicaBlob bad{blob.part, damaged};
  Status st = PeerReplicaStore().put(bad);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("rank 1"), std::string::npos) << st;
  // Sent over TCP, the receiver refuses it too.
  auto listener = TcpReplicaListener::listen_loopback();
  ASSERT_TRUE(listener.ok());
  auto sender = std::async(std::launch::async, [&]() -> Status {
    auto ch = TcpReplicaChannel::connect("localhost", (*listener)->port(), 2s);
    return ch.ok() ? (*ch)->send(bad) : ch.status();
  });
  auto ch = (*listener)->accept(5s);
  ASSERT_TRUE(ch.ok());
  EXPECT_EQ((*ch)->receive(5s, 1u << 30).status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(sender.get().ok());
}

TEST(PeerReplica, CutOffTooLargeAndLateTransfersAreErrors) {
  testing::TempDir dir;
  std::unique_ptr<CheckpointWriter> w;
  ReplicaBlob blob = make_blob(dir.sub("run"), 4, w);
  auto listener = TcpReplicaListener::listen_loopback();
  ASSERT_TRUE(listener.ok());
  const int port = (*listener)->port();
  {
    // The peer dies after half a frame header.
    auto raw = TcpReplicaChannel::connect("127.0.0.1", port, 2s);
    ASSERT_TRUE(raw.ok());
    auto ch = (*listener)->accept(5s);
    ASSERT_TRUE(ch.ok());
    ASSERT_EQ(::send((*raw)->fd(), "TRPREPL1abcd", 12, MSG_NOSIGNAL), 12);
    raw->reset();
    EXPECT_EQ((*ch)->receive(5s, 1u << 30).status().code(), StatusCode::kUnavailable);
  }
  {
    // Larger than the receiver accepts.
    auto raw = TcpReplicaChannel::connect("127.0.0.1", port, 2s);
    auto ch = (*listener)->accept(5s);
    ASSERT_TRUE(ch.ok());
    ASSERT_TRUE((*raw)->send(blob).ok());
    EXPECT_EQ((*ch)->receive(5s, 16).status().code(), StatusCode::kResourceExhausted);
  }
  {
    // Nothing arrives in time.
    auto raw = TcpReplicaChannel::connect("127.0.0.1", port, 2s);
    auto ch = (*listener)->accept(5s);
    ASSERT_TRUE(ch.ok());
    EXPECT_EQ((*ch)->receive(100ms, 1u << 30).status().code(), StatusCode::kDeadlineExceeded);
  }
  EXPECT_EQ((*listener)->accept(50ms).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(PeerReplica, NoSnapshotBeforeTheFirstSave) {
  testing::TempDir dir;
  auto w = CheckpointWriter::create(WriterOptions{dir.sub("run"), ParallelLayout{}, 0});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(replica_from_writer(**w).status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace troupe::checkpoint
