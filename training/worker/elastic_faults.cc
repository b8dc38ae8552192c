// training/worker/elastic_faults.cc — test.inject: parsing the fault specs and the
// hook that fires them at the comm layer's fault points (elastic_faults.h).
#include "training/worker/elastic_faults.h"

#include <fmt/format.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

namespace troupe::training {

FaultState* g_faults = nullptr;

namespace {

bool phase_matches(const std::string& phase, std::string_view what) {
  // "any" is the points a step meets; a snapshot's landing (on its own thread, while the
  // next step runs) is named only by its own phase.
  if (phase == "any") return what.rfind("landing of step", 0) != 0;
  if (phase == "forward") return what.rfind("ulysses seq->head", 0) == 0;
  if (phase == "alltoall") return what.rfind("expert dispatch", 0) == 0;
  if (phase == "sync") return what.rfind("grads", 0) == 0 || what.rfind("bf16 grads", 0) == 0;
  if (phase == "checkpoint") return what.rfind("checkpoint write", 0) == 0;
  if (phase == "snapshot") return what.rfind("snapshot of step", 0) == 0;
  if (phase == "landing") return what.rfind("landing of step", 0) == 0;
  return false;
}

// The step a fault point belongs to: the step thread's, except for the points of the
// snapshot and writer threads (a snapshot's landing, a checkpoint's write run while later
// steps do, and a snapshot's point is met after the next step may have been launched
// ahead), which name their own step.
int64_t point_step(const FaultState& fs, std::string_view what) {
  for (const std::string_view own :
       {std::string_view("checkpoint write of step "), std::string_view("snapshot of step "),
        std::string_view("landing of step ")}) {
    if (what.rfind(own, 0) == 0)
      return std::strtoll(std::string(what.substr(own.size())).c_str(), nullptr, 10);
  }
  return fs.step.load();
}

}  // namespace

void fault_hook(std::string_view what) {
  FaultState* fs = g_faults;
  if (fs == nullptr) return;
  for (size_t i = 0; i < fs->specs.size(); ++i) {
    const FaultSpec& f = fs->specs[i];
    const int64_t at = point_step(*fs, what);
    if (f.action == FaultSpec::Action::kSlow) {
      if (f.slot == fs->slot && at >= f.step && fs->slowed_step[i] != at && phase_matches(f.phase, what)) {
        fs->slowed_step[i] = at;
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
      }
      continue;
    }
    if (fs->fired[i] || f.slot != fs->slot || f.step != at || !phase_matches(f.phase, what)) continue;
    fs->fired[i] = true;
    const char* name = f.action == FaultSpec::Action::kKill      ? "SIGKILL"
                       : f.action == FaultSpec::Action::kStop    ? "SIGSTOP"
                       : f.action == FaultSpec::Action::kCut     ? "a data-plane cut"
                       : f.action == FaultSpec::Action::kHang    ? "a hang"
                       : f.action == FaultSpec::Action::kCorrupt ? "a damaged snapshot part"
                                                                 : "a control-connection cut";
    // The driver measures detection from the record's time, so nothing slow may lie between
    // that time and the fault: the log line goes first (a write to a file on a busy disk can
    // block for seconds), and a record whose store took long (a busy scheduler's durable
    // write) is stored again with the time it was stored, which is when the fault happens.
    fmt::print(stderr, "elastic: slot {} injects {} at step {} during '{}'\n", fs->slot, name, f.step, what);
    std::fflush(stderr);
    const std::string key = elastic_key(fs->job, fmt::format("fault/{}", fs->slot));
    auto record = [&](int64_t ts_ms) {
      (void)fs->store->set(
          key, nlohmann::json{{"ts_ms", ts_ms}, {"what", std::string(what)}, {"step", f.step}}.dump());
    };
    const int64_t fault_ms = wall_ms();
    record(fault_ms);
    if (const int64_t stored_ms = wall_ms(); stored_ms - fault_ms > 20) record(stored_ms);
    switch (f.action) {
      case FaultSpec::Action::kKill:
        raise(SIGKILL);
        break;
      case FaultSpec::Action::kStop:
        raise(SIGSTOP);
        break;
      case FaultSpec::Action::kCut:
        if (fs->cut) fs->cut();
        break;
      case FaultSpec::Action::kCutControl:
        if (fs->cut_control) fs->cut_control();
        break;
      case FaultSpec::Action::kCorrupt:
        if (fs->corrupt) fs->corrupt();
        break;
      case FaultSpec::Action::kHang:
        while (true) std::this_thread::sleep_for(std::chrono::seconds(1));  // until killed
      case FaultSpec::Action::kSlow:
        break;
    }
  }
}
}  // namespace troupe::training
