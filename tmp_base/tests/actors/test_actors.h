// tests/actors/test_actors.h — message types and small actors shared by the actor tests:
// Ping/Pong, Add/Sum, Crash, Boom, and a Recorder that remembers every Down it receives.
#pragma once

#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "actors/actor_system.h"

namespace troupe {
inline std::ostream& operator<<(std::ostream& os, const Status& s) {
  return os << s.to_string();
}
}  // namespace troupe

namespace troupe::actors::testing {

struct Ping {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'0101ull;
  int64_t seq = 0;
  std::string text;
  void encode(ByteWriter& w) const { w.put(seq).put_bytes(text); }
  static Result<Ping> decode(ByteReader& r) {
    Ping p;
    r.get(&p.seq);
    r.get_bytes(&p.text);
    TROUPE_RETURN_IF_ERROR(r.finish("Ping"));
    return p;
  }
};

struct Pong {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'0102ull;
  int64_t seq = 0;
  std::string text;
  void encode(ByteWriter& w) const { w.put(seq).put_bytes(text); }
  static Result<Pong> decode(ByteReader& r) {
    Pong p;
    r.get(&p.seq);
    r.get_bytes(&p.text);
    TROUPE_RETURN_IF_ERROR(r.finish("Pong"));
    return p;
  }
};

// Empty messages share this shape.
template <uint64_t kId>
struct Signal {
  static constexpr uint64_t kTypeId = kId;
  void encode(ByteWriter&) const {}
  static Result<Signal> decode(ByteReader& r) {
    TROUPE_RETURN_IF_ERROR(r.finish("Signal"));
    return Signal{};
  }
};
using Crash = Signal<0x0E5A'0000'0000'0103ull>;    // the handler throws
using Fail = Signal<0x0E5A'0000'0000'0104ull>;     // the handler returns an error
using Unknown = Signal<0x0E5A'0000'0000'0105ull>;  // nobody handles it
using Defer = Signal<0x0E5A'0000'0000'0106ull>;    // the reply comes later
using Release = Signal<0x0E5A'0000'0000'0107ull>;  // delivers the deferred reply
using Quit = Signal<0x0E5A'0000'0000'0108ull>;     // stop(kExit)

// Replies Pong{seq, text} to Ping; throws on Crash; fails on Fail; defers on Defer.
class PongActor : public Actor {
 public:
  PongActor() {
    handle<Ping>([this](const Ping& p) {
      ++pings;
      return Pong{p.seq, p.text};
    });
    handle<Crash>([](const Crash&) -> Status { throw std::runtime_error("asked to crash"); });
    handle<Fail>([](const Fail&) { return Status(invalid_argument("refused on purpose")); });
    handle<Defer>([this](const Defer&) { deferred = make_response_promise(); });
    handle<Release>([this](const Release&) { deferred.deliver(Pong{99, "late"}); });
    handle<Quit>([this](const Quit&) { stop(DownReason::kExit, "asked to quit"); });
  }
  int pings = 0;
  ResponsePromise deferred;
};

// Remembers every Down; optionally monitors or links a target on start.
class Recorder : public Actor {
 public:
  enum class Mode { kNone, kMonitor, kLink };
  Recorder(std::vector<Down>* downs, std::mutex* mu, ActorRef target = {}, Mode mode = Mode::kNone)
      : downs_(downs), mu_(mu), target_(std::move(target)), mode_(mode) {}
  Status on_start() override {
    if (mode_ == Mode::kMonitor) monitor(target_);
    if (mode_ == Mode::kLink) link(target_);
    return ok_status();
  }
  void on_down(const Down& d) override {
    std::lock_guard<std::mutex> lk(*mu_);
    downs_->push_back(d);
  }

 private:
  std::vector<Down>* downs_;
  std::mutex* mu_;
  ActorRef target_;
  Mode mode_;
};

}  // namespace troupe::actors::testing
