// actors/training/actor_control.h — the actor implementation of the step control plane
// (control.h): every worker process runs an ActorSystem (node "w<rank>", ZeroMQ on
// loopback) hosting its Stage's actor "stage" on a dedicated thread (a step blocks it for
// the step's duration, SPMD with the other workers); the driver's ActorSystem (node
// "driver") connects to every worker — endpoints are exchanged through the job's
// rendezvous store ("<prefix>actors/w<rank>") — asks each "stage" actor for every
// command and monitors them, so a dead worker fails the job at once (Down), and a worker
// whose driver goes away stops serving.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "actors/actor_system.h"
#include "actors/training/control.h"

namespace troupe::training {

// The two control messages: a Command, and its reply (JSON text: the StepReport, the
// validation loss, or the stop acknowledgement).
struct StageCommandMsg {
  static constexpr uint64_t kTypeId = 0x7472'6169'6e00'0001ull;
  std::string json;
  void encode(actors::ByteWriter& w) const { w.put_bytes(json); }
  static Result<StageCommandMsg> decode(actors::ByteReader& r) {
    StageCommandMsg m;
    r.get_bytes(&m.json);
    TROUPE_RETURN_IF_ERROR(r.finish("StageCommandMsg"));
    return m;
  }
};

struct StageReplyMsg {
  static constexpr uint64_t kTypeId = 0x7472'6169'6e00'0002ull;
  std::string json;
  void encode(actors::ByteWriter& w) const { w.put_bytes(json); }
  static Result<StageReplyMsg> decode(actors::ByteReader& r) {
    StageReplyMsg m;
    r.get_bytes(&m.json);
    TROUPE_RETURN_IF_ERROR(r.finish("StageReplyMsg"));
    return m;
  }
};

class ActorStepServer final : public StepServer {
 public:
  // Starts this worker's actor system. The endpoint is published by serve(), once the
  // stage actor exists.
  static Result<std::unique_ptr<ActorStepServer>> start(comm::RendezvousStore& store, std::string prefix, int rank);
  ~ActorStepServer() override;
  Status serve(const Handler& handler, std::chrono::milliseconds idle_timeout) override;

 private:
  ActorStepServer(comm::RendezvousStore& store, std::string prefix, int rank)
      : store_(store), prefix_(std::move(prefix)), rank_(rank) {}
  comm::RendezvousStore& store_;
  std::string prefix_;
  int rank_;
  std::unique_ptr<actors::ActorSystem> sys_;
  std::shared_ptr<std::atomic<bool>> driver_lost_ = std::make_shared<std::atomic<bool>>(false);
};

class ActorStepDriver final : public StepDriver {
 public:
  // Starts the driver's actor system and connects to the `world` workers as their
  // endpoints appear in the store (waiting up to `connect_timeout`; `supervise` is
  // polled meanwhile).
  static Result<std::unique_ptr<ActorStepDriver>> start(comm::RendezvousStore& store, std::string prefix, int world,
                                                        std::chrono::milliseconds connect_timeout,
                                                        const Supervisor& supervise);
  ~ActorStepDriver() override;
  Result<nlohmann::json> call(const Command& cmd, std::chrono::milliseconds timeout,
                              const Supervisor& supervise) override;

 private:
  ActorStepDriver() = default;
  struct Shared {
    std::mutex mu;
    std::string failure;  // first Down of a stage actor
  };
  std::unique_ptr<actors::ActorSystem> sys_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  int world_ = 0;
};

}  // namespace troupe::training
