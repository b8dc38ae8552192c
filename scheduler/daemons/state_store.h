// scheduler/daemons/state_store.h — defines StateStore, the scheduler's durable state in SQLite
// (jobs, processes and their placements, agents, rendezvous keys, events), and the
// records it holds (JobRecord, ProcRecord, AgentRecord).
//
// The schema is versioned (table meta, key schema_version); opening a database written
// by a newer schema is refused with a clear error, an older one is migrated in place.
// Writes go to the database at once (WAL mode, synchronous=NORMAL); outside a batch each
// is its own transaction. The scheduler wraps each turn of its loop in one batch
// (begin_batch / commit_batch) and sends its answers only after the commit, so a
// scheduler killed at any point restarts with every acknowledged job record, and a turn
// that handles thousands of messages costs one commit, not thousands. Statements are
// prepared once and cached. WAL checkpoints (which fsync) run on a thread of their own
// with its own connection (PASSIVE: they never block a commit), not inside a commit of
// the scheduler's loop. Not thread-safe: the scheduler's event loop owns it.
#pragma once

#include <sqlite3.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "scheduler/client/job_spec.h"

namespace troupe::sched {

inline constexpr int kSchemaVersion = 2;  // 2: process actor endpoints, actor placements

enum class JobState { kPending, kRunning, kRestarting, kSucceeded, kFailed, kCancelled };
const char* job_state_name(JobState s);
Result<JobState> parse_job_state(const std::string& s);
inline bool job_state_final(JobState s) {
  return s == JobState::kSucceeded || s == JobState::kFailed || s == JobState::kCancelled;
}

enum class ProcState { kPending, kStarting, kRunning, kExited, kLost };
const char* proc_state_name(ProcState s);
Result<ProcState> parse_proc_state(const std::string& s);

struct JobRecord {
  std::string id;
  JobSpec spec;
  JobState state = JobState::kPending;
  uint64_t epoch = 0;          // bumped on every restart of the workers
  int restarts = 0;            // worker restarts so far
  int driver_restarts = 0;
  int exit_code = 0;           // worst exit status of the final epoch (128+signal)
  std::string message;         // why it failed or was cancelled
  int64_t created_ms = 0;
  int64_t updated_ms = 0;
  std::string job_dir;         // on the scheduler's host: events.jsonl lives here
};

struct ProcRecord {
  std::string job_id;
  std::string name;            // "driver" or "worker-<rank>"
  std::string role;            // driver | worker
  int rank = 0;
  uint64_t epoch = 0;
  std::string agent_id;        // placement: which agent, which slot (-1: no slot)
  int slot = -1;
  int pid = 0;
  ProcState state = ProcState::kPending;
  int exit_code = 0;
  int term_signal = 0;
  int64_t started_ms = 0;
  int64_t ended_ms = 0;
  std::string actor_node;      // the process's actor system, once it said hello with one
  std::string endpoint;

  // The exit status the way a shell reports it: exit code, or 128 + signal.
  int exit_status() const { return term_signal ? 128 + term_signal : exit_code; }
};

struct AgentRecord {
  std::string id;
  std::string host;
  int slots = 0;
  int gpus = 0;
  int64_t last_seen_ms = 0;
};

class StateStore {
 public:
  static Result<std::unique_ptr<StateStore>> open(const std::string& path);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  Result<uint64_t> next_job_seq();
  Status put_job(const JobRecord& job);
  Result<std::vector<JobRecord>> load_jobs();

  Status put_proc(const ProcRecord& proc);
  Result<std::vector<ProcRecord>> load_procs(const std::string& job_id);

  // The driver's actor placement of one epoch (actor name -> process name); replaces it.
  Status put_placements(const std::string& job_id, uint64_t epoch,
                        const std::vector<std::pair<std::string, std::string>>& placements);
  Result<std::vector<std::pair<std::string, std::string>>> load_placements(const std::string& job_id, uint64_t epoch);

  Status put_agent(const AgentRecord& agent);
  Result<std::vector<AgentRecord>> load_agents();

  Status kv_set(const std::string& job_id, uint64_t epoch, const std::string& key, const std::string& value);
  Result<std::optional<std::string>> kv_get(const std::string& job_id, uint64_t epoch, const std::string& key);
  // Every key of (job, epoch) with its value.
  Result<std::vector<std::pair<std::string, std::string>>> kv_load(const std::string& job_id, uint64_t epoch);
  Status kv_drop_job(const std::string& job_id);

  Status add_event(const std::string& job_id, int64_t ts_ms, const std::string& type, const std::string& json);
  Result<int64_t> count_events(const std::string& job_id);

  Result<std::optional<std::string>> meta_get(const std::string& key);
  Status meta_set(const std::string& key, const std::string& value);

  int schema_version() const { return schema_version_; }

  // One transaction for every write until commit_batch. Batches do not nest. A write that
  // fails inside one undoes only itself (SQLite statement atomicity), except errors that
  // end the transaction (disk full, I/O), which commit_batch reports.
  Status begin_batch();
  Status commit_batch();
  bool in_batch() const { return in_batch_; }

 private:
  explicit StateStore(sqlite3* db) : db_(db) {}
  Status exec(const char* sql);
  Status migrate();
  sqlite3_stmt* prepare(const char* sql);  // cached; null (and sqlite3_errmsg) on error

  void start_checkpointer(const std::string& path);

  sqlite3* db_;
  int schema_version_ = 0;
  bool in_batch_ = false;
  sqlite3* ck_db_ = nullptr;  // the checkpointer's connection
  std::thread checkpointer_;
  std::mutex ck_mu_;
  std::condition_variable ck_cv_;
  bool ck_stop_ = false;
  std::unordered_map<std::string, sqlite3_stmt*> stmts_;
};

}  // namespace troupe::sched
