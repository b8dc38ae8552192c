// actors/training/checkpointing.h — defines how training uses checkpoint/:
//   RankCheckpointer (every rank): snapshot a StageState into host memory and write it in
//     the background (CheckpointWriter); training continues while it writes;
//   CheckpointCommitter (the driver, or the single process): once every rank's part of
//     step N is durable, finalize_checkpoint (manifest, rename, `latest`, keep-K) — in a
//     background thread, so the driver keeps driving steps;
//   open_resume_checkpoint: `--resume <run dir | checkpoints dir | step dir>` to the newest
//     checkpoint that passes checksum verification, each skipped one reported by name;
//   prepare_checkpoint_dir: moves checkpoints newer than the resumed step (and stale
//     temporary directories) aside, so the continued run's saves never meet them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "actors/training/stage_state.h"
#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "core/status.h"
#include "layers/train_config.h"

namespace troupe::training {

struct SaveFigures {
  double blocked_ms = 0;  // training blocked: the snapshot (and waiting for a previous save)
  uint64_t bytes = 0;     // this rank's bytes
};

class RankCheckpointer {
 public:
  // dir: where step_<N> directories go (shared by every rank and the driver).
  // max_bytes_per_second: the writer's rate limit (0: none).
  static Result<std::unique_ptr<RankCheckpointer>> create(const std::string& dir,
                                                          const ParallelLayout& layout, int rank,
                                                          uint64_t max_bytes_per_second = 0);
  ~RankCheckpointer();  // waits for the write in flight

  // Saves `state` (StateScope::kSave) as step state.step: copies it into the writer's host
  // buffer, then returns; the write goes on in the background. A previous save still
  // writing is waited for first (counted as blocked time); its failure is returned here.
  // A failed save leaves `step_<N>.tmp/rank_<R>.error` (the reason) for the committer.
  Result<SaveFigures> save(const StageState& state);
  // Waits for the save in flight; its outcome (OK when none).
  Status finish();
  // The step of the save that has become durable since the last call (then no save is in
  // flight), or -1 when none has (still writing, or none started); `wait`: waits for the
  // save in flight first. A failed save is returned as its error (its error marker is
  // left, as by finish()).
  Result<int64_t> poll_durable(bool wait = false);
  // The step of the save in flight (-1: none).
  int64_t pending_step() const { return pending_ ? last_step_ : -1; }
  // Leaves the error marker of step `step` (for a failure before save() was reached,
  // e.g. the state could not be exported), so the committer stops waiting for this rank.
  void mark_failed(int64_t step, const Status& st) const;

 private:
  RankCheckpointer() = default;
  std::string dir_;
  int rank_ = 0;
  std::unique_ptr<checkpoint::CheckpointWriter> writer_;
  checkpoint::SaveHandle last_;
  int64_t last_step_ = 0;
  bool pending_ = false;
};

// The error marker a rank leaves in step_<N>.tmp when its save failed.
std::string error_file_name(int rank);  // "rank_00003.error"

struct CommitterOptions {
  std::string dir;             // the checkpoint directory (holds step_<N>)
  int world_size = 1;
  int keep = 3;
  checkpoint::CheckpointInfo info;  // config text, tokenizer path, base metadata
  std::chrono::milliseconds part_timeout{600000};  // how long a commit waits for the parts
};

class CheckpointCommitter {
 public:
  explicit CheckpointCommitter(CommitterOptions o) : o_(std::move(o)) {}
  ~CheckpointCommitter();  // stops waiting (an uncommitted step stays step_<N>.tmp) and joins

  // Queues step `step` for commit and returns at once: one background thread, in step
  // order, waits for every rank's part (or a rank's error marker) and finalizes.
  // `data_position` and `metadata` are merged into the info.
  void commit(int64_t step, nlohmann::json data_position, nlohmann::json metadata);
  // Call once the workers have stopped (their writes are over): commits what is queued,
  // a step still missing parts fails at once naming the ranks; returns the first failure
  // of any commit.
  Status finish();
  // Steps committed so far, in order.
  std::vector<int64_t> committed() const;

 private:
  struct Pending {
    int64_t step = 0;
    nlohmann::json data_position, metadata;
  };
  void loop();
  Status commit_one(const Pending& p);

  CommitterOptions o_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool cancel_ = false, finishing_ = false;
  Status first_error_;
  std::vector<int64_t> committed_;
};

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
