// bench/actors/actor_bench.cc — round-trip latency and messages/s of the actor API, for
// three paths: "local" (two actors in one ActorSystem: encode + mailbox, no sockets),
// "inproc" (two ActorSystems sharing a ZeroMQ context, inproc:// transport) and "tcp"
// (two ActorSystems over loopback tcp), at several payload sizes.
//
// Formulas printed with the table:
//   rtt       = wall time of one ask -> reply, sequential (p50 and p99 over `iters` asks)
//   msgs/s    = completed asks / wall time, with `window` asks in flight (each ask is one
//               request and one reply envelope)
//   MB/s      = msgs/s * payload bytes (request payload only)
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <vector>
#include <zmq.hpp>

#include "actors/actor_system.h"

using namespace troupe;
using namespace troupe::actors;
using namespace std::chrono_literals;
using Clk = std::chrono::steady_clock;

struct Blob {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'0B01ull;
  std::string data;
  void encode(ByteWriter& w) const { w.put_bytes(data); }
  static Result<Blob> decode(ByteReader& r) {
    Blob b;
    r.get_bytes(&b.data);
    TROUPE_RETURN_IF_ERROR(r.finish("Blob"));
    return b;
  }
};

struct Tiny {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'0B02ull;
  uint64_t n = 0;
  void encode(ByteWriter& w) const { w.put(n); }
  static Result<Tiny> decode(ByteReader& r) {
    Tiny t;
    r.get(&t.n);
    TROUPE_RETURN_IF_ERROR(r.finish("Tiny"));
    return t;
  }
};

// Replies to each Blob with a Tiny (so the reply size is constant and small).
class Echo : public Actor {
 public:
  Echo() {
    handle<Blob>([](const Blob& b) { return Tiny{b.data.size()}; });
  }
};

struct Row {
  const char* path;
  size_t bytes;
  double p50_us, p99_us, msgs_per_s;
};

Row measure(const char* path, ActorSystem& client, const ActorRef& echo, size_t bytes, int iters,
            int window) {
  Blob blob{std::string(bytes, 'x')};
  for (int i = 0; i < 50; ++i) (void)client.ask<Tiny>(echo, blob, 5s).get();  // warm-up
  std::vector<double> us;
  us.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clk::now();
    auto r = client.ask<Tiny>(echo, blob, 5s).get();
    us.push_back(std::chrono::duration<double, std::micro>(Clk::now() - t0).count());
    if (!r.ok()) std::fprintf(stderr, "ask failed: %s\n", r.status().to_string().c_str());
  }
  std::sort(us.begin(), us.end());
  // Windowed throughput.
  const int total = iters * 10;
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0, done = 0, failed = 0;
  const auto t0 = Clk::now();
  for (int i = 0; i < total; ++i) {
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return in_flight < window; });
      ++in_flight;
    }
    client.ask<Tiny>(echo, blob, 10s, std::function<void(Result<Tiny>)>([&](Result<Tiny> r) {
                       std::lock_guard<std::mutex> lk(mu);
                       --in_flight;
                       ++done;
                       if (!r.ok()) ++failed;
                       cv.notify_all();
                     }));
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done == total; });
  }
  const double secs = std::chrono::duration<double>(Clk::now() - t0).count();
  if (failed) std::fprintf(stderr, "%d asks failed\n", failed);
  return Row{path, bytes, us[us.size() / 2], us[us.size() * 99 / 100], total / secs};
}

std::unique_ptr<ActorSystem> make(const std::string& node, std::optional<control::TransportOptions> net) {
  ActorSystemOptions o;
  o.node_id = node;
  o.network = std::move(net);
  auto s = ActorSystem::create(std::move(o));
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(s).value();
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int window = 64;
  const std::vector<size_t> sizes = {16, 1024, 64 * 1024};
  std::vector<Row> rows;
  {
    auto sys = make("local", std::nullopt);
    auto echo = *sys->spawn<Echo>("echo");
    for (size_t b : sizes) rows.push_back(measure("local", *sys, echo, b, iters, window));
  }
  {
    zmq::context_t ctx(1);
    control::TransportOptions server_net;
    server_net.bind_endpoint = "inproc://bench-server";
    server_net.context = &ctx;
    control::TransportOptions client_net;
    client_net.bind_endpoint = "";
    client_net.context = &ctx;
    auto server = make("server", server_net);
    auto client = make("client", client_net);
    auto echo = *server->spawn<Echo>("echo");
    (void)client->connect("server", server->endpoint());
    for (size_t b : sizes)
      rows.push_back(measure("inproc", *client, ActorRef("server", "echo"), b, iters, window));
    client->shutdown();
    server->shutdown();
  }
  {
    control::TransportOptions server_net;  // tcp://127.0.0.1:* by default
    control::TransportOptions client_net;
    client_net.bind_endpoint = "";
    auto server = make("server", server_net);
    auto client = make("client", client_net);
    auto echo = *server->spawn<Echo>("echo");
    (void)client->connect("server", server->endpoint());
    for (size_t b : sizes)
      rows.push_back(measure("tcp", *client, ActorRef("server", "echo"), b, iters, window));
  }
  std::printf(
      "actor ask/reply: rtt = one sequential ask (p50/p99 of %d); msgs/s = asks completed per second with %d "
      "in flight; MB/s = msgs/s * payload\n",
      iters, window);
  std::printf("%-8s %10s %10s %10s %12s %10s\n", "path", "payload B", "rtt p50 us", "rtt p99 us", "msgs/s",
              "MB/s");
  for (const Row& r : rows) {
    std::printf("%-8s %10zu %10.1f %10.1f %12.0f %10.1f\n", r.path, r.bytes, r.p50_us, r.p99_us, r.msgs_per_s,
                r.msgs_per_s * r.bytes / 1e6);
  }
  return 0;
}
