// actors/training/control.h — defines the control messages between the job's Trainer
// (driver process) and its Stage hosts (worker processes) — Command ("run step N",
// "evaluate", "stop") and the reply of world rank 0 ("step done" with loss and metrics) —
// and ControlChannel, the small interface they travel through.
//
// Only step-level messages use it: inside a step the workers run SPMD (collectives and
// send/recv, no control message per micro-batch). StoreControlChannel carries the
// messages as keys of a RendezvousStore ("<prefix>ctl/cmd/<seq>", "<prefix>ctl/reply/<seq>",
// "<prefix>ctl/error/<rank>"), which works wherever the data plane can rendezvous (a
// FileStore in the run directory, or the scheduler's store). The actor runtime (actors/,
// ZeroMQ) is meant to replace it behind this interface once it is usable (see
// docs/parallelism.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/rendezvous_store.h"

namespace troupe::training {

struct Command {
  enum class Kind { kStep, kEval, kStop };
  int64_t seq = 0;   // 0, 1, 2, ... in the order the driver sends them
  Kind kind = Kind::kStep;
  int64_t step = 0;  // kStep: the 1-based optimizer step to run
};

class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // Driver side.
  virtual Status send(const Command& cmd) = 0;
  // Blocks until the reply to `seq` arrives or `deadline` passes (kDeadlineExceeded).
  virtual Result<nlohmann::json> wait_reply(int64_t seq, comm::Deadline deadline) = 0;
  // A worker's reported failure ("" when none has reported one).
  virtual Result<std::string> worker_error(int rank) = 0;
  // Worker side.
  virtual Result<Command> wait_command(int64_t seq, comm::Deadline deadline) = 0;
  virtual Status reply(int64_t seq, const nlohmann::json& body) = 0;
  virtual Status report_error(int rank, const std::string& what) = 0;
};

class StoreControlChannel final : public ControlChannel {
 public:
  // `store` must outlive the channel; keys go under `prefix` (a job/epoch namespace).
  StoreControlChannel(comm::RendezvousStore& store, std::string prefix)
      : store_(store), prefix_(std::move(prefix)) {}

  Status send(const Command& cmd) override;
  Result<nlohmann::json> wait_reply(int64_t seq, comm::Deadline deadline) override;
  Result<std::string> worker_error(int rank) override;
  Result<Command> wait_command(int64_t seq, comm::Deadline deadline) override;
  Status reply(int64_t seq, const nlohmann::json& body) override;
  Status report_error(int rank, const std::string& what) override;

 private:
  std::string key(const std::string& k) const { return prefix_ + "ctl/" + k; }
  comm::RendezvousStore& store_;
  std::string prefix_;
};

}  // namespace troupe::training
