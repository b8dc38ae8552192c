// tests/scheduler/relay_test.cc — job processes' sessions relayed by their agent
// (scheduler/daemons/agent.h, "Relay"): the Relay message's codec bounds, the ZAP handler's reading
// of an ipc peer's uid, and an in-process scheduler with a real Agent (real sockets) whose
// relay carries store, status and heartbeat traffic of a job process it started; malformed
// and nested relays are dropped while the scheduler keeps serving; a peer of another uid is
// refused by the relay's ZAP handler even when the directory would let it in.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/control/curve.h"
#include "scheduler/client/job_spec.h"
#include "scheduler/client/scheduler_store.h"
#include "scheduler/daemons/agent.h"
#include "scheduler/daemons/scheduler.h"
#include "tests/scheduler/harness.h"

namespace troupe::sched {
namespace {

using std::chrono::milliseconds;

TEST(RelayCodec, RoundTripsAndRejectsBadSessionNames) {
  const std::string inner = encode_message(Message{5, StatusQuery{"job-1"}});
  const std::string bytes =
      encode_message(Message{0, RelayedMessage{"proc:job-1:worker-0:0:42/inbox", inner}});
  auto back = decode_message(bytes.data(), bytes.size());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  auto* r = std::get_if<RelayedMessage>(&back->payload);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->session, "proc:job-1:worker-0:0:42/inbox");
  EXPECT_EQ(r->msg, inner);
  EXPECT_STREQ(payload_name(back->payload), "relay");

  for (const std::string& bad : {std::string(), std::string("a b"), std::string("a\nb"),
                                 std::string(kMaxRelaySessionBytes + 1, 'x')}) {
    const std::string b = encode_message(Message{0, RelayedMessage{bad, inner}});
    auto d = decode_message(b.data(), b.size());
    EXPECT_FALSE(d.ok()) << "session of " << bad.size() << " bytes was accepted";
  }
  const std::string shortmsg = encode_message(Message{0, RelayedMessage{"s/inbox", "12345678"}});
  EXPECT_FALSE(decode_message(shortmsg.data(), shortmsg.size()).ok());
}

TEST(RelayZap, ReadsTheUidOfAnIpcPeer) {
  EXPECT_EQ(control::zap_address_uid("localhost:1000:1000:4242"), 1000);
  EXPECT_EQ(control::zap_address_uid("localhost:0:0:1"), 0);
  EXPECT_EQ(control::zap_address_uid(":65534:65534:7"), 65534);
  EXPECT_EQ(control::zap_address_uid("127.0.0.1"), -1);  // a tcp peer: no credentials
  EXPECT_EQ(control::zap_address_uid("::1"), -1);
  EXPECT_EQ(control::zap_address_uid("0:0:1"), -1);
  EXPECT_EQ(control::zap_address_uid("localhost:x:0:1"), -1);
  EXPECT_EQ(control::zap_address_uid("localhost::0:1"), -1);
  EXPECT_EQ(control::zap_address_uid(""), -1);
}

class RelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("relay-test");
    SchedulerOptions o;
    o.state_dir = dir_ + "/state";
    auto s = Scheduler::create(o);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    sched_ = std::move(s).value();
    sched_thread_ = std::thread([this] { sched_->run(); });
    AgentOptions ao;
    ao.scheduler = sched_->endpoint();
    ao.agent_id = "relay-test";
    ao.slots = 1;
    ao.work_dir = dir_ + "/agent";
    ao.heartbeat_ms = 100;
    auto a = Agent::create(ao);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    agent_ = std::move(a).value();
    relay_ = agent_->relay_endpoint();
    ASSERT_EQ(relay_.rfind("ipc://", 0), 0u) << relay_;
    agent_thread_ = std::thread([this] { agent_->run(); });
    auto c = ClientEndpoint::connect(sched_->endpoint(), {}, "relay-test-cli");
    ASSERT_TRUE(c.ok());
    direct_ = std::move(c).value();
  }
  void TearDown() override {
    direct_.reset();
    if (agent_) agent_->stop();
    if (agent_thread_.joinable()) agent_thread_.join();
    agent_.reset();
    if (sched_) sched_->stop();
    if (sched_thread_.joinable()) sched_thread_.join();
    sched_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::string submit(const JobSpec& spec) {
    auto r = direct_->request(SubmitJob{spec.to_json()}, milliseconds(5000));
    EXPECT_TRUE(r.ok() && r->status().ok()) << (r.ok() ? r->message : r.status().to_string());
    return r.ok() ? nlohmann::json::parse(r->body)["job_id"].get<std::string>() : "";
  }
  nlohmann::json status(ClientEndpoint& c, const std::string& job) {
    auto r = c.request(StatusQuery{job}, milliseconds(5000));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return {};
    EXPECT_TRUE(r->status().ok()) << r->message;
    return nlohmann::json::parse(r->body, nullptr, false);
  }

  std::string dir_, relay_;
  std::unique_ptr<Scheduler> sched_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<ClientEndpoint> direct_;
  std::thread sched_thread_, agent_thread_;
};

