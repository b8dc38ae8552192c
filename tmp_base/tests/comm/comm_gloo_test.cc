// tests/comm/comm_gloo_test.cc — the Gloo Communicator across real processes (2 and 4
// ranks on loopback, FileStore in a temp dir): every operation and dtype against a
// reference computed locally, uneven all_to_all_v counts with zeros, process groups from
// a layout, a rank SIGKILLed mid-collective, a hung peer, abort, and a rebuild in a new
// epoch with the survivors.
#include <gtest/gtest.h>

#include <cmath>

#include "comm/gloo_communicator.h"
#include "comm/process_groups.h"
#include "tests/comm/comm_test_util.h"

namespace troupe::comm {
namespace {

using namespace std::chrono_literals;
using testing::ChildExit;
using testing::TempDir;

// Values exact in bf16, f16 and fp8 e4m3 (multiples of 0.25 in [-3.5, 3.5]), so sums
// over 4 ranks are exact in every float dtype.
float value(int rank, int64_t i) {
  return static_cast<float>((rank * 7 + i * 3) % 29 - 14) * 0.25f;
}

Tensor make_input(int rank, int64_t n, DType dt, int salt = 0) {
  if (n == 0) return Tensor::empty({0}, dt);  // core's from_floats memcpy()s from null when empty
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = value(rank + salt, i);
  if (dt == DType::kI32 || dt == DType::kI64) {
    for (auto& x : v) x = std::round(x * 4);
  }
  return Tensor::from_floats({n}, v, dt);
}

// Poisoned output (so a missing write shows).
Tensor make_output(int64_t n, DType dt) {
  Tensor t = Tensor::empty({n}, dt);
  if (dt == DType::kI32 || dt == DType::kI64 || dtype_is_float(dt))
    t.fill(dt == DType::kF8E4M3 ? 448.0f : 12345.0f);
  return t;
}

bool same(const Tensor& got, const std::vector<float>& want) {
  if (want.empty()) return got.numel() == 0;
  auto g = got.to_floats();
  if (g.size() != want.size()) return false;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!(g[i] == want[i])) {
      std::fprintf(stderr, "  mismatch at %zu: got %g want %g\n", i, g[i], want[i]);
      return false;
    }
  }
  return true;
}

std::unique_ptr<FileStore> open_store(const std::filesystem::path& dir) {
  auto s = FileStore::open(dir);
  if (!s.ok()) {
    std::fprintf(stderr, "FileStore::open: %s\n", s.status().to_string().c_str());
    std::_Exit(4);
  }
  return std::move(s).value();
}

std::unique_ptr<Communicator> connect(RendezvousStore& store, int rank, int size, uint64_t epoch = 0,
                                      std::chrono::milliseconds op_timeout = 20s,
                                      std::string name = "world") {
  CommSpec spec;
  spec.store = &store;
  spec.ns = StoreNamespace{"job", epoch};
  spec.name = std::move(name);
  spec.rank = rank;
  spec.size = size;
  spec.options.op_timeout = op_timeout;
  spec.options.init_timeout = 20s;
  auto c = make_gloo_communicator(spec);
  if (!c.ok()) {
    std::fprintf(stderr, "[rank %d] connect: %s\n", rank, c.status().to_string().c_str());
    std::_Exit(5);
  }
  return std::move(c).value();
}

