// scheduler/daemons/state_store.cc — StateStore over SQLite: schema, migrations, statements.
#include "scheduler/daemons/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace troupe::sched {
namespace {

// One use of a prepared statement (cached by the StateStore: parsing SQL on every write
// cost more than the write); the destructor resets it and clears its bindings.
class Stmt {
 public:
  Stmt(sqlite3* db, sqlite3_stmt* st) : db_(db), st_(st), rc_(st ? SQLITE_OK : SQLITE_ERROR) {}
  ~Stmt() {
    if (st_) {
      sqlite3_reset(st_);
      sqlite3_clear_bindings(st_);
    }
  }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Status prepared() const {
    return rc_ == SQLITE_OK ? ok_status() : io_error("sqlite prepare: {}", sqlite3_errmsg(db_));
  }
  Stmt& text(int i, const std::string& s) {
    sqlite3_bind_text(st_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& blob(int i, const std::string& s) {
    sqlite3_bind_blob(st_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& i64(int i, int64_t v) {
    sqlite3_bind_int64(st_, i, v);
    return *this;
  }
  // SQLITE_ROW -> true, SQLITE_DONE -> false, else an error.
  Result<bool> step() {
    int rc = sqlite3_step(st_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return io_error("sqlite step: {}", sqlite3_errmsg(db_));
  }
  Status run() {
    auto r = step();
    return r.ok() ? ok_status() : r.status();
  }
  std::string col_text(int i) const {
    auto* p = reinterpret_cast<const char*>(sqlite3_column_text(st_, i));
    return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(st_, i))) : std::string();
  }
  std::string col_blob(int i) const {
    auto* p = static_cast<const char*>(sqlite3_column_blob(st_, i));
    return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(st_, i))) : std::string();
  }
  int64_t col_i64(int i) const { return sqlite3_column_int64(st_, i); }

 private:
  sqlite3* db_;
  sqlite3_stmt* st_;
  int rc_;
};

constexpr const char* kSchemaV1 = R"sql(
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL, epoch INTEGER NOT NULL,
  restarts INTEGER NOT NULL, driver_restarts INTEGER NOT NULL, exit_code INTEGER NOT NULL,
  message TEXT NOT NULL, created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL,
  job_dir TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS procs (
  job_id TEXT NOT NULL, name TEXT NOT NULL, role TEXT NOT NULL, rank INTEGER NOT NULL,
  epoch INTEGER NOT NULL, agent_id TEXT NOT NULL, slot INTEGER NOT NULL, pid INTEGER NOT NULL,
  state TEXT NOT NULL, exit_code INTEGER NOT NULL, term_signal INTEGER NOT NULL,
  started_ms INTEGER NOT NULL, ended_ms INTEGER NOT NULL, PRIMARY KEY (job_id, name));
CREATE TABLE IF NOT EXISTS agents (
  id TEXT PRIMARY KEY, host TEXT NOT NULL, slots INTEGER NOT NULL, gpus INTEGER NOT NULL,
  last_seen_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS kv (
  job_id TEXT NOT NULL, epoch INTEGER NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
  PRIMARY KEY (job_id, epoch, key));
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, ts_ms INTEGER NOT NULL,
  type TEXT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id);
)sql";

// Version 2: each process's actor-system address, and the driver's actor placements.
constexpr const char* kSchemaV2 = R"sql(
ALTER TABLE procs ADD COLUMN actor_node TEXT NOT NULL DEFAULT '';
ALTER TABLE procs ADD COLUMN endpoint TEXT NOT NULL DEFAULT '';
CREATE TABLE IF NOT EXISTS placements (
  job_id TEXT NOT NULL, epoch INTEGER NOT NULL, actor TEXT NOT NULL, proc TEXT NOT NULL,
  PRIMARY KEY (job_id, epoch, actor));
)sql";

}  // namespace