TEST_F(RelayTest, StoreAndStatusRequestsGoThroughTheAgent) {
  JobSpec spec;
  spec.argv = {"/bin/sleep", "60"};  // runs while the test does (the agent kills it at the end)
  spec.nproc = 1;
  spec.driver = false;
  const std::string job = submit(spec);
  ASSERT_FALSE(job.empty());

  auto relayed = SchedulerStore::connect(relay_, {}, job, 0);
  ASSERT_TRUE(relayed.ok()) << relayed.status().to_string();
  auto direct = SchedulerStore::connect(sched_->endpoint(), {}, job, 0);
  ASSERT_TRUE(direct.ok());
  ASSERT_TRUE((*relayed)->set("from-relay", "r").ok());
  auto got = (*direct)->get("from-relay", SchedulerStore::Clock::now() + milliseconds(3000));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, "r");
  // A parked get through the relay is answered when another client sets the key.
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    EXPECT_TRUE((*direct)->set("late", "x").ok());
  });
  auto late = (*relayed)->get("late", SchedulerStore::Clock::now() + milliseconds(10000));
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status().to_string();
  EXPECT_EQ(*late, "x");
  // Deadlines hold through the relay too.
  auto none = (*relayed)->get("never", SchedulerStore::Clock::now() + milliseconds(300));
  EXPECT_EQ(none.status().code(), StatusCode::kDeadlineExceeded) << none.status().to_string();

  auto c = ClientEndpoint::connect(relay_, {}, "proc:relay-test");
  ASSERT_TRUE(c.ok());
  auto doc = status(**c, job);
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc["jobs"][0]["id"], job);
}

TEST_F(RelayTest, ProcessesOfTheAgentGetTheRelayAndBeatThroughIt) {
  JobSpec spec;
  spec.argv = {test::worker_bin()};
  spec.nproc = 1;
  spec.driver = false;
  spec.env = {{"TW_RUN_MS", "1500"}, {"TW_BEAT", "1"}, {"TW_OUT", dir_}};
  const std::string job = submit(spec);
  ASSERT_FALSE(job.empty());
  std::string events = dir_ + "/state/jobs/" + job + "/events.jsonl";
  pid_t pid = 0;
  ASSERT_TRUE(test::wait_until(
      [&] {
        for (const auto& e : test::read_events(events)) {
          if (e["type"] == "proc_started") pid = e["pid"].get<pid_t>();
        }
        return pid > 0;
      },
      milliseconds(10000)));
  // The process's environment names the agent's relay...
  std::ifstream envf(fmt::format("/proc/{}/environ", pid), std::ios::binary);
  std::string env((std::istreambuf_iterator<char>(envf)), std::istreambuf_iterator<char>());
  EXPECT_NE(env.find("TROUPE_AGENT_RELAY=" + relay_), std::string::npos);
  // ...its hello reaches the scheduler, and the job completes with its beats judged live.
  ASSERT_TRUE(test::wait_until(
      [&] {
        for (const auto& e : test::read_events(events)) {
          if (e["type"] == "proc_hello") return true;
        }
        return false;
      },
      milliseconds(10000)));
  ASSERT_TRUE(test::wait_until([&] { return status(*direct_, job)["jobs"][0]["state"] == "succeeded"; },
                               milliseconds(15000)));
}

