// tests/comm/control/control_transport_test.cc — Transport over real sockets in one
// process: tcp, ipc and inproc exchange in both directions, loopback-only binding,
// connection loss, CURVE with an allow-list, and PeerLiveness timing on a ManualClock.
#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "comm/control/liveness.h"
#include "tests/comm/control/control_test_util.h"

namespace troupe::control {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::user_envelope;

TransportOptions options(const std::string& node, const std::string& bind) {
  TransportOptions o;
  o.node_id = node;
  o.bind_endpoint = bind;
  o.heartbeat_interval = 100ms;
  o.heartbeat_timeout = 600ms;
  return o;
}

// A connects to B; A -> B goes through A's DEALER, B -> A through B's ROUTER.
void exchange(const std::string& bind, zmq::context_t* ctx) {
  Inbox a_in, b_in;
  auto ob = options("b", bind);
  ob.context = ctx;
  auto b = Transport::start(ob, b_in.callbacks());
  ASSERT_TRUE(b.ok()) << b.status();
  auto oa = options("a", "");
  oa.context = ctx;
  auto a = Transport::start(oa, a_in.callbacks());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->connect("b", (*b)->endpoint()).ok());
  ASSERT_TRUE((*a)->send("b", user_envelope("a", "b", "hello")).ok());
  Envelope e;
  std::string from;
  ASSERT_TRUE(b_in.pop(&e, &from));
  EXPECT_EQ(from, "a");
  EXPECT_EQ(std::get<UserPayload>(e.payload).data, "hello");
  ASSERT_TRUE((*b)->send("a", user_envelope("b", "a", "world")).ok());
  ASSERT_TRUE(a_in.pop(&e, &from));
  EXPECT_EQ(from, "b");
  EXPECT_EQ(std::get<UserPayload>(e.payload).data, "world");
  EXPECT_TRUE((*a)->is_peer_up("b"));
}

TEST(ControlTransport, ExchangesOverTcp) {
  exchange("tcp://127.0.0.1:*", nullptr);
}

TEST(ControlTransport, ExchangesOverIpc) {
  exchange(fmt::format("ipc:///tmp/troupe-control-test-{}.sock", ::getpid()), nullptr);
}

TEST(ControlTransport, ExchangesOverInproc) {
  zmq::context_t ctx(1);
  exchange("inproc://troupe-test-b", &ctx);
}

TEST(ControlTransport, RefusesNonLoopbackBindAndBadNodeIds) {
  Inbox in;
  auto t = Transport::start(options("x", "tcp://0.0.0.0:*"), in.callbacks());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("loopback"), std::string::npos);
  EXPECT_FALSE(Transport::start(options("a/b", "tcp://127.0.0.1:*"), in.callbacks()).ok());
  EXPECT_FALSE(Transport::start(options("", "tcp://127.0.0.1:*"), in.callbacks()).ok());
  EXPECT_TRUE(is_loopback_endpoint("tcp://127.0.0.1:5"));
  EXPECT_TRUE(is_loopback_endpoint("tcp://[::1]:5"));
  EXPECT_FALSE(is_loopback_endpoint("tcp://10.0.0.1:5"));
}

TEST(ControlTransport, UnknownNodeIsUndeliverable) {
  Inbox in;
  std::promise<Status> why;
  auto cb = in.callbacks();
  cb.on_undeliverable = [&](Envelope&&, const Status& st) { why.set_value(st); };
  auto t = Transport::start(options("a", "tcp://127.0.0.1:*"), cb);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->send("nobody", user_envelope("a", "nobody", "x")).ok());
  auto fut = why.get_future();
  ASSERT_EQ(fut.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(fut.get().code(), StatusCode::kNotFound);
}

TEST(ControlTransport, AStoppingPeerSaysGoodbyeAndIsReportedAsExit) {
  Inbox a_in, b_in;
  auto b = Transport::start(options("b", "tcp://127.0.0.1:*"), b_in.callbacks());
  ASSERT_TRUE(b.ok());
  auto a = Transport::start(options("a", ""), a_in.callbacks());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->connect("b", (*b)->endpoint()).ok());
  ASSERT_TRUE((*a)->send("b", user_envelope("a", "b", "x")).ok());
  Envelope e;
  ASSERT_TRUE(b_in.pop(&e, nullptr));
  ASSERT_TRUE((*b)->send("a", user_envelope("b", "a", "y")).ok());
  ASSERT_TRUE(a_in.pop(&e, nullptr));
  const auto t0 = std::chrono::steady_clock::now();
  (*b)->stop();
  testing::PeerEvent ev;
  ASSERT_TRUE(a_in.wait_event([](const testing::PeerEvent& p) { return p.node == "b" && !p.up; }, &ev, 3s));
  EXPECT_EQ(ev.reason, DownReason::kExit) << ev.text;
  EXPECT_NE(ev.text.find("b left"), std::string::npos) << ev.text;
  EXPECT_LT(ev.at - t0, 600ms + 300ms);
}

