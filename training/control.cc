// training/control.cc — command kind names.
#include "training/control.h"

#include <fmt/format.h>

namespace troupe::training {

const char* command_kind_name(Command::Kind k) {
  switch (k) {
    case Command::Kind::kStep: return "step";
    case Command::Kind::kEval: return "eval";
    case Command::Kind::kStop: return "stop";
    case Command::Kind::kSave: return "save";
    case Command::Kind::kSnapshot:
      return "snapshot";
  }
  return "?";
}

}  // namespace troupe::training
