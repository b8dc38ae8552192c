// tests/scheduler/units_test.cc — unit tests of the scheduler's parts: job specs and
// layouts, placement, the rendezvous table (with injected time), the SQLite state store
// (reopen, schema version), the wire codec (round trip, garbage), the spawner (logs, exit
// codes, signals, process-group kill, missing programs) and events.jsonl.
#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "scheduler/client/job_spec.h"
#include "scheduler/client/protocol.h"
#include "scheduler/daemons/event_log.h"
#include "scheduler/daemons/placement.h"
#include "scheduler/daemons/receive_lag.h"
#include "scheduler/daemons/rendezvous.h"
#include "scheduler/daemons/spawner.h"
#include "scheduler/daemons/state_store.h"
#include "tests/scheduler/harness.h"

namespace troupe::sched {
namespace {

using std::chrono::milliseconds;

std::string slurp(const std::string& p) {
  std::ifstream f(p);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// The layout parser itself: tests/core/parallel_layout_test.cc.
TEST(JobSpec, LayoutsParseAndMismatchesAreNamed) {
  JobSpec s;
  s.argv = {"app"};
  s.nproc = 4;
  EXPECT_EQ(s.parsed_layout(), ParallelLayout::make(1, 4, 1).value());  // no layout: all dp
  s.layout = "2x1x2";
  ASSERT_TRUE(s.validate().ok());
  EXPECT_EQ(s.layout, "pp=2,dp=1,n=2");  // rewritten in the canonical form
  EXPECT_EQ(s.parsed_layout(), ParallelLayout::make(2, 1, 2).value());
  s.layout = "pp=0,dp=4";
  Status bad = s.validate();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("job spec: parallel layout 'pp=0,dp=4': pp must be >= 1"), std::string::npos)
      << bad.message();
  s.layout = "tp=2";
  EXPECT_NE(s.validate().message().find("unknown key 'tp'"), std::string::npos);
  s.layout = "pp=1,dp=1,n=2";
  Status v = s.validate();
  EXPECT_EQ(v.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.message().find("needs 2 workers but nproc is 4"), std::string::npos) << v.message();
  s.layout = "dp=2,n=2";
  ASSERT_TRUE(s.validate().ok());
  s.env["TROUPE_RANK"] = "1";
  EXPECT_FALSE(s.validate().ok());
}

TEST(JobSpec, JsonRoundTripAndUnknownFieldsRejected) {
  JobSpec s;
  s.argv = {"app", "--config", "x.toml"};
  s.env = {{"A", "1"}};
  s.nproc = 2;
  s.max_restarts = 3;
  s.checkpoint_dir = "/ckpt";
  auto back = JobSpec::from_json(s.to_json());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->argv, s.argv);
  EXPECT_EQ(back->env, s.env);
  EXPECT_EQ(back->max_restarts, 3);
  EXPECT_EQ(back->checkpoint_dir, "/ckpt");
  EXPECT_NE(JobSpec::from_json(R"({"argv":["a"],"nprocs":2})").status().message().find("unknown field 'nprocs'"),
            std::string::npos);
  EXPECT_FALSE(JobSpec::from_json("{not json").ok());
}

TEST(Placement, KeepsEachMoeGroupInsideOneNode) {
  std::vector<AgentCapacity> agents = {{"a", {0, 1, 2}}, {"b", {0, 1, 2, 3}}, {"c", {1}}};
  auto p = place_workers(ParallelLayout::make(1, 3, 2).value(), agents);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  ASSERT_EQ(p->size(), 6u);
  for (int g = 0; g < 3; ++g) EXPECT_EQ((*p)[g * 2].agent_id, (*p)[g * 2 + 1].agent_id) << "group " << g;
  // a takes one group (3 slots, one left over), b two groups.
  EXPECT_EQ((*p)[0].agent_id, "a");
  EXPECT_EQ((*p)[2].agent_id, "b");
  EXPECT_EQ((*p)[4].agent_id, "b");
  EXPECT_EQ(place_driver(*p, agents), "a");
  // 4 groups of 2 do not fit in (3, 4, 1) although 8 slots are free.
  auto q = place_workers(ParallelLayout::make(1, 4, 2).value(), agents);
  EXPECT_EQ(q.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(q.status().message().find("a: 3, b: 4, c: 1"), std::string::npos) << q.status().message();
  EXPECT_FALSE(place_workers(ParallelLayout(), {}).ok());
}

TEST(Rendezvous, SetGetWaitAndDeadlinesNamespacedByJobAndEpoch) {
  RendezvousTable t(nullptr);
  auto now = RendezvousTable::Clock::time_point{} + std::chrono::hours(1);
  StoreRequest get{StoreOp::kGet, "j", 0, {"nccl_id"}, "", 500};
  EXPECT_FALSE(t.handle(get, 1, now).has_value());  // parked
  StoreRequest wait{StoreOp::kWait, "j", 0, {"nccl_id", "other"}, "", 1000};
  EXPECT_FALSE(t.handle(wait, 2, now).has_value());
  // A set in another epoch or job wakes nobody.
  ASSERT_TRUE(t.handle(StoreRequest{StoreOp::kSet, "j", 1, {"nccl_id"}, "E1", 0}, 3, now)->status().ok());
  ASSERT_TRUE(t.handle(StoreRequest{StoreOp::kSet, "k", 0, {"nccl_id"}, "K", 0}, 4, now)->status().ok());
  EXPECT_TRUE(t.take_ready(now).empty());
  ASSERT_TRUE(t.handle(StoreRequest{StoreOp::kSet, "j", 0, {"nccl_id"}, std::string("\0id", 3), 0}, 5, now));
  auto ready = t.take_ready(now);
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].first, 1u);
  EXPECT_EQ(ready[0].second.data, std::string("\0id", 3));
  // The wait still misses "other" and times out at its deadline, naming it.
  EXPECT_TRUE(t.take_ready(now + milliseconds(999)).empty());
  auto late = t.take_ready(now + milliseconds(1000));
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].second.code, StatusCode::kDeadlineExceeded);
  EXPECT_NE(late[0].second.message.find("other"), std::string::npos);
  auto c = t.handle(StoreRequest{StoreOp::kContains, "j", 1, {"nccl_id"}, "", 0}, 6, now);
  EXPECT_EQ(c->data, "1");
  EXPECT_EQ(t.handle(StoreRequest{StoreOp::kGet, "j", 1, {"nccl_id"}, "", 0}, 7, now)->data, "E1");
  EXPECT_EQ(t.handle(StoreRequest{StoreOp::kSet, "j", 0, {""}, "x", 0}, 8, now)->code, StatusCode::kInvalidArgument);
  // Ending a job answers its waiters.
  EXPECT_FALSE(t.handle(StoreRequest{StoreOp::kGet, "k", 0, {"never"}, "", 60000}, 9, now).has_value());
  t.drop_job("k");
  auto dropped = t.take_ready(now);
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].second.code, StatusCode::kCancelled);
}

