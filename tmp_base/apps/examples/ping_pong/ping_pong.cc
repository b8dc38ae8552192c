// apps/examples/ping_pong/ping_pong.cc — the actor API's tutorial example: a Pinger
// actor asks a Ponger actor `rounds` times, first inside one process, then across two.
//
//   ping_pong                     both actors in this process
//   ping_pong --two-process       starts `ping_pong --serve` as a child, pings it over tcp
//   ping_pong --serve [ENDPOINT]  hosts the Ponger (node "pong-node"), prints its endpoint
//   ping_pong --connect ENDPOINT  pings a Ponger served elsewhere
//
// Read it top to bottom: the messages, the two actors, then main() wiring a system.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <future>
#include <string>

#include "actors/actor_system.h"

using namespace troupe;
using namespace troupe::actors;
using namespace std::chrono_literals;

// 1. Messages: plain structs with a type id and an encoding (see actors/message.h).
struct Ping {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'0001ull;
  int64_t round = 0;
  void encode(ByteWriter& w) const { w.put(round); }
  static Result<Ping> decode(ByteReader& r) {
    Ping p;
    r.get(&p.round);
    TROUPE_RETURN_IF_ERROR(r.finish("Ping"));
    return p;
  }
};

struct Pong {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'0002ull;
  int64_t round = 0;
  std::string from;
  void encode(ByteWriter& w) const { w.put(round).put_bytes(from); }
  static Result<Pong> decode(ByteReader& r) {
    Pong p;
    r.get(&p.round);
    r.get_bytes(&p.from);
    TROUPE_RETURN_IF_ERROR(r.finish("Pong"));
    return p;
  }
};

// 2. The Ponger declares the one message it handles; returning a Pong answers the ask.
class Ponger : public Actor {
 public:
  Ponger() {
    handle<Ping>([this](const Ping& p) { return Pong{p.round, self().to_string()}; });
  }
};

// 3. The Pinger asks, and asks again from the reply callback (which runs inside the
// Pinger, one message at a time). It watches the Ponger: if that dies, a Down arrives.
class Pinger : public Actor {
 public:
  Pinger(ActorRef ponger, int rounds, std::promise<Status>* done)
      : ponger_(std::move(ponger)), rounds_(rounds), done_(done) {}

  Status on_start() override {
    monitor(ponger_);
    send(1);
    return ok_status();
  }
  void on_down(const Down& d) override {
    finish(unavailable("{} went down ({}): {}", d.actor.to_string(), control::down_reason_name(d.reason),
                       d.text));
  }

 private:
  void send(int64_t round) {
    ask<Pong>(ponger_, Ping{round}, 2s, [this, round](Result<Pong> r) {
      if (!r.ok()) return finish(r.status());
      std::printf("%s: ping %lld -> pong from %s\n", self().to_string().c_str(),
                  static_cast<long long>(round), r->from.c_str());
      if (round < rounds_) return send(round + 1);
      finish(ok_status());
    });
  }
  void finish(Status st) {
    if (done_ == nullptr) return;
    done_->set_value(std::move(st));
    done_ = nullptr;
    stop();
  }

  ActorRef ponger_;
  int rounds_;
  std::promise<Status>* done_;
};

// Runs a Pinger in `sys` against `ponger` and waits for it.
int run_pinger(ActorSystem& sys, const ActorRef& ponger, int rounds) {
  std::promise<Status> done;
  auto pinger = sys.spawn<Pinger>("pinger", ponger, rounds, &done);
  if (!pinger.ok()) return std::fprintf(stderr, "%s\n", pinger.status().to_string().c_str()), 1;
  auto fut = done.get_future();
  if (fut.wait_for(30s) != std::future_status::ready) return std::fprintf(stderr, "timed out\n"), 1;
  Status st = fut.get();
  std::printf("%s\n", st.ok() ? "done" : st.to_string().c_str());
  return st.ok() ? 0 : 1;
}

int local(int rounds) {
  auto sys = ActorSystem::create({.node_id = "local"});
  if (!sys.ok()) return 1;
  auto ponger = (*sys)->spawn<Ponger>("ponger");
  return ponger.ok() ? run_pinger(**sys, *ponger, rounds) : 1;
}

control::TransportOptions network(std::string bind) {
  control::TransportOptions t;
  t.bind_endpoint = std::move(bind);
  return t;
}

int serve(const std::string& bind) {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // with --two-process: never outlive the parent
  auto sys = ActorSystem::create({.node_id = "pong-node", .network = network(bind)});
  if (!sys.ok()) return std::fprintf(stderr, "%s\n", sys.status().to_string().c_str()), 1;
  if (!(*sys)->spawn<Ponger>("ponger").ok()) return 1;
  std::printf("serving pong-node/ponger at %s\n", (*sys)->endpoint().c_str());
  std::fflush(stdout);
  char c;
  while (::read(0, &c, 1) > 0) {  // until stdin closes
  }
  return 0;
}

int connect_and_ping(const std::string& endpoint, int rounds) {
  auto sys = ActorSystem::create({.node_id = "ping-node", .network = network("")});
  if (!sys.ok()) return 1;
  Status st = (*sys)->connect("pong-node", endpoint);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.to_string().c_str()), 1;
  return run_pinger(**sys, ActorRef("pong-node", "ponger"), rounds);
}

// Starts `ping_pong --serve` as a child process, reads its endpoint, pings it.
int two_process(int rounds) {
  int to_child[2], from_child[2];
  if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return 1;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 1);
    ::close(to_child[1]);
    ::close(from_child[0]);
    ::execl("/proc/self/exe", "ping_pong", "--serve", "tcp://127.0.0.1:*", nullptr);
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  char line[256] = {};
  FILE* out = ::fdopen(from_child[0], "r");
  int rc = 1;
  if (std::fgets(line, sizeof(line), out) != nullptr) {
    std::printf("child says: %s", line);
    const char* at = std::strstr(line, " at ");
    std::string endpoint = at ? std::string(at + 4, std::strcspn(at + 4, "\n")) : "";
    rc = connect_and_ping(endpoint, rounds);
  }
  ::close(to_child[1]);  // the child exits when its stdin closes
  ::waitpid(pid, nullptr, 0);
  std::fclose(out);
  return rc;
}

int main(int argc, char** argv) {
  const int rounds = 3;
  if (argc == 1) return local(rounds);
  if (argc == 2 && std::strcmp(argv[1], "--two-process") == 0) return two_process(rounds);
  if (argc >= 2 && std::strcmp(argv[1], "--serve") == 0)
    return serve(argc > 2 ? argv[2] : "tcp://127.0.0.1:5555");
  if (argc == 3 && std::strcmp(argv[1], "--connect") == 0) return connect_and_ping(argv[2], rounds);
  std::fprintf(stderr, "usage: ping_pong [--two-process | --serve [ENDPOINT] | --connect ENDPOINT]\n");
  return 2;
}
