// apps/train_moe/train_options.cc — the training command line made whole
// (resolve_train_options): --parallel folded into the overrides, and `--resume <run>`
// without --config taking the saved run's config from its checkpoints. Training itself
// is the framework's (training::run_app: the Trainer and the Stage, one process for
// layout 1x1x1).
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/train_moe/commands.h"
#include "training/checkpointing/checkpointing.h"

namespace troupe::train_moe {

namespace fs = std::filesystem;

namespace {

// --resume without --config: the saved run's config (its text is in every manifest) and
// overrides, then this command line's overrides (so --set and --parallel still apply);
// the run directory defaults to the one the checkpoints belong to.
Result<TrainOptions> with_checkpoint_config(const TrainOptions& o) {
  std::error_code ec;
  const fs::path p = fs::path(o.resume).lexically_normal();
  fs::path run_dir, ckdir;
  if (fs::is_directory(p / "checkpoints", ec)) {
    run_dir = p;
    ckdir = p / "checkpoints";
  } else if (fs::exists(p / checkpoint::kManifestFile, ec) ||
             checkpoint::parse_step_dir_name(p.filename().string())) {
    ckdir = p.parent_path();
  } else {
    ckdir = p;
  }
  if (run_dir.empty() && ckdir.filename() == "checkpoints") run_dir = ckdir.parent_path();
  TrainOptions r = o;
  if (r.run_dir.empty()) {
    if (run_dir.empty()) return invalid_argument("--resume {} without --config: give --run-dir", o.resume);
    r.run_dir = run_dir.string();
  }
  // Any manifest of the run holds its config; the newest readable one is taken.
  std::vector<std::string> dirs;
  if (fs::exists(p / checkpoint::kManifestFile, ec)) dirs.push_back(p.string());
  for (const auto& [step, d] : checkpoint::list_checkpoints(ckdir.string())) dirs.push_back(d);
  for (const std::string& d : dirs) {
    Result<std::unique_ptr<checkpoint::CheckpointReader>> m =
        checkpoint::CheckpointReader::open(d, checkpoint::VerifyMode::kManifestOnly);
    if (!m.ok() || (*m)->manifest().config_text.empty()) continue;
    fs::create_directories(r.run_dir, ec);
    const std::string path = r.run_dir + "/config.resume.toml";
    // Every process of a distributed run writes the same text: tmp + rename keeps it whole.
    const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << (*m)->manifest().config_text;
      if (!out) return io_error("cannot write {}", tmp);
    }
    fs::rename(tmp, path, ec);
    if (ec) return io_error("cannot rename {} to {}: {}", tmp, path, ec.message());
    r.config = path;
    r.overrides.clear();
    for (const auto& v : (*m)->manifest().metadata.value("overrides", nlohmann::json::array())) {
      r.overrides.push_back(v.get<std::string>());
    }
    r.overrides.insert(r.overrides.end(), o.overrides.begin(), o.overrides.end());
    fmt::print("train_moe: config from checkpoint {} ({} overrides, then this command's {})\n", d,
               r.overrides.size() - o.overrides.size(), o.overrides.size());
    return r;
  }
  return not_found("--resume {} without --config: no checkpoint manifest with a config found in {}", o.resume,
                   ckdir.string());
}

}  // namespace

Result<TrainOptions> resolve_train_options(const TrainOptions& opts) {
  // --parallel becomes overrides after --set's (recorded with the run and its checkpoints).
  TrainOptions folded = opts;
  TROUPE_ASSIGN_OR_RETURN(folded.overrides, training::all_overrides(opts));
  folded.parallel.clear();
  folded.init_from.clear();  // its overrides are in
  if (folded.config.empty() && !folded.resume.empty()) return with_checkpoint_config(folded);
  if (folded.config.empty()) return invalid_argument("train: --config is required");
  return folded;
}

}  // namespace troupe::train_moe
