// checkpoint/snapshot_keeper.h — defines SnapshotKeeper, the holder of a node's in-memory
// snapshots: the memory a training worker writes its state into lives here, so it
// survives the worker; a copy goes to the keeper of another node, so it survives the node.
// troupe-agent runs one (so does `troupe run`'s embedded agent); the standalone launcher
// (train_moe --parallel ..., no scheduler) runs one in its own process, which outlives its
// workers the same way (docs/elastic.md "Snapshots").
//
// What it holds, per (job, rank):
//   - two generations, shared-memory segments it creates (snapshot_segment.h) and hands
//     to the worker of that rank by file descriptor: the worker writes a part into the
//     generation that does not hold the newest committed snapshot, so the last complete
//     one is never overwritten (memory: two generations, never more);
//   - copies of that rank's parts received from (or fetched from) other keepers, the two
//     newest steps.
// Protocols (messages in snapshot_protocol.h):
//   - workers: a Unix seqpacket socket `<dir>/snap.sock` in a fresh 0700 directory
//     (troupe-snap-XXXXXX under the given base), accepting only this user's processes
//     (SO_PEERCRED); attach / begin / landed / commit / fetch / query / release;
//   - keepers: TCP on `host_addr` (OS-assigned port): put (a copy arrives), get (a copy is
//     asked for), release. Unauthenticated, like Gloo's pairs: keep the data network private.
// A commit with a replica target queues a push of that part to the target keeper (one
// pusher thread, one part at a time, newest first); a worker's begin on a generation being
// pushed cancels that push first (the neighbour keeps its previous complete copy). Parts
// of a (job, rank) left untouched for KeeperOptions::idle_release are dropped.
//
// Threads: one per worker session and per peer connection (a handful per node), an accept
// thread per listener and the pusher; every public method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/snapshot_protocol.h"
#include "core/status.h"

namespace troupe::checkpoint {

struct KeeperOptions {
  std::string node;       // this keeper's node (the agent id; the launcher's host name)
  std::string host_addr;  // where other keepers reach it (IPv4); empty: no TCP listener
  std::string dir_base;   // the 0700 directory's parent; empty: $TMPDIR, else /tmp
  std::chrono::milliseconds peer_timeout{30000};    // one peer transfer's silence limit
  std::chrono::milliseconds connect_timeout{3000};  // reaching another keeper
  // The parts of a (job, rank) nobody attached, wrote, committed, fetched or copied for
  // this long are dropped: the job is over (a finished job's workers release theirs at
  // once; a failed job's would otherwise stay).
  std::chrono::milliseconds idle_release{std::chrono::hours(1)};
};

// The processes a keeper serves find its socket in job_env::kSnapshotKeeper (core/job_env.h).

struct KeeperTotals {
  uint64_t bytes = 0;  // segment bytes held (generations and copies)
  int parts = 0;       // landed parts of local workers
  int copies = 0;      // parts copied from other keepers
  int jobs = 0;
};

class SnapshotKeeper {
 public:
  static Result<std::unique_ptr<SnapshotKeeper>> start(KeeperOptions options);
  ~SnapshotKeeper();  // stops every thread, drops every segment, removes the directory
  SnapshotKeeper(const SnapshotKeeper&) = delete;
  SnapshotKeeper& operator=(const SnapshotKeeper&) = delete;

  const std::string& node() const;
  std::string socket_path() const;  // what workers get as TROUPE_SNAPSHOT_KEEPER
  std::string endpoint() const;     // "addr:port" for other keepers; empty without a listener
  // What it holds of `job` (empty: of every job).
  std::vector<SnapHeld> held(const std::string& job = "") const;
  KeeperTotals totals() const;
  // Drops every part of `job` here (not at its replicas).
  void release(const std::string& job);

  struct Impl;

 private:
  explicit SnapshotKeeper(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One line for `troupe status`: "3 parts + 2 copies, 12.1 MiB" (or "-" when empty).
std::string keeper_totals_text(const KeeperTotals& t);

}  // namespace troupe::checkpoint
