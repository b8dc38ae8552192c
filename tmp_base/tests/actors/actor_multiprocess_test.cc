// tests/actors/actor_multiprocess_test.cc — actors in two real processes over loopback
// tcp: messages both ways; `kill -9` and SIGSTOP of the child each give the parent a Down
// within the heartbeat timeout (plus a stated margin); the parent reaches a restarted
// child again.
//
// The child is this same binary re-executed (/proc/self/exe --child ...). It prints
// "READY <endpoint>" on stdout, exits when its stdin closes, and dies with the parent
// (PR_SET_PDEATHSIG), so no test leaves an orphan; every wait is bounded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "tests/actors/test_actors.h"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;
using namespace testing;
using Clk = std::chrono::steady_clock;

constexpr auto kHeartbeatInterval = 200ms;
constexpr auto kHeartbeatTimeout = 800ms;
// Detection happens within the timeout plus one loop period; the rest is slack for two
// loaded cores.
constexpr auto kDownBound = kHeartbeatTimeout + kHeartbeatInterval + 1000ms;

control::TransportOptions network(const std::string& bind) {
  control::TransportOptions t;
  t.bind_endpoint = bind;
  t.heartbeat_interval = kHeartbeatInterval;
  t.heartbeat_timeout = kHeartbeatTimeout;
  return t;
}

// On start, tells the parent's sink that this process is up.
class Greeter : public Actor {
 public:
  explicit Greeter(ActorRef sink) : sink_(std::move(sink)) {}
  Status on_start() override {
    tell(sink_, Ping{1, "hello from " + self().node()});
    return ok_status();
  }

 private:
  ActorRef sink_;
};

// Records every Ping it is told.
class Sink : public Actor {
 public:
  Sink(std::mutex* mu, std::condition_variable* cv, std::vector<std::string>* got)
      : mu_(mu), cv_(cv), got_(got) {
    handle<Ping>([this](const Ping& p, const MessageContext& ctx) {
      std::lock_guard<std::mutex> lk(*mu_);
      got_->push_back(ctx.sender().to_string() + ": " + p.text);
      cv_->notify_all();
    });
  }

 private:
  std::mutex* mu_;
  std::condition_variable* cv_;
  std::vector<std::string>* got_;
};

int child_main(const std::string& node, const std::string& bind, const std::string& parent_ep) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ActorSystemOptions o;
  o.node_id = node;
  o.network = network(bind);
  auto sys = ActorSystem::create(o);
  if (!sys.ok()) {
    std::fprintf(stderr, "child: %s\n", sys.status().to_string().c_str());
    return 1;
  }
  if (!(*sys)->spawn<PongActor>("pong").ok()) return 1;
  if (!parent_ep.empty()) {
    if (!(*sys)->connect("parent", parent_ep).ok()) return 1;
    if (!(*sys)->spawn<Greeter>("greeter", ActorRef("parent", "sink")).ok()) return 1;
  }
  std::printf("READY %s\n", (*sys)->endpoint().c_str());
  std::fflush(stdout);
  char buf[64];
  while (::read(0, buf, sizeof(buf)) > 0) {
  }
  (*sys)->shutdown();
  return 0;
}

class Child {
 public:
  // Starts the child and waits (bounded) for its READY line.
  static std::unique_ptr<Child> start(const std::string& node, const std::string& bind,
                                      const std::string& parent_ep) {
    auto c = std::unique_ptr<Child>(new Child());
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return nullptr;
    c->pid_ = ::fork();
    if (c->pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      const char* argv[] = {"/proc/self/exe",
                            "--child",
                            node.c_str(),
                            bind.c_str(),
                            parent_ep.empty() ? "-" : parent_ep.c_str(),
                            nullptr};
      ::execv("/proc/self/exe", const_cast<char* const*>(argv));
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    c->stdin_ = in[1];
    c->stdout_ = out[0];
    if (!c->read_ready(10s)) return nullptr;
    return c;
  }
  ~Child() { kill_and_reap(); }

  pid_t pid() const { return pid_; }
  const std::string& endpoint() const { return endpoint_; }
  void signal(int sig) { ::kill(pid_, sig); }
  void kill_and_reap() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::kill(pid_, SIGCONT);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    if (stdin_ >= 0) ::close(stdin_);
    if (stdout_ >= 0) ::close(stdout_);
    stdin_ = stdout_ = -1;
  }

 private:
  Child() = default;
  bool read_ready(std::chrono::milliseconds timeout) {
    const auto deadline = Clk::now() + timeout;
    std::string acc;
    while (Clk::now() < deadline) {
      pollfd p{stdout_, POLLIN, 0};
      const int ms = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clk::now()).count());
      if (::poll(&p, 1, std::max(ms, 1)) <= 0) continue;
      char buf[256];
      ssize_t n = ::read(stdout_, buf, sizeof(buf));
      if (n <= 0) return false;
      acc.append(buf, static_cast<size_t>(n));
      const size_t at = acc.find("READY ");
      const size_t nl = at == std::string::npos ? std::string::npos : acc.find('\n', at);
      if (nl != std::string::npos) {
        endpoint_ = acc.substr(at + 6, nl - at - 6);
        return true;
      }
    }
    return false;
  }
  pid_t pid_ = -1;
  int stdin_ = -1, stdout_ = -1;
  std::string endpoint_;
};

