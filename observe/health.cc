// observe/health.cc — HostProbe, StepProbe and HealthSampler (health.h).
#include "observe/health.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/env.h"

namespace troupe::observe {

namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> w;
  std::istringstream is(line);
  for (std::string s; is >> s;) w.push_back(s);
  return w;
}

double num(const std::string& s) {
  try {
    return std::stod(s);
  } catch (...) {
    return 0;
  }
}

// "Tcp: a b c\nTcp: 1 2 3" -> {a: 1, ...} for the section `name`.
std::map<std::string, double> snmp_section(const std::string& text, const std::string& name) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string header;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + ":", 0) != 0) continue;
    if (header.empty()) {
      header = line;
      continue;
    }
    const auto h = words(header), v = words(line);
    for (size_t i = 1; i < h.size() && i < v.size(); ++i) out[h[i]] = num(v[i]);
    break;
  }
  return out;
}

// The cpu.stat of `pid`'s cgroup: v1 (a hierarchy whose controllers include "cpu",
// throttled_time in ns) or v2 (the unified one, throttled_usec).
std::pair<std::string, bool> cpu_stat_of(const std::string& root, pid_t pid) {
  std::istringstream in(slurp(root + "/" + std::to_string(pid) + "/cgroup"));
  std::string v2_path;
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string ctrls = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (ctrls.empty()) {
      v2_path = path;
      continue;
    }
    std::istringstream cs(ctrls);
    for (std::string c; std::getline(cs, c, ',');) {
      if (c != "cpu") continue;
      for (const char* mount : {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"}) {
        const std::string p = std::string(mount) + path + "/cpu.stat";
        if (fs::exists(p)) return {p, false};
      }
    }
  }
  if (!v2_path.empty() && fs::exists("/sys/fs/cgroup/cgroup.controllers")) {
    const std::string p = "/sys/fs/cgroup" + v2_path + "/cpu.stat";
    if (fs::exists(p)) return {p, true};
  }
  return {"", false};
}

}  // namespace

HostProbe::HostProbe(pid_t pid, std::string proc_root) : pid_(pid), root_(std::move(proc_root)) {}

HostProbe::Counters HostProbe::read_counters() const {
  Counters c;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  const std::string self = root_ + "/" + std::to_string(pid_);
  {  // host CPU: the first line of /proc/stat, in ticks
    std::istringstream in(slurp(root_ + "/stat"));
    std::string line;
    std::getline(in, line);
    const auto w = words(line);
    if (w.size() >= 9 && w[0] == "cpu") {
      double total = 0;
      for (size_t i = 1; i <= 8; ++i) total += num(w[i]);  // user .. steal
      c["cpu_total"] = total;
      c["cpu_busy"] = total - num(w[4]) - num(w[5]);
      c["cpu_iowait"] = num(w[5]);
      c["cpu_steal"] = num(w[8]);
    }
  }
  {
    std::istringstream in(slurp(root_ + "/meminfo"));
    for (std::string line; std::getline(in, line);) {
      const auto w = words(line);
      if (w.size() >= 2 && w[0] == "MemTotal:") c["g:mem_total"] = num(w[1]) * 1024;
      if (w.size() >= 2 && w[0] == "MemAvailable:") c["g:mem_available"] = num(w[1]) * 1024;
    }
  }
  {  // the process's network namespace: its interfaces and TCP counters
    std::istringstream in(slurp(self + "/net/dev"));
    bool any = false;
    double rx = 0, tx = 0;
    for (std::string line; std::getline(in, line);) {
      const size_t colon = line.find(':');
      if (colon == std::string::npos) continue;
      const auto name = words(line.substr(0, colon));
      const auto w = words(line.substr(colon + 1));
      if (name.empty() || name[0] == "lo" || w.size() < 9) continue;
      rx += num(w[0]);
      tx += num(w[8]);
      any = true;
    }
    if (any) c["net_rx"] = rx, c["net_tx"] = tx;
    const auto tcp = snmp_section(slurp(self + "/net/snmp"), "Tcp");
    if (tcp.count("RetransSegs")) c["tcp_retrans"] = tcp.at("RetransSegs");
    if (tcp.count("OutSegs")) c["tcp_out"] = tcp.at("OutSegs");
  }
  {  // the process: /proc/<pid>/stat fields 14, 15 (utime, stime), 24 (rss pages), 42 (blkio ticks)
    const std::string st = slurp(self + "/stat");
    const size_t rp = st.rfind(')');
    if (rp != std::string::npos) {
      const auto w = words(st.substr(rp + 1));  // w[0] is field 3
      if (w.size() >= 40) {
        c["proc_cpu"] = (num(w[11]) + num(w[12])) / tick;
        c["g:rss"] = num(w[21]) * static_cast<double>(sysconf(_SC_PAGESIZE));
        if (slurp(root_ + "/sys/kernel/task_delayacct").rfind('1', 0) == 0)
          c["blkio_delay"] = num(w[39]) / tick;
      }
    }
  }
  {  // run-queue wait of every thread (schedstat field 2, ns)
    std::error_code ec;
    double wait_ns = 0;
    bool any = false;
    for (const auto& t : fs::directory_iterator(self + "/task", ec)) {
      const auto w = words(slurp(t.path().string() + "/schedstat"));
      if (w.size() >= 2) wait_ns += num(w[1]), any = true;
    }
    if (any) c["run_delay"] = wait_ns / 1e9;
  }
  {
    std::istringstream in(slurp(self + "/io"));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("write_bytes:", 0) == 0) c["io_write"] = num(line.substr(12));
    }
  }
  return c;
}

