// training/parallel/elastic_comm.cc — ElasticComm (a communicator with a replaceable
// backend), the process-wide "throw on data-plane error" switch, and the fault points
// with test.inject's parser (parse_faults).
#include "training/parallel/elastic_comm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <string>
#include <utility>

namespace troupe::training {

namespace {
std::atomic<bool> g_throw{false};
std::atomic<FaultHook> g_fault_hook{nullptr};
}  // namespace

void set_fault_hook(FaultHook hook) { g_fault_hook.store(hook); }
void fault_point(std::string_view what) {
  if (FaultHook h = g_fault_hook.load()) h(what);
}

namespace {
// test.inject's words: the actions and the phases (FaultSpec, elastic_comm.h).
constexpr std::pair<std::string_view, FaultSpec::Action> kFaultActions[] = {
    {"kill", FaultSpec::Action::kKill},      {"stop", FaultSpec::Action::kStop},
    {"slow", FaultSpec::Action::kSlow},      {"cut", FaultSpec::Action::kCut},
    {"hang", FaultSpec::Action::kHang},      {"cutctl", FaultSpec::Action::kCutControl},
    {"corrupt", FaultSpec::Action::kCorrupt}};
constexpr std::string_view kFaultPhases[] = {"forward", "alltoall",   "sync", "snapshot",
                                             "landing", "checkpoint", "any",  "start"};

template <typename Range, typename Name>
std::string word_list(const Range& r, Name name) {
  std::string out;
  for (const auto& w : r) out += (out.empty() ? "" : ", ") + std::string(name(w));
  return out;
}
}  // namespace

Result<std::vector<FaultSpec>> parse_faults(const std::string& spec) {
  std::vector<FaultSpec> out;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string::npos) comma = spec.size();
    const std::string item = spec.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) continue;
    FaultSpec f;
    const size_t at = item.find('@'), c1 = item.find(':'), c2 = item.rfind(':');
    if (at == std::string::npos || c1 == std::string::npos || c2 == c1 || c1 < at) {
      return invalid_argument("test.inject: '{}' is not <action>@<step>:<phase>:<slot>", item);
    }
    const std::string action = item.substr(0, at);
    const auto a = std::find_if(std::begin(kFaultActions), std::end(kFaultActions),
                                [&](const auto& e) { return e.first == action; });
    if (a == std::end(kFaultActions)) {
      return invalid_argument("test.inject: unknown action '{}' ({})", action,
                              word_list(kFaultActions, [](const auto& e) { return e.first; }));
    }
    f.action = a->second;
    f.phase = item.substr(c1 + 1, c2 - c1 - 1);
    if (std::find(std::begin(kFaultPhases), std::end(kFaultPhases), f.phase) == std::end(kFaultPhases)) {
      return invalid_argument("test.inject: unknown phase '{}' ({})", f.phase,
                              word_list(kFaultPhases, [](std::string_view w) { return w; }));
    }
    char* end = nullptr;
    const std::string step_s = item.substr(at + 1, c1 - at - 1), slot_s = item.substr(c2 + 1);
    f.step = std::strtoll(step_s.c_str(), &end, 10);
    const bool start = f.phase == "start";
    if (step_s.empty() || *end != '\0' || (start ? f.step != 0 : f.step < 1))
      return invalid_argument("test.inject: bad step in '{}' (phase start: step 0, else >= 1)", item);
    if (start && f.action != FaultSpec::Action::kSlow)
      return invalid_argument("test.inject: '{}': phase start takes only slow (slow@0:start:<slot>)", item);
    f.slot = static_cast<int>(std::strtol(slot_s.c_str(), &end, 10));
    if (slot_s.empty() || *end != '\0' || f.slot < 0)
      return invalid_argument("test.inject: bad slot in '{}'", item);
    out.push_back(f);
  }
  return out;
}

void set_throw_on_comm_error(bool on) { g_throw.store(on); }
bool throw_on_comm_error() { return g_throw.load(); }

Result<std::unique_ptr<ElasticComm>> ElasticComm::create(const comm::CommSpec& spec, comm::CommFactory factory) {
  std::unique_ptr<ElasticComm> c(new ElasticComm(spec, std::move(factory)));
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> inner, c->factory_(spec));
  c->inner_ = std::move(inner);
  return c;
}

std::shared_ptr<comm::Communicator> ElasticComm::inner() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inner_;
}

std::string_view ElasticComm::backend() const { return inner()->backend(); }
Device ElasticComm::device() const { return inner()->device(); }

comm::WorkPtr ElasticComm::all_reduce(Tensor tensor, comm::ReduceOp op, const comm::OpOptions& opts) {
  return inner()->all_reduce(std::move(tensor), op, opts);
}
comm::WorkPtr ElasticComm::reduce_scatter(Tensor input, Tensor output, comm::ReduceOp op,
                                          const comm::OpOptions& opts) {
  return inner()->reduce_scatter(std::move(input), std::move(output), op, opts);
}
comm::WorkPtr ElasticComm::all_gather(Tensor input, Tensor output, const comm::OpOptions& opts) {
  return inner()->all_gather(std::move(input), std::move(output), opts);
}
comm::WorkPtr ElasticComm::all_to_all(Tensor input, Tensor output, const comm::OpOptions& opts) {
  return inner()->all_to_all(std::move(input), std::move(output), opts);
}
comm::WorkPtr ElasticComm::all_to_all_v(Tensor input, std::vector<int64_t> send_counts, Tensor output,
                                        std::vector<int64_t> recv_counts, const comm::OpOptions& opts) {
  return inner()->all_to_all_v(std::move(input), std::move(send_counts), std::move(output), std::move(recv_counts),
                               opts);
}
comm::WorkPtr ElasticComm::send(Tensor tensor, int peer, const comm::OpOptions& opts) {
  return inner()->send(std::move(tensor), peer, opts);
}
comm::WorkPtr ElasticComm::recv(Tensor tensor, int peer, const comm::OpOptions& opts) {
  return inner()->recv(std::move(tensor), peer, opts);
}
comm::WorkPtr ElasticComm::broadcast(Tensor tensor, int root, const comm::OpOptions& opts) {
  return inner()->broadcast(std::move(tensor), root, opts);
}
comm::WorkPtr ElasticComm::barrier(const comm::OpOptions& opts) { return inner()->barrier(opts); }
comm::WorkPtr ElasticComm::fence(const comm::OpOptions& opts) {
  return inner()->fence(opts);
}

void ElasticComm::abort(std::string_view reason) { inner()->abort(reason); }
Status ElasticComm::health() const { return inner()->health(); }

Status ElasticComm::rebuild(const comm::StoreNamespace& ns) {
  std::shared_ptr<comm::Communicator> old = inner();
  old->abort("rebuilding in a new epoch");
  comm::CommSpec spec = spec_;
  spec.ns = ns;
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> fresh, factory_(spec));
  std::lock_guard<std::mutex> lock(mu_);
  inner_ = std::move(fresh);
  spec_ = spec;
  generation_.fetch_add(1);
  return ok_status();
}

}  // namespace troupe::training
