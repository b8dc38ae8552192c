// training/checkpointing/checkpointing.cc — the resume and checkpoint-directory helpers (see
// checkpointing.h).
#include "training/checkpointing/checkpointing.h"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/env.h"
#include "core/job_env.h"

namespace troupe::training {

namespace fs = std::filesystem;

// ---- resume ------------------------------------------------------------------------------

Result<std::unique_ptr<checkpoint::CheckpointReader>> open_resume_checkpoint(const std::string& path,
                                                                             const std::string& what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return not_found("{}: {} does not exist", what, path);
  std::string dir = path;
  if (!fs::exists(fs::path(path) / checkpoint::kManifestFile, ec) && fs::is_directory(fs::path(path) / "checkpoints", ec)) {
    dir = (fs::path(path) / "checkpoints").string();
  }
  const bool named = checkpoint::parse_step_dir_name(fs::path(dir).lexically_normal().filename().string()).has_value() ||
                     fs::exists(fs::path(dir) / checkpoint::kManifestFile, ec);
  Result<std::unique_ptr<checkpoint::CheckpointReader>> r =
      named ? checkpoint::CheckpointReader::open(dir, checkpoint::VerifyMode::kStructure)
            : checkpoint::CheckpointReader::open_latest_valid(dir, checkpoint::VerifyMode::kChecksums);
  if (!r.ok()) return r.status().with_context(what);
  if (named) TROUPE_RETURN_IF_ERROR((*r)->verify_checksums().with_context(what));
  for (const std::string& s : (*r)->skipped()) fmt::print(stderr, "train_moe: {}: skipped checkpoint {}\n", what == "--resume" ? "resume" : what, s);
  return r;
}

Status prepare_checkpoint_dir(const std::string& dir, int64_t start_step) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return ok_status();
  const int64_t stamp =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string name = de.path().filename().string();
    std::string base = name;
    const bool tmp = base.size() > 4 && base.compare(base.size() - 4, 4, ".tmp") == 0;
    if (tmp) base.resize(base.size() - 4);
    const std::optional<int64_t> step = checkpoint::parse_step_dir_name(base);
    if (!step || *step <= start_step || !de.is_directory(ec)) continue;
    if (tmp) {
      fs::remove_all(de.path(), ec);
      if (ec) return io_error("cannot remove the stale {}: {}", de.path().string(), ec.message());
      fmt::print("checkpoint: removed {} (an unfinished save of a step after {})\n", de.path().string(), start_step);
    } else {
      const fs::path to = de.path().string() + fmt::format(".superseded-{}", stamp);
      fs::rename(de.path(), to, ec);
      if (ec) return io_error("cannot rename {}: {}", de.path().string(), ec.message());
      fmt::print("checkpoint: {} is after the starting step {}; moved aside to {}\n", de.path().string(), start_step,
                 to.string());
    }
  }
  return ok_status();
}

std::optional<std::pair<int64_t, std::string>> newest_committed_checkpoint(const std::string& dir) {
  for (const auto& [step, path] : checkpoint::list_checkpoints(dir)) {
    if (checkpoint::CheckpointReader::open(path, checkpoint::VerifyMode::kStructure).ok())
      return std::make_pair(step, path);
  }
  return std::nullopt;
}

namespace {
std::string human_bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return fmt::format("{:.1f} GiB", static_cast<double>(b) / (1 << 30));
  if (b >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20));
  if (b >= (uint64_t{1} << 10)) return fmt::format("{:.1f} KiB", static_cast<double>(b) / (1 << 10));
  return fmt::format("{} bytes", b);
}
}  // namespace