// The parent's side: an actor system with a sink, and a monitor recorder.
class MultiProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    ActorSystemOptions o;
    o.node_id = "parent";
    o.network = network("tcp://127.0.0.1:*");
    o.on_node_up = [this](const std::string& node) {
      std::lock_guard<std::mutex> lk(mu_);
      node_events_.push_back(node + " up");
    };
    o.on_node_down = [this](const std::string& node, DownReason r, const std::string&) {
      std::lock_guard<std::mutex> lk(mu_);
      node_events_.push_back(fmt::format("{} down: {}", node, control::down_reason_name(r)));
    };
    auto s = ActorSystem::create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    sys_ = std::move(s).value();
    ASSERT_TRUE(sys_->spawn<Sink>("sink", &mu_, &cv_, &got_).ok());
  }
  void TearDown() override { sys_->shutdown(); }

  // Monitors `target`; returns a future of (Down, when it arrived).
  std::future<std::pair<Down, Clk::time_point>> watch(const ActorRef& target) {
    auto p = std::make_shared<std::promise<std::pair<Down, Clk::time_point>>>();
    auto f = p->get_future();
    EXPECT_TRUE(sys_->monitor(target, [p](const Down& d) { p->set_value({d, Clk::now()}); }).ok());
    return f;
  }
  // Asks child/pong until it answers or `timeout` passes.
  bool pong_answers(const std::string& node, std::chrono::milliseconds timeout) {
    const auto deadline = Clk::now() + timeout;
    while (Clk::now() < deadline) {
      auto r = sys_->ask<Pong>(ActorRef(node, "pong"), Ping{5, "are you there"}, 500ms).get();
      if (r.ok() && r->seq == 5) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }

  std::unique_ptr<ActorSystem> sys_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> got_;
  std::vector<std::string> node_events_;  // guarded by mu_
  std::mutex downs_mu_;                   // members: Recorder actors point here until TearDown
  std::vector<Down> downs_;
};

TEST_F(MultiProcess, ExchangeMessagesBothWays) {
  auto child = Child::start("child", "tcp://127.0.0.1:*", sys_->endpoint());
  ASSERT_NE(child, nullptr);
  {
    std::unique_lock<std::mutex> lk(mu_);
    ASSERT_TRUE(cv_.wait_for(lk, 10s, [&] { return !got_.empty(); }));
    EXPECT_EQ(got_[0], "child/greeter: hello from child");
  }
  // The child connected to us: the reply route exists without connect().
  auto r = sys_->ask<Pong>(ActorRef("child", "pong"), Ping{42, "over tcp"}, 5s).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq, 42);
  EXPECT_EQ(r->text, "over tcp");
  auto missing = sys_->ask<Pong>(ActorRef("child", "nobody"), Ping{}, 5s).get();
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status();
  // A remote actor's normal exit reaches a local monitor through the network.
  auto down = watch(ActorRef("child", "pong"));
  std::this_thread::sleep_for(100ms);
  ASSERT_TRUE(sys_->tell(ActorRef("child", "pong"), Quit{}).ok());
  ASSERT_EQ(down.wait_for(5s), std::future_status::ready);
  auto [d, at] = down.get();
  EXPECT_EQ(d.reason, DownReason::kExit);
  EXPECT_EQ(d.text, "asked to quit");
}

