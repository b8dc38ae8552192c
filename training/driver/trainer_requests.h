// training/driver/trainer_requests.h — OperatorRequests: the one channel through which
// operator requests reach the Trainer, and their answers leave it.
//
// Owns: the request queue and the answer of the request in progress. A request is the
// key "<job>/elastic/request/<k>" of the job's store (k = 0, 1, 2, ... in order) holding
// {"op": "scale", "dp": N} or {"op": "replace", "slot": S[, "avoid": "<agent>"]}; its
// answer goes to "<job>/elastic/answer/<k>" (the event the Trainer logged for it:
// scaled, scale_unchanged, scale_refused, replaced, replace_refused, request_refused).
// Every writer uses it: `troupe scale|replace <job id>` and `troupe drain` through the
// scheduler's store, `troupe scale|replace <run dir>` through the standalone launcher's
// store (a FileStore in <run dir>/rendezvous), the scheduler's health policy, and
// test.scale_at ("<step>:<dp>,...": scripted requests after given steps, answered to
// nobody).
// May call: the store through the polls it was given (one attempt each; nothing while the
// scheduler is out: the request waits for the next boundary). Acting on a request is
// membership's (Trainer::serve_requests, trainer_membership.cc), at a step boundary with
// nothing in flight.
// Invariants: requests are taken in the order of k, one per boundary, each answered once;
// an answer the store does not take is kept and sent again at the next boundary.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/status.h"

namespace troupe::training {

struct OperatorRequest {
  enum class Op { kScale, kReplace };
  Op op = Op::kScale;
  std::string text;   // what it asks for, as asked: the dp (kScale) or the slot (kReplace)
  std::string avoid;  // kReplace: an agent its replacement must not land on (troupe drain)
};

class OperatorRequests {
 public:
  // The store as the requests use it: key(rest) names "<job>/elastic/<rest>"; the polls
  // make one attempt; out() says the store is unreachable now (the scheduler restarting).
  struct Store {
    std::function<std::string(const std::string&)> key;
    std::function<Result<bool>(const std::string&)> contains;
    std::function<Result<std::string>(const std::string&)> get;
    std::function<Status(const std::string&, const std::string&)> set;
    std::function<bool()> out;
  };
  // `scale_at`: test.scale_at (validated by the config loader).
  OperatorRequests(Store store, const std::string& scale_at);

  // Whether test.scale_at asks for a rescale after `step` (the step window never
  // runs past it).
  bool scripted_after(int64_t step) const { return scripted_.count(step) != 0; }
  // Whether a request waits at the boundary after `step` (scripted, or in the store).
  bool waiting(int64_t step);
  // The next request at the boundary after `step`: the store's next one (a malformed one
  // is answered request_refused here and skipped), else the scripted one; nullopt when
  // none is left for this boundary. Call answer() for each before the next take().
  std::optional<OperatorRequest> take(int64_t step);
  // The outcome of the request last taken (an event the Trainer logged).
  void answer(nlohmann::json outcome);
  // Sends the answer of the store request taken last (after status.json shows the change).
  void send_answer();

 private:
  Store store_;
  std::map<int64_t, std::string> scripted_;  // step -> dp text (the last one given for a step)
  int64_t scripted_taken_ = -1;              // the boundary whose scripted request was taken
  int64_t next_ = 0;                         // the next store request's number
  bool from_store_ = false;                  // the request last taken came from the store
  std::optional<int64_t> unanswered_;        // the store request whose answer is not sent yet
  nlohmann::json answer_;
};

}  // namespace troupe::training