TEST(StateStore, SurvivesReopenAndRefusesANewerSchema) {
  std::string dir = test::make_temp_dir("store");
  std::string path = dir + "/s.db";
  {
    auto s = StateStore::open(path);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    EXPECT_EQ(*(*s)->next_job_seq(), 1u);
    EXPECT_EQ(*(*s)->next_job_seq(), 2u);
    JobRecord j;
    j.id = "job-1";
    j.spec.argv = {"app"};
    j.spec.nproc = 4;
    j.state = JobState::kRunning;
    j.epoch = 2;
    j.job_dir = dir + "/jobs/job-1";
    ASSERT_TRUE((*s)->put_job(j).ok());
    ProcRecord p;
    p.job_id = "job-1";
    p.name = "worker-3";
    p.role = "worker";
    p.rank = 3;
    p.agent_id = "a2";
    p.slot = 1;
    p.pid = 1234;
    p.state = ProcState::kRunning;
    ASSERT_TRUE((*s)->put_proc(p).ok());
    ASSERT_TRUE((*s)->kv_set("job-1", 2, "k", std::string("v\0w", 3)).ok());
    ASSERT_TRUE((*s)->add_event("job-1", 5, "placed", "{}").ok());
  }
  {
    auto s = StateStore::open(path);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*(*s)->next_job_seq(), 3u);
    auto jobs = (*s)->load_jobs();
    ASSERT_TRUE(jobs.ok());
    ASSERT_EQ(jobs->size(), 1u);
    EXPECT_EQ((*jobs)[0].state, JobState::kRunning);
    EXPECT_EQ((*jobs)[0].epoch, 2u);
    EXPECT_EQ((*jobs)[0].spec.nproc, 4);
    auto procs = (*s)->load_procs("job-1");
    ASSERT_EQ(procs->size(), 1u);
    EXPECT_EQ((*procs)[0].agent_id, "a2");
    EXPECT_EQ((*procs)[0].pid, 1234);
    EXPECT_EQ(**(*s)->kv_get("job-1", 2, "k"), std::string("v\0w", 3));
    EXPECT_FALSE((*s)->kv_get("job-1", 1, "k")->has_value());
    EXPECT_EQ(*(*s)->count_events("job-1"), 1);
    ASSERT_TRUE((*s)->meta_set("schema_version", "99").ok());
  }
  auto newer = StateStore::open(path);
  EXPECT_EQ(newer.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(newer.status().message().find("schema version 99"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(StateStore, MigratesAVersionOneDatabase) {
  std::string dir = test::make_temp_dir("store-v1");
  std::string path = dir + "/v1.db";
  {
    // What a version-1 scheduler left behind (its procs table has no endpoint columns).
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    const char* v1 =
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema_version', '1');"
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL, epoch INTEGER NOT NULL,"
        " restarts INTEGER NOT NULL, driver_restarts INTEGER NOT NULL, exit_code INTEGER NOT NULL,"
        " message TEXT NOT NULL, created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, job_dir TEXT NOT NULL);"
        "CREATE TABLE procs (job_id TEXT NOT NULL, name TEXT NOT NULL, role TEXT NOT NULL, rank INTEGER NOT NULL,"
        " epoch INTEGER NOT NULL, agent_id TEXT NOT NULL, slot INTEGER NOT NULL, pid INTEGER NOT NULL,"
        " state TEXT NOT NULL, exit_code INTEGER NOT NULL, term_signal INTEGER NOT NULL,"
        " started_ms INTEGER NOT NULL, ended_ms INTEGER NOT NULL, PRIMARY KEY (job_id, name));"
        "INSERT INTO procs VALUES ('job-1','worker-0','worker',0,0,'a1',0,42,'running',0,0,1,0);"
        "CREATE TABLE agents (id TEXT PRIMARY KEY, host TEXT NOT NULL, slots INTEGER NOT NULL,"
        " gpus INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL);"
        "CREATE TABLE kv (job_id TEXT NOT NULL, epoch INTEGER NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,"
        " PRIMARY KEY (job_id, epoch, key));"
        "CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, ts_ms INTEGER NOT NULL,"
        " type TEXT NOT NULL, detail TEXT NOT NULL);";
    ASSERT_EQ(sqlite3_exec(db, v1, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_close(db);
  }
  auto s = StateStore::open(path);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ((*s)->schema_version(), 2);
  EXPECT_EQ(*(*s)->meta_get("schema_version"), std::optional<std::string>("2"));
  auto procs = (*s)->load_procs("job-1");
  ASSERT_TRUE(procs.ok()) << procs.status().to_string();
  ASSERT_EQ(procs->size(), 1u);
  EXPECT_EQ((*procs)[0].pid, 42);
  EXPECT_EQ((*procs)[0].endpoint, "");
  ASSERT_TRUE((*s)->put_placements("job-1", 0, {{"expert-0", "worker-0"}}).ok());
  ASSERT_TRUE((*s)->put_placements("job-1", 0, {{"expert-1", "worker-0"}, {"router", "driver"}}).ok());
  auto placed = (*s)->load_placements("job-1", 0);
  ASSERT_TRUE(placed.ok());
  ASSERT_EQ(placed->size(), 2u);  // replaced, not appended
  EXPECT_EQ((*placed)[0].first, "expert-1");
  s->reset();
  std::filesystem::remove_all(dir);
}

TEST(Codec, RoundTripsAndRejectsGarbage) {
  SpawnRequest sp;
  sp.job_id = "job-7";
  sp.name = "worker-1";
  sp.epoch = 3;
  sp.argv = {"app", "--x"};
  sp.env = {{"A", "1"}, {"B", ""}};
  std::string bytes = encode_message(Message{42, sp});
  auto back = decode_message(bytes.data(), bytes.size());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->request_id, 42u);
  auto* got = std::get_if<SpawnRequest>(&back->payload);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->argv, sp.argv);
  EXPECT_EQ(got->env, sp.env);
  EXPECT_EQ(got->epoch, 3u);

  Reply r{StatusCode::kNotFound, "unknown job", "{}", std::string("\x00\x01", 2), 9};
  std::string rb = encode_message(Message{1, r});
  auto rback = decode_message(rb.data(), rb.size());
  ASSERT_TRUE(rback.ok());
  EXPECT_EQ(std::get<Reply>(rback->payload).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(std::get<Reply>(rback->payload).data, std::string("\x00\x01", 2));

  // Truncated, misaligned-size, random and empty input: errors, never crashes.
  EXPECT_FALSE(decode_message(bytes.data(), bytes.size() - 8).ok());
  EXPECT_FALSE(decode_message(bytes.data(), 5).ok());
  EXPECT_FALSE(decode_message(bytes.data(), 0).ok());
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    std::string junk(8 * (1 + rng() % 32), '\0');
    for (auto& ch : junk) ch = static_cast<char>(rng());
    (void)decode_message(junk.data(), junk.size());  // must return, ok or not
  }
}

TEST(Codec, BeatsCarryTheirSendTime) {
  std::string ab = encode_message(Message{0, AgentHeartbeat{"a-1", 7, 1700000000123}});
  auto aback = decode_message(ab.data(), ab.size());
  ASSERT_TRUE(aback.ok());
  EXPECT_EQ(std::get<AgentHeartbeat>(aback->payload).sent_at_ms, 1700000000123);
  std::string pb =
      encode_message(Message{0, ProcBeat{"job-1", "worker-3", 2, 99, false, "", "", 1700000000456}});
  auto pback = decode_message(pb.data(), pb.size());
  ASSERT_TRUE(pback.ok());
  EXPECT_EQ(std::get<ProcBeat>(pback->payload).sent_at_ms, 1700000000456);
  EXPECT_EQ(std::get<ProcBeat>(pback->payload).name, "worker-3");
}

// Peers with clocks minutes apart, beating on time: no lag. Then most beats arrive 800 ms
// late (our receive path is behind): the median says so. One peer alone late, or one whose
// clock steps back by an hour: the median does not move. A shift every peer keeps for
// over a minute (every clock stepped back) is absorbed.
TEST(ReceiveLag, MedianExcessOverEachPeersBaseline) {
  ReceiveLag lag(milliseconds(2000));
  auto t = ReceiveLag::Clock::time_point{} + std::chrono::hours(1);
  int64_t wall = 1'700'000'000'000;
  EXPECT_EQ(lag.lag(t).count(), 0) << "no beats, no estimate";
  const int64_t skew[10] = {0, 120'000, -300'000, 5, -7, 42'000, 1, 2, 3, -60'000};
  auto round = [&](int64_t delay_ms, int late_peers, int64_t extra_for_peer0 = 0) {
    for (int p = 0; p < 10; ++p) {
      const int64_t sent = wall + skew[p] + (p == 0 ? -extra_for_peer0 : 0);
      lag.add("peer-" + std::to_string(p), sent, wall + 2 + (p < late_peers ? delay_ms : 0), t);
    }
    wall += 1000;
    t += milliseconds(1000);
  };
  for (int i = 0; i < 5; ++i) round(0, 0);
  EXPECT_LE(lag.lag(t).count(), 1);
  EXPECT_EQ(lag.peers(), 10u);
  for (int i = 0; i < 3; ++i) round(800, 8);
  EXPECT_GE(lag.lag(t).count(), 790);
  for (int i = 0; i < 3; ++i) round(0, 0);
  EXPECT_LE(lag.lag(t).count(), 1) << "the window forgets old beats";
  for (int i = 0; i < 3; ++i) round(5000, 1);
  EXPECT_LE(lag.lag(t).count(), 1) << "one late peer is that peer's problem";
  for (int i = 0; i < 3; ++i) round(0, 0, 3'600'000);
  EXPECT_LE(lag.lag(t).count(), 1) << "a clock step of one peer";
  for (int i = 0; i < 3; ++i) round(2000, 10);
  EXPECT_GE(lag.lag(t).count(), 1990);
  for (int i = 0; i < 65; ++i) round(2000, 10);
  EXPECT_LE(lag.lag(t).count(), 1) << "a lasting shift is absorbed within a minute";
  lag.add("old-sender", 0, wall, t);  // no stamp: ignored
  EXPECT_EQ(lag.peers(), 10u);
  lag.prune(wall + 120'000, 60'000);
  EXPECT_EQ(lag.peers(), 0u);
}

TEST(Spawner, LogsExitCodesSignalsAndGroupKill) {
  std::string dir = test::make_temp_dir("spawn");
  std::vector<std::string> env = {"PATH=/usr/bin:/bin", "GREETING=hi"};
  auto wait_exit = [](pid_t pid) {
    std::optional<ExitInfo> e;
    EXPECT_TRUE(test::wait_until([&] { return (e = try_reap(pid)).has_value(); }, std::chrono::seconds(10)));
    return e.value_or(ExitInfo{-1, 0});
  };
  auto c = spawn_process({{"sh", "-c", "echo $GREETING; echo err >&2; exit 5"}, env, dir, dir + "/logs/a.log", true});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_GE(c->pidfd, 0);
  EXPECT_EQ(wait_exit(c->pid).exit_code, 5);
  EXPECT_EQ(slurp(dir + "/logs/a.log"), "hi\nerr\n");
  close(c->pidfd);

  // A grandchild in the same group dies with a group kill.
  auto g = spawn_process({{"sh", "-c", "sleep 600 & echo $! > child.pid; wait"}, env, dir, dir + "/g.log", true});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(test::wait_until([&] { return !slurp(dir + "/child.pid").empty(); }, std::chrono::seconds(5)));
  pid_t grandchild = std::stoi(slurp(dir + "/child.pid"));
  EXPECT_TRUE(test::pid_alive(grandchild));
  EXPECT_EQ(getpgid(grandchild), g->pid);
  ASSERT_TRUE(kill_process_group(g->pid, SIGKILL).ok());
  auto e = wait_exit(g->pid);
  EXPECT_EQ(e.term_signal, SIGKILL);
  EXPECT_EQ(e.exit_status(), 137);
  EXPECT_TRUE(test::wait_until([&] { return !test::pid_alive(grandchild); }, std::chrono::seconds(5)));
  close(g->pidfd);

  auto missing = spawn_process({{"no-such-program-xyz"}, env, "", "", true});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  auto notexec = spawn_process({{"/etc/passwd"}, env, "", "", true});
  EXPECT_NE(notexec.status().message().find("exec /etc/passwd"), std::string::npos) << notexec.status().to_string();
  auto baddir = spawn_process({{"true"}, env, "/no/such/dir", "", true});
  EXPECT_NE(baddir.status().message().find("chdir /no/such/dir"), std::string::npos) << baddir.status().to_string();
  EXPECT_FALSE(kill_process_group(1, SIGKILL).ok());
  std::filesystem::remove_all(dir);
}

TEST(EventLog, AppendsTimestampedJsonLines) {
  std::string dir = test::make_temp_dir("events");
  auto log = EventLog::open(dir + "/jobs/job-1", "job-1");
  ASSERT_TRUE(log.ok());
  ASSERT_TRUE(log->append("proc_exited", {{"proc", "worker-2"}, {"signal", 9}}, 1795000000123).ok());
  ASSERT_TRUE(log->append("job_finished", nlohmann::json::object(), 1795000000200).ok());
  auto ev = test::read_events(log->path());
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["type"], "proc_exited");
  EXPECT_EQ(ev[0]["proc"], "worker-2");
  EXPECT_EQ(ev[0]["ts_ms"], 1795000000123);
  EXPECT_EQ(ev[0]["ts"], "2026-11-18T11:06:40.123Z");
  EXPECT_EQ(ev[1]["job"], "job-1");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace troupe::sched