void expect_all_ok(const std::vector<ChildExit>& exits) {
  for (const auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << testing::describe(e);
}

const DType kFloatTypes[] = {DType::kF32, DType::kBF16};
const DType kMoveTypes[] = {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2};

// Every operation and dtype once; returns through CHILD_CHECK.
void check_all_operations(Communicator& c) {
  const int r = c.rank(), n = c.size();
  // all_reduce: sum and max in every reducible dtype, issued together (asynchronous).
  {
    const int64_t len = 1003;
    std::vector<std::pair<WorkPtr, std::pair<Tensor, std::vector<float>>>> pending;
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        Tensor t = make_input(r, len, dt);
        std::vector<float> want(len);
        for (int64_t i = 0; i < len; ++i) {
          float acc = op == ReduceOp::kSum ? 0.0f : -1e30f;
          for (int q = 0; q < n; ++q) {
            float v = make_input(q, len, dt).to_floats()[i];
            acc = op == ReduceOp::kSum ? acc + v : std::max(acc, v);
          }
          want[i] = acc;
        }
        pending.push_back({c.all_reduce(t, op), {t, want}});
      }
    }
    for (auto& [w, tw] : pending) {
      CHILD_CHECK_OK(w->wait());
      CHILD_CHECK(same(tw.first, tw.second), "{}", w->what());
    }
  }
  // reduce_scatter (bf16 travels as bf16, sums in fp32).
  for (DType dt : kFloatTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      const int64_t m = 257;
      Tensor in = make_input(r, m * n, dt);
      Tensor out = make_output(m, dt);
      CHILD_CHECK_OK(c.reduce_scatter(in, out, op)->wait());
      std::vector<float> want(m);
      for (int64_t i = 0; i < m; ++i) {
        float acc = op == ReduceOp::kSum ? 0.0f : -1e30f;
        for (int q = 0; q < n; ++q) {
          float v = make_input(q, m * n, dt).to_floats()[r * m + i];
          acc = op == ReduceOp::kSum ? acc + v : std::max(acc, v);
        }
        want[i] = acc;
      }
      CHILD_CHECK(same(out, want), "reduce_scatter {} {}", dtype_name(dt), reduce_op_name(op));
    }
  }
  // all_gather, all_to_all, broadcast in every dtype, fp8 included.
  for (DType dt : kMoveTypes) {
    const int64_t len = 301;
    Tensor in = make_input(r, len, dt);
    Tensor out = make_output(len * n, dt);
    CHILD_CHECK_OK(c.all_gather(in, out)->wait());
    std::vector<float> want;
    for (int q = 0; q < n; ++q) {
      auto v = make_input(q, len, dt).to_floats();
      want.insert(want.end(), v.begin(), v.end());
    }
    CHILD_CHECK(same(out, want), "all_gather {}", dtype_name(dt));

    const int64_t chunk = 123;
    Tensor a_in = make_input(r, chunk * n, dt);
    Tensor a_out = make_output(chunk * n, dt);
    CHILD_CHECK_OK(c.all_to_all(a_in, a_out)->wait());
    want.clear();
    for (int q = 0; q < n; ++q) {
      auto v = make_input(q, chunk * n, dt).to_floats();
      want.insert(want.end(), v.begin() + r * chunk, v.begin() + (r + 1) * chunk);
    }
    CHILD_CHECK(same(a_out, want), "all_to_all {}", dtype_name(dt));

    const int root = n - 1;
    Tensor b = make_input(r, 77, dt);
    CHILD_CHECK_OK(c.broadcast(b, root)->wait());
    CHILD_CHECK(same(b, make_input(root, 77, dt).to_floats()), "broadcast {}", dtype_name(dt));
  }
  // all_to_all_v with uneven counts, zeros included (rank 1 sends nothing at all).
  auto count = [&](int from, int to) -> int64_t {
    if (from == 1) return 0;
    return ((from * 3 + to * 5) % 4) * 7;
  };
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF8E4M3}) {
    std::vector<int64_t> sc(n), rc(n);
    for (int p = 0; p < n; ++p) {
      sc[p] = count(r, p);
      rc[p] = count(p, r);
    }
    int64_t sn = 0, rn = 0;
    for (int p = 0; p < n; ++p) {
      sn += sc[p];
      rn += rc[p];
    }
    Tensor in = make_input(r, sn, dt, 100);
    Tensor out = make_output(rn, dt);
    CHILD_CHECK_OK(c.all_to_all_v(in, sc, out, rc)->wait());
    std::vector<float> want;
    for (int q = 0; q < n; ++q) {
      int64_t off = 0;
      for (int p = 0; p < r; ++p) off += count(q, p);
      int64_t qn = 0;
      for (int p = 0; p < n; ++p) qn += count(q, p);
      if (qn == 0) continue;  // (core's to_floats() memcpy()s into null when empty)
      auto v = make_input(q, qn, dt, 100).to_floats();
      want.insert(want.end(), v.begin() + off, v.begin() + off + count(q, r));
    }
    CHILD_CHECK(same(out, want), "all_to_all_v {}", dtype_name(dt));
  }
  // send/recv around a ring, both posted before either is waited on.
  for (DType dt : kMoveTypes) {
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    Tensor s = make_input(r, 513, dt, 7);
    Tensor d = make_output(513, dt);
    auto ws = c.send(s, next);
    auto wr = c.recv(d, prev);
    CHILD_CHECK_OK(wr->wait());
    CHILD_CHECK_OK(ws->wait());
    CHILD_CHECK(same(d, make_input(prev, 513, dt, 7).to_floats()), "ring send/recv {}", dtype_name(dt));
  }
  CHILD_CHECK_OK(c.barrier()->wait());
  // Rejected arguments complete at once and leave the communicator usable.
  {
    Tensor fp8 = make_input(r, 8, DType::kF8E4M3);
    Status st = c.all_reduce(fp8, ReduceOp::kSum)->wait();
    CHILD_CHECK(st.code() == StatusCode::kInvalidArgument, "{}", st.to_string());
    Status st2 = c.all_gather(make_input(r, 8, DType::kF32), make_output(9, DType::kF32))->wait();
    CHILD_CHECK(st2.code() == StatusCode::kInvalidArgument, "{}", st2.to_string());
    Status st3 = c.send(make_input(r, 8, DType::kF32), r)->wait();
    CHILD_CHECK(st3.code() == StatusCode::kInvalidArgument, "{}", st3.to_string());
    std::vector<int64_t> bad(n, 1);
    Status st4 = c.all_to_all_v(make_input(r, 3, DType::kF32), bad, make_output(n, DType::kF32), bad)->wait();
    CHILD_CHECK(st4.code() == StatusCode::kInvalidArgument, "{}", st4.to_string());
    CHILD_CHECK_OK(c.health());
  }
  CHILD_CHECK_OK(c.barrier()->wait());
}