TEST_F(RelayTest, MalformedAndNestedRelaysAreDroppedAndTheSchedulerKeepsServing) {
  const std::string status_q = encode_message(Message{9, StatusQuery{"-"}});
  // Undecodable inner bytes, a relay inside a relay, and an agent registration through a
  // relay (a relayed session is a job process's): each is dropped with a logged error.
  EXPECT_TRUE(direct_->send(Message{0, RelayedMessage{"x/inbox", std::string(64, '\x7f')}}));
  EXPECT_TRUE(direct_->send(Message{
      0, RelayedMessage{"y/inbox", encode_message(Message{0, RelayedMessage{"z/inbox", status_q}})}}));
  RegisterAgent evil;
  evil.agent_id = "evil";
  evil.slots = 64;
  EXPECT_TRUE(direct_->send(Message{0, RelayedMessage{"w/inbox", encode_message(Message{0, evil})}}));
  auto doc = status(*direct_, "-");
  ASSERT_TRUE(doc.is_object());
  for (const auto& a : doc["agents"]) EXPECT_NE(a["id"], "evil");
  // The agent's relay still works after the garbage.
  auto c = ClientEndpoint::connect(relay_, {}, "proc:relay-test-2");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(status(**c, "-").is_object());
}

// A unix socket bound at `path`; listening unless `listen` is false (then closed: what an
// agent killed with SIGKILL leaves behind). Returns the fd (-1 when closed).
int unix_socket_at(const std::string& path, bool listen) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path;
  if (listen) {
    EXPECT_EQ(::listen(fd, 1), 0);
    return fd;
  }
  ::close(fd);
  return -1;
}

// Sets the modification time of `path` (not following a link) `age` into the past.
void age_file(const std::string& path, std::chrono::seconds age) {
  timespec t[2];
  t[0].tv_sec = t[1].tv_sec = ::time(nullptr) - age.count();
  t[0].tv_nsec = t[1].tv_nsec = 0;
  EXPECT_EQ(::utimensat(AT_FDCWD, path.c_str(), t, AT_SYMLINK_NOFOLLOW), 0) << path;
}

