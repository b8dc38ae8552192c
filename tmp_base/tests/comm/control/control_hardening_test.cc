// tests/comm/control/control_hardening_test.cc — throws hostile traffic at a live
// Transport endpoint: garbage, truncated, misframed, spoofed, misrouted and oversized
// frames, raw non-ZMTP bytes, unauthenticated and wrong-key CURVE clients. After each
// barrage the endpoint must still serve a legitimate peer, and the bad frames must have
// been dropped (counted), never delivered.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <map>
#include <random>
#include <set>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "comm/control/codec.h"
#include "comm/control/log_limit.h"
#include "core/logging.h"
#include "tests/comm/control/control_test_util.h"

namespace troupe::control {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::user_envelope;

constexpr size_t kMaxBytes = 64 * 1024;

TransportOptions options(const std::string& node, const std::string& bind) {
  TransportOptions o;
  o.node_id = node;
  o.bind_endpoint = bind;
  o.heartbeat_interval = 100ms;
  o.heartbeat_timeout = 1000ms;
  o.max_message_bytes = kMaxBytes;
  return o;
}

// An echo server: every user envelope is sent back to its sender's node.
struct EchoServer {
  Inbox inbox;
  std::unique_ptr<Transport> transport;
  std::atomic<int> delivered{0};
  Status start(TransportOptions o) {
    auto cb = inbox.callbacks();
    cb.on_envelope = [this](Envelope&& e, const std::string& from) {
      ++delivered;
      Envelope r = user_envelope(transport->node_id(), from, std::get<UserPayload>(e.payload).data);
      transport->send(from, r).ignore();
    };
    auto t = Transport::start(std::move(o), cb);
    if (!t.ok()) return t.status();
    transport = std::move(t).value();
    return ok_status();
  }
};

// A legitimate client's round trip through the server.
void expect_serves(Transport& server, const std::string& client_node, const CurveConfig& curve = {},
                   const std::string& server_key = "") {
  Inbox in;
  auto o = options(client_node, "");
  o.curve = curve;
  auto c = Transport::start(o, in.callbacks());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->connect(server.node_id(), server.endpoint(), server_key).ok());
  ASSERT_TRUE((*c)->send(server.node_id(), user_envelope(client_node, server.node_id(), "ping")).ok());
  Envelope e;
  ASSERT_TRUE(in.pop(&e, nullptr, 5s)) << "server stopped serving";
  EXPECT_EQ(std::get<UserPayload>(e.payload).data, "ping");
}

void send_raw_tcp(const std::string& endpoint, const std::string& bytes) {
  const size_t colon = endpoint.rfind(':');
  const int port = std::stoi(endpoint.substr(colon + 1));
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    (void)n;
  }
  ::close(fd);
}

