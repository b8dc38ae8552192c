// scheduler/client/job_spec.cc — JobSpec validation and JSON form.
#include "scheduler/client/job_spec.h"

#include <nlohmann/json.hpp>

namespace troupe::sched {

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
  if (health_policy != "flag" && health_policy != "replace" && health_policy != "drain") {
    return invalid_argument("job spec: health_policy must be flag, replace or drain, got '{}'",
                            health_policy);
  }
  if (heartbeat_timeout_ms < 100) {
    return invalid_argument("job spec: heartbeat_timeout_ms must be >= 100, got {}", heartbeat_timeout_ms);
  }
  if (!layout.empty()) {
    Result<ParallelLayout> parsed = ParallelLayout::parse(layout);
    if (!parsed.ok()) return parsed.status().with_context("job spec");
    const ParallelLayout& l = *parsed;
    if (l.world_size() != nproc) {
      return invalid_argument("job spec: layout {} needs {} workers but nproc is {}", l.to_string(),
                              l.world_size(), nproc);
    }
    layout = l.to_string();
  }
  for (const auto& [k, v] : env) {
    if (k.empty() || k.find('=') != std::string::npos) return invalid_argument("job spec: bad env name '{}'", k);
    if (k.rfind("TROUPE_", 0) == 0) {
      return invalid_argument(
          "job spec: env {} is reserved for the scheduler (an app's own settings go in its "
          "config, e.g. train_moe's [test] section: --allow-test-config --set test.inject=...)",
          k);
    }
  }
  return ok_status();
}

ParallelLayout JobSpec::parsed_layout() const {
  if (!layout.empty()) {
    Result<ParallelLayout> l = ParallelLayout::parse(layout);
    if (l.ok()) return *l;
  }
  return ParallelLayout::make(1, nproc, 1).value_or(ParallelLayout());
}

std::string JobSpec::to_json() const {
  nlohmann::json j;
  j["name"] = name;
  j["argv"] = argv;
  j["env"] = env;
  j["nproc"] = nproc;
  j["layout"] = layout;
  j["max_restarts"] = max_restarts;
  j["max_driver_restarts"] = max_driver_restarts;
  j["checkpoint_dir"] = checkpoint_dir;
  j["backend"] = backend;
  j["work_dir"] = work_dir;
  j["driver"] = driver;
  j["heartbeat_timeout_ms"] = heartbeat_timeout_ms;
  if (elastic) j["elastic"] = true;
  if (health_policy != "flag") j["health_policy"] = health_policy;
  return j.dump();
}

Result<JobSpec> JobSpec::from_json(const std::string& text) {
  JobSpec s;
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) return invalid_argument("job spec: not a JSON object");
    static const char* const kKnown[] = {"name",
                                         "argv",
                                         "env",
                                         "nproc",
                                         "layout",
                                         "min_workers",  // written by earlier versions; ignored
                                         "max_workers",  // (a job's bounds: elastic.min_dp, max_dp)
                                         "max_restarts",
                                         "max_driver_restarts",
                                         "checkpoint_dir",
                                         "backend",
                                         "work_dir",
                                         "driver",
                                         "heartbeat_timeout_ms",
                                         "elastic",
                                         "health_policy"};
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
    s.max_restarts = j.value("max_restarts", 0);
    s.max_driver_restarts = j.value("max_driver_restarts", 3);
    s.checkpoint_dir = j.value("checkpoint_dir", "");
    s.backend = j.value("backend", "cpu");
    s.work_dir = j.value("work_dir", "");
    s.driver = j.value("driver", true);
    s.heartbeat_timeout_ms = j.value("heartbeat_timeout_ms", 3000);
    s.elastic = j.value("elastic", false);
    s.health_policy = j.value("health_policy", "flag");
  } catch (const std::exception& e) {
    return invalid_argument("job spec: {}", e.what());
  }
  return s;
}

}  // namespace troupe::sched