const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::kPending: return "pending";
    case JobState::kRunning: return "running";
    case JobState::kRestarting: return "restarting";
    case JobState::kSucceeded: return "succeeded";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
  }
  return "?";
}

Result<JobState> parse_job_state(const std::string& s) {
  for (auto st : {JobState::kPending, JobState::kRunning, JobState::kRestarting, JobState::kSucceeded,
                  JobState::kFailed, JobState::kCancelled}) {
    if (s == job_state_name(st)) return st;
  }
  return data_loss("unknown job state '{}' in the database", s);
}

const char* proc_state_name(ProcState s) {
  switch (s) {
    case ProcState::kPending: return "pending";
    case ProcState::kStarting: return "starting";
    case ProcState::kRunning: return "running";
    case ProcState::kExited: return "exited";
    case ProcState::kLost: return "lost";
  }
  return "?";
}

Result<ProcState> parse_proc_state(const std::string& s) {
  for (auto st : {ProcState::kPending, ProcState::kStarting, ProcState::kRunning, ProcState::kExited,
                  ProcState::kLost}) {
    if (s == proc_state_name(st)) return st;
  }
  return data_loss("unknown process state '{}' in the database", s);
}

Result<std::unique_ptr<StateStore>> StateStore::open(const std::string& path) {
  // Created 0600 before SQLite opens it: SQLite gives the -wal and -shm files the mode of
  // the database file, so none of them is readable by anyone but its owner.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return io_error("cannot create state database {}: {}", path, std::strerror(errno));
  ::fchmod(fd, 0600);
  ::close(fd);
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return io_error("cannot open state database {}: {}", path, msg);
  }
  // No global allocation statistics: they take a mutex on every allocation.
  static const bool memstatus_off = [] { return sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0) == SQLITE_OK; }();
  (void)memstatus_off;
  std::unique_ptr<StateStore> store(new StateStore(db));
  sqlite3_busy_timeout(db, 2000);
  TROUPE_RETURN_IF_ERROR(store->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"));
  TROUPE_RETURN_IF_ERROR(store->migrate().with_context(path));
  store->start_checkpointer(path);
  return store;
}

void StateStore::start_checkpointer(const std::string& path) {
  if (sqlite3_open_v2(path.c_str(), &ck_db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, nullptr) !=
      SQLITE_OK) {
    sqlite3_close(ck_db_);
    ck_db_ = nullptr;
    return;  // commits keep checkpointing themselves (SQLite's default)
  }
  sqlite3_busy_timeout(ck_db_, 100);
  exec("PRAGMA wal_autocheckpoint=0").ignore();
  checkpointer_ = std::thread([this] {
    std::unique_lock<std::mutex> lk(ck_mu_);
    while (!ck_cv_.wait_for(lk, std::chrono::milliseconds(500), [this] { return ck_stop_; })) {
      lk.unlock();
      sqlite3_wal_checkpoint_v2(ck_db_, nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);
      lk.lock();
    }
  });
}

StateStore::~StateStore() {
  if (checkpointer_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(ck_mu_);
      ck_stop_ = true;
    }
    ck_cv_.notify_all();
    checkpointer_.join();
  }
  if (ck_db_) sqlite3_close(ck_db_);
  if (in_batch_) exec("COMMIT").ignore();
  for (auto& [sql, st] : stmts_) sqlite3_finalize(st);
  sqlite3_close(db_);
}

sqlite3_stmt* StateStore::prepare(const char* sql) {
  auto it = stmts_.find(sql);
  if (it != stmts_.end()) return it->second;
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db_, sql, -1, &st, nullptr) != SQLITE_OK) {
    sqlite3_finalize(st);
    return nullptr;
  }
  stmts_.emplace(sql, st);
  return st;
}

Status StateStore::begin_batch() {
  if (in_batch_) return failed_precondition("state store: a batch is already open");
  TROUPE_RETURN_IF_ERROR(exec("BEGIN"));
  in_batch_ = true;
  return ok_status();
}