TEST(ControlHardening, SurvivesMalformedFramesAndKeepsServing) {
  EchoServer server;
  ASSERT_TRUE(server.start(options("server", "tcp://127.0.0.1:*")).ok());
  const std::string ep = server.transport->endpoint();
  expect_serves(*server.transport, "before");

  zmq::context_t ctx(1);
  zmq::socket_t evil(ctx, zmq::socket_type::dealer);
  evil.set(zmq::sockopt::linger, 0);
  evil.set(zmq::sockopt::routing_id, "evil");
  evil.connect(ep);
  auto valid = encode_envelope(user_envelope("evil", "server", "payload"));
  ASSERT_TRUE(valid.ok());
  std::mt19937_64 rng(7);
  std::vector<std::string> frames = {
      "garbage",                            // not whole words
      std::string(64, '\xff'),              // words, but no valid segment table
      valid->substr(0, valid->size() - 8),  // truncated
      *valid + std::string(8, '\0'),        // trailing bytes
      *encode_envelope(user_envelope("good", "server", "spoofed sender")),
      *encode_envelope(user_envelope("evil", "other-node", "misrouted")),
  };
  for (int i = 0; i < 50; ++i) {
    std::string junk(8 * (1 + rng() % 16), '\0');
    for (auto& c : junk) c = static_cast<char>(rng());
    frames.push_back(junk);
  }
  for (const std::string& f : frames) evil.send(zmq::buffer(f), zmq::send_flags::none);
  // Two frames where one envelope is expected.
  std::array<zmq::const_buffer, 2> two = {zmq::buffer(*valid), zmq::buffer(*valid)};
  zmq::send_multipart(evil, two);
  // Oversized: libzmq drops the connection before our code sees it.
  zmq::socket_t big(ctx, zmq::socket_type::dealer);
  big.set(zmq::sockopt::linger, 0);
  big.set(zmq::sockopt::routing_id, "big");
  big.connect(ep);
  big.send(zmq::buffer(std::string(4 * kMaxBytes, 'x')), zmq::send_flags::none);
  // Not ZMTP at all.
  std::string noise(4096, '\0');
  for (auto& c : noise) c = static_cast<char>(rng());
  send_raw_tcp(ep, noise);
  send_raw_tcp(ep, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");

  expect_serves(*server.transport, "after");
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server.transport->stats().frames_dropped < frames.size() + 1 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_GE(server.transport->stats().frames_dropped, frames.size() + 1);
  EXPECT_EQ(server.delivered.load(), 2) << "only the two legitimate pings are delivered";
}

TEST(ControlHardening, RefusesUnauthenticatedAndWrongKeyCurveClients) {
  auto server_kp = generate_curve_keypair();
  auto good_kp = generate_curve_keypair();
  auto wrong_kp = generate_curve_keypair();
  ASSERT_TRUE(server_kp.ok() && good_kp.ok() && wrong_kp.ok());
  EchoServer server;
  auto o = options("server", "tcp://127.0.0.1:*");
  o.curve.own = *server_kp;
  o.curve.allowed_client_keys = {good_kp->public_key};
  ASSERT_TRUE(server.start(o).ok());
  const std::string ep = server.transport->endpoint();
  CurveConfig good;
  good.own = *good_kp;
  expect_serves(*server.transport, "good-1", good, server_kp->public_key);

  zmq::context_t ctx(1);
  // A plain (NULL mechanism) client: the handshake fails.
  zmq::socket_t plain(ctx, zmq::socket_type::dealer);
  plain.set(zmq::sockopt::linger, 0);
  plain.set(zmq::sockopt::routing_id, "plain");
  plain.connect(ep);
  auto env = encode_envelope(user_envelope("plain", "server", "no crypto"));
  plain.send(zmq::buffer(*env), zmq::send_flags::dontwait);
  // A CURVE client with a key not on the allow-list: refused by the ZAP handler.
  zmq::socket_t wrong(ctx, zmq::socket_type::dealer);
  wrong.set(zmq::sockopt::linger, 0);
  wrong.set(zmq::sockopt::routing_id, "wrong");
  wrong.set(zmq::sockopt::curve_serverkey, server_kp->public_key);
  wrong.set(zmq::sockopt::curve_publickey, wrong_kp->public_key);
  wrong.set(zmq::sockopt::curve_secretkey, wrong_kp->secret_key);
  wrong.connect(ep);
  auto env2 = encode_envelope(user_envelope("wrong", "server", "wrong key"));
  wrong.send(zmq::buffer(*env2), zmq::send_flags::dontwait);
  // A CURVE client that believes in the wrong server key.
  zmq::socket_t mitm(ctx, zmq::socket_type::dealer);
  mitm.set(zmq::sockopt::linger, 0);
  mitm.set(zmq::sockopt::routing_id, "mitm");
  mitm.set(zmq::sockopt::curve_serverkey, wrong_kp->public_key);
  mitm.set(zmq::sockopt::curve_publickey, good_kp->public_key);
  mitm.set(zmq::sockopt::curve_secretkey, good_kp->secret_key);
  mitm.connect(ep);
  auto env3 = encode_envelope(user_envelope("mitm", "server", "bad server key"));
  mitm.send(zmq::buffer(*env3), zmq::send_flags::dontwait);
  send_raw_tcp(ep, std::string(1000, 'z'));
  std::this_thread::sleep_for(500ms);

  expect_serves(*server.transport, "good-2", good, server_kp->public_key);
  EXPECT_EQ(server.delivered.load(), 2) << "only the allow-listed client got through";
}

// serve_zap_request answers whatever is waiting, one request per call, and says when
// nothing was (the transport drains the queue each wake: every connecting CURVE client
// waits for its answer). Requests come here through a DEALER standing in for libzmq.
TEST(ControlHardening, ZapHandlerAnswersEachWaitingRequestThenReportsNone) {
  auto good_kp = generate_curve_keypair();
  auto other_kp = generate_curve_keypair();
  ASSERT_TRUE(good_kp.ok() && other_kp.ok());
  auto raw_key = [](const std::string& z85) {
    std::string raw(32, '\0');
    EXPECT_NE(zmq_z85_decode(reinterpret_cast<uint8_t*>(raw.data()), z85.c_str()), nullptr);
    return raw;
  };
  zmq::context_t ctx(1);
  zmq::socket_t rep(ctx, zmq::socket_type::rep);
  rep.bind("inproc://zap-drain-test");
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.connect("inproc://zap-drain-test");
  auto log = make_logger("zap-test");
  const std::set<std::string> allowed = {good_kp->public_key};
  EXPECT_FALSE(serve_zap_request(rep, allowed, *log)) << "nothing waits yet";
  const std::vector<std::pair<std::string, std::string>> reqs = {{"1", raw_key(good_kp->public_key)},
                                                                 {"2", raw_key(other_kp->public_key)},
                                                                 {"3", raw_key(good_kp->public_key)}};
  for (const auto& [id, key] : reqs) {
    std::array<zmq::const_buffer, 8> frames = {zmq::str_buffer(""),
                                               zmq::str_buffer("1.0"),
                                               zmq::buffer(id),
                                               zmq::str_buffer("troupe"),
                                               zmq::str_buffer("127.0.0.1"),
                                               zmq::str_buffer(""),
                                               zmq::str_buffer("CURVE"),
                                               zmq::buffer(key)};
    ASSERT_TRUE(zmq::send_multipart(dealer, frames));
  }
  std::this_thread::sleep_for(50ms);  // inproc delivery
  int served = 0;
  while (serve_zap_request(rep, allowed, *log)) ++served;
  EXPECT_EQ(served, 3);
  std::map<std::string, std::string> status;  // request id -> status code
  for (int i = 0; i < 3; ++i) {
    std::vector<zmq::message_t> reply;
    ASSERT_TRUE(zmq::recv_multipart(dealer, std::back_inserter(reply)));
    ASSERT_EQ(reply.size(), 7u);  // delimiter + the six ZAP reply frames
    status[reply[2].to_string()] = reply[3].to_string();
  }
  EXPECT_EQ(status["1"], "200");
  EXPECT_EQ(status["2"], "400") << "a key not on the allow-list is refused";
  EXPECT_EQ(status["3"], "200");
}

// A peer whose id holds terminal control bytes floods bad frames: every frame is dropped
// and counted, the log shows the id escaped (\xNN, never a raw control byte) and only a
// few lines for that peer (the rest are counted as not logged).
TEST(ControlHardening, BadFrameWarningsAreEscapedAndRateLimited) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(1000);
  auto logger = make_logger("control");
  logger->sinks().push_back(sink);
  EchoServer server;
  ASSERT_TRUE(server.start(options("server", "tcp://127.0.0.1:*")).ok());
  zmq::context_t ctx(1);
  zmq::socket_t evil(ctx, zmq::socket_type::dealer);
  evil.set(zmq::sockopt::linger, 0);
  const std::string nasty_id = std::string("ev\x1b[2J\nil\x07", 10);
  evil.set(zmq::sockopt::routing_id, nasty_id);
  evil.connect(server.transport->endpoint());
  constexpr size_t kFrames = 300;
  for (size_t i = 0; i < kFrames; ++i)
    evil.send(zmq::buffer(std::string("bad\x01\x02\x1b frame")), zmq::send_flags::none);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server.transport->stats().frames_dropped < kFrames && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  expect_serves(*server.transport, "good");
  logger->sinks().pop_back();
  const auto st = server.transport->stats();
  EXPECT_GE(st.frames_dropped, kFrames);
  size_t lines = 0;
  for (const std::string& line : sink->last_formatted()) {
    if (line.find("dropped a frame") == std::string::npos) continue;
    ++lines;
    EXPECT_NE(line.find("ev\\x1b[2J\\x0ail\\x07"), std::string::npos) << line;
    for (size_t i = 0; i + 1 < line.size(); ++i) {  // the formatted line's own '\n' ends it
      const auto c = static_cast<unsigned char>(line[i]);
      EXPECT_TRUE(c >= 32 && c < 127) << "raw byte " << int(c) << " in: " << line;
    }
  }
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 3u) << "one peer's bad frames are rate-limited";
  EXPECT_GE(st.drops_not_logged, kFrames - 3);
}

TEST(ControlHardening, EscapeForLog) {
  EXPECT_EQ(escape_for_log("plain id-1"), "plain id-1");
  EXPECT_EQ(escape_for_log(std::string("a\0b\\\xff", 5)), "a\\x00b\\\\\\xff");
  EXPECT_EQ(escape_for_log(std::string(100, 'x'), 10), std::string(10, 'x') + "...");
}

TEST(ControlHardening, LogRateLimiterWindows) {
  LogRateLimiter lim(2, 3, std::chrono::milliseconds(1000));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(lim.admit("a", t0).log);
  EXPECT_TRUE(lim.admit("a", t0).log);
  EXPECT_FALSE(lim.admit("a", t0).log);
  EXPECT_FALSE(lim.admit("a", t0).log);
  EXPECT_TRUE(lim.admit("b", t0).log);   // its own bucket; the global one is now full
  EXPECT_FALSE(lim.admit("c", t0).log);  // global bound
  const auto d = lim.admit("a", t0 + std::chrono::milliseconds(1001));
  EXPECT_TRUE(d.log);
  EXPECT_EQ(d.suppressed, 2u);  // reported with the next line let through
  EXPECT_EQ(lim.total_suppressed(), 3u);
}

}  // namespace
}  // namespace troupe::control
