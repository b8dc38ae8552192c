// comm/control/envelope.cc — names and ids for the plain envelope types (C++17: part of
// the codec target).
#include "comm/control/envelope.h"

#include <fmt/format.h>

namespace troupe::control {

std::string_view down_reason_name(DownReason r) {
  switch (r) {
    case DownReason::kExit:
      return "exit";
    case DownReason::kCrash:
      return "crash";
    case DownReason::kHeartbeatTimeout:
      return "heartbeat timeout";
    case DownReason::kConnectionLost:
      return "connection lost";
    case DownReason::kKilled:
      return "killed";
  }
  return "unknown";
}

uint64_t system_type_id(const Payload& p) {
  if (const auto* u = std::get_if<UserPayload>(&p)) return u->type_id;
  return kSystemTypeIdBase + 1 + p.index();
}

bool is_reserved_type_id(uint64_t type_id) {
  return type_id == 0 || type_id >= kSystemTypeIdBase;
}

std::string describe(const Envelope& e) {
  static constexpr const char* kNames[] = {"heartbeat", "monitor", "demonitor", "link",
                                           "unlink",    "down",    "error",     "ack"};
  std::string kind = std::holds_alternative<UserPayload>(e.payload)
                         ? fmt::format("user {:#x}", std::get<UserPayload>(e.payload).type_id)
                         : std::string(kNames[e.payload.index()]);
  return fmt::format("{} {} -> {}{}{}", kind, e.sender.to_string(), e.receiver.to_string(),
                     e.correlation_id ? fmt::format(" corr={}", e.correlation_id) : "",
                     e.is_reply ? " (reply)" : "");
}

}  // namespace troupe::control