TEST(ControlTransport, ReportsConnectionLostWhenThePeerDiesWithoutGoodbye) {
  // B is a bare ROUTER socket: once A's first frame arrived it closes with no goodbye, as
  // a killed process's socket does.
  zmq::context_t ctx;
  zmq::socket_t b(ctx, zmq::socket_type::router);
  b.set(zmq::sockopt::linger, 0);
  b.set(zmq::sockopt::routing_id, "b");
  b.bind("tcp://127.0.0.1:*");
  const std::string ep = b.get(zmq::sockopt::last_endpoint);
  Inbox a_in;
  auto a = Transport::start(options("a", ""), a_in.callbacks());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->connect("b", ep).ok());
  ASSERT_TRUE((*a)->send("b", user_envelope("a", "b", "x")).ok());
  std::vector<zmq::message_t> frames;  // [A's routing id, envelope]
  b.set(zmq::sockopt::rcvtimeo, 3000);
  ASSERT_TRUE(zmq::recv_multipart(b, std::back_inserter(frames)).has_value());
  ASSERT_EQ(frames.size(), 2u);
  const auto t0 = std::chrono::steady_clock::now();
  b.close();
  testing::PeerEvent ev;
  ASSERT_TRUE(a_in.wait_event([](const testing::PeerEvent& p) { return p.node == "b" && !p.up; }, &ev, 3s));
  EXPECT_EQ(ev.reason, DownReason::kConnectionLost) << ev.text;
  EXPECT_LT(ev.at - t0, 600ms + 300ms);
}

TEST(ControlTransport, CurveAllowsListedKeysOnly) {
  auto server_kp = generate_curve_keypair();
  auto good_kp = generate_curve_keypair();
  auto bad_kp = generate_curve_keypair();
  ASSERT_TRUE(server_kp.ok() && good_kp.ok() && bad_kp.ok());
  Inbox s_in, g_in, x_in;
  auto os = options("server", "tcp://127.0.0.1:*");
  os.curve.own = *server_kp;
  os.curve.allowed_client_keys = {good_kp->public_key};
  auto server = Transport::start(os, s_in.callbacks());
  ASSERT_TRUE(server.ok()) << server.status();

  auto og = options("good", "");
  og.curve.own = *good_kp;
  auto good = Transport::start(og, g_in.callbacks());
  ASSERT_TRUE(good.ok()) << good.status();
  auto ox = options("intruder", "");
  ox.curve.own = *bad_kp;
  auto intruder = Transport::start(ox, x_in.callbacks());
  ASSERT_TRUE(intruder.ok());

  EXPECT_FALSE((*good)->connect("server", (*server)->endpoint()).ok()) << "CURVE needs the server key";
  ASSERT_TRUE((*good)->connect("server", (*server)->endpoint(), server_kp->public_key).ok());
  ASSERT_TRUE((*intruder)->connect("server", (*server)->endpoint(), server_kp->public_key).ok());
  ASSERT_TRUE((*intruder)->send("server", user_envelope("intruder", "server", "let me in")).ok());
  ASSERT_TRUE((*good)->send("server", user_envelope("good", "server", "hi")).ok());
  Envelope e;
  std::string from;
  ASSERT_TRUE(s_in.pop(&e, &from));
  EXPECT_EQ(from, "good");
  ASSERT_TRUE((*server)->send("good", user_envelope("server", "good", "welcome")).ok());
  ASSERT_TRUE(g_in.pop(&e, &from));
  EXPECT_EQ(std::get<UserPayload>(e.payload).data, "welcome");
  // The intruder's message never arrives.
  EXPECT_FALSE(s_in.pop(&e, &from, 500ms)) << "got a message from " << from;
}

TEST(ControlCurve, KeyFilesRoundTrip) {
  auto kp = generate_curve_keypair();
  ASSERT_TRUE(kp.ok());
  const std::string prefix = fmt::format("/tmp/troupe-keytest-{}", ::getpid());
  ASSERT_TRUE(write_curve_key_files(prefix, *kp).ok());
  auto secret = read_curve_key_file(prefix + ".key");
  ASSERT_TRUE(secret.ok()) << secret.status();
  EXPECT_EQ(secret->public_key, kp->public_key);
  EXPECT_EQ(secret->secret_key, kp->secret_key);
  auto pub = read_curve_key_file(prefix + ".pub");
  ASSERT_TRUE(pub.ok());
  EXPECT_TRUE(pub->secret_key.empty());
  EXPECT_FALSE(validate_z85_key("short", "k").ok());
  CurveConfig mismatched;
  mismatched.own = {pub->public_key, generate_curve_keypair()->secret_key};
  EXPECT_FALSE(mismatched.validate().ok());
  ::unlink((prefix + ".key").c_str());
  ::unlink((prefix + ".pub").c_str());
}

TEST(PeerLiveness, DeclaresSilentPeersDownOnceAndUpAgain) {
  ManualClock clock;
  PeerLiveness l(std::chrono::milliseconds(3000));
  l.watch("a", clock.now());
  EXPECT_TRUE(l.heard("b", clock.now()));   // first contact
  EXPECT_FALSE(l.heard("b", clock.now()));  // already up
  clock.advance(2999ms);
  l.heard("b", clock.now());
  EXPECT_TRUE(l.expire(clock.now()).empty());
  clock.advance(2ms);  // a: 3001 ms silent
  EXPECT_EQ(l.expire(clock.now()), std::vector<std::string>{"a"});
  EXPECT_TRUE(l.expire(clock.now()).empty()) << "reported once";
  EXPECT_FALSE(l.is_up("a"));
  EXPECT_TRUE(l.heard("a", clock.now())) << "heard again: up again";
  EXPECT_TRUE(l.mark_down("b"));
  EXPECT_FALSE(l.mark_down("b"));
  EXPECT_EQ(l.up_peers(), std::vector<std::string>{"a"});
}

}  // namespace
}  // namespace troupe::control
