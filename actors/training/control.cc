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

Result<nlohmann::json> StoreStepDriver::call(const Command& cmd, std::chrono::milliseconds timeout,
                                             const Supervisor& supervise) {
  TROUPE_RETURN_IF_ERROR(store_.set(fmt::format("{}ctl/cmd/{}", prefix_, cmd.seq), command_to_json(cmd).dump()));
  const auto deadline = Clock::now() + timeout;
  const std::string reply_key = fmt::format("{}ctl/reply/{}", prefix_, cmd.seq);
  while (true) {
    Result<std::string> r = store_.get(reply_key, std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
    if (r.ok()) {
      nlohmann::json j = nlohmann::json::parse(r.value(), nullptr, false);
      if (j.is_discarded() || !j.is_object()) return data_loss("control: reply {} is not a JSON object", reply_key);
      return j;
    }
    if (r.status().code() != StatusCode::kDeadlineExceeded) return r.status();
    for (int rank = 0; rank < world_; ++rank) {
      const std::string k = fmt::format("{}ctl/error/{}", prefix_, rank);
      TROUPE_ASSIGN_OR_RETURN(bool has, store_.contains(k));
      if (has) {
        Result<std::string> err = store_.get(k, comm::deadline_in(std::chrono::milliseconds(1000)));
        return aborted("worker rank {} failed: {}", rank, err.ok() ? err.value() : err.status().to_string());
      }
    }
    if (supervise) TROUPE_RETURN_IF_ERROR(supervise());
    if (Clock::now() >= deadline) {
      return deadline_exceeded("no reply to command {} ({} {}) within {} ms", cmd.seq, command_kind_name(cmd.kind),
                               cmd.step, timeout.count());
    }
  }
}

Status StoreStepServer::serve(const Handler& handler, std::chrono::milliseconds idle_timeout) {
  for (int64_t seq = 0;; ++seq) {
    Result<std::string> text = store_.get(fmt::format("{}ctl/cmd/{}", prefix_, seq), comm::deadline_in(idle_timeout));
    if (!text.ok()) {
      (void)report_error(text.status().to_string());
      return text.status();
    }
    Result<Command> cmd = command_from_json(text.value());
    if (!cmd.ok()) {
      (void)report_error(cmd.status().to_string());
      return cmd.status();
    }
    const nlohmann::json body = handler(cmd.value());
    if (rank_ == 0) TROUPE_RETURN_IF_ERROR(store_.set(fmt::format("{}ctl/reply/{}", prefix_, seq), body.dump()));
    if (cmd.value().kind == Command::Kind::kStop) return ok_status();
  }
}

Status StoreStepServer::report_error(const std::string& what) {
  return store_.set(fmt::format("{}ctl/error/{}", prefix_, rank_), what);
}

}  // namespace troupe::training