Status StateStore::commit_batch() {
  if (!in_batch_) return ok_status();
  in_batch_ = false;
  Status s = exec("COMMIT");
  if (!s.ok() && !sqlite3_get_autocommit(db_)) exec("ROLLBACK").ignore();
  return s;
}

Status StateStore::exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return io_error("sqlite: {}", msg);
  }
  return ok_status();
}

Status StateStore::migrate() {
  // meta may not exist yet: a fresh database is version 0.
  int version = 0;
  {
    Stmt probe(db_, prepare("SELECT value FROM meta WHERE key = 'schema_version'"));
    if (probe.prepared().ok()) {
      TROUPE_ASSIGN_OR_RETURN(bool row, probe.step());
      if (row) version = std::stoi(probe.col_text(0));
    }
  }
  if (version > kSchemaVersion) {
    return failed_precondition("state database has schema version {}, newer than this build's {}", version,
                               kSchemaVersion);
  }
  // Each step runs in its own transaction and records the version it reached, so a
  // database of any older version is brought up to date in order.
  const char* steps[] = {kSchemaV1, kSchemaV2};
  for (int v = version + 1; v <= kSchemaVersion; ++v) {
    TROUPE_RETURN_IF_ERROR(exec("BEGIN"));
    Status s = exec(steps[v - 1]);
    if (s.ok()) s = meta_set("schema_version", std::to_string(v));
    if (!s.ok()) {
      exec("ROLLBACK").ignore();
      return s.with_context(fmt::format("migrating to schema version {}", v));
    }
    TROUPE_RETURN_IF_ERROR(exec("COMMIT"));
  }
  schema_version_ = kSchemaVersion;
  return ok_status();
}

Result<uint64_t> StateStore::next_job_seq() {
  TROUPE_ASSIGN_OR_RETURN(auto cur, meta_get("job_seq"));
  uint64_t next = cur ? std::stoull(*cur) + 1 : 1;
  TROUPE_RETURN_IF_ERROR(meta_set("job_seq", std::to_string(next)));
  return next;
}

