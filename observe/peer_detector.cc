// observe/peer_detector.cc — PeerDetector and DetectorOptions (peer_detector.h).
#include "observe/peer_detector.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace troupe::observe {

namespace {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t m = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(m), v.end());
  double hi = v[m];
  if (v.size() % 2 == 1) return hi;
  const double lo = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(m));
  return (lo + hi) / 2;
}

Result<double> parse_double(const std::string& key, const std::string& v) {
  try {
    size_t used = 0;
    const double d = std::stod(v, &used);
    if (used != v.size() || !std::isfinite(d)) throw std::invalid_argument(v);
    return d;
  } catch (...) {
    return invalid_argument("detector: '{}' needs a number (got '{}')", key, v);
  }
}

constexpr const char* kReportGap = "report_gap_s";
constexpr size_t kPairwiseLimit = 64;  // larger jobs: distance to the median instead of to each peer

}  // namespace

std::map<std::string, MetricRule> DetectorOptions::default_rules() {
  // Floors: the least spread a metric is judged with (its unit), and the least share of
  // the job's median; a worker must be z_threshold of these from its peers.
  return {
      {"proc_run_delay", {0.05, 0.25, +1}},    // s/s waiting for a CPU
      {"proc_throttled", {0.05, 0.25, +1}},    // s/s throttled by the cgroup's quota
      {"proc_cpu", {0.10, 0.30, 0}},           // CPUs used
      {"proc_blkio_delay", {0.05, 0.50, +1}},  // s/s waiting for block I/O
      {"step_compute_ms", {5.0, 0.25, +1}},    // compute per step
      {"step_io_ms", {20.0, 0.50, +1}},        // checkpoint write time
      {"host_tcp_retrans_per_s", {0.5, 0.50, +1}},
      {"host_cpu_steal", {0.05, 0.50, +1}},
      {"gpu_sm_clock_mhz", {50.0, 0.05, -1}},
      {"gpu_temp_c", {5.0, 0.05, +1}},
      {"gpu_util", {0.10, 0.10, -1}},
      {"gpu_ecc_uncorrected", {0.5, 0.0, +1}},
      {"gpu_xid_errors", {0.5, 0.0, +1}},
      {"gpu_throttle_reasons", {0.5, 0.0, 0}},
  };
}

Status DetectorOptions::set(const std::string& key_value) {
  const size_t eq = key_value.find('=');
  if (eq == std::string::npos || eq == 0)
    return invalid_argument("detector: '{}' is not key=value (e.g. z_threshold=5)", key_value);
  const std::string key = key_value.substr(0, eq), val = key_value.substr(eq + 1);
  TROUPE_ASSIGN_OR_RETURN(double d, parse_double(key, val));
  if (key == "z_threshold")
    z_threshold = d;
  else if (key == "window")
    window = static_cast<int>(d);
  else if (key == "persist")
    persist = static_cast<int>(d);
  else if (key == "min_workers")
    min_workers = static_cast<int>(d);
  else if (key == "max_outlier_fraction")
    max_outlier_fraction = d;
  else if (key == "silence_s")
    silence_s = d;
  else if (key == "eval_interval_s")
    eval_interval_s = d;
  else {
    const size_t dot = key.rfind('.');
    const std::string metric = dot == std::string::npos ? "" : key.substr(0, dot);
    const std::string field = dot == std::string::npos ? "" : key.substr(dot + 1);
    if (metric.empty() || (metric != kReportGap && find_metric_info(metric) == nullptr)) {
      return invalid_argument(
          "detector: unknown key '{}' (z_threshold, window, persist, min_workers, max_outlier_fraction, "
          "silence_s, eval_interval_s, or <metric>.abs_floor|rel_floor|direction|on|off)",
          key);
    }
    MetricRule& r = rules.try_emplace(metric, MetricRule{0, 0.25, +1}).first->second;
    if (field == "abs_floor")
      r.abs_floor = d;
    else if (field == "rel_floor")
      r.rel_floor = d;
    else if (field == "direction")
      r.direction = static_cast<int>(d);
    else if (field == "off" && d != 0)
      rules.erase(metric);
    else if (field == "on" || field == "off") {
    } else {
      return invalid_argument("detector: '{}': a metric takes abs_floor, rel_floor, direction, on or off",
                              key);
    }
  }
  return validate();
}

Status DetectorOptions::validate() const {
  if (!(z_threshold > 0)) return invalid_argument("detector: z_threshold must be > 0 (got {})", z_threshold);
  if (window < 1) return invalid_argument("detector: window must be >= 1 (got {})", window);
  if (persist < 1 || persist > window)
    return invalid_argument("detector: persist must be in 1..window ({}) (got {})", window, persist);
  if (min_workers < 3) return invalid_argument("detector: min_workers must be >= 3 (got {})", min_workers);
  if (!(max_outlier_fraction > 0 && max_outlier_fraction < 0.5))
    return invalid_argument("detector: max_outlier_fraction must be in (0, 0.5) (got {})",
                            max_outlier_fraction);
  if (!(silence_s > 0)) return invalid_argument("detector: silence_s must be > 0 (got {})", silence_s);
  if (!(eval_interval_s > 0))
    return invalid_argument("detector: eval_interval_s must be > 0 (got {})", eval_interval_s);
  for (const auto& [m, r] : rules) {
    if (r.abs_floor < 0 || r.rel_floor < 0 || (r.abs_floor == 0 && r.rel_floor == 0))
      return invalid_argument("detector: {}: abs_floor and rel_floor must be >= 0 and not both 0", m);
    if (r.direction < -1 || r.direction > 1)
      return invalid_argument("detector: {}.direction must be -1, 0 or 1", m);
  }
  return ok_status();
}

