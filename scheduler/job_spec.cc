// scheduler/job_spec.cc — JobSpec validation, layout parsing and JSON form.
#include "scheduler/job_spec.h"

#include <nlohmann/json.hpp>

#include <charconv>

namespace troupe::sched {
namespace {

Result<int> parse_positive(const std::string& s, const std::string& what) {
  int v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v <= 0) {
    return invalid_argument("layout: {} must be a positive integer, got '{}'", what, s);
  }
  return v;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) return out;
    start = pos + 1;
  }
}

}  // namespace

std::string ParallelLayout::to_string() const { return fmt::format("pp={},dp={},n={}", pp, dp, n); }

Result<ParallelLayout> parse_layout(const std::string& text) {
  ParallelLayout l;
  if (text.empty()) return invalid_argument("layout: empty string");
  if (text.find('=') == std::string::npos) {
    auto parts = split(text, 'x');
    if (parts.size() != 3) return invalid_argument("layout '{}': expected PPxDPxN or pp=P,dp=D,n=N", text);
    TROUPE_ASSIGN_OR_RETURN(l.pp, parse_positive(parts[0], "pp"));
    TROUPE_ASSIGN_OR_RETURN(l.dp, parse_positive(parts[1], "dp"));
    TROUPE_ASSIGN_OR_RETURN(l.n, parse_positive(parts[2], "n"));
    return l;
  }
  for (const auto& item : split(text, ',')) {
    auto eq = item.find('=');
    if (eq == std::string::npos) return invalid_argument("layout '{}': '{}' is not key=value", text, item);
    std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    int* dst = key == "pp" ? &l.pp : key == "dp" ? &l.dp : key == "n" ? &l.n : nullptr;
    if (!dst) return invalid_argument("layout '{}': unknown key '{}' (pp, dp, n)", text, key);
    TROUPE_ASSIGN_OR_RETURN(*dst, parse_positive(val, key));
  }
  return l;
}

Status JobSpec::validate() {
  if (argv.empty() || argv[0].empty()) return invalid_argument("job spec: no command given");
  if (nproc < 1 || nproc > 100000) return invalid_argument("job spec: nproc must be in [1, 100000], got {}", nproc);
  if (max_restarts < 0) return invalid_argument("job spec: max_restarts must be >= 0, got {}", max_restarts);
  if (max_driver_restarts < 0) {
    return invalid_argument("job spec: max_driver_restarts must be >= 0, got {}", max_driver_restarts);
  }
  if (backend != "cpu" && backend != "cuda") {
    return invalid_argument("job spec: backend must be cpu or cuda, got '{}'", backend);
  }
  if (heartbeat_timeout_ms < 100) {
    return invalid_argument("job spec: heartbeat_timeout_ms must be >= 100, got {}", heartbeat_timeout_ms);
  }
  if (!layout.empty()) {
    TROUPE_ASSIGN_OR_RETURN(ParallelLayout l, parse_layout(layout));
    if (l.world_size() != nproc) {
      return invalid_argument("job spec: layout {} needs {} workers but nproc is {}", l.to_string(),
                              l.world_size(), nproc);
    }
    layout = l.to_string();
  }
  if (min_workers == 0) min_workers = nproc;
  if (max_workers == 0) max_workers = nproc;
  if (min_workers < 1 || min_workers > nproc || max_workers < nproc) {
    return invalid_argument("job spec: elastic bounds must satisfy 1 <= min ({}) <= nproc ({}) <= max ({})",
                            min_workers, nproc, max_workers);
  }
  for (const auto& [k, v] : env) {
    if (k.empty() || k.find('=') != std::string::npos) return invalid_argument("job spec: bad env name '{}'", k);
    if (k.rfind("TROUPE_", 0) == 0) {
      return invalid_argument(
          "job spec: env {} is reserved for the scheduler (an app's own settings go in its "
          "config, e.g. train_moe's [elastic] section: --set elastic.inject=...)",
          k);
    }
  }
  return ok_status();
}

ParallelLayout JobSpec::parsed_layout() const {
  if (layout.empty()) return ParallelLayout{1, nproc, 1};
  auto l = parse_layout(layout);
  return l.ok() ? *l : ParallelLayout{1, nproc, 1};
}

std::string JobSpec::to_json() const {
  nlohmann::json j;
  j["name"] = name;
  j["argv"] = argv;
  j["env"] = env;
  j["nproc"] = nproc;
  j["layout"] = layout;
  j["min_workers"] = min_workers;
  j["max_workers"] = max_workers;
  j["max_restarts"] = max_restarts;
  j["max_driver_restarts"] = max_driver_restarts;
  j["checkpoint_dir"] = checkpoint_dir;
  j["backend"] = backend;
  j["work_dir"] = work_dir;
  j["driver"] = driver;
  j["heartbeat_timeout_ms"] = heartbeat_timeout_ms;
  if (elastic) j["elastic"] = true;
  return j.dump();
}

Result<JobSpec> JobSpec::from_json(const std::string& text) {
  JobSpec s;
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) return invalid_argument("job spec: not a JSON object");
    static const char* const kKnown[] = {"name", "argv", "env", "nproc", "layout", "min_workers",
                                         "max_workers", "max_restarts", "max_driver_restarts", "checkpoint_dir", "backend",
                                         "work_dir", "driver", "heartbeat_timeout_ms", "elastic"};
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool known = false;
      for (const char* k : kKnown) known = known || it.key() == k;
      if (!known) return invalid_argument("job spec: unknown field '{}'", it.key());
    }
    s.name = j.value("name", "");
    s.argv = j.value("argv", std::vector<std::string>{});
    s.env = j.value("env", std::map<std::string, std::string>{});
    s.nproc = j.value("nproc", 1);
    s.layout = j.value("layout", "");
    s.min_workers = j.value("min_workers", 0);
    s.max_workers = j.value("max_workers", 0);
    s.max_restarts = j.value("max_restarts", 0);
    s.max_driver_restarts = j.value("max_driver_restarts", 3);
    s.checkpoint_dir = j.value("checkpoint_dir", "");
    s.backend = j.value("backend", "cpu");
    s.work_dir = j.value("work_dir", "");
    s.driver = j.value("driver", true);
    s.heartbeat_timeout_ms = j.value("heartbeat_timeout_ms", 3000);
    s.elastic = j.value("elastic", false);
  } catch (const std::exception& e) {
    return invalid_argument("job spec: {}", e.what());
  }
  return s;
}

}  // namespace troupe::sched