Status StateStore::put_job(const JobRecord& j) {
  Stmt st(
      db_,
      prepare("INSERT OR REPLACE INTO jobs (id, spec, state, epoch, restarts, driver_restarts, exit_code, "
              "message, created_ms, updated_ms, job_dir) VALUES (?,?,?,?,?,?,?,?,?,?,?)"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, j.id).text(2, j.spec.to_json()).text(3, job_state_name(j.state)).i64(4, static_cast<int64_t>(j.epoch));
  st.i64(5, j.restarts).i64(6, j.driver_restarts).i64(7, j.exit_code).text(8, j.message);
  st.i64(9, j.created_ms).i64(10, j.updated_ms).text(11, j.job_dir);
  return st.run();
}

Result<std::vector<JobRecord>> StateStore::load_jobs() {
  Stmt st(db_,
          prepare("SELECT id, spec, state, epoch, restarts, driver_restarts, exit_code, message, created_ms, "
                  "updated_ms, job_dir FROM jobs ORDER BY created_ms, id"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  std::vector<JobRecord> out;
  for (;;) {
    TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
    if (!row) break;
    JobRecord j;
    j.id = st.col_text(0);
    TROUPE_ASSIGN_OR_RETURN(j.spec, JobSpec::from_json(st.col_text(1)));
    TROUPE_ASSIGN_OR_RETURN(j.state, parse_job_state(st.col_text(2)));
    j.epoch = static_cast<uint64_t>(st.col_i64(3));
    j.restarts = static_cast<int>(st.col_i64(4));
    j.driver_restarts = static_cast<int>(st.col_i64(5));
    j.exit_code = static_cast<int>(st.col_i64(6));
    j.message = st.col_text(7);
    j.created_ms = st.col_i64(8);
    j.updated_ms = st.col_i64(9);
    j.job_dir = st.col_text(10);
    out.push_back(std::move(j));
  }
  return out;
}

Status StateStore::put_proc(const ProcRecord& p) {
  Stmt st(
      db_,
      prepare("INSERT OR REPLACE INTO procs (job_id, name, role, rank, epoch, agent_id, slot, pid, state, "
              "exit_code, term_signal, started_ms, ended_ms, actor_node, endpoint) VALUES "
              "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, p.job_id).text(2, p.name).text(3, p.role).i64(4, p.rank).i64(5, static_cast<int64_t>(p.epoch));
  st.text(6, p.agent_id).i64(7, p.slot).i64(8, p.pid).text(9, proc_state_name(p.state));
  st.i64(10, p.exit_code).i64(11, p.term_signal).i64(12, p.started_ms).i64(13, p.ended_ms);
  st.text(14, p.actor_node).text(15, p.endpoint);
  return st.run();
}

Result<std::vector<ProcRecord>> StateStore::load_procs(const std::string& job_id) {
  Stmt st(
      db_,
      prepare("SELECT job_id, name, role, rank, epoch, agent_id, slot, pid, state, exit_code, term_signal, "
              "started_ms, ended_ms, actor_node, endpoint FROM procs WHERE job_id = ? ORDER BY role, rank"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id);
  std::vector<ProcRecord> out;
  for (;;) {
    TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
    if (!row) break;
    ProcRecord p;
    p.job_id = st.col_text(0);
    p.name = st.col_text(1);
    p.role = st.col_text(2);
    p.rank = static_cast<int>(st.col_i64(3));
    p.epoch = static_cast<uint64_t>(st.col_i64(4));
    p.agent_id = st.col_text(5);
    p.slot = static_cast<int>(st.col_i64(6));
    p.pid = static_cast<int>(st.col_i64(7));
    TROUPE_ASSIGN_OR_RETURN(p.state, parse_proc_state(st.col_text(8)));
    p.exit_code = static_cast<int>(st.col_i64(9));
    p.term_signal = static_cast<int>(st.col_i64(10));
    p.started_ms = st.col_i64(11);
    p.ended_ms = st.col_i64(12);
    p.actor_node = st.col_text(13);
    p.endpoint = st.col_text(14);
    out.push_back(std::move(p));
  }
  return out;
}

Status StateStore::put_placements(const std::string& job_id, uint64_t epoch,
                                  const std::vector<std::pair<std::string, std::string>>& placements) {
  TROUPE_RETURN_IF_ERROR(exec("SAVEPOINT placements"));
  Status s;
  {
    Stmt del(db_, prepare("DELETE FROM placements WHERE job_id = ? AND epoch = ?"));
    s = del.prepared();
    if (s.ok()) s = del.text(1, job_id).i64(2, static_cast<int64_t>(epoch)).run();
  }
  for (const auto& [actor, proc] : placements) {
    if (!s.ok()) break;
    Stmt ins(db_, prepare("INSERT INTO placements (job_id, epoch, actor, proc) VALUES (?,?,?,?)"));
    s = ins.prepared();
    if (s.ok()) s = ins.text(1, job_id).i64(2, static_cast<int64_t>(epoch)).text(3, actor).text(4, proc).run();
  }
  if (!s.ok()) {
    exec("ROLLBACK TO placements; RELEASE placements").ignore();
    return s;
  }
  return exec("RELEASE placements");
}

Result<std::vector<std::pair<std::string, std::string>>> StateStore::load_placements(const std::string& job_id,
                                                                                    uint64_t epoch) {
  Stmt st(db_, prepare("SELECT actor, proc FROM placements WHERE job_id = ? AND epoch = ? ORDER BY actor"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id).i64(2, static_cast<int64_t>(epoch));
  std::vector<std::pair<std::string, std::string>> out;
  for (;;) {
    TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
    if (!row) break;
    out.emplace_back(st.col_text(0), st.col_text(1));
  }
  return out;
}

Status StateStore::put_agent(const AgentRecord& a) {
  Stmt st(db_,
          prepare("INSERT OR REPLACE INTO agents (id, host, slots, gpus, last_seen_ms) VALUES (?,?,?,?,?)"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, a.id).text(2, a.host).i64(3, a.slots).i64(4, a.gpus).i64(5, a.last_seen_ms);
  return st.run();
}

Result<std::vector<AgentRecord>> StateStore::load_agents() {
  Stmt st(db_, prepare("SELECT id, host, slots, gpus, last_seen_ms FROM agents ORDER BY id"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  std::vector<AgentRecord> out;
  for (;;) {
    TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
    if (!row) break;
    out.push_back(AgentRecord{st.col_text(0), st.col_text(1), static_cast<int>(st.col_i64(2)),
                              static_cast<int>(st.col_i64(3)), st.col_i64(4)});
  }
  return out;
}

Status StateStore::kv_set(const std::string& job_id, uint64_t epoch, const std::string& key,
                          const std::string& value) {
  Stmt st(db_, prepare("INSERT OR REPLACE INTO kv (job_id, epoch, key, value) VALUES (?,?,?,?)"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id).i64(2, static_cast<int64_t>(epoch)).text(3, key).blob(4, value);
  return st.run();
}

Result<std::optional<std::string>> StateStore::kv_get(const std::string& job_id, uint64_t epoch,
                                                      const std::string& key) {
  Stmt st(db_, prepare("SELECT value FROM kv WHERE job_id = ? AND epoch = ? AND key = ?"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id).i64(2, static_cast<int64_t>(epoch)).text(3, key);
  TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
  if (!row) return std::optional<std::string>();
  return std::optional<std::string>(st.col_blob(0));
}

Result<std::vector<std::pair<std::string, std::string>>> StateStore::kv_load(const std::string& job_id,
                                                                             uint64_t epoch) {
  Stmt st(db_, prepare("SELECT key, value FROM kv WHERE job_id = ? AND epoch = ?"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id).i64(2, static_cast<int64_t>(epoch));
  std::vector<std::pair<std::string, std::string>> out;
  for (;;) {
    TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
    if (!row) break;
    out.emplace_back(st.col_text(0), st.col_blob(1));
  }
  return out;
}

Status StateStore::kv_drop_job(const std::string& job_id) {
  Stmt st(db_, prepare("DELETE FROM kv WHERE job_id = ?"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id);
  return st.run();
}

Status StateStore::add_event(const std::string& job_id, int64_t ts_ms, const std::string& type,
                             const std::string& json) {
  Stmt st(db_, prepare("INSERT INTO events (job_id, ts_ms, type, detail) VALUES (?,?,?,?)"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id).i64(2, ts_ms).text(3, type).text(4, json);
  return st.run();
}

Result<int64_t> StateStore::count_events(const std::string& job_id) {
  Stmt st(db_, prepare("SELECT COUNT(*) FROM events WHERE job_id = ?"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, job_id);
  TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
  return row ? st.col_i64(0) : int64_t{0};
}

Result<std::optional<std::string>> StateStore::meta_get(const std::string& key) {
  Stmt st(db_, prepare("SELECT value FROM meta WHERE key = ?"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, key);
  TROUPE_ASSIGN_OR_RETURN(bool row, st.step());
  if (!row) return std::optional<std::string>();
  return std::optional<std::string>(st.col_text(0));
}

Status StateStore::meta_set(const std::string& key, const std::string& value) {
  Stmt st(db_, prepare("INSERT OR REPLACE INTO meta (key, value) VALUES (?,?)"));
  TROUPE_RETURN_IF_ERROR(st.prepared());
  st.text(1, key).text(2, value);
  return st.run();
}

}  // namespace troupe::sched
