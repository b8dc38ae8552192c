// training/driver/trainer_requests.cc — OperatorRequests (trainer_requests.h): the one
// channel of operator requests (scale, replace, drain; test.scale_at) to the Trainer.
#include "training/driver/trainer_requests.h"

#include <fmt/format.h>

#include <cstdlib>
#include <utility>

namespace troupe::training {

OperatorRequests::OperatorRequests(Store store, const std::string& scale_at) : store_(std::move(store)) {
  // "<step>:<dp>[,...]"; an item without ':' asks nothing.
  for (size_t pos = 0; pos < scale_at.size();) {
    size_t comma = scale_at.find(',', pos);
    if (comma == std::string::npos) comma = scale_at.size();
    const std::string item = scale_at.substr(pos, comma - pos);
    pos = comma + 1;
    const size_t colon = item.find(':');
    if (colon == std::string::npos) continue;
    scripted_[std::strtoll(item.substr(0, colon).c_str(), nullptr, 10)] = item.substr(colon + 1);
  }
}

bool OperatorRequests::waiting(int64_t step) {
  if (scripted_after(step)) return true;
  // A poll (one attempt, skipped while the scheduler is out): training goes on through an
  // outage and a request waits for the next boundary.
  if (unanswered_ || store_.out()) return false;
  Result<bool> has = store_.contains(store_.key(fmt::format("request/{}", next_)));
  return has.ok() && has.value();
}

std::optional<OperatorRequest> OperatorRequests::take(int64_t step) {
  from_store_ = false;
  if (!unanswered_ && !store_.out()) {
    const std::string k = store_.key(fmt::format("request/{}", next_));
    Result<bool> has = store_.contains(k);
    Result<std::string> got =
        has.ok() && has.value() ? store_.get(k) : Result<std::string>(not_found("none"));
    if (got.ok()) {
      const std::string text = std::move(got).value();
      unanswered_ = next_++;
      answer_ = nlohmann::json{{"event", "request_refused"}, {"why", "malformed request"}, {"request", text}};
      const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      const std::string op = j.is_object() ? j.value("op", "") : "";
      if (op == "scale" && j.contains("dp") && j["dp"].is_number_integer()) {
        from_store_ = true;
        return OperatorRequest{OperatorRequest::Op::kScale, std::to_string(j["dp"].get<int64_t>()), ""};
      }
      if (op == "replace" && j.contains("slot") && j["slot"].is_number_integer()) {
        from_store_ = true;
        return OperatorRequest{OperatorRequest::Op::kReplace, std::to_string(j["slot"].get<int64_t>()),
                               j.value("avoid", "")};
      }
      // Malformed: answered as such at send_answer; the scripted request still runs.
    }
  }
  if (scripted_taken_ != step) {
    if (auto it = scripted_.find(step); it != scripted_.end()) {
      scripted_taken_ = step;
      return OperatorRequest{OperatorRequest::Op::kScale, it->second, ""};
    }
  }
  return std::nullopt;
}

void OperatorRequests::answer(nlohmann::json outcome) {
  if (from_store_) answer_ = std::move(outcome);
  from_store_ = false;
}

void OperatorRequests::send_answer() {
  if (!unanswered_ || store_.out()) return;
  // Kept for the next boundary when the store does not take it now.
  if (!store_.set(store_.key(fmt::format("answer/{}", *unanswered_)), answer_.dump()).ok()) return;
  unanswered_.reset();
}

}  // namespace troupe::training
