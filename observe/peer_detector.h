// observe/peer_detector.h — defines PeerDetector: the faulty-machine detector of one job,
// in the manner of Minder (NSDI '25): every health metric of every worker is compared
// with the same metric of its peers in the job, and a worker is flagged only when its
// deviation persists.
//
// Each evaluation (every `eval_interval_s`), for each metric: the workers' latest values
// are normalised by the job's robust spread (1.4826 x the median absolute deviation,
// floored per metric so that identical peers do not turn noise into outliers), a worker's
// score is the median of its distances to each peer in those units (the sign checked
// against the metric's bad direction), and it deviates when the score reaches
// `z_threshold` while no more than `max_outlier_fraction` of the job deviates at once (a
// job-wide change is no machine's fault). It is flagged when it deviated in at least
// `persist` of the last `window` evaluations, the latest included (continuity). Heartbeat
// evidence: a worker whose reports stopped for `silence_s` while its peers' arrive
// deviates on the pseudo-metric "report_gap_s". A flagged (worker, metric) is cleared after
// `window` evaluations without deviation.
//
// Every threshold is in DetectorOptions, with its default there and in docs/elastic.md;
// DetectorOptions::set takes them as "key=value" (troupe-scheduler --detector).
//
// Threading: one thread (the scheduler's loop). Time is passed in (tests drive it).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "observe/metric.h"

namespace troupe::observe {

struct MetricRule {
  double abs_floor = 0;  // the spread is at least this (the metric's unit) ...
  double rel_floor = 0;  // ... and at least this share of the job's median
  int direction = 1;     // +1: high is bad, -1: low is bad, 0: either
};

struct DetectorOptions {
  double z_threshold = 4.0;  // distance to the peers, in spread units, that counts as deviating
  int window = 5;            // evaluations in the sliding window
  int persist = 3;           // deviating evaluations in the window (the latest one included) to flag
  int min_workers = 4;       // fewer workers reporting: no verdict
  double max_outlier_fraction = 0.25;  // more of the job deviating at once on a metric: no verdict on it
  double silence_s = 1.5;              // reports missing this long while the peers' arrive: deviating
  double eval_interval_s = 0.5;        // evaluations (each report still counts once)
  // The metrics judged and their rules; others are reported but not judged.
  std::map<std::string, MetricRule> rules = default_rules();

  static std::map<std::string, MetricRule> default_rules();
  // "z_threshold=5", "persist=2", "proc_cpu.abs_floor=0.2", "gpu_temp_c.direction=1",
  // "step_io_ms.off=1" (stop judging a metric), "host_cpu_steal.on=1" (judge one with
  // default floors). An unknown key or a bad value is an error naming it.
  Status set(const std::string& key_value);
  Status validate() const;
  std::string describe() const;  // one line, for logs
};

// One flag (or its clearing) for the caller to act on.
struct Verdict {
  std::string worker;
  std::string node;
  std::string metric;
  double value = 0;                // the worker's latest value
  double peer_median = 0;          // the job's median
  double score = 0;                // distance in spread units
  bool cleared = false;            // true: the worker no longer deviates on the metric
  int64_t first_deviation_ms = 0;  // wall time of the first deviating evaluation of this episode
};

class PeerDetector {
 public:
  using Clock = std::chrono::steady_clock;
  explicit PeerDetector(DetectorOptions o) : o_(std::move(o)) {}

  // A worker's report, arrived at `now` (`wall_ms` for the verdicts' times).
  void report(const std::string& worker, const std::string& node, const std::vector<Metric>& metrics,
              Clock::time_point now);
  // The worker left the job (exited, replaced): forgotten.
  void forget(const std::string& worker);
  // Runs the evaluations due by `now` and returns the new flags and clearings.
  std::vector<Verdict> evaluate(Clock::time_point now, int64_t wall_ms);
  // Flagged (worker, metric) pairs now.
  const std::set<std::pair<std::string, std::string>>& flagged() const { return flagged_; }
  const DetectorOptions& options() const { return o_; }

 private:
  struct Worker {
    std::string node;
    Clock::time_point last_report{};
    uint64_t seq = 0;                             // reports received
    std::map<std::string, uint64_t> counted_seq;  // per metric: the report last counted
    Clock::time_point gap_counted{};              // report_gap_s: last counted
    std::map<std::string, double> latest;
    // per metric: the last `window` evaluations, deviating or not (front: the oldest)
    std::map<std::string, std::deque<bool>> history;
    std::map<std::string, int64_t> first_dev_ms;
  };
  void evaluate_once(Clock::time_point now, int64_t wall_ms, std::vector<Verdict>& out);
  void note(Worker& w, const std::string& name, const std::string& metric, bool deviating, double value,
            double median, double score, int64_t wall_ms, std::vector<Verdict>& out);

  DetectorOptions o_;
  std::map<std::string, Worker> workers_;
  std::set<std::pair<std::string, std::string>> flagged_;
  Clock::time_point next_eval_{};
};

}  // namespace troupe::observe