std::string DetectorOptions::describe() const {
  return fmt::format(
      "z_threshold {} window {} persist {} min_workers {} max_outlier_fraction {} silence_s {} ({} metrics)",
      z_threshold, window, persist, min_workers, max_outlier_fraction, silence_s, rules.size());
}

void PeerDetector::report(const std::string& worker, const std::string& node,
                          const std::vector<Metric>& metrics, Clock::time_point now) {
  Worker& w = workers_[worker];
  w.node = node;
  w.last_report = now;
  ++w.seq;
  w.latest.clear();
  for (const Metric& m : metrics) {
    if (std::isfinite(m.value)) w.latest[m.name] = m.value;
  }
}

void PeerDetector::forget(const std::string& worker) {
  workers_.erase(worker);
  for (auto it = flagged_.begin(); it != flagged_.end();)
    it = it->first == worker ? flagged_.erase(it) : std::next(it);
}

std::vector<Verdict> PeerDetector::evaluate(Clock::time_point now, int64_t wall_ms) {
  std::vector<Verdict> out;
  const auto interval =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.eval_interval_s));
  if (next_eval_ == Clock::time_point{}) next_eval_ = now + interval;
  if (now < next_eval_) return out;
  evaluate_once(now, wall_ms, out);
  next_eval_ += interval;
  if (next_eval_ <= now) next_eval_ = now + interval;  // behind: evaluate once, not to catch up
  return out;
}

void PeerDetector::note(Worker& w, const std::string& name, const std::string& metric, bool deviating,
                        double value, double median, double score, int64_t wall_ms,
                        std::vector<Verdict>& out) {
  std::deque<bool>& h = w.history[metric];
  h.push_back(deviating);
  while (static_cast<int>(h.size()) > o_.window) h.pop_front();
  const int count = static_cast<int>(std::count(h.begin(), h.end(), true));
  if (deviating && !w.first_dev_ms.count(metric)) w.first_dev_ms[metric] = wall_ms;
  if (count == 0) w.first_dev_ms.erase(metric);
  const auto key = std::make_pair(name, metric);
  const bool was = flagged_.count(key) > 0;
  if (!was && deviating && count >= o_.persist) {
    flagged_.insert(key);
    out.push_back({name, w.node, metric, value, median, score, false, w.first_dev_ms[metric]});
  } else if (was && count == 0 && static_cast<int>(h.size()) == o_.window) {
    flagged_.erase(key);
    out.push_back({name, w.node, metric, value, median, score, true, 0});
  }
}

void PeerDetector::evaluate_once(Clock::time_point now, int64_t wall_ms, std::vector<Verdict>& out) {
  if (static_cast<int>(workers_.size()) < o_.min_workers) return;
  std::vector<std::string> fresh;
  std::vector<double> ages;
  for (const auto& [name, w] : workers_) {
    const double age = std::chrono::duration<double>(now - w.last_report).count();
    ages.push_back(age);
    if (age < o_.silence_s) fresh.push_back(name);
  }
  // Heartbeat evidence, while most of the job reports (else the silence is not one
  // machine's: the scheduler stalled, or every worker waits on one that is judged below).
  if (fresh.size() * 2 > workers_.size()) {
    const double med_age = median_of(ages);
    for (auto& [name, w] : workers_) {
      if (now - w.gap_counted < std::chrono::milliseconds(950)) continue;  // once a second
      w.gap_counted = now;
      const double age = std::chrono::duration<double>(now - w.last_report).count();
      note(w, name, kReportGap, age >= o_.silence_s, age, med_age, age, wall_ms, out);
    }
  }
  if (static_cast<int>(fresh.size()) < o_.min_workers) return;
  for (const auto& [metric, rule] : o_.rules) {
    std::vector<std::string> names;
    std::vector<double> xs;
    for (const std::string& n : fresh) {
      const auto& lat = workers_[n].latest;
      if (auto it = lat.find(metric); it != lat.end()) names.push_back(n), xs.push_back(it->second);
    }
    const size_t n = xs.size();
    if (static_cast<int>(n) < o_.min_workers) continue;
    const double med = median_of(xs);
    std::vector<double> dev(n);
    for (size_t i = 0; i < n; ++i) dev[i] = std::fabs(xs[i] - med);
    const double spread =
        std::max({1.4826 * median_of(dev), rule.abs_floor, rule.rel_floor * std::fabs(med)});
    std::vector<double> score(n, 0.0);
    for (size_t i = 0; i < n; ++i) {
      const double signed_dev = xs[i] - med;
      if ((rule.direction > 0 && signed_dev <= 0) || (rule.direction < 0 && signed_dev >= 0)) continue;
      if (n <= kPairwiseLimit) {
        std::vector<double> d;
        d.reserve(n - 1);
        for (size_t j = 0; j < n; ++j) {
          if (j != i) d.push_back(std::fabs(xs[i] - xs[j]) / spread);
        }
        score[i] = median_of(std::move(d));
      } else {
        score[i] = std::fabs(signed_dev) / spread;
      }
    }
    const size_t deviating = static_cast<size_t>(
        std::count_if(score.begin(), score.end(), [&](double s) { return s >= o_.z_threshold; }));
    // A change shared by much of the job (a phase of training, the network as a whole) is
    // not one machine's: no verdict on this metric now.
    if (static_cast<double>(deviating) > o_.max_outlier_fraction * static_cast<double>(n)) continue;
    for (size_t i = 0; i < n; ++i) {
      Worker& w = workers_[names[i]];
      uint64_t& counted = w.counted_seq[metric];
      if (counted == w.seq) continue;  // this report was counted already
      counted = w.seq;
      note(w, names[i], metric, score[i] >= o_.z_threshold, xs[i], med, score[i], wall_ms, out);
    }
  }
}

}  // namespace troupe::observe