TEST_F(MultiProcess, KillNineGivesDownWithinTheHeartbeatTimeout) {
  auto child = Child::start("victim", "tcp://127.0.0.1:*", "");
  ASSERT_NE(child, nullptr);
  ASSERT_TRUE(sys_->connect("victim", child->endpoint()).ok());
  ASSERT_TRUE(pong_answers("victim", 10s));
  auto down = watch(ActorRef("victim", "pong"));
  // Every monitor gets the Down, and a linked local actor is stopped (kKilled).
  ASSERT_TRUE(sys_->spawn<Recorder>("monitor-1", &downs_, &downs_mu_, ActorRef("victim", "pong"),
                                    Recorder::Mode::kMonitor)
                  .ok());
  ASSERT_TRUE(sys_->spawn<Recorder>("linked-1", &downs_, &downs_mu_, ActorRef("victim", "pong"),
                                    Recorder::Mode::kLink)
                  .ok());
  auto linked_down = watch(ActorRef("parent", "linked-1"));
  std::this_thread::sleep_for(200ms);  // the monitor and link requests reach the child
  const auto t0 = Clk::now();
  child->signal(SIGKILL);
  ASSERT_EQ(down.wait_for(5s), std::future_status::ready) << "no Down after kill -9";
  auto [d, at] = down.get();
  EXPECT_LT(at - t0, kDownBound);
  EXPECT_TRUE(d.reason == DownReason::kConnectionLost || d.reason == DownReason::kHeartbeatTimeout)
      << control::down_reason_name(d.reason);
  EXPECT_EQ(d.actor, (control::ActorAddress{"victim", "pong"}));
  auto r = sys_->ask<Pong>(ActorRef("victim", "pong"), Ping{}, 300ms).get();
  EXPECT_FALSE(r.ok());
  ASSERT_EQ(linked_down.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(linked_down.get().first.reason, DownReason::kKilled);
  std::lock_guard<std::mutex> lk(downs_mu_);
  ASSERT_EQ(downs_.size(), 2u) << "monitor-1 and linked-1 each get the Down";
  for (const Down& x : downs_) EXPECT_EQ(x.reason, d.reason);
}

// True when every thread of `pid` is stopped (state 'T' in /proc/<pid>/task/*/stat).
bool is_stopped(pid_t pid) {
  namespace fs = std::filesystem;
  std::error_code ec;
  int threads = 0;
  for (const auto& t : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(t.path() / "stat");
    std::string line;
    std::getline(in, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') return false;
    ++threads;
  }
  return !ec && threads > 0;
}

TEST_F(MultiProcess, SigstopGivesHeartbeatTimeoutDown) {
  auto child = Child::start("sleeper", "tcp://127.0.0.1:*", sys_->endpoint());
  ASSERT_NE(child, nullptr);
  ASSERT_TRUE(pong_answers("sleeper", 10s));
  auto down = watch(ActorRef("sleeper", "pong"));
  std::this_thread::sleep_for(100ms);
  // An ask in flight when the peer freezes fails with Unavailable at the Down, not at
  // its own (longer) deadline.
  auto pending = sys_->ask<Pong>(ActorRef("sleeper", "pong"), Ping{}, 20s);
  const auto t0 = Clk::now();
  child->signal(SIGSTOP);
  // kill() returns before every thread of the child has stopped; on a loaded machine the
  // child could still answer an ask sent at once. Wait until /proc shows it stopped.
  for (int i = 0; i < 200 && !is_stopped(child->pid()); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(is_stopped(child->pid())) << "the child did not stop within 1 s of SIGSTOP";
  auto pending2 = sys_->ask<Pong>(ActorRef("sleeper", "pong"), Ping{}, 20s);
  ASSERT_EQ(down.wait_for(5s), std::future_status::ready) << "no Down after SIGSTOP";
  auto [d, at] = down.get();
  EXPECT_GT(at - t0, kHeartbeatTimeout - kHeartbeatInterval) << "declared dead too early";
  EXPECT_LT(at - t0, kDownBound);
  EXPECT_EQ(d.reason, DownReason::kHeartbeatTimeout) << d.text;
  {
    // on_node_down runs just after the Downs are delivered, on the transport thread.
    std::unique_lock<std::mutex> lk(mu_);
    const std::vector<std::string> expected = {"sleeper up", "sleeper down: heartbeat timeout"};
    for (int i = 0; i < 200 && node_events_ != expected; ++i) {
      lk.unlock();
      std::this_thread::sleep_for(10ms);
      lk.lock();
    }
    EXPECT_EQ(node_events_, expected);
  }
  ASSERT_EQ(pending2.wait_for(2s), std::future_status::ready);
  EXPECT_EQ(pending2.get().status().code(), StatusCode::kUnavailable);
  ASSERT_EQ(pending.wait_for(2s), std::future_status::ready);
  EXPECT_FALSE(sys_->is_node_up("sleeper"));
  child->kill_and_reap();
}

TEST_F(MultiProcess, ReachesARestartedChild) {
  auto child = Child::start("phoenix", "tcp://127.0.0.1:*", "");
  ASSERT_NE(child, nullptr);
  const std::string ep = child->endpoint();  // the restart binds the same port
  ASSERT_TRUE(sys_->connect("phoenix", ep).ok());
  ASSERT_TRUE(pong_answers("phoenix", 10s));
  auto down = watch(ActorRef("phoenix", "pong"));
  std::this_thread::sleep_for(100ms);
  child->kill_and_reap();
  ASSERT_EQ(down.wait_for(5s), std::future_status::ready);
  std::unique_ptr<Child> again;
  for (int i = 0; i < 20 && !again; ++i) {  // the port may take a moment to be free
    again = Child::start("phoenix", ep, "");
    if (!again) std::this_thread::sleep_for(100ms);
  }
  ASSERT_NE(again, nullptr) << "could not restart the child on " << ep;
  EXPECT_TRUE(pong_answers("phoenix", 10s)) << "no reply from the restarted child";
  EXPECT_TRUE(sys_->is_node_up("phoenix"));
}

}  // namespace
}  // namespace troupe::actors

int main(int argc, char** argv) {
  if (argc == 5 && std::strcmp(argv[1], "--child") == 0) {
    return troupe::actors::child_main(argv[2], argv[3], std::strcmp(argv[4], "-") == 0 ? "" : argv[4]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
