// actors/training/control.cc — command encoding and the store-backed StepDriver /
// StepServer.
#include "actors/training/control.h"

#include <fmt/format.h>

namespace troupe::training {

using Clock = std::chrono::steady_clock;

const char* command_kind_name(Command::Kind k) {
  switch (k) {
    case Command::Kind::kStep: return "step";
    case Command::Kind::kEval: return "eval";
    case Command::Kind::kStop: return "stop";
    case Command::Kind::kSave: return "save";
  }
  return "?";
}

nlohmann::json command_to_json(const Command& c) {
  return nlohmann::json{{"seq", c.seq}, {"kind", command_kind_name(c.kind)}, {"step", c.step}};
}

Result<Command> command_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("seq") || !j["seq"].is_number_integer() ||
      !j.contains("kind") || !j["kind"].is_string() || !j.contains("step") || !j["step"].is_number_integer()) {
    return data_loss("control: malformed command: {}", text.substr(0, 200));
  }
  Command c;
  c.seq = j["seq"].get<int64_t>();
  c.step = j["step"].get<int64_t>();
  const std::string kind = j["kind"].get<std::string>();
  if (kind == "step") {
    c.kind = Command::Kind::kStep;
  } else if (kind == "eval") {
    c.kind = Command::Kind::kEval;
  } else if (kind == "stop") {
    c.kind = Command::Kind::kStop;
  } else if (kind == "save") {
    c.kind = Command::Kind::kSave;
  } else {
    return data_loss("control: command has unknown kind '{}'", kind);
  }
  return c;
}

}  // namespace troupe::training
