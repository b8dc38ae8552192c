// tests/actors/actor_system_test.cc — the actor API in one process. Most tests run the
// system in ExecutionMode::kManual with a ManualClock: every message and timer is run by
// run_until_idle() on the test thread, so each assertion is about a known state (who
// got what, when a deadline fired). One test uses the threaded scheduler.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "tests/actors/test_actors.h"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;
using namespace testing;

class ManualSystem : public ::testing::Test {
 protected:
  void SetUp() override {
    ActorSystemOptions o;
    o.node_id = "n1";
    o.mode = ExecutionMode::kManual;
    o.clock = &clock_;
    o.random = seeded_random(1);
    auto s = ActorSystem::create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    sys_ = std::move(s).value();
  }
  template <class T>
  static bool ready(const std::future<T>& f) {
    return f.wait_for(0s) == std::future_status::ready;
  }
  std::vector<Down> downs() {
    std::lock_guard<std::mutex> lk(mu_);
    return downs_;
  }

  ManualClock clock_;
  std::unique_ptr<ActorSystem> sys_;
  std::mutex mu_;
  std::vector<Down> downs_;
};

TEST_F(ManualSystem, AskGetsTheHandlersReply) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  EXPECT_EQ(pong->to_string(), "n1/pong");
  auto f = sys_->ask<Pong>(*pong, Ping{7, "hi"}, 1s);
  EXPECT_FALSE(ready(f)) << "nothing runs before run_until_idle";
  EXPECT_GT(sys_->run_until_idle(), 0u);
  ASSERT_TRUE(ready(f));
  auto r = f.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq, 7);
  EXPECT_EQ(r->text, "hi");
  ASSERT_TRUE(sys_->tell(*pong, Ping{8, ""}).ok());
  sys_->run_until_idle();
}

TEST_F(ManualSystem, AskDeadlineFollowsTheInjectedClock) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  auto f = sys_->ask<Pong>(*pong, Defer{}, 5s);  // the actor holds the reply
  sys_->run_until_idle();
  clock_.advance(4999ms);
  sys_->run_until_idle();
  EXPECT_FALSE(ready(f)) << "deadline fired early";
  clock_.advance(2ms);
  sys_->run_until_idle();
  ASSERT_TRUE(ready(f));
  EXPECT_EQ(f.get().status().code(), StatusCode::kDeadlineExceeded);
}

TEST_F(ManualSystem, ErrorsComeBackAsValues) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  auto failed = sys_->ask<Ack>(*pong, Fail{}, 1s);
  auto unknown = sys_->ask<Ack>(*pong, Unknown{}, 1s);
  auto missing = sys_->ask<Pong>(ActorRef("n1", "nobody"), Ping{}, 1s);
  auto wrong_type = sys_->ask<Ack>(*pong, Ping{1, ""}, 1s);
  sys_->run_until_idle();
  EXPECT_EQ(failed.get().status().code(), StatusCode::kInvalidArgument);
  auto u = unknown.get();
  EXPECT_EQ(u.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(u.status().message().find("does not handle"), std::string::npos) << u.status();
  EXPECT_EQ(missing.get().status().code(), StatusCode::kNotFound);
  EXPECT_EQ(wrong_type.get().status().code(), StatusCode::kInvalidArgument);
  auto no_network = sys_->ask<Pong>(ActorRef("elsewhere", "x"), Ping{}, 1s);
  EXPECT_EQ(no_network.get().status().code(), StatusCode::kUnavailable);
}

TEST_F(ManualSystem, DeferredReplyThroughResponsePromise) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  auto f = sys_->ask<Pong>(*pong, Defer{}, 1s);
  sys_->run_until_idle();
  EXPECT_FALSE(ready(f));
  ASSERT_TRUE(sys_->tell(*pong, Release{}).ok());
  sys_->run_until_idle();
  ASSERT_TRUE(ready(f));
  auto r = f.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq, 99);
}

