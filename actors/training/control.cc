// actors/training/control.cc — StoreControlChannel: JSON messages as store keys.
// Decoding is strict: a malformed message is an error naming the key, never a crash.
#include "actors/training/control.h"

#include <fmt/format.h>

namespace troupe::training {

namespace {
const char* kind_name(Command::Kind k) {
  switch (k) {
    case Command::Kind::kStep: return "step";
    case Command::Kind::kEval: return "eval";
    case Command::Kind::kStop: return "stop";
  }
  return "?";
}
}  // namespace

Status StoreControlChannel::send(const Command& cmd) {
  const nlohmann::json j{{"seq", cmd.seq}, {"kind", kind_name(cmd.kind)}, {"step", cmd.step}};
  return store_.set(key(fmt::format("cmd/{}", cmd.seq)), j.dump());
}

Result<nlohmann::json> StoreControlChannel::wait_reply(int64_t seq, comm::Deadline deadline) {
  const std::string k = key(fmt::format("reply/{}", seq));
  TROUPE_ASSIGN_OR_RETURN(std::string v, store_.get(k, deadline));
  nlohmann::json j = nlohmann::json::parse(v, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return data_loss("control: reply {} is not a JSON object", k);
  return j;
}

Result<std::string> StoreControlChannel::worker_error(int rank) {
  const std::string k = key(fmt::format("error/{}", rank));
  TROUPE_ASSIGN_OR_RETURN(bool has, store_.contains(k));
  if (!has) return std::string();
  return store_.get(k, comm::deadline_in(std::chrono::milliseconds(1000)));
}

Result<Command> StoreControlChannel::wait_command(int64_t seq, comm::Deadline deadline) {
  const std::string k = key(fmt::format("cmd/{}", seq));
  TROUPE_ASSIGN_OR_RETURN(std::string v, store_.get(k, deadline));
  const nlohmann::json j = nlohmann::json::parse(v, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("kind") || !j["kind"].is_string() || !j.contains("step") ||
      !j["step"].is_number_integer()) {
    return data_loss("control: command {} is malformed: {}", k, v);
  }
  Command c;
  c.seq = seq;
  c.step = j["step"].get<int64_t>();
  const std::string kind = j["kind"].get<std::string>();
  if (kind == "step") {
    c.kind = Command::Kind::kStep;
  } else if (kind == "eval") {
    c.kind = Command::Kind::kEval;
  } else if (kind == "stop") {
    c.kind = Command::Kind::kStop;
  } else {
    return data_loss("control: command {} has unknown kind '{}'", k, kind);
  }
  return c;
}

Status StoreControlChannel::reply(int64_t seq, const nlohmann::json& body) {
  return store_.set(key(fmt::format("reply/{}", seq)), body.dump());
}

Status StoreControlChannel::report_error(int rank, const std::string& what) {
  return store_.set(key(fmt::format("error/{}", rank)), what);
}

}  // namespace troupe::training
