// training/control.h — defines Command, the step-level message from the Trainer to
// every worker ("run step N", "evaluate", "save step N", "stop"; it travels as the typed
// StepCommand of training/messages.h).
//
// Only step-level messages exist: inside a step the workers run SPMD (collectives and
// send/recv, no control message per micro-batch).
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
  // kSave: a checkpoint of the step just run, off the every-K schedule (the job's last);
  // kSnapshot: a snapshot of the step just run, off the schedule (before a planned
  // membership change: a rescale, a replacement).
  enum class Kind : uint8_t { kStep = 0, kEval = 1, kStop = 2, kSave = 3, kSnapshot = 4 };
  int64_t seq = 0;   // 0, 1, 2, ... in the order the driver sends them
  Kind kind = Kind::kStep;
  int64_t step = 0;  // kStep: the 1-based optimizer step to run; kSave: the step just run
};
const char* command_kind_name(Command::Kind k);

}  // namespace troupe::training