class GlooOps : public ::testing::TestWithParam<int> {};

TEST_P(GlooOps, EveryOperationAndDtypeMatchesTheReference) {
  const int n = GetParam();
  TempDir dir;
  auto exits = testing::run_ranks(
      n,
      [&](int rank) {
        auto store = open_store(dir.path());
        auto c = connect(*store, rank, n);
        // A peer dying mid-write must give an error, not kill us with SIGPIPE.
        struct sigaction sa {};
        ::sigaction(SIGPIPE, nullptr, &sa);
        CHILD_CHECK(sa.sa_handler == SIG_IGN, "SIGPIPE not ignored");
        check_all_operations(*c);
        return 0;
      },
      60s);
  expect_all_ok(exits);
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooOps, ::testing::Values(2, 4));

TEST(GlooGroups, ProcessGroupsFromALayout) {
  // pp=2,dp=1,n=2: ranks 0,1 form stage 0's n-group, 2,3 stage 1's; pipeline pairs (0,2), (1,3).
  TempDir dir;
  auto layout = ParallelLayout::make(2, 1, 2).value();
  auto exits = testing::run_ranks(
      4,
      [&](int rank) {
        auto store = open_store(dir.path());
        CommSpec base;
        base.store = store.get();
        base.ns = StoreNamespace{"job", 0};
        base.options.op_timeout = 20s;
        auto groups = make_process_groups(layout, rank, base,
                                          [](const CommSpec& s) { return make_gloo_communicator(s); });
        CHILD_CHECK_OK(groups.status());
        if (!groups.ok()) return 1;
        auto& g = *groups;
        CHILD_CHECK(g.n->size() == 2 && g.dp->size() == 1 && g.pp->size() == 2);
        CHILD_CHECK(g.n->rank() == g.coord.n && g.pp->rank() == g.coord.pp);
        // n-group all-reduce sums the two ranks of one stage only.
        Tensor t = Tensor::from_floats({1}, std::vector<float>{static_cast<float>(rank + 1)});
        CHILD_CHECK_OK(g.n->all_reduce(t, ReduceOp::kSum)->wait());
        float want = g.coord.pp == 0 ? 3.0f : 7.0f;
        CHILD_CHECK(t.item({0}) == want, "n-group sum {} want {}", t.item({0}), want);
        // dp group of one: identity.
        Tensor u = Tensor::from_floats({1}, std::vector<float>{5.0f});
        CHILD_CHECK_OK(g.dp->all_reduce(u, ReduceOp::kSum)->wait());
        CHILD_CHECK(u.item({0}) == 5.0f);
        // Pipeline: stage 0 sends activations to its next stage.
        if (layout.next_stage(rank)) {
          Tensor act = Tensor::from_floats({2}, std::vector<float>{float(rank), 42.0f});
          CHILD_CHECK_OK(g.pp->send(act, g.coord.pp + 1)->wait());
        } else {
          Tensor act = Tensor::zeros({2}, DType::kF32);
          CHILD_CHECK_OK(g.pp->recv(act, g.coord.pp - 1)->wait());
          CHILD_CHECK(act.item({0}) == float(*layout.prev_stage(rank)) && act.item({1}) == 42.0f);
        }
        return 0;
      },
      60s);
  expect_all_ok(exits);
}

