// training/checkpointing/checkpointing.h — defines how training uses checkpoint/ besides the
// snapshots checkpoints are written from (snapshots.h; the Trainer finalizes them):
//   open_resume_checkpoint: `--resume <run dir | checkpoints dir | step dir>` to the newest
//     checkpoint that passes checksum verification, each skipped one reported by name;
//   prepare_checkpoint_dir: moves checkpoints newer than the resumed step (and stale
//     temporary directories) aside, so the continued run's saves never meet them.
#pragma once

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "core/status.h"
#include "training/run_config.h"
#include "training/stage/stage_state.h"

namespace troupe::training {

// Resolves `path` — a run directory (its checkpoints/ is searched), a directory of
// step_<N> checkpoints, or one checkpoint directory — and opens the newest checkpoint
// whose manifest, files and checksums are all valid (a named step directory is the only
// candidate). Every newer checkpoint skipped is printed to stderr with its reason;
// NotFound (with every reason) when none is valid. `what` names the caller in errors and
// in the skip notes ("--resume", "sample").
Result<std::unique_ptr<checkpoint::CheckpointReader>> open_resume_checkpoint(const std::string& path,
                                                                             const std::string& what = "--resume");

// Before a run saves into `dir` starting after step `start_step` (0 for a fresh run):
// renames complete checkpoints of later steps to step_<N>.superseded-<ms> and removes
// temporary step_<N>.tmp directories of later steps (a crashed save), printing each.
Status prepare_checkpoint_dir(const std::string& dir, int64_t start_step);

// Where a run's checkpoints go: checkpoint.dir, else $TROUPE_CHECKPOINT_DIR (set by the
// scheduler from the job's checkpoint_dir), else <run_dir>/checkpoints.
std::string checkpoint_dir_for(const layers::TrainConfig& tc, const std::string& run_dir);

// The run-level metadata stored with every checkpoint (model shape facts, the layout and
// batch it was saved with, the config overrides) and the check a resume makes with it:
// a different model is an error naming the field; a different seed or global batch (a
// different data order than the saved run) is printed as a warning.
nlohmann::json run_metadata(const layers::TrainConfig& tc, const std::vector<std::string>& overrides);
Status check_resume_compatible(const checkpoint::Manifest& m, const layers::TrainConfig& tc);

// The CheckpointInfo of a run: config text (the config file's), tokenizer path, metadata.
Result<checkpoint::CheckpointInfo> run_checkpoint_info(const std::string& config_path,
                                                       const std::vector<std::string>& overrides,
                                                       const layers::TrainConfig& tc, const std::string& tokenizer_path);

// metrics.jsonl of a resumed run: keeps the records up to `last_step` (those of the saved
// run), drops later ones (steps run after the checkpoint, about to be run again).
Status trim_metrics(const std::string& path, int64_t last_step);

// After a save of step `step` into `dir` failed: removes its unfinished step_<N>.tmp (a
// full disk must not stay full of it) and says in `text` what is true about the space:
// how much `dir`'s file system has free against `needed_bytes` (the size of the job's last
// committed checkpoint; 0: unknown) and which committed checkpoint is the newest.
struct FailedSave {
  bool disk_full = false;  // free_bytes < needed_bytes (after the removal)
  uint64_t free_bytes = 0;
  uint64_t needed_bytes = 0;
  std::string text;
};
FailedSave clean_failed_save(const std::string& dir, int64_t step, uint64_t needed_bytes);

// The newest checkpoint of `dir` whose manifest and files are in place (step, path), or
// nullopt.
std::optional<std::pair<int64_t, std::string>> newest_committed_checkpoint(const std::string& dir);

// True when a run with checkpoint.every = `every` saves after `step` (`last`: the run's
// final step, including a stop on the time limit).
bool checkpoint_due(int64_t every, int64_t step, bool last);

}  // namespace troupe::training
