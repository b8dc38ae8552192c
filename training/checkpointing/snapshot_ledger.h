// training/checkpointing/snapshot_ledger.h — defines SnapshotLedger, the Trainer's record of the
// job's in-memory snapshots (the driver's side of docs/elastic.md "Snapshots").
//
// Two-phase, like a checkpoint: a snapshot of step S is complete once every rank of the
// epoch reported its part landed (SnapshotLanded: its keeper, the keeper's endpoint, the
// manifest checksum of the part); the Trainer then commits it — records the manifest of
// parts in the job's store (so a restarted driver finds it) and tells every worker
// (SnapshotCommitted), naming for each node the keeper of another node that keeps its
// copy (nodes in name order, each to the next: never its own node). A recovery goes back
// to the newest committed snapshot no restore has found damaged or lost.
//
// Memory: the ledger keeps the committed snapshots the keepers can still hold (a rank
// keeps two generations: the two newest committed) and the incomplete ones of the
// current epoch.
//
// Threads: the Trainer's thread only.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "training/messages.h"

namespace troupe::training {

struct SnapshotPartRecord {
  bool landed = false;
  std::string node, endpoint;  // its keeper
  uint64_t xxh64 = 0;          // its manifest's checksum
  uint64_t bytes = 0;
  std::string copy_endpoint;  // the keeper of another node its copy goes to ("": none)
};

struct SnapshotRecord {
  int64_t step = -1;
  uint64_t epoch = 0;
  int64_t dp = 1, grad_accum = 1;
  int64_t tokens = 0;                     // tokens seen after the step (its data position)
  std::vector<SnapshotPartRecord> parts;  // per rank of the epoch's layout
  bool committed = false;
  bool checkpoint = false;  // also written to disk
  std::string unusable;     // why a restore could not use it (empty: usable)

  nlohmann::json to_json() const;
  static Result<SnapshotRecord> from_json(const nlohmann::json& j);
  // Where each rank's part can be fetched (its keeper, then its copy's) and its checksum.
  std::vector<PartSource> sources() const;
  int64_t bytes() const;
};

class SnapshotLedger {
 public:
  // A part landed (or failed: l.error). Parts of another epoch than `epoch` are ignored.
  // Returns the step when the part completes its snapshot (every rank of `world` landed).
  std::optional<int64_t> landed(const SnapshotLanded& l, uint64_t epoch, int world, int64_t dp,
                                int64_t grad_accum);
  // Commits the complete snapshot of `step`: its copy targets, and the message for the
  // workers. `tokens`: the data position after the step.
  SnapshotCommitted commit(int64_t step, int64_t tokens, bool checkpoint);
  // The commit of `step` again, for the workers of `epoch` (after a restore of it: its
  // checkpoint, interrupted by the failure, is written from the snapshot).
  SnapshotCommitted recommit(int64_t step, uint64_t epoch, bool checkpoint) const;
  // The newest committed, usable snapshot at or before `step`; nullptr when none.
  const SnapshotRecord* newest_usable(int64_t step) const;
  const SnapshotRecord* find(int64_t step) const;
  void mark_unusable(int64_t step, const std::string& why);
  // A new epoch: incomplete snapshots of older epochs never complete.
  void drop_incomplete();
  // The committed snapshots, newest first, for the job's store and status.
  nlohmann::json committed_json() const;
  // Reads what committed_json wrote (a restarted driver).
  static Result<SnapshotLedger> from_json(const std::string& text);
  int64_t newest_committed() const;

 private:
  std::map<int64_t, SnapshotRecord> records_;
};

}  // namespace troupe::training