TEST(GlooFailure, KilledRankMakesOthersFailWithinDeadlineThenSurvivorsRebuild) {
  constexpr int kRanks = 4, kVictim = 2;
  constexpr auto kOpTimeout = 4s;
  TempDir dir;
  auto exits = testing::run_ranks(
      kRanks,
      [&](int rank) {
        auto store = open_store(dir.path());
        auto c = connect(*store, rank, kRanks, 0, kOpTimeout);
        Tensor t = Tensor::zeros({1 << 20}, DType::kF32);
        for (int iter = 0; iter < 200; ++iter) {
          t.fill(1.0f);
          auto start = Clock::now();
          WorkPtr w = c->all_reduce(t, ReduceOp::kSum);
          if (rank == kVictim && iter == 3) {
            std::this_thread::sleep_for(2ms);  // inside the collective
            ::raise(SIGKILL);
          }
          Status st = w->wait();
          auto elapsed = Clock::now() - start;
          if (!st.ok()) {
            CHILD_CHECK(iter >= 3, "failed before the victim died: {}", st.to_string());
            CHILD_CHECK(elapsed < kOpTimeout + 2s, "error took {} ms",
                        std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count());
            std::fprintf(stderr, "[rank %d] iteration %d failed after %lld ms: %s\n", rank, iter,
                         static_cast<long long>(
                             std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()),
                         st.to_string().c_str());
            break;
          }
          CHILD_CHECK(iter <= 3 || iter < 200, "");
          if (iter == 199) CHILD_CHECK(false, "no failure seen after the victim died");
        }
        // Poisoned: later operations fail at once.
        Status later = c->barrier()->wait();
        CHILD_CHECK(!later.ok(), "operation after a failure succeeded");
        c->abort("peer died");
        c.reset();
        // New epoch, three survivors, renumbered.
        const int new_rank = rank < kVictim ? rank : rank - 1;
        auto c2 = connect(*store, new_rank, kRanks - 1, 1, kOpTimeout);
        Tensor u = Tensor::from_floats({3}, std::vector<float>{1.0f, float(new_rank), 2.0f});
        CHILD_CHECK_OK(c2->all_reduce(u, ReduceOp::kSum)->wait());
        CHILD_CHECK(u.item({0}) == 3.0f && u.item({1}) == 3.0f && u.item({2}) == 6.0f);
        return 0;
      },
      60s);
  for (const auto& e : exits) {
    if (e.rank == kVictim) {
      EXPECT_TRUE(!e.exited && e.signal == SIGKILL && !e.timed_out) << testing::describe(e);
    } else {
      EXPECT_TRUE(e.exited && e.code == 0) << testing::describe(e);
    }
  }
}