FailedSave clean_failed_save(const std::string& dir, int64_t step, uint64_t needed_bytes) {
  FailedSave out;
  out.needed_bytes = needed_bytes;
  std::string removed;
  std::error_code ec;
  const fs::path tmp = fs::path(dir) / checkpoint::tmp_dir_name(step);
  if (fs::exists(tmp, ec)) {
    fs::remove_all(tmp, ec);
    removed = ec ? fmt::format("could not remove the unfinished {}: {}; ", tmp.string(), ec.message())
                 : fmt::format("the unfinished {} was removed; ", tmp.string());
  }
  struct statvfs sv {};
  const bool known = ::statvfs(dir.c_str(), &sv) == 0;
  if (known) out.free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
  out.disk_full = known && needed_bytes > 0 && out.free_bytes < needed_bytes;
  std::string space;
  if (!known) {
    space = fmt::format("the free space of {} is unknown", dir);
  } else if (needed_bytes == 0) {
    space = fmt::format("{} has {} free", dir, human_bytes(out.free_bytes));
  } else {
    space = fmt::format(
        "{} has {} free, a checkpoint of this job needs {}{}", dir, human_bytes(out.free_bytes),
        human_bytes(needed_bytes),
        out.disk_full ? fmt::format(" (free at least {} more)", human_bytes(needed_bytes - out.free_bytes))
                      : "");
  }
  const auto newest = newest_committed_checkpoint(dir);
  out.text = fmt::format("{}{}; the newest committed checkpoint is {}", removed, space,
                         newest ? fmt::format("step {} ({})", newest->first, newest->second) : "none");
  return out;
}

std::string checkpoint_dir_for(const layers::TrainConfig& tc, const std::string& run_dir) {
  if (!tc.checkpoint.dir.empty()) return tc.checkpoint.dir;
  if (std::optional<std::string> job_dir = env::get(job_env::kCheckpointDir)) return *job_dir;
  return (fs::path(run_dir) / "checkpoints").string();
}

nlohmann::json run_metadata(const layers::TrainConfig& tc, const std::vector<std::string>& overrides) {
  const layers::ModelConfig& m = tc.model;
  return nlohmann::json{
      {"format", "troupe-train-state-1"},
      {"overrides", overrides},
      {"model", {{"params", m.num_params()}, {"n_layers", m.n_layers}, {"d_model", m.d_model},
                 {"vocab_size", m.vocab_size}, {"num_experts", m.moe.num_experts}, {"tie_embeddings", m.tie_embeddings}}},
      {"saved_layout", fmt::format("pp={},dp={},n={}", tc.parallel.pp, tc.parallel.dp, tc.parallel.n)},
      {"global_batch", tc.global_batch()},
      {"seq_len", tc.train.seq_len},
      {"seed", tc.train.seed}};
}

Status check_resume_compatible(const checkpoint::Manifest& man, const layers::TrainConfig& tc) {
  const nlohmann::json now = run_metadata(tc, {});
  const nlohmann::json saved = man.metadata.value("model", nlohmann::json::object());
  for (const auto& [k, v] : now["model"].items()) {
    if (saved.contains(k) && saved[k] != v) {
      return failed_precondition("--resume: the checkpoint's model has {} = {} but this config has {} (the model "
                                 "config must match the saved run)",
                                 k, saved[k].dump(), v.dump());
    }
  }
  for (const char* k : {"seed", "global_batch", "seq_len"}) {
    if (man.metadata.contains(k) && man.metadata[k] != now[k]) {
      fmt::print(stderr, "train_moe: warning: resuming with {} = {} but the checkpoint was saved with {}: the data "
                         "order differs from the saved run's\n", k, now[k].dump(), man.metadata[k].dump());
    }
  }
  return ok_status();
}

Result<checkpoint::CheckpointInfo> run_checkpoint_info(const std::string& config_path,
                                                       const std::vector<std::string>& overrides,
                                                       const layers::TrainConfig& tc, const std::string& tokenizer_path) {
  std::ifstream in(config_path);
  if (!in) return io_error("cannot read the config {}", config_path);
  std::ostringstream text;
  text << in.rdbuf();
  checkpoint::CheckpointInfo info;
  info.config_text = text.str();
  info.tokenizer_path = tokenizer_path;
  info.metadata = run_metadata(tc, overrides);
  return info;
}

Status trim_metrics(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in) return ok_status();  // nothing recorded yet
  std::vector<std::string> keep;
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;  // a torn last line of a killed run
    if (j.value("step", int64_t{0}) <= last_step) keep.push_back(line);
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  if (!out) return io_error("cannot rewrite {}", path);
  for (const auto& l : keep) out << l << "\n";
  return ok_status();
}

}  // namespace troupe::training
