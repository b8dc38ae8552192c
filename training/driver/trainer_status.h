// training/driver/trainer_status.h — the Trainer's reporting parts: EventLog (the job's
// events.jsonl, which every part writes) and StragglerTracker (ranks slower than their
// peers, from the step replies). status.json is Trainer::write_status (trainer_status.cc).
//
// Owns: the events file, the straggler streaks and flags.
// May call: RunMetrics (each event also goes to TensorBoard/Prometheus). Never changes
// membership: a straggler to replace comes back to the step driver, which acts on it.
// Invariants: every event carries its wall time (ts_ms) and is flushed at once (a crash
// loses none); a slot is flagged once.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "training/run_config.h"

namespace troupe::training {

class RunMetrics;

// <run dir>/events.jsonl: one JSON object a line, also handed to the run's exporters. The
// driver's thread only.
class EventLog {
 public:
  // Appends (a resumed run's record goes on) or starts the file anew.
  Status open(const std::string& path, bool append);
  bool is_open() const { return out_.is_open(); }
  void set_metrics(RunMetrics* m) { metrics_ = m; }
  void event(nlohmann::json e);

 private:
  std::ofstream out_;
  RunMetrics* metrics_ = nullptr;
};

// A rank whose compute time exceeds elastic.straggler_ratio times the median of its peers
// (and by more than 20 ms) for elastic.straggler_window consecutive steps is flagged
// (event, console, status.json).
class StragglerTracker {
 public:
  StragglerTracker(const layers::ElasticOptions& eo, EventLog& log)
      : ratio_(eo.straggler_ratio),
        window_(static_cast<int>(eo.straggler_window)),
        replace_(eo.straggler_policy == "replace"),
        log_(log) {}
  // Step `step`'s replies, by rank (slots[r] hosts rank r). With straggler_policy
  // "replace": the first slot newly flagged, to be replaced.
  std::optional<int> track(const std::vector<nlohmann::json>& replies, const std::vector<int>& slots,
                           int64_t step);
  bool flagged(int slot) const { return flagged_.count(slot) > 0; }

 private:
  double ratio_;
  int window_;
  bool replace_;
  EventLog& log_;
  std::map<int, int> slow_streak_;  // consecutive slow steps, by slot
  std::set<int> flagged_;
};

}  // namespace troupe::training