TEST(GlooFailure, HungPeerGivesDeadlineExceeded) {
  constexpr auto kOpTimeout = 800ms;
  TempDir dir;
  auto exits = testing::run_ranks(
      2,
      [&](int rank) {
        auto store = open_store(dir.path());
        auto c = connect(*store, rank, 2, 0, kOpTimeout);
        if (rank == 1) {
          // Alive but never joins: sleeps through rank 0's deadline.
          std::this_thread::sleep_for(kOpTimeout + 1500ms);
          return 0;
        }
        Tensor t = Tensor::zeros({16}, DType::kF32);
        auto start = Clock::now();
        Status st = c->all_reduce(t, ReduceOp::kSum)->wait();
        auto elapsed = Clock::now() - start;
        CHILD_CHECK(st.code() == StatusCode::kDeadlineExceeded, "{}", st.to_string());
        CHILD_CHECK(elapsed >= kOpTimeout - 50ms && elapsed < kOpTimeout + 2s, "took {} ms",
                    std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count());
        return 0;
      },
      30s);
  expect_all_ok(exits);
}

TEST(GlooFailure, FrozenPeerSigstopGivesDeadlineExceeded) {
  // A stopped process keeps its sockets open: only the deadline can catch it.
  constexpr auto kOpTimeout = 1s;
  TempDir dir;
  auto exits = testing::run_ranks(
      2,
      [&](int rank) {
        auto store = open_store(dir.path());
        auto c = connect(*store, rank, 2, 0, kOpTimeout);
        Tensor t = Tensor::zeros({4096}, DType::kF32);
        for (int iter = 0; iter < 2; ++iter) CHILD_CHECK_OK(c->all_reduce(t, ReduceOp::kSum)->wait());
        if (rank == 1) {
          CHILD_CHECK_OK(store->set("frozen_pid", std::to_string(::getpid())));
          ::raise(SIGSTOP);  // rank 0 kills us once it has seen the timeout
          return 1;
        }
        auto pid = store->get("frozen_pid", deadline_in(10s));
        CHILD_CHECK_OK(pid.status());
        std::this_thread::sleep_for(50ms);  // let the peer reach SIGSTOP
        auto start = Clock::now();
        Status st = c->all_reduce(t, ReduceOp::kSum)->wait();
        auto elapsed = Clock::now() - start;
        CHILD_CHECK(st.code() == StatusCode::kDeadlineExceeded, "{}", st.to_string());
        CHILD_CHECK(elapsed < kOpTimeout + 2s, "took {} ms",
                    std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count());
        if (pid.ok()) ::kill(std::stoi(*pid), SIGKILL);
        return 0;
      },
      30s);
  EXPECT_TRUE(exits[0].exited && exits[0].code == 0) << testing::describe(exits[0]);
  EXPECT_TRUE(!exits[1].exited && exits[1].signal == SIGKILL && !exits[1].timed_out)
      << testing::describe(exits[1]);
}

