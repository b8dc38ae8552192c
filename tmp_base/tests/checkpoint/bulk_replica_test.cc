// tests/checkpoint/bulk_replica_test.cc — replicas over comm's real TCP bulk transport:
// three ranks (threads, each with its own transport and sockets) pass their shards around
// the data-parallel ring twice, and each restores its neighbour's tensors bitwise; an
// oversized blob and a silent peer are errors, not hangs.
#include "checkpoint/bulk_replica.h"

#include <gtest/gtest.h>

#include <barrier>
#include <numeric>
#include <thread>

#include "comm/rendezvous_store.h"
#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

using namespace std::chrono_literals;

comm::BulkSpec spec_for(comm::RendezvousStore& store, int rank, int size) {
  comm::BulkSpec s;
  s.store = &store;
  s.ns = comm::StoreNamespace{"ckpt-replica-test", 0};
  s.rank = rank;
  s.size = size;
  s.timeout = 10s;
  return s;
}

Tensor rank_tensor(int rank, int64_t step) {
  std::vector<float> v(3000);
  std::iota(v.begin(), v.end(), static_cast<float>(rank * 100000 + step * 1000));
  return Tensor::from_floats({30, 100}, v);
}

TEST(BulkReplica, RingOfThreeRanksRestoresNeighboursBitwise) {
  constexpr int kRanks = 3;
  testing::TempDir dir;
  std::vector<std::string> errors(kRanks);
  std::barrier done(kRanks);
  // `keep` outlives body(): the transport and endpoint stay up until every rank is done.
  struct Kept {
    std::unique_ptr<comm::FileStore> store;
    std::unique_ptr<comm::BulkTransport> transport;
    std::unique_ptr<BulkReplicaEndpoint> endpoint;
  };
  auto body = [&](int rank, Kept& keep) -> std::string {
    auto store = comm::FileStore::open(dir.sub("store"));
    if (!store.ok()) return store.status().to_string();
    keep.store = std::move(*store);
    auto t = comm::make_tcp_transport(spec_for(*keep.store, rank, kRanks));
    if (!t.ok()) return t.status().to_string();
    keep.transport = std::move(*t);
    auto ep = BulkReplicaEndpoint::create(*keep.transport, BulkReplicaOptions{1u << 20});
    if (!ep.ok()) return ep.status().to_string();
    keep.endpoint = std::move(*ep);
    auto w = CheckpointWriter::create(WriterOptions{dir.sub("run"), ParallelLayout{1, kRanks, 1}, rank});
    if (!w.ok()) return w.status().to_string();
    PeerReplicaStore replicas;
    const int next = (rank + 1) % kRanks, prev = (rank + kRanks - 1) % kRanks;
    for (int64_t step : {5, 6}) {
      auto h = (*w)->save(
          step, {SaveEntry{"opt.m.shard", {30 * kRanks, 100}, {30 * rank, 0}, rank_tensor(rank, step)}});
      if (!h.ok() || !h->wait().ok()) return "save failed";
      auto blob = replica_from_writer(**w);
      if (!blob.ok()) return blob.status().to_string();
      if (Status st = keep.endpoint->send_to(next, *blob); !st.ok()) return st.to_string();
      auto got = keep.endpoint->receive_from(prev, 10s);
      if (!got.ok()) return got.status().to_string();
      if (Status st = replicas.put(*got); !st.ok()) return st.to_string();
      auto x = read_replica(*replicas.get(prev), "opt.m.shard", Slice{{30 * prev, 30}, {0, 100}});
      if (!x.ok()) return x.status().to_string();
      if (!testing::bitwise_equal(*x, rank_tensor(prev, step)))
        return fmt::format("step {}: replica differs", step);
      if (replicas.step_of(prev) != step) return "wrong step held";
    }
    return "";
  };
  // Every rank keeps its transport until all are done (the last acknowledgements).
  auto run_rank = [&](int rank) {
    Kept keep;
    errors[static_cast<size_t>(rank)] = body(rank, keep);
    done.arrive_and_wait();
    keep.transport.reset();  // first: it may still write into the endpoint's buffers
    keep.endpoint.reset();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { run_rank(r); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

TEST(BulkReplica, OversizedBlobAndSilentPeerAreErrors) {
  testing::TempDir dir;
  std::string err0, err1;
  auto body = [&](int rank) -> std::string {
    auto store = comm::FileStore::open(dir.sub("store"));
    auto t = comm::make_tcp_transport(spec_for(**store, rank, 2));
    if (!t.ok()) return t.status().to_string();
    auto ep = BulkReplicaEndpoint::create(**t, BulkReplicaOptions{256});
    if (!ep.ok()) return ep.status().to_string();
    if (rank == 0) {
      ReplicaBlob big;
      big.part.rank = 0;
      big.bytes = std::make_shared<std::vector<std::byte>>(4096);
      Status st = (*ep)->send_to(1, big);
      if (st.code() != StatusCode::kResourceExhausted) return "oversized: " + st.to_string();
      if ((*ep)->send_to(0, big).code() != StatusCode::kInvalidArgument) return "self send accepted";
    } else {
      auto got = (*ep)->receive_from(0, 300ms);
      if (got.status().code() != StatusCode::kDeadlineExceeded)
        return "silent peer: " + got.status().to_string();
    }
    return "";
  };
  std::thread a([&] { err0 = body(0); });
  std::thread b([&] { err1 = body(1); });
  a.join();
  b.join();
  EXPECT_EQ(err0, "");
  EXPECT_EQ(err1, "");
}

}  // namespace
}  // namespace troupe::checkpoint