std::vector<Metric> HostProbe::sample() {
  Counters c = read_counters();
  // The cgroup is looked up each time: a process may be moved into one after it started.
  const auto [stat_path, v2] = cpu_stat_of(root_, pid_);
  if (!stat_path.empty()) {
    std::istringstream in(slurp(stat_path));
    for (std::string line; std::getline(in, line);) {
      const auto w = words(line);
      if (w.size() < 2) continue;
      if (!v2 && w[0] == "throttled_time") c["throttled"] = num(w[1]) / 1e9;
      if (v2 && w[0] == "throttled_usec") c["throttled"] = num(w[1]) / 1e6;
    }
  }
  const auto now = std::chrono::steady_clock::now();
  std::vector<Metric> out;
  if (c.count("g:mem_total") && c.count("g:mem_available")) {
    out.push_back({"host_mem_used_bytes", c["g:mem_total"] - c["g:mem_available"]});
    out.push_back({"host_mem_available_bytes", c["g:mem_available"]});
  }
  if (c.count("g:rss")) out.push_back({"proc_rss_bytes", c["g:rss"]});
  if (primed_) {
    const double dt = std::max(1e-3, std::chrono::duration<double>(now - prev_at_).count());
    auto delta = [&](const char* k) -> std::optional<double> {
      if (!c.count(k) || !prev_.count(k)) return std::nullopt;
      return std::max(0.0, c[k] - prev_[k]);  // counters of exited threads may go back
    };
    if (auto total = delta("cpu_total"); total && *total > 0) {
      out.push_back({"host_cpu_util", *delta("cpu_busy") / *total});
      out.push_back({"host_cpu_steal", *delta("cpu_steal") / *total});
      out.push_back({"host_cpu_iowait", *delta("cpu_iowait") / *total});
    }
    const std::pair<const char*, const char*> rates[] = {{"net_rx", "host_net_rx_bytes_per_s"},
                                                         {"net_tx", "host_net_tx_bytes_per_s"},
                                                         {"tcp_retrans", "host_tcp_retrans_per_s"},
                                                         {"tcp_out", "host_tcp_out_per_s"},
                                                         {"proc_cpu", "proc_cpu"},
                                                         {"run_delay", "proc_run_delay"},
                                                         {"throttled", "proc_throttled"},
                                                         {"io_write", "proc_io_write_bytes_per_s"},
                                                         {"blkio_delay", "proc_blkio_delay"}};
    for (const auto& [k, name] : rates) {
      if (auto d = delta(k)) out.push_back({name, *d / dt});
    }
  }
  prev_ = std::move(c);
  prev_at_ = now;
  primed_ = true;
  return out;
}

void StepProbe::record_step(double step_ms, double compute_ms, double comm_ms) {
  std::lock_guard<std::mutex> lk(mu_);
  ++steps_;
  step_ms_ += step_ms;
  compute_ms_ += compute_ms;
  comm_ms_ += comm_ms;
}

void StepProbe::record_io(double ms) {
  std::lock_guard<std::mutex> lk(mu_);
  ++ios_;
  io_ms_ += ms;
}

void StepProbe::begin_io() {
  std::lock_guard<std::mutex> lk(mu_);
  io_since_ = std::chrono::steady_clock::now();
}

void StepProbe::end_io() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!io_since_) return;
  ++ios_;
  io_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - *io_since_).count();
  io_since_.reset();
}

std::vector<Metric> StepProbe::take(double elapsed_s) {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<Metric> out;
  if (steps_ > 0) {
    out = {{"step_ms", step_ms_ / steps_},
           {"step_compute_ms", compute_ms_ / steps_},
           {"step_comm_ms", comm_ms_ / steps_}};
    last_ = out;
  } else if (last_) {
    out = *last_;  // no step ended in this interval: the last figures still stand
  }
  if (ios_ > 0) last_io_ms_ = io_ms_ / ios_;
  double io = last_io_ms_.value_or(-1);
  if (io_since_) {
    io = std::max(
        io, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - *io_since_).count());
  }
  if (io >= 0) out.push_back({"step_io_ms", io});
  if (steps_ > 0 || last_) out.push_back({"steps_per_s", elapsed_s > 0 ? steps_ / elapsed_s : 0.0});
  steps_ = ios_ = 0;
  step_ms_ = compute_ms_ = comm_ms_ = io_ms_ = 0;
  return out;
}

HealthSampler::HealthSampler(HealthSamplerOptions o, std::shared_ptr<StepProbe> steps)
    : host_(o.pid > 0 ? o.pid : getpid(), o.proc_root), steps_(std::move(steps)) {
  if (o.gpu) {
    std::string device = o.gpu_device;
    if (device.empty()) {
      const std::string vis = env::get_or("CUDA_VISIBLE_DEVICES", "0");
      device = vis.substr(0, vis.find(','));
    }
    auto n = Nvml::open(device);
    if (n.ok()) {
      nvml_ = std::move(n).value();
    } else {
      gpu_why_ = n.status().message();
    }
  }
  last_ = std::chrono::steady_clock::now();
}

std::vector<Metric> HealthSampler::sample() {
  std::vector<Metric> out = host_.sample();
  const auto now = std::chrono::steady_clock::now();
  if (steps_) {
    for (auto& m : steps_->take(std::chrono::duration<double>(now - last_).count()))
      out.push_back(std::move(m));
  }
  last_ = now;
  if (nvml_) {
    for (auto& m : nvml_->sample()) out.push_back(std::move(m));
  }
  return out;
}

const MetricInfo* find_metric_info(std::string_view name) {
  for (const MetricInfo& m : kHealthMetrics) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

}  // namespace troupe::observe
