// tests/scheduler/store_test.cc — SchedulerStore as a comm::RendezvousStore against a live
// scheduler (in-process, real sockets): set/get/wait/contains, blocking get woken by a
// set from another client, deadlines, epoch isolation, PrefixStore on top, unknown jobs.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "comm/rendezvous_store.h"
#include "scheduler/client/scheduler_store.h"
#include "scheduler/daemons/scheduler.h"
#include "tests/scheduler/harness.h"

namespace troupe::sched {
namespace {

using std::chrono::milliseconds;

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("store-test");
    SchedulerOptions o;
    o.state_dir = dir_;
    auto s = Scheduler::create(o);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    sched_ = std::move(s).value();
    thread_ = std::thread([this] { sched_->run(); });
    auto c = ClientEndpoint::connect(sched_->endpoint(), {}, "store-test-cli");
    ASSERT_TRUE(c.ok());
    JobSpec spec;
    spec.argv = {"/bin/true"};
    spec.nproc = 2;  // no agent: the job stays pending, its store is usable
    auto r = (*c)->request(SubmitJob{spec.to_json()}, milliseconds(3000));
    ASSERT_TRUE(r.ok() && r->status().ok());
    job_ = nlohmann::json::parse(r->body)["job_id"];
  }
  void TearDown() override {
    sched_->stop();
    if (thread_.joinable()) thread_.join();
    sched_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<SchedulerStore> store(uint64_t epoch, const std::string& job = "") {
    auto s = SchedulerStore::connect(sched_->endpoint(), {}, job.empty() ? job_ : job, epoch);
    EXPECT_TRUE(s.ok());
    return std::move(s).value();
  }

  std::string dir_, job_;
  std::unique_ptr<Scheduler> sched_;
  std::thread thread_;
};

TEST_F(StoreTest, ImplementsTheRendezvousStoreContract) {
  auto a = store(0);
  auto b = store(0);
  comm::RendezvousStore& sa = *a;
  comm::RendezvousStore& sb = *b;
  ASSERT_TRUE(sa.set("nccl_id", std::string("\x01\x00\x02", 3)).ok());
  auto got = sb.get("nccl_id", comm::deadline_in(milliseconds(2000)));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, std::string("\x01\x00\x02", 3));
  EXPECT_TRUE(*sb.contains("nccl_id"));
  EXPECT_FALSE(*sb.contains("absent"));

  // A blocked get is woken by another client's set.
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(200));
    EXPECT_TRUE(sa.set("late", "v").ok());
  });
  auto t0 = std::chrono::steady_clock::now();
  auto late = sb.get("late", comm::deadline_in(milliseconds(5000)));
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status().to_string();
  EXPECT_EQ(*late, "v");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(3000));

  // Deadlines: a missing key fails on time, naming the key.
  t0 = std::chrono::steady_clock::now();
  Status w = sb.wait({"nccl_id", "never"}, comm::deadline_in(milliseconds(300)));
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(w.code(), StatusCode::kDeadlineExceeded) << w.to_string();
  EXPECT_NE(w.message().find("never"), std::string::npos);
  EXPECT_GE(took, milliseconds(250));
  EXPECT_LT(took, milliseconds(2000));

  // Another epoch is another namespace.
  auto e1 = store(1);
  EXPECT_FALSE(*e1->contains("nccl_id"));
  // comm's PrefixStore composes with it.
  comm::PrefixStore ps(sa, comm::StoreNamespace{job_, 0}.prefix());
  ASSERT_TRUE(ps.set("gloo/0", "addr").ok());
  EXPECT_EQ(*sb.get(job_ + "/e0/gloo/0", comm::deadline_in(milliseconds(1000))), "addr");
}

// One store, two threads: a get blocked on a key nobody sets (a rendezvous waiting for a
// late peer) does not hold up the other thread's set and contains (the elastic worker's
// heartbeat). Before the store's calls ran concurrently the set waited out the get, and a
// worker waiting longer than the heartbeat timeout for a slow replacement looked silent.
TEST_F(StoreTest, ABlockedGetDoesNotHoldUpAnotherThreadsSet) {
  auto a = store(0);
  auto b = store(0);
  using Clock = std::chrono::steady_clock;
  Clock::time_point get_done{};
  Result<std::string> blocked = std::string();
  std::thread waiter([&] {
    blocked = a->get("never-set", comm::deadline_in(milliseconds(3000)));
    get_done = Clock::now();
  });
  std::this_thread::sleep_for(milliseconds(200));  // the get is (almost surely) in flight
  for (int i = 0; i < 5; ++i) {                    // EXPECT, not ASSERT: the waiter thread must be joined
    EXPECT_TRUE(a->set(fmt::format("hb{}", i), "beat").ok());
    const Result<bool> has = a->contains(fmt::format("hb{}", i));
    EXPECT_TRUE(has.ok() && *has);
  }
  const Clock::time_point sets_done = Clock::now();
  waiter.join();
  EXPECT_EQ(blocked.status().code(), StatusCode::kDeadlineExceeded) << blocked.status().to_string();
  EXPECT_LT(sets_done, get_done) << "the sets waited for the blocked get";
  EXPECT_EQ(*b->get("hb4", comm::deadline_in(milliseconds(1000))), "beat");
  // disconnect() while nothing is in flight: every later call fails, naming the job.
  a->disconnect();
  const Status after = a->set("k", "v");
  EXPECT_EQ(after.code(), StatusCode::kUnavailable);
  EXPECT_NE(after.message().find(job_), std::string::npos) << after.to_string();
}

TEST_F(StoreTest, UnknownJobIsAnError) {
  auto s = store(0, "job-404");
  Status st = s->set("k", "v");
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
}

}  // namespace
}  // namespace troupe::sched