TEST(GlooFailure, AbortCompletesPendingWorkAtOnceAndPeersSeeErrors) {
  TempDir dir;
  auto exits = testing::run_ranks(
      2,
      [&](int rank) {
        auto store = open_store(dir.path());
        auto c = connect(*store, rank, 2, 0, 30s);
        Tensor t = Tensor::zeros({64}, DType::kF32);
        auto start = Clock::now();
        if (rank == 0) {
          // Neither is ever matched by rank 1.
          WorkPtr r = c->recv(t, 1);
          WorkPtr a = c->all_reduce(Tensor::zeros({8}, DType::kF32), ReduceOp::kSum);
          std::this_thread::sleep_for(200ms);
          CHILD_CHECK(!r->test() && !a->test());
          std::thread aborter([&] { c->abort("test abort"); });
          Status sr = r->wait(), sa = a->wait();
          aborter.join();
          CHILD_CHECK(sr.code() == StatusCode::kAborted, "{}", sr.to_string());
          CHILD_CHECK(sa.code() == StatusCode::kAborted, "{}", sa.to_string());
          CHILD_CHECK(Clock::now() - start < 2s);
          CHILD_CHECK(c->health().code() == StatusCode::kAborted);
          CHILD_CHECK(c->barrier()->wait().code() == StatusCode::kAborted);
        } else {
          // Waits for a message that never comes; rank 0's abort must end it long before 30 s.
          Status st = c->recv(t, 0)->wait();
          CHILD_CHECK(!st.ok(), "recv succeeded");
          CHILD_CHECK(Clock::now() - start < 10s, "peer of an aborted rank waited {} ms",
                      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count());
          c->abort("peer aborted");
        }
        c.reset();
        auto c2 = connect(*store, rank, 2, 1, 10s);
        Tensor u = Tensor::from_floats({1}, std::vector<float>{float(rank + 1)});
        CHILD_CHECK_OK(c2->all_reduce(u, ReduceOp::kMax)->wait());
        CHILD_CHECK(u.item({0}) == 2.0f);
        return 0;
      },
      40s);
  expect_all_ok(exits);
}

TEST(GlooSetup, BindsAGivenInterface) {
  TempDir dir;
  auto exits = testing::run_ranks(
      2,
      [&](int rank) {
        auto store = open_store(dir.path());
        CommSpec spec;
        spec.store = store.get();
        spec.ns = StoreNamespace{"job", 0};
        spec.rank = rank;
        spec.size = 2;
        auto c = make_gloo_communicator(spec, GlooTransportOptions{.hostname = "", .iface = "lo"});
        CHILD_CHECK_OK(c.status());
        if (!c.ok()) return 1;
        Tensor t = Tensor::from_floats({2}, std::vector<float>{1.0f, float(rank)});
        CHILD_CHECK_OK((*c)->all_reduce(t, ReduceOp::kSum)->wait());
        CHILD_CHECK(t.item({0}) == 2.0f && t.item({1}) == 1.0f);
        auto bad = make_gloo_communicator(spec, GlooTransportOptions{.hostname = "", .iface = "no-such-if0"});
        CHILD_CHECK(!bad.ok());
        return 0;
      },
      30s);
  expect_all_ok(exits);
}

TEST(GlooSetup, MissingPeerFailsInitWithinTheDeadline) {
  TempDir dir;
  auto store = FileStore::open(dir.path()).value();
  CommSpec spec;
  spec.store = store.get();
  spec.ns = StoreNamespace{"job", 0};
  spec.rank = 0;
  spec.size = 2;
  spec.options.init_timeout = 500ms;
  auto start = Clock::now();
  auto exits = testing::run_ranks(
      1,
      [&](int) {
        auto c = make_gloo_communicator(spec);
        CHILD_CHECK(!c.ok());
        if (!c.ok()) CHILD_CHECK(c.status().code() == StatusCode::kUnavailable, "{}", c.status().to_string());
        return 0;
      },
      20s);
  expect_all_ok(exits);
  EXPECT_LT(Clock::now() - start, 5s);
  CommSpec bad = spec;
  bad.rank = 2;
  EXPECT_EQ(make_gloo_communicator(bad).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace troupe::comm
