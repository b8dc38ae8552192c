// tests/comm/comm_rendezvous_test.cc — FileStore (set/get/wait with deadlines, atomic
// replacement, key escaping, several processes), MemoryStore (the same contract between
// threads: a waiter woken by set, deadlines), PrefixStore/StoreNamespace and the
// GlooStore adapter's errors.
#include <gloo/common/error.h>
#include <gtest/gtest.h>

#include <thread>

#include "comm/gloo_store.h"
#include "comm/rendezvous_store.h"
#include "tests/comm/comm_test_util.h"

namespace troupe::comm {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

TEST(FileStore, SetGetOverwriteAndContains) {
  TempDir dir;
  auto store = FileStore::open(dir.path() / "store").value();
  ASSERT_TRUE(store->set("a/b c", std::string("x\0y", 3)).ok());
  EXPECT_EQ(store->get("a/b c", deadline_in(1s)).value(), std::string("x\0y", 3));
  ASSERT_TRUE(store->set("a/b c", "second").ok());
  EXPECT_EQ(store->get("a/b c", deadline_in(1s)).value(), "second");
  EXPECT_TRUE(store->contains("a/b c").value());
  EXPECT_FALSE(store->contains("a/b").value());
  ASSERT_TRUE(store->set("empty", "").ok());
  EXPECT_EQ(store->get("empty", deadline_in(1s)).value(), "");
  // Keys that differ only in characters the escaping touches stay distinct.
  ASSERT_TRUE(store->set("x/y", "1").ok());
  ASSERT_TRUE(store->set("x%2Fy", "2").ok());
  EXPECT_EQ(store->get("x/y", deadline_in(1s)).value(), "1");
  EXPECT_EQ(store->get("x%2Fy", deadline_in(1s)).value(), "2");
  // No temporary files left behind.
  for (const auto& e : std::filesystem::directory_iterator(dir.path() / "store")) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp", 0), 0u) << e.path();
  }
}

TEST(FileStore, BadKeysAreRejected) {
  TempDir dir;
  auto store = FileStore::open(dir.path()).value();
  EXPECT_EQ(store->set("", "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->set("a\nb", "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->set(std::string(300, 'k'), "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FileStore::open("").status().code(), StatusCode::kInvalidArgument);
}

TEST(FileStore, GetAndWaitRespectTheDeadline) {
  TempDir dir;
  auto store = FileStore::open(dir.path()).value();
  auto start = Clock::now();
  auto r = store->get("never", deadline_in(150ms));
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("never"), std::string::npos);
  ASSERT_TRUE(store->set("k1", "v").ok());
  Status st = store->wait({"k1", "k2"}, deadline_in(150ms));
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("k2"), std::string::npos);
  auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 2s);
}

TEST(FileStore, ValuesCrossProcesses) {
  TempDir dir;
  auto exits = testing::run_ranks(
      3,
      [&](int rank) {
        auto store = FileStore::open(dir.path()).value();
        CHILD_CHECK_OK(store->set(fmt::format("rank{}", rank), std::string(100000, char('a' + rank))));
        CHILD_CHECK_OK(store->wait({"rank0", "rank1", "rank2"}, deadline_in(10s)));
        for (int q = 0; q < 3; ++q) {
          auto v = store->get(fmt::format("rank{}", q), deadline_in(1s));
          CHILD_CHECK(v.ok() && *v == std::string(100000, char('a' + q)), "rank {} value", q);
        }
        return 0;
      },
      20s);
  for (const auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << testing::describe(e);
}

TEST(MemoryStore, SetGetWaitAndKeys) {
  MemoryStore store;
  ASSERT_TRUE(store.set("a/b c", std::string("x\0y", 3)).ok());
  EXPECT_EQ(store.get("a/b c", deadline_in(1s)).value(), std::string("x\0y", 3));
  ASSERT_TRUE(store.set("a/b c", "second").ok());
  EXPECT_EQ(store.get("a/b c", deadline_in(1s)).value(), "second");
  EXPECT_TRUE(store.contains("a/b c").value());
  EXPECT_FALSE(store.contains("a/b").value());
  EXPECT_EQ(store.set("", "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.set("a\nb", "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.get("", deadline_in(1s)).status().code(), StatusCode::kInvalidArgument);
  // Deadlines: a missing key is named, and the wait ends at the deadline.
  const auto start = Clock::now();
  Result<std::string> r = store.get("never", deadline_in(150ms));
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("never"), std::string::npos);
  Status st = store.wait({"a/b c", "k2"}, deadline_in(150ms));
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("k2"), std::string::npos);
  EXPECT_GE(Clock::now() - start, 300ms);
}

// A waiter in another thread is woken by set(), long before its deadline.
TEST(MemoryStore, SetWakesWaiters) {
  MemoryStore store;
  std::string got;
  Status waited;
  std::thread t([&] {
    Result<std::string> v = store.get("late", deadline_in(30s));
    if (v.ok()) got = *v;
    waited = store.wait({"late", "later"}, deadline_in(30s));
  });
  std::this_thread::sleep_for(50ms);
  const auto start = Clock::now();
  ASSERT_TRUE(store.set("late", "v").ok());
  ASSERT_TRUE(store.set("later", "w").ok());
  t.join();
  EXPECT_EQ(got, "v");
  EXPECT_TRUE(waited.ok()) << waited.to_string();
  EXPECT_LT(Clock::now() - start, 10s);  // woken, not timed out (generous: a loaded machine)
}

TEST(PrefixStore, NamespacesByJobAndEpoch) {
  TempDir dir;
  auto base = FileStore::open(dir.path()).value();
  StoreNamespace e0{"jobA", 0}, e1{"jobA", 1};
  EXPECT_EQ(e0.prefix(), "jobA/e0/");
  EXPECT_EQ(e1.key("world/rank0"), "jobA/e1/world/rank0");
  PrefixStore p0(*base, e0.prefix()), p1(*base, e1.prefix());
  ASSERT_TRUE(p0.set("k", "old").ok());
  EXPECT_FALSE(p1.contains("k").value());
  EXPECT_EQ(p1.get("k", deadline_in(50ms)).status().code(), StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(p1.set("k", "new").ok());
  EXPECT_EQ(p0.get("k", deadline_in(1s)).value(), "old");
  EXPECT_EQ(base->get("jobA/e1/k", deadline_in(1s)).value(), "new");
  EXPECT_TRUE(p1.wait({"k"}, deadline_in(1s)).ok());
}

TEST(GlooStore, MapsCallsAndThrowsOnTimeout) {
  TempDir dir;
  auto base = FileStore::open(dir.path()).value();
  GlooStore store(*base, 100ms);
  store.set("key", std::vector<char>{'1', '2'});
  EXPECT_EQ(store.get("key"), (std::vector<char>{'1', '2'}));
  store.wait({"key"});
  auto start = Clock::now();
  EXPECT_THROW(store.get("missing"), gloo::IoException);
  EXPECT_THROW(store.wait({"missing"}, std::chrono::milliseconds(0)), gloo::IoException);
  EXPECT_LT(Clock::now() - start, 2s);
}

}  // namespace
}  // namespace troupe::comm