TEST_F(ManualSystem, CrashSendsDownToEveryMonitor) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  ASSERT_TRUE(sys_->spawn<Recorder>("w1", &downs_, &mu_, *pong, Recorder::Mode::kMonitor).ok());
  ASSERT_TRUE(sys_->spawn<Recorder>("w2", &downs_, &mu_, *pong, Recorder::Mode::kMonitor).ok());
  std::vector<Down> external;
  ASSERT_TRUE(sys_->monitor(*pong, [&](const Down& d) { external.push_back(d); }).ok());
  sys_->run_until_idle();
  auto crashed = sys_->ask<Ack>(*pong, Crash{}, 1s);
  sys_->run_until_idle();
  EXPECT_EQ(crashed.get().status().code(), StatusCode::kInternal);
  auto d = downs();
  ASSERT_EQ(d.size(), 2u);
  ASSERT_EQ(external.size(), 1u);
  d.push_back(external[0]);
  for (const Down& x : d) {
    EXPECT_EQ(x.actor, pong->address());
    EXPECT_EQ(x.reason, DownReason::kCrash);
    EXPECT_NE(x.text.find("asked to crash"), std::string::npos) << x.text;
  }
  EXPECT_FALSE(sys_->has_actor("pong"));
  EXPECT_TRUE(sys_->has_actor("w1"));
  // Monitoring an actor that no longer exists gives a Down at once.
  std::vector<Down> late;
  ASSERT_TRUE(sys_->monitor(*pong, [&](const Down& x) { late.push_back(x); }).ok());
  sys_->run_until_idle();
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].text, "no such actor");
}

TEST_F(ManualSystem, LinkStopsTheOtherSideOnAbnormalExitOnly) {
  auto a = sys_->spawn<PongActor>("a");
  auto b = sys_->spawn<PongActor>("b");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(sys_->spawn<Recorder>("linked-a", &downs_, &mu_, *a, Recorder::Mode::kLink).ok());
  ASSERT_TRUE(sys_->spawn<Recorder>("linked-b", &downs_, &mu_, *b, Recorder::Mode::kLink).ok());
  std::vector<Down> watch;
  ASSERT_TRUE(sys_->monitor(ActorRef("n1", "linked-a"), [&](const Down& d) { watch.push_back(d); }).ok());
  sys_->run_until_idle();
  ASSERT_TRUE(sys_->tell(*b, Quit{}).ok());   // normal exit: linked-b survives
  ASSERT_TRUE(sys_->tell(*a, Crash{}).ok());  // crash: linked-a is stopped
  sys_->run_until_idle();
  EXPECT_TRUE(sys_->has_actor("linked-b"));
  EXPECT_FALSE(sys_->has_actor("linked-a"));
  ASSERT_EQ(watch.size(), 1u);
  EXPECT_EQ(watch[0].reason, DownReason::kKilled);
  EXPECT_NE(watch[0].text.find("linked actor n1/a went down (crash)"), std::string::npos) << watch[0].text;
}

TEST_F(ManualSystem, StopAndShutdownSendDowns) {
  auto a = sys_->spawn<PongActor>("a");
  auto b = sys_->spawn<PongActor>("b");
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<Down> got;
  ASSERT_TRUE(sys_->monitor(*a, [&](const Down& d) { got.push_back(d); }).ok());
  ASSERT_TRUE(sys_->monitor(*b, [&](const Down& d) { got.push_back(d); }).ok());
  sys_->run_until_idle();
  ASSERT_TRUE(sys_->tell(*a, Quit{}).ok());
  sys_->run_until_idle();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].reason, DownReason::kExit);
  EXPECT_EQ(got[0].text, "asked to quit");
  sys_->shutdown();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].reason, DownReason::kKilled);
  EXPECT_EQ(sys_->actor_count(), 0u);
  EXPECT_FALSE(sys_->spawn<PongActor>("c").ok());
}

