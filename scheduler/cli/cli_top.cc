// scheduler/cli/cli_top.cc — `troupe top` (cli_top.h): reads a run directory's metrics,
// status and events (and a scheduler job's record) and draws one frame of text.
#include "scheduler/cli/cli_top.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "scheduler/cli/cli_elastic.h"
#include "scheduler/cli/cli_health.h"

namespace troupe::sched {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The JSON objects of the last `max_bytes` of a .jsonl file (a partial first line and
// lines that do not parse — one being written — are skipped).
std::vector<json> tail_jsonl(const std::string& path, std::streamoff max_bytes = 256 * 1024) {
  std::vector<json> out;
  std::ifstream in(path, std::ios::binary);
  if (!in) return out;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff from = std::max<std::streamoff>(0, size - max_bytes);
  in.seekg(from);
  std::string line;
  if (from > 0) std::getline(in, line);  // the rest of a cut line
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    if (j.is_object()) out.push_back(std::move(j));
  }
  return out;
}

std::string fmt_num(const json& r, const char* key, const char* spec_fmt) {
  if (!r.contains(key) || !r[key].is_number()) return "-";
  return fmt::format(fmt::runtime(spec_fmt), r[key].get<double>());
}

std::string seconds_ago(int64_t then_ms) {
  if (then_ms <= 0) return "-";
  const int64_t s = std::max<int64_t>(0, (now_ms() - then_ms) / 1000);
  if (s < 120) return fmt::format("{}s ago", s);
  if (s < 7200) return fmt::format("{}m ago", s / 60);
  return fmt::format("{}h ago", s / 3600);
}

int64_t mtime_ms(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
}

std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows) {
    if (w.size() < r.size()) w.resize(r.size(), 0);
    for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    std::string line = "  ";
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(w[i] - r[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

// The metrics section: the newest training record, the newest validation loss, the mean
// throughput over the last steps.
std::string metrics_section(const std::string& run_dir) {
  const std::string path = run_dir + "/metrics.jsonl";
  const std::vector<json> recs = tail_jsonl(path);
  if (recs.empty()) return fmt::format("metrics: none yet ({} is missing or empty)\n", path);
  const json* last = nullptr;
  const json* val = nullptr;
  std::vector<const json*> steps;
  for (const auto& r : recs) {
    if (r.contains("loss")) {
      last = &r;
      steps.push_back(&r);
    }
    if (r.contains("val_loss")) val = &r;
  }
  std::string out;
  if (last == nullptr) {
    out += fmt::format("step {} (no training step yet)", val ? val->value("step", int64_t{0}) : 0);
  } else {
    const json& r = *last;
    double tps_sum = 0;
    int n = 0;
    for (size_t i = steps.size() > 10 ? steps.size() - 10 : 0; i < steps.size(); ++i) {
      if (steps[i]->contains("tokens_per_s")) tps_sum += (*steps[i])["tokens_per_s"].get<double>(), ++n;
    }
    double trend = 0;
    const json& first = *steps[steps.size() > 10 ? steps.size() - 10 : 0];
    trend = r["loss"].get<double>() - first["loss"].get<double>();
    out += fmt::format("step {}  loss {}  ({:+.4f} over the last {} steps)  lr {}  grad_norm {}\n",
                       r.value("step", int64_t{0}), fmt_num(r, "loss", "{:.4f}"), trend,
                       std::min<size_t>(steps.size(), 10) - 1, fmt_num(r, "lr", "{:.2e}"),
                       fmt_num(r, "grad_norm", "{:.3f}"));
    out += fmt::format("tokens/s {} (mean of last {}: {:.0f})  tokens {}", fmt_num(r, "tokens_per_s", "{:.0f}"), n,
                       n ? tps_sum / n : 0.0, r.value("tokens", int64_t{0}));
    if (r.contains("mfu")) out += fmt::format("  mfu {:.1f}%", 100.0 * r["mfu"].get<double>());
    if (r.contains("dp")) out += fmt::format("  dp {}", r["dp"].get<int64_t>());
    out += "\n";
    out += fmt::format("step {} ms", fmt_num(r, "step_ms", "{:.1f}"));
    if (r.contains("driver_step_ms")) out += fmt::format(" (driver {} ms)", fmt_num(r, "driver_step_ms", "{:.1f}"));
    if (r.contains("compute_ms")) {
      out += fmt::format("  rank 0: compute {} ms, comm {} ms  comm mean over ranks {} ms",
                         fmt_num(r, "compute_ms", "{:.1f}"), fmt_num(r, "comm_ms", "{:.1f}"),
                         fmt_num(r, "comm_ms_mean", "{:.1f}"));
    }
    if (r.contains("load_imbalance")) out += fmt::format("  expert load max/mean {}", fmt_num(r, "load_imbalance", "{:.2f}"));
    out += "\n";
  }
  if (val != nullptr) out += fmt::format("val_loss {} at step {}", fmt_num(*val, "val_loss", "{:.4f}"), val->value("step", int64_t{0}));
  const json* ck = nullptr;
  for (const auto& r : recs) {
    if (r.contains("ckpt_stall_ms")) ck = &r;
  }
  if (ck != nullptr) {
    out += fmt::format("{}last checkpoint save at step {} (stall {} ms)", val ? "  " : "",
                       ck->value("step", int64_t{0}), fmt_num(*ck, "ckpt_stall_ms", "{:.1f}"));
  }
  if (val != nullptr || ck != nullptr) out += "\n";
  out += fmt::format("metrics.jsonl updated {}\n", seconds_ago(mtime_ms(path)));
  return out;
}

// Workers of an elastic job (status.json or the driver's store key).
std::string workers_section(const json& st, const std::string& from) {
  std::string out = fmt::format("workers ({}): epoch {}, dp {} (grad_accum {}), {} recoveries{}\n", from,
                                st.value("epoch", int64_t{0}), st.value("dp", int64_t{0}),
                                st.value("grad_accum", int64_t{0}), st.value("recoveries", int64_t{0}),
                                st.value("failed", false) ? ", FAILED" : "");
  std::vector<std::vector<std::string>> rows = {{"SLOT", "RANK", "PID", "ALIVE", "STEP_MS", "COMPUTE_MS", "COMM_MS", "FLAGS"}};
  int stragglers = 0;
  for (const auto& w : st.value("workers", json::array())) {
    const bool slow = w.value("straggler", false);
    stragglers += slow ? 1 : 0;
    rows.push_back({std::to_string(w.value("slot", -1)), std::to_string(w.value("rank", -1)),
                    std::to_string(w.value("pid", -1)), w.value("alive", false) ? "yes" : "NO",
                    fmt_num(w, "step_ms", "{:.1f}"), fmt_num(w, "compute_ms", "{:.1f}"), fmt_num(w, "comm_ms", "{:.1f}"),
                    slow ? "STRAGGLER" : ""});
  }
  out += table(rows);
  if (stragglers > 0) out += fmt::format("  {} straggler(s) flagged\n", stragglers);
  return out;
}

// "12:03:04 failure_detected cause=exit slots=[1]" from an event of either log.
std::string event_line(const json& e) {
  const int64_t ts = e.value("ts_ms", int64_t{0});
  const std::time_t t = static_cast<std::time_t>(ts / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::string name = e.value("event", e.value("type", std::string("?")));
  std::string fields;
  for (auto it = e.begin(); it != e.end(); ++it) {
    const std::string& k = it.key();
    if (k == "event" || k == "type" || k == "ts" || k == "ts_ms" || k == "job" || k == "plan") continue;
    std::string v = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
    if (v.size() > 60) v = v.substr(0, 57) + "...";
    fields += fmt::format(" {}={}", k, v);
  }
  std::string line = fmt::format("{:02}:{:02}:{:02} {}{}", tm.tm_hour, tm.tm_min, tm.tm_sec, name, fields);
  if (line.size() > 150) line = line.substr(0, 147) + "...";
  return line;
}

bool is_alert(const std::string& name) {
  return name.find("fail") != std::string::npos || name.find("killed") != std::string::npos ||
         name.find("timeout") != std::string::npos || name.find("lost") != std::string::npos ||
         name == "straggler" || name.find("restarting") != std::string::npos || name == "health_flag";
}

}  // namespace

std::string job_run_dir(const json& job) {
  const std::vector<std::string> argv = job.value("argv", std::vector<std::string>{});
  std::string run_dir, config;
  for (size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == "--run-dir") run_dir = argv[i + 1];
    if (argv[i] == "--config") config = argv[i + 1];
  }
  if (run_dir.empty() && !config.empty()) run_dir = "runs/" + fs::path(config).stem().string();
  const std::string work = job.value("work_dir", "");
  if (!run_dir.empty() && fs::path(run_dir).is_relative() && !work.empty()) run_dir = (fs::path(work) / run_dir).string();
  return run_dir;
}

std::string render_top_frame(const std::string& title, const std::string& run_dir, const json* job,
                             const std::optional<json>& elastic, int max_events) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::string out = fmt::format("troupe top — {}   {:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC\n", title, tm.tm_year + 1900,
                                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
  std::vector<json> events;
  if (job != nullptr) {
    const json& j = *job;
    out += fmt::format("job {}  {}  workers {}/{}  epoch {}  restarts {}/{}  layout {}{}\n", j.value("id", ""),
                       j.value("state", ""), j.value("running_workers", 0), j.value("nproc", 0), j.value("epoch", 0),
                       j.value("restarts", 0), j.value("max_restarts", 0), j.value("layout", ""),
                       j.value("elastic", false) ? "  elastic" : "");
    if (!j.value("message", "").empty()) out += fmt::format("  {}\n", j.value("message", ""));
    std::vector<std::vector<std::string>> rows = {{"PROCESS", "RANK", "AGENT", "PID", "STATE", "HEARTBEAT"}};
    for (const auto& p : j.value("procs", json::array())) {
      if (p.value("epoch", 0) != j.value("epoch", 0)) continue;  // earlier epochs: see the events
      rows.push_back({p.value("name", ""), p.value("rank", -1) < 0 ? "-" : std::to_string(p.value("rank", -1)),
                      p.value("agent", ""), p.value("pid", 0) ? std::to_string(p.value("pid", 0)) : "-",
                      p.value("state", ""), p.value("heartbeating", false) ? "yes" : "-"});
    }
    if (rows.size() > 1) out += table(rows);
    if (j.contains("health")) {
      const std::string h = render_health_table(j["health"]);
      if (!h.empty()) out += h;
    }
    const std::string jd = j.value("job_dir", "");
    if (!jd.empty()) {
      for (auto& e : tail_jsonl(jd + "/events.jsonl")) events.push_back(std::move(e));
    }
  }
  out += "\n";
  if (run_dir.empty()) {
    out += "run directory: unknown (the job's command names no --run-dir or --config)\n";
  } else {
    out += fmt::format("run directory {}\n", run_dir);
    out += metrics_section(run_dir);
    std::ifstream sin(run_dir + "/status.json");
    const json st = json::parse(sin, nullptr, false);
    if (st.is_object()) {
      out += "\n" + workers_section(st, "status.json");
    } else if (elastic) {
      out += "\n" + workers_section(*elastic, "the driver's store");
    }
    for (auto& e : tail_jsonl(run_dir + "/events.jsonl")) events.push_back(std::move(e));
  }
  if (run_dir.empty() && elastic) out += "\n" + workers_section(*elastic, "the driver's store");
  std::stable_sort(events.begin(), events.end(),
                   [](const json& a, const json& b) { return a.value("ts_ms", int64_t{0}) < b.value("ts_ms", int64_t{0}); });
  int failures = 0, recoveries = 0;
  for (const auto& e : events) {
    const std::string name = e.value("event", e.value("type", std::string()));
    if (name == "failure_detected" || (name == "proc_exited" && e.value("exit_status", 0) != 0)) ++failures;
    if (name == "recovered" || name == "job_restarting") ++recoveries;
  }
  out += fmt::format("\nrecent events ({} shown of {}; {} failures, {} recoveries/restarts):\n",
                     std::min<size_t>(events.size(), static_cast<size_t>(std::max(0, max_events))), events.size(),
                     failures, recoveries);
  const size_t from = events.size() > static_cast<size_t>(std::max(0, max_events)) ? events.size() - max_events : 0;
  for (size_t i = from; i < events.size(); ++i) {
    const std::string name = events[i].value("event", events[i].value("type", std::string()));
    out += fmt::format("  {} {}\n", is_alert(name) ? "!" : " ", event_line(events[i]));
  }
  if (events.empty()) out += "  (none)\n";
  return out;
}

int cli_top(const CliConnection& c, const TopOptions& o) {
  if (o.target.empty()) {
    std::fprintf(stderr, "troupe top: give a job id or a run directory\n");
    return 2;
  }
  if (!(o.interval_s > 0)) {
    std::fprintf(stderr, "troupe top: --interval must be > 0 seconds\n");
    return 2;
  }
  std::error_code ec;
  const bool is_dir = fs::is_directory(o.target, ec);
  if (is_dir) {
    const bool any = fs::exists(o.target + "/metrics.jsonl", ec) || fs::exists(o.target + "/events.jsonl", ec) ||
                     fs::exists(o.target + "/status.json", ec);
    if (!any) {
      std::fprintf(stderr,
                   "troupe top: %s is not a train_moe run directory (no metrics.jsonl, events.jsonl or status.json)\n",
                   o.target.c_str());
      return 3;
    }
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  while (true) {
    std::string frame;
    bool ended = false;
    if (is_dir) {
      frame = render_top_frame(o.target, o.target, nullptr, std::nullopt, o.events);
    } else {
      Result<json> job = fetch_job_status(c, o.target);
      if (!job.ok()) {
        const bool nf = job.status().code() == StatusCode::kNotFound;
        std::fprintf(stderr, "troupe top: %s%s\n", job.status().message().c_str(),
                     nf ? " (give a job id from `troupe status`, or a run directory)" : "");
        return nf ? 3 : 4;
      }
      std::optional<json> elastic;
      if (job->value("elastic", false)) elastic = elastic_job_status(c, o.target);
      const std::string state = job->value("state", "");
      ended = state == "succeeded" || state == "failed" || state == "cancelled";
      frame = render_top_frame(o.target, job_run_dir(*job), &*job, elastic, o.events);
    }
    if (o.once) {
      std::fputs(frame.c_str(), stdout);
      return 0;
    }
    // Clear the screen, home the cursor, draw.
    std::fputs(("\x1b[H\x1b[2J" + frame + "\n(every " + fmt::format("{:g}", o.interval_s) + " s; Ctrl-C quits)\n").c_str(),
               stdout);
    std::fflush(stdout);
    if (ended) return 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.interval_s);
    while (std::chrono::steady_clock::now() < until) {
      if (g_stop.load()) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (g_stop.load()) return 0;
  }
}

}  // namespace troupe::sched
