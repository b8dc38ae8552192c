// actors/training/control.h — defines the control messages between the job's Trainer
// (driver process) and the Stage actors of the workers — Command ("run step N",
// "evaluate", "save step N", "stop") and its reply ("step done" with loss and metrics,
// from world rank 0) — and the two ends they travel between: StepDriver (driver side: send a command to
// every worker, return rank 0's reply, supervise while waiting) and StepServer (worker
// side: run commands in order until "stop").
//
// Only step-level messages use them: inside a step the workers run SPMD (collectives and
// send/recv, no control message per micro-batch).
//
// Two implementations:
// - Actors (actor_control.h, the default): each worker hosts a "stage" actor in its
//   ActorSystem (ZeroMQ control plane); the driver's Trainer asks every one of them and
//   monitors them (a dead worker is a Down at once).
// - Store (here): messages as keys of a RendezvousStore ("<prefix>ctl/cmd/<seq>",
//   "<prefix>ctl/reply/<seq>", "<prefix>ctl/error/<rank>"); needs nothing but the store
//   the data plane rendezvous through. Kept as the fallback (TROUPE_CONTROL=store).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/rendezvous_store.h"

namespace troupe::training {

struct Command {
  enum class Kind : uint8_t { kStep = 0, kEval = 1, kStop = 2, kSave = 3 };
  int64_t seq = 0;   // 0, 1, 2, ... in the order the driver sends them
  Kind kind = Kind::kStep;
  int64_t step = 0;  // kStep: the 1-based optimizer step to run; kSave: the step just run
};
const char* command_kind_name(Command::Kind k);

// OK while the workers are healthy; else the problem. Polled while waiting for replies.
using Supervisor = std::function<Status()>;

class StepDriver {
 public:
  virtual ~StepDriver() = default;
  // Sends `cmd` to every worker; returns world rank 0's reply. Fails with the first worker
  // failure seen (its report, a Down, `supervise`) or after `timeout`.
  virtual Result<nlohmann::json> call(const Command& cmd, std::chrono::milliseconds timeout,
                                      const Supervisor& supervise) = 0;
};

class StepServer {
 public:
  virtual ~StepServer() = default;
  using Handler = std::function<nlohmann::json(const Command&)>;
  // Runs `handler` for every command in order until "stop" (whose reply is sent too).
  // Fails when no command arrives within `idle_timeout` or the driver is gone.
  virtual Status serve(const Handler& handler, std::chrono::milliseconds idle_timeout) = 0;
};

class StoreStepDriver final : public StepDriver {
 public:
  // `store` must outlive this; keys under `prefix` (a job/epoch namespace).
  StoreStepDriver(comm::RendezvousStore& store, std::string prefix, int world)
      : store_(store), prefix_(std::move(prefix)), world_(world) {}
  Result<nlohmann::json> call(const Command& cmd, std::chrono::milliseconds timeout,
                              const Supervisor& supervise) override;

 private:
  comm::RendezvousStore& store_;
  std::string prefix_;
  int world_;
};

class StoreStepServer final : public StepServer {
 public:
  StoreStepServer(comm::RendezvousStore& store, std::string prefix, int rank)
      : store_(store), prefix_(std::move(prefix)), rank_(rank) {}
  Status serve(const Handler& handler, std::chrono::milliseconds idle_timeout) override;
  // Tells the driver this worker failed (before or instead of serving).
  Status report_error(const std::string& what);

 private:
  comm::RendezvousStore& store_;
  std::string prefix_;
  int rank_;
};

// Strict decoding of a command's JSON form ({"seq", "kind", "step"}); errors name the
// problem, never crash.
nlohmann::json command_to_json(const Command& c);
Result<Command> command_from_json(const std::string& text);

}  // namespace troupe::training