// Asks another actor from inside an actor; the reply callback runs in the asking actor.
class Asker : public Actor {
 public:
  Asker(ActorRef target, Duration timeout, std::vector<std::string>* log)
      : target_(std::move(target)), timeout_(timeout), log_(log) {}
  Status on_start() override {
    ask<Pong>(target_, Ping{1, "from asker"}, timeout_, [this](Result<Pong> r) {
      log_->push_back(r.ok() ? r->text : std::string(status_code_name(r.status().code())));
    });
    run_after(10s, [this] { log_->push_back("timer"); });
    return ok_status();
  }

 private:
  ActorRef target_;
  Duration timeout_;
  std::vector<std::string>* log_;
};

TEST_F(ManualSystem, ActorsAskEachOtherAndUseTimers) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  std::vector<std::string> log;
  ASSERT_TRUE(sys_->spawn<Asker>("asker", *pong, 1s, &log).ok());
  ASSERT_TRUE(sys_->spawn<Asker>("asker2", ActorRef("n1", "nobody"), 1s, &log).ok());
  sys_->run_until_idle();
  std::sort(log.begin(), log.end());  // the two askers run in spawn-queue order
  EXPECT_EQ(log, (std::vector<std::string>{"NotFound", "from asker"}));
  clock_.advance(10s);
  sys_->run_until_idle();
  EXPECT_EQ(log.size(), 4u);
  EXPECT_EQ(log[2], "timer");
}

TEST_F(ManualSystem, TypedRefsAndNameRules) {
  auto pong = sys_->spawn<PongActor>("pong");
  ASSERT_TRUE(pong.ok());
  TypedActorRef<Ping, Quit> typed(*pong);
  auto f = sys_->ask<Pong>(typed, Ping{3, ""}, 1s);  // sys_->tell(typed, Crash{}) would not compile
  sys_->run_until_idle();
  EXPECT_TRUE(f.get().ok());
  EXPECT_EQ(sys_->spawn<PongActor>("pong").status().code(), StatusCode::kAlreadyExists);
  EXPECT_FALSE(sys_->spawn<PongActor>("a/b").ok());
  EXPECT_FALSE(sys_->spawn<PongActor>("$x").ok());
  auto parsed = ActorRef::parse("node-3/stage-0");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->node(), "node-3");
  EXPECT_FALSE(ActorRef::parse("no-slash").ok());
  EXPECT_FALSE(ActorRef::parse("a/b/c").ok());
}

TEST(ActorSystemOptions, BadOptionsAreErrors) {
  ActorSystemOptions o;
  o.node_id = "a/b";
  EXPECT_EQ(ActorSystem::create(o).status().code(), StatusCode::kInvalidArgument);
  o.node_id = "n";
  o.threads = 0;
  EXPECT_FALSE(ActorSystem::create(o).ok());
  o.threads = 1;
  o.network = control::TransportOptions{};
  o.network->bind_endpoint = "tcp://0.0.0.0:*";
  auto s = ActorSystem::create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("loopback"), std::string::npos) << s.status();
}

TEST(ThreadedSystem, ManyConcurrentAsksOneMessageAtATime) {
  ActorSystemOptions o;
  o.node_id = "n1";
  o.threads = 4;
  auto sys = ActorSystem::create(o);
  ASSERT_TRUE(sys.ok());
  std::vector<ActorRef> pongs;
  for (int i = 0; i < 4; ++i) {
    auto r = (*sys)->spawn<PongActor>(fmt::format("pong-{}", i));
    ASSERT_TRUE(r.ok());
    pongs.push_back(*r);
  }
  auto dedicated = (*sys)->spawn_actor("solo", std::make_unique<PongActor>(), SpawnOptions{true});
  ASSERT_TRUE(dedicated.ok());
  pongs.push_back(*dedicated);
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  constexpr int kPerThread = 200;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        auto r = (*sys)->ask<Pong>(pongs[(t + i) % pongs.size()], Ping{i, ""}, 5s).get();
        if (r.ok() && r->seq == i) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4 * kPerThread);
  (*sys)->shutdown();
  EXPECT_EQ((*sys)->actor_count(), 0u);
}

}  // namespace
}  // namespace troupe::actors