TEST(RelayDirs, AnAgentRemovesTheRelayDirectoriesOfDeadAgentsOnly) {
  const std::string base = test::make_temp_dir("relay-dirs");
  namespace fs = std::filesystem;
  for (const char* d : {"troupe-agent-dead01", "troupe-agent-live01", "troupe-agent-starting",
                        "troupe-agent-binding", "other-dead01"}) {
    fs::create_directories(base + "/" + d);
  }
  unix_socket_at(base + "/troupe-agent-dead01/relay", false);
  age_file(base + "/troupe-agent-dead01/relay", std::chrono::minutes(5));  // killed 5 minutes ago
  const int live = unix_socket_at(base + "/troupe-agent-live01/relay", true);
  age_file(base + "/troupe-agent-live01/relay", std::chrono::minutes(5));
  // An agent starting at this moment: its socket is bound but not yet listening, so a
  // connect is refused as on a dead one; only its age tells them apart.
  unix_socket_at(base + "/troupe-agent-binding/relay", false);
  unix_socket_at(base + "/other-dead01/relay", false);  // not an agent's: left alone
  age_file(base + "/other-dead01/relay", std::chrono::minutes(5));
  const char* old_tmpdir = std::getenv("TMPDIR");
  const std::string saved = old_tmpdir ? old_tmpdir : "";
  ::setenv("TMPDIR", base.c_str(), 1);
  AgentOptions ao;
  ao.scheduler = "tcp://127.0.0.1:1";  // never reached: the relay is set up before that matters
  ao.agent_id = "relay-dirs";
  ao.slots = 1;
  ao.work_dir = base + "/work";
  auto a = Agent::create(ao);
  if (old_tmpdir)
    ::setenv("TMPDIR", saved.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_FALSE(fs::exists(base + "/troupe-agent-dead01"));
  EXPECT_TRUE(fs::exists(base + "/troupe-agent-live01/relay"));
  EXPECT_TRUE(fs::exists(base + "/troupe-agent-starting"));
  EXPECT_TRUE(fs::exists(base + "/troupe-agent-binding/relay"));
  EXPECT_TRUE(fs::exists(base + "/other-dead01/relay"));
  const std::string mine = (*a)->relay_endpoint().substr(6);
  EXPECT_EQ(mine.rfind(base + "/troupe-agent-", 0), 0u) << mine;
  struct stat st {};
  ASSERT_EQ(::stat(fs::path(mine).parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  a->reset();  // the agent's own directory goes with it
  EXPECT_FALSE(fs::exists(fs::path(mine).parent_path()));
  ::close(live);
  fs::remove_all(base);
}

TEST(RelayAsks, AnUnansweredAskIsForgottenAfterItsDeadline) {
  // What an agent's relay holds for a request the scheduler never answers (lost with a
  // scheduler restart): the ask's promise, until its asker's deadline has passed.
  auto server = ServerEndpoint::bind("tcp://127.0.0.1:0", {}, 1);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto client = ClientEndpoint::connect((*server)->bound_endpoint(), {}, "asker");
  ASSERT_TRUE(client.ok());
  std::thread asker([&] {
    auto r = (*client)->request(StatusQuery{"-"}, milliseconds(300));
    EXPECT_FALSE(r.ok());  // never answered
  });
  std::vector<Incoming> got;
  ASSERT_TRUE(test::wait_until(
      [&] {
        for (auto& in : (*server)->poll(milliseconds(20))) got.push_back(std::move(in));
        return !got.empty();
      },
      milliseconds(5000)));
  EXPECT_EQ(got[0].peer.rfind("ask:", 0), 0u);
  EXPECT_EQ((*server)->pending_asks(), 1u);
  EXPECT_EQ((*server)->expire_asks(milliseconds(1000)), 0u);  // its deadline has not passed
  asker.join();
  std::this_thread::sleep_for(milliseconds(1200));
  EXPECT_EQ((*server)->expire_asks(milliseconds(1000)), 1u);
  EXPECT_EQ((*server)->pending_asks(), 0u);
  EXPECT_FALSE((*server)->send(got[0].peer, Message{0, Reply{}}));  // a late answer goes nowhere
}

TEST_F(RelayTest, RefusesAPeerOfAnotherUser) {
  // Same user: admitted.
  EXPECT_TRUE(probe_connection(relay_, {}, milliseconds(3000)).ok());
  if (getuid() != 0) GTEST_SKIP() << "needs root to run a peer as another uid (setuid)";
  // Open the directory and the socket to everybody, so that only the ZAP handler stands
  // between another user and the relay.
  const std::string sock = relay_.substr(6);
  ASSERT_EQ(::chmod(std::filesystem::path(sock).parent_path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(sock.c_str(), 0777), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
    Status s = probe_connection(relay_, {}, milliseconds(3000));
    _exit(s.code() == StatusCode::kPermissionDenied ? 0 : s.ok() ? 1 : 2);
  }
  int st = 0;
  ASSERT_EQ(waitpid(child, &st, 0), child);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "1: admitted, 2: no refusal seen, 3: setuid failed";
}

}  // namespace
}  // namespace troupe::sched
