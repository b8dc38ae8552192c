// scheduler/cli/cli_health.cc — render_health_table (cli_health.h).
#include "scheduler/cli/cli_health.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace troupe::sched {

namespace {

using json = nlohmann::json;

std::string cell(const json& m, const char* key, const char* fmtstr, double scale = 1.0) {
  if (!m.contains(key) || !m[key].is_number()) return "-";
  return fmt::format(fmt::runtime(fmtstr), m[key].get<double>() * scale);
}

std::string bytes(const json& m, const char* key) {
  if (!m.contains(key) || !m[key].is_number()) return "-";
  const double b = m[key].get<double>();
  if (b >= 1e9) return fmt::format("{:.1f}G", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f}M", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f}k", b / 1e3);
  return fmt::format("{:.0f}", b);
}

}  // namespace

std::string render_health_table(const json& health) {
  const json workers = health.value("workers", json::array());
  if (workers.empty()) return "";
  bool gpu = false;
  for (const auto& w : workers) gpu |= w.value("metrics", json::object()).contains("gpu_sm_clock_mhz");
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head = {"PROCESS",  "AGENT",     "AGE",       "HOST CPU", "STEAL",
                                   "PROC CPU", "RUNQ",      "THROTTLED", "RSS",      "NET RX/s",
                                   "NET TX/s", "RETRANS/s", "COMPUTE ms"};
  if (gpu) {
    for (const char* h : {"SM MHz", "POWER W", "TEMP C", "GPU UTIL", "GPU MEM", "ECC UNC", "XID"})
      head.push_back(h);
  }
  head.push_back("FLAGS");
  rows.push_back(head);
  for (const auto& w : workers) {
    const json m = w.value("metrics", json::object());
    std::vector<std::string> r = {w.value("name", ""),
                                  w.value("node", ""),
                                  fmt::format("{:.1f}s", w.value("age_s", 0.0)),
                                  cell(m, "host_cpu_util", "{:.0f}%", 100),
                                  cell(m, "host_cpu_steal", "{:.1f}%", 100),
                                  cell(m, "proc_cpu", "{:.2f}"),
                                  cell(m, "proc_run_delay", "{:.3f}"),
                                  cell(m, "proc_throttled", "{:.3f}"),
                                  bytes(m, "proc_rss_bytes"),
                                  bytes(m, "host_net_rx_bytes_per_s"),
                                  bytes(m, "host_net_tx_bytes_per_s"),
                                  cell(m, "host_tcp_retrans_per_s", "{:.1f}"),
                                  cell(m, "step_compute_ms", "{:.1f}")};
    if (gpu) {
      r.push_back(cell(m, "gpu_sm_clock_mhz", "{:.0f}"));
      r.push_back(cell(m, "gpu_power_w", "{:.0f}"));
      r.push_back(cell(m, "gpu_temp_c", "{:.0f}"));
      r.push_back(cell(m, "gpu_util", "{:.0f}%", 100));
      r.push_back(bytes(m, "gpu_mem_used_bytes"));
      r.push_back(cell(m, "gpu_ecc_uncorrected", "{:.0f}"));
      r.push_back(cell(m, "gpu_xid_errors", "{:.0f}"));
    }
    std::string flags;
    for (const auto& f : w.value("flags", json::array()))
      flags += (flags.empty() ? "" : ",") + f.get<std::string>();
    r.push_back(flags.empty() ? "-" : "! " + flags);
    rows.push_back(std::move(r));
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out =
      fmt::format("health (each worker's last report; detector: {}):\n", health.value("detector", ""));
  for (const auto& r : rows) {
    std::string line = " ";
    for (size_t i = 0; i < r.size(); ++i) line += fmt::format(" {:<{}}", r[i], width[i]);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace troupe::sched
