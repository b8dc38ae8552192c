// tests/comm/comm_bulk_transport_test.cc — bulk host transport: the verbs/TCP choice (no
// RDMA device here, so TCP), and the TCP transport for real across processes: writes with
// tags into peers' registered buffers, bounds errors reported on both sides, a dead peer
// giving error completions instead of a hang.
#include <gtest/gtest.h>

#include <numeric>

#include "comm/bulk_transport.h"
#include "tests/comm/comm_test_util.h"

namespace troupe::comm {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

BulkSpec spec_for(RendezvousStore& store, int rank, int size) {
  BulkSpec s;
  s.store = &store;
  s.ns = StoreNamespace{"bulkjob", 0};
  s.rank = rank;
  s.size = size;
  s.timeout = 5s;
  return s;
}

// Polls until `n` completions arrived or 10 s passed.
std::vector<BulkCompletion> collect(BulkTransport& t, size_t n) {
  std::vector<BulkCompletion> all;
  auto deadline = deadline_in(10s);
  while (all.size() < n && Clock::now() < deadline) {
    auto got = t.poll(deadline);
    if (!got.ok()) break;
    all.insert(all.end(), got->begin(), got->end());
  }
  return all;
}

TEST(BulkTransport, ChoosesVerbsOnlyWithAnRdmaDevice) {
  TempDir dir;
  int devices = rdma_device_count();
  auto exits = testing::run_ranks(
      1,
      [&](int) {
        auto store = FileStore::open(dir.path()).value();
        auto t = make_bulk_transport(spec_for(*store, 0, 1));
        CHILD_CHECK_OK(t.status());
        if (!t.ok()) return 1;
        CHILD_CHECK((*t)->kind() == (devices > 0 ? "verbs" : "tcp"), "picked {}", (*t)->kind());
        if (devices == 0) {
          auto v = make_bulk_transport(spec_for(*store, 0, 1), BulkKind::kVerbs);
          CHILD_CHECK(v.status().code() == StatusCode::kUnavailable, "{}", v.status().to_string());
          CHILD_CHECK(v.status().message().find("no RDMA device") != std::string::npos);
        }
        return 0;
      },
      20s);
  EXPECT_TRUE(exits[0].exited && exits[0].code == 0) << testing::describe(exits[0]);
}

TEST(TcpTransport, WritesLandInPeersBuffersWithTags) {
  constexpr int kRanks = 3;
  constexpr uint64_t kChunk = (8u << 20) + 13;  // several socket-buffer sizes, odd length
  TempDir dir;
  auto exits = testing::run_ranks(
      kRanks,
      [&](int rank) {
        auto store = FileStore::open(dir.path()).value();
        auto tr = make_tcp_transport(spec_for(*store, rank, kRanks));
        CHILD_CHECK_OK(tr.status());
        if (!tr.ok()) return 1;
        auto& t = **tr;
        std::vector<uint8_t> src(kChunk), dst(kChunk * kRanks, 0xEE);
        for (uint64_t i = 0; i < kChunk; ++i) src[i] = static_cast<uint8_t>((i * 31 + rank * 7) & 0xFF);
        CHILD_CHECK_OK(t.register_buffer(0, src.data(), src.size()));
        CHILD_CHECK_OK(t.register_buffer(1, dst.data(), dst.size()));
        CHILD_CHECK(t.register_buffer(1, dst.data(), 1).code() == StatusCode::kAlreadyExists);
        for (int p = 0; p < kRanks; ++p) {
          if (p != rank) CHILD_CHECK_OK(t.write(p, 0, 0, 1, rank * kChunk, kChunk, rank * 100 + p));
        }
        CHILD_CHECK(t.write(rank, 0, 0, 1, 0, 1, 0).code() == StatusCode::kInvalidArgument);
        CHILD_CHECK(t.write((rank + 1) % kRanks, 7, 0, 1, 0, 1, 0).code() == StatusCode::kNotFound);
        CHILD_CHECK(t.write((rank + 1) % kRanks, 0, 1, 1, 0, kChunk, 0).code() == StatusCode::kOutOfRange);
        auto all = collect(t, 2 * (kRanks - 1));
        int done = 0, received = 0;
        for (const auto& c : all) {
          CHILD_CHECK_OK(c.status);
          if (c.kind == BulkCompletion::Kind::kWriteDone) {
            ++done;
            CHILD_CHECK(c.tag == static_cast<uint32_t>(rank * 100 + c.peer) && c.bytes == kChunk &&
                        c.buffer == 1);
          } else {
            ++received;
            CHILD_CHECK(c.tag == static_cast<uint32_t>(c.peer * 100 + rank) && c.bytes == kChunk &&
                        c.buffer == 1);
          }
        }
        CHILD_CHECK(done == kRanks - 1 && received == kRanks - 1, "done {} received {}", done, received);
        for (int q = 0; q < kRanks; ++q) {
          if (q == rank) continue;
          bool ok = true;
          for (uint64_t i = 0; i < kChunk && ok; ++i)
            ok = dst[q * kChunk + i] == static_cast<uint8_t>((i * 31 + q * 7) & 0xFF);
          CHILD_CHECK(ok, "data from rank {}", q);
        }
        // Every rank has read its first-phase completions before anyone writes again: a
        // fast rank's next writes would otherwise arrive in a slow rank's first collect().
        CHILD_CHECK_OK(store->set(fmt::format("phase1_{}", rank), "1"));
        CHILD_CHECK_OK(store->wait({"phase1_0", "phase1_1", "phase1_2"}, deadline_in(20s)));
        // Out of range at the target: both sides hear about it, the connection stays usable.
        const int peer = (rank + 1) % kRanks;
        CHILD_CHECK_OK(t.write(peer, 0, 0, 1, dst.size() - 10, 100, 9));
        CHILD_CHECK_OK(t.write(peer, 0, 0, 1, 0, 16, 10));
        auto more = collect(t, 4);
        int errors = 0, oks = 0;
        for (const auto& c : more) (c.status.ok() ? oks : errors)++;
        CHILD_CHECK(errors == 2 && oks == 2, "errors {} oks {}", errors, oks);
        // Everyone finishes reading before anyone tears down.
        CHILD_CHECK_OK(store->set(fmt::format("done{}", rank), "1"));
        CHILD_CHECK_OK(store->wait({"done0", "done1", "done2"}, deadline_in(10s)));
        return 0;
      },
      60s);
  for (const auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << testing::describe(e);
}

TEST(TcpTransport, DeadPeerGivesErrorCompletions) {
  TempDir dir;
  auto exits = testing::run_ranks(
      2,
      [&](int rank) {
        auto store = FileStore::open(dir.path()).value();
        auto tr = make_tcp_transport(spec_for(*store, rank, 2));
        CHILD_CHECK_OK(tr.status());
        if (!tr.ok()) return 1;
        if (rank == 1) ::raise(SIGKILL);
        auto& t = **tr;
        std::vector<uint8_t> src(1 << 20, 1);
        CHILD_CHECK_OK(t.register_buffer(0, src.data(), src.size()));
        std::this_thread::sleep_for(100ms);
        auto start = Clock::now();
        Status w = t.write(1, 0, 0, 0, 0, src.size(), 5);
        if (w.ok()) {
          auto all = collect(t, 1);
          CHILD_CHECK(all.size() == 1 && !all[0].status.ok(), "expected an error completion");
        } else {
          CHILD_CHECK(w.code() == StatusCode::kUnavailable, "{}", w.to_string());
        }
        CHILD_CHECK(Clock::now() - start < 6s);
        return 0;
      },
      30s);
  EXPECT_TRUE(exits[0].exited && exits[0].code == 0) << testing::describe(exits[0]);
  EXPECT_EQ(exits[1].signal, SIGKILL);
}

}  // namespace
}  // namespace troupe::comm
