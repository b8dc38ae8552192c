// actors/training/trainer_requests.cc — operator requests (troupe scale, replace,
// drain; elastic.scale_at) and their answers.
// Owns: the request queue and the answer of the request in progress.
// May call: the store (request and answer keys), event(). Acting on a request is
// membership's (trainer_membership.cc), at a step boundary.
#include "actors/training/trainer_driver.h"

namespace troupe::training {

Status Trainer::take_store_request() {
  if (pending_answer_ || store_out()) return ok_status();
  const std::string k = key(fmt::format("request/{}", next_request_));
  Result<bool> has = poll_contains(k);
  if (!has.ok() || !has.value()) return ok_status();  // none, or the scheduler is out: next boundary
  Result<std::string> got = poll_get(k, std::chrono::milliseconds(5000));
  if (!got.ok()) return ok_status();
  const std::string text = std::move(got).value();
  pending_answer_ = next_request_++;
  last_answer_ =
      nlohmann::json{{"event", "request_refused"}, {"why", "malformed request"}, {"request", text}};
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) return ok_status();
  const std::string op = j.value("op", "");
  if (op == "scale" && j.contains("dp") && j["dp"].is_number_integer()) {
    std::ofstream(run_dir_ + "/scale_request") << j["dp"].get<int64_t>() << "\n";
    last_answer_ = nlohmann::json{{"event", "scale_unchanged"}, {"dp", plan_.dp}};
  } else if (op == "replace" && j.contains("slot") && j["slot"].is_number_integer()) {
    std::ofstream(run_dir_ + "/replace_request") << j["slot"].get<int64_t>() << "\n";
    avoid_node_ = j.value("avoid", "");
  }
  return ok_status();
}

Status Trainer::answer_store_request() {
  avoid_node_.clear();
  if (!pending_answer_ || store_out()) return ok_status();
  // Kept for the next boundary when the scheduler does not take it now.
  if (!poll_set(key(fmt::format("answer/{}", *pending_answer_)), last_answer_.dump()).ok())
    return ok_status();
  pending_answer_.reset();
  return ok_status();
}

}  // namespace troupe::training
