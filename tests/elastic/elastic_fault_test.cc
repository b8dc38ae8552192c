// tests/elastic/elastic_fault_test.cc — the fault-injection suite: a 4-worker train_moe
// job (dp=2, n=2, the tiny test model; the standalone launcher, no flag: every
// distributed job is elastic; in-memory snapshots after every step) survives real faults
// of real worker processes:
//   kill -9 during the forward pass (the first Ulysses all-to-all), during the MoE
//   all-to-all, SIGSTOP (a hang: heartbeat detection, the stopped process is killed and
//   replaced), two failures in a row, a lost worker with no spare left (the job shrinks to
//   dp=1), kill -9 while a checkpoint is being written from its snapshot, a damaged
//   snapshot part (skipped for the snapshot before it; every one damaged: the checkpoint),
//   a killed worker of an n=4 job under `troupe run` and of a pp=2 dp=2 job (losses
//   bitwise those of the fault-free run), a full disk during a checkpoint write, the final
//   save overtaking the commit of the last step's snapshot (a part landing late),
//   a rescale dp=2 -> dp=1 -> dp=2 asked through test.scale_at, and a
//   persistent straggler (150 ms slower every step) flagged from its step timings and
//   replaced by policy; the same protocol under `troupe run --elastic` (the scheduler
//   places, kills and reports the workers; no --elastic flag: the driver claims the
//   supervision); `troupe scale|replace|status`; a data-plane connection cut with no process lost (rebuilt in
//   place) and a hang inside a step with the heartbeat alive (step watchdog, then the wedged worker is killed
//   and replaced).
// Faults come from the config key test.inject (training/worker/elastic.h): the worker
// raises SIGKILL or SIGSTOP on itself at the named point, after recording the time.
//
// Checked in every case: the job exits 0; every step's loss equals the fault-free elastic
// run's within 1e-5 (relative; the same data order: every rank goes back to the newest
// snapshot and the steps after it run again, and a different dp keeps the global batch:
// each replica takes more micro-batches; bitwise where the layout is the baseline's own);
// events.jsonl holds the detection and recovery with detection <= 1 s after an exit (in the
// two bitwise cases <= 3 s from the fault, which includes the kernel's end of the killed
// process, and <= 1 s from the agent's record of the exit) and <= the heartbeat timeout + 1 s
// for a hang, recovery to the next completed step <= 10 s, steps
// lost <= K (elastic.snapshot_every); and no process of the job is left (its process
// group is empty).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "actors/actor_system.h"
#include "checkpoint/reader.h"
#include "comm/rendezvous_store.h"
#include "tests/common/train_moe_harness.h"
#include "training/role_actors.h"
#include "training/worker/elastic.h"

namespace {

// Messages no training actor accepts, for the malformed-message test: an unknown type id,
// and one with ActorStatusQuery's type id whose bytes are not a Cap'n Proto message.
struct UnknownMessage {
  static constexpr uint64_t kTypeId = 0x0E5A'0000'0000'7771ull;
  std::string junk;
  void encode(troupe::control::ByteWriter& w) const { w.put_bytes(junk); }
  static troupe::Result<UnknownMessage> decode(troupe::control::ByteReader& r) {
    UnknownMessage m;
    r.get_bytes(&m.junk);
    TROUPE_RETURN_IF_ERROR(r.finish("UnknownMessage"));
    return m;
  }
};
struct GarbledStatusQuery {
  static constexpr uint64_t kTypeId = troupe::training::ActorStatusQuery::kTypeId;
  std::string junk;
  void encode(troupe::control::ByteWriter& w) const { w.put_bytes(junk); }
  static troupe::Result<GarbledStatusQuery> decode(troupe::control::ByteReader& r) {
    GarbledStatusQuery m;
    r.get_bytes(&m.junk);
    TROUPE_RETURN_IF_ERROR(r.finish("GarbledStatusQuery"));
    return m;
  }
};

namespace fs = std::filesystem;
using troupe::test::events_named;
using troupe::test::latest_step_records;
using troupe::test::rel_diff;
using troupe::test::RunResult;

constexpr int64_t kSteps = 8;
// 3 s, above the 2 s default: at 1.5 s, with both cores busy (two spin loops and another
// test beside the job), a live worker went 1.54-1.55 s without a beat in three cases that do
// not study the heartbeat (a rebuild, the CLI commands, a late snapshot landing), and the
// extra failure broke them.
constexpr int64_t kHeartbeatTimeoutMs = 3000;
// Snapshots after every step (elastic.snapshot_every): a recovery runs at most this many
// steps again.
constexpr int64_t kSnapshotEvery = 1;

// Runs argv with extra environment variables, bounded by `timeout`; `tick` is called every
// 20 ms while it runs. After a clean exit the rest of the job's process group (workers die
// with the launcher or exit after "stop") gets 2 s to go, then group_empty_after_exit says
// whether it did; whatever is left is killed.
RunResult run(const std::vector<std::string>& argv, const std::vector<std::string>& env, const fs::path& log,
              std::chrono::seconds timeout, const std::function<void()>& tick = {}) {
  return troupe::test::run(argv, log, timeout,
                           {.env = env, .tick = tick, .group_exit_wait = std::chrono::milliseconds(2000)});
}

class ElasticFault : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(troupe::test::make_run_root("troupe-elastic"));
    const RunResult p =
        troupe::test::prepare_data(*root_ / "data", {}, *root_ / "prepare.log", std::chrono::seconds(120));
    ASSERT_EQ(p.exit_code, 0) << p.output;
  }
  static void TearDownTestSuite() {
    troupe::test::remove_run_root(*root_);
    delete root_;
  }

  // The job's command line: the tiny model at dp=2, n=2, a 3 s heartbeat timeout, the
  // fault to inject (test.inject) and further `key=value` settings ([elastic], ...).
  static std::vector<std::string> args(const std::string& name, const std::string& fault = "",
                                       std::vector<std::string> extra = {}) {
    troupe::test::TrainMoeCommand c;
    c.run_dir = *root_ / name;
    c.sets = troupe::test::tiny_model_sets({.steps = kSteps, .data_dir = *root_ / "data"});
    c.sets.push_back(fmt::format("elastic.heartbeat_timeout_ms={}", kHeartbeatTimeoutMs));
    c.sets.push_back(fmt::format("elastic.snapshot_every={}", kSnapshotEvery));
    if (!fault.empty()) c.sets.push_back(fmt::format("test.inject=\"{}\"", fault));
    for (auto& e : extra) c.sets.push_back(std::move(e));
    c.parallel = "dp=2,n=2";
    return c.argv();
  }

  // The fault-free elastic run (computed once).
  static const std::vector<nlohmann::json>& baseline() {
    static std::vector<nlohmann::json> ref;
    if (ref.empty()) {
      const RunResult r = run(args("baseline"), {}, *root_ / "baseline.log", std::chrono::seconds(180));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      ref = latest_step_records(*root_ / "baseline" / "metrics.jsonl");
      EXPECT_EQ(static_cast<int64_t>(ref.size()), kSteps) << r.output;
      // Every step is snapshotted: rank 0 reports what starting the copy took.
      for (const auto& s : ref) {
        EXPECT_TRUE(s.contains("snapshot_ms") && s["snapshot_ms"].get<double>() >= 0) << s.dump();
        EXPECT_EQ(s.value("snapshot", int64_t{-1}), s["step"].get<int64_t>()) << s.dump();
      }
      std::printf("[elastic] fault-free run: %.1f s\n", r.seconds);
    }
    return ref;
  }

  // Every step's loss equals the baseline's within 1e-5.
  static void expect_same_losses(const std::string& name, const RunResult& r) {
    const auto& ref = baseline();
    const auto got = latest_step_records(*root_ / name / "metrics.jsonl");
    ASSERT_EQ(got.size(), ref.size()) << r.output;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i]["step"], ref[i]["step"]);
      const double d = rel_diff(ref[i]["loss"].get<double>(), got[i]["loss"].get<double>());
      EXPECT_LE(d, 1e-5) << name << " step " << i + 1;
      worst = std::max(worst, d);
    }
    std::printf("[elastic %s] %zu steps, max relative loss difference vs fault-free %.3g\n", name.c_str(), got.size(),
                worst);
  }

  // Checks detection/recovery events against the targets and prints the figures.
  static void expect_recoveries(const std::string& name, const RunResult& r, size_t count, const std::string& cause,
                                int64_t detect_limit_ms) {
    const fs::path ev = *root_ / name / "events.jsonl";
    const auto det = events_named(ev, "failure_detected");
    const auto rec = events_named(ev, "recovered");
    ASSERT_EQ(det.size(), count) << r.output;
    ASSERT_EQ(rec.size(), count) << r.output;
    for (size_t i = 0; i < count; ++i) {
      EXPECT_EQ(det[i]["cause"], cause) << r.output;
      ASSERT_TRUE(det[i].contains("detection_ms")) << det[i].dump();
      const int64_t d = det[i]["detection_ms"].get<int64_t>();
      const double rs = rec[i]["recovery_s"].get<double>();
      const int64_t lost = rec[i]["steps_lost"].get<int64_t>();
      EXPECT_GE(d, 0);
      EXPECT_LE(d, detect_limit_ms) << name;
      EXPECT_LE(rs, 10.0) << name;
      EXPECT_LE(lost, kSnapshotEvery) << name;
      std::printf(
          "[elastic %s] failure %zu (%s, step %lld): detection %lld ms (target <= %lld), recovery to the "
          "next "
          "completed step %.2f s (target <= 10), steps lost %lld (target <= K = 1)\n",
          name.c_str(), i + 1, cause.c_str(), static_cast<long long>(det[i]["step"].get<int64_t>()),
          static_cast<long long>(d), static_cast<long long>(detect_limit_ms), rs,
          static_cast<long long>(lost));
    }
  }

  static void expect_clean_finish(const RunResult& r) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(r.group_empty_after_exit) << "a process of the job outlived it";
  }

  RunResult run_case(const std::string& name, const std::string& fault, std::vector<std::string> extra = {},
                     const std::function<void()>& tick = {}) {
    baseline();
    RunResult r = run(args(name, fault, std::move(extra)), {}, *root_ / (name + ".log"),
                      std::chrono::seconds(180), tick);
    std::printf("[elastic %s] ran in %.1f s\n", name.c_str(), r.seconds);
    return r;
  }

  static fs::path* root_;
};

fs::path* ElasticFault::root_ = nullptr;

TEST_F(ElasticFault, KillDuringForward) {
  const RunResult r = run_case("kill-forward", "kill@3:forward:1");
  expect_clean_finish(r);
  expect_same_losses("kill-forward", r);
  expect_recoveries("kill-forward", r, 1, "exit", 1000);
}

TEST_F(ElasticFault, KillDuringAllToAll) {
  const RunResult r = run_case("kill-alltoall", "kill@4:alltoall:2");
  expect_clean_finish(r);
  expect_same_losses("kill-alltoall", r);
  expect_recoveries("kill-alltoall", r, 1, "exit", 1000);
  // The rebuild travels as a typed ElasticPlan message to the stage actor of every
  // survivor (3 of the 4 workers) besides its store record; a worker records which it
  // took first (a new worker always reads the store).
  const auto opened = events_named(*root_ / "kill-alltoall" / "events.jsonl", "epoch_opened");
  ASSERT_EQ(opened.size(), 1u) << r.output;  // the rebuild (epoch 1)
  EXPECT_EQ(opened[0]["plan_messages"], 3) << opened[0].dump();
  const auto rec = events_named(*root_ / "kill-alltoall" / "events.jsonl", "recovered");
  ASSERT_EQ(rec.size(), 1u);
  const int64_t by_message = rec[0].value("plan_by_message", int64_t{-1});
  EXPECT_GE(by_message, 0) << rec[0].dump();
  EXPECT_LE(by_message, 3) << rec[0].dump();
  std::printf(
      "[elastic kill-alltoall] rebuild plan sent to 3 survivors as a message; %lld took it from the message, "
      "the others from the store\n",
      static_cast<long long>(by_message));
}

TEST_F(ElasticFault, SigstopHangIsDetectedByHeartbeat) {
  const RunResult r = run_case("sigstop", "stop@3:forward:3");
  expect_clean_finish(r);
  expect_same_losses("sigstop", r);
  expect_recoveries("sigstop", r, 1, "heartbeat", kHeartbeatTimeoutMs + 1000);
  EXPECT_EQ(events_named(*root_ / "sigstop" / "events.jsonl", "worker_killed").size(), 1u) << r.output;
}

// A bad action or phase is refused naming it and the words test.inject takes.
TEST(ElasticInject, UnknownActionOrPhaseNamesTheChoices) {
  using troupe::training::parse_faults;
  const auto act = parse_faults("kill@2:sync:0,explode@3:sync:1");
  ASSERT_FALSE(act.ok());
  EXPECT_NE(act.status().to_string().find(
                "unknown action 'explode' (kill, stop, slow, cut, hang, cutctl, corrupt)"),
            std::string::npos)
      << act.status().to_string();
  const auto ph = parse_faults("stop@2:backward:0");
  ASSERT_FALSE(ph.ok());
  EXPECT_NE(
      ph.status().to_string().find(
          "unknown phase 'backward' (forward, alltoall, sync, snapshot, landing, checkpoint, any, start)"),
      std::string::npos)
      << ph.status().to_string();
  const auto ok = parse_faults("corrupt@4:landing:1,cutctl@2:any:0");
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_TRUE(ok.value()[0].action == troupe::training::FaultSpec::Action::kCorrupt);
  EXPECT_TRUE(ok.value()[1].action == troupe::training::FaultSpec::Action::kCutControl);
}

// The fault grammar's start phase: only slow, only at step 0; the others keep step >= 1.
TEST(ElasticInject, StartPhaseTakesOnlySlowAtStepZero) {
  using troupe::training::FaultSpec;
  using troupe::training::parse_faults;
  const auto ok = parse_faults("slow@0:start:2,kill@3:forward:1");
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  ASSERT_EQ(ok.value().size(), 2u);
  EXPECT_EQ(ok.value()[0].phase, "start");
  EXPECT_EQ(ok.value()[0].slot, 2);
  EXPECT_TRUE(ok.value()[0].action == FaultSpec::Action::kSlow);
  for (const char* bad : {"kill@0:start:1", "slow@1:start:1", "slow@0:forward:1", "slow@0:begin:1"}) {
    const auto r = parse_faults(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.status().to_string().find("test.inject"), std::string::npos) << r.status().to_string();
    }
  }
}

// A worker that takes longer than the heartbeat timeout to start (here twice it, before
// its first beat) is starting, not silent: the job runs through without a recovery. Its
// first beat ends the grace: the heartbeat timeout applies from then on (the sigstop case).
TEST_F(ElasticFault, SlowStartIsNotASilentWorker) {
  const RunResult r = run_case("slow-start", "slow@0:start:2");
  expect_clean_finish(r);
  expect_same_losses("slow-start", r);
  const fs::path ev = *root_ / "slow-start" / "events.jsonl";
  EXPECT_EQ(events_named(ev, "failure_detected").size(), 0u) << r.output;
  EXPECT_EQ(events_named(ev, "worker_killed").size(), 0u) << r.output;
  EXPECT_NE(r.output.find("injects a slow start"), std::string::npos) << r.output;
}

TEST_F(ElasticFault, TwoFailuresInARow) {
  const RunResult r = run_case("two-failures", "kill@3:forward:1,kill@4:alltoall:0");
  expect_clean_finish(r);
  expect_same_losses("two-failures", r);
  expect_recoveries("two-failures", r, 2, "exit", 1000);
}

TEST_F(ElasticFault, LostWorkerWithoutSpareShrinksDp) {
  const RunResult r = run_case("no-spare", "kill@3:alltoall:3", {"elastic.spares=0"});
  expect_clean_finish(r);
  expect_same_losses("no-spare", r);
  expect_recoveries("no-spare", r, 1, "exit", 1000);
  const auto got = latest_step_records(*root_ / "no-spare" / "metrics.jsonl");
  ASSERT_EQ(static_cast<int64_t>(got.size()), kSteps);
  EXPECT_EQ(got.back()["dp"], 1) << r.output;
}

TEST_F(ElasticFault, ScaleDp2To1To2) {
  // dp 2 -> 1 after step 2, back to 2 after step 5 (scripted requests: test.scale_at).
  const fs::path dir = *root_ / "scale";
  const RunResult r = run_case("scale", "", {"test.scale_at=\"2:1,5:2\""});
  expect_clean_finish(r);
  expect_same_losses("scale", r);
  const auto scaled = events_named(dir / "events.jsonl", "scaled");
  ASSERT_EQ(scaled.size(), 2u) << r.output;
  EXPECT_EQ(scaled[0]["to_dp"], 1);
  EXPECT_EQ(scaled[1]["to_dp"], 2);
  const auto got = latest_step_records(dir / "metrics.jsonl");
  std::vector<int> dps;
  for (const auto& s : got) dps.push_back(s["dp"].get<int>());
  EXPECT_NE(std::find(dps.begin(), dps.end(), 1), dps.end());
  EXPECT_EQ(dps.back(), 2);
  for (const auto& s : scaled) {
    std::printf("[elastic scale] dp %d -> %d after step %lld in %lld ms\n", s["from_dp"].get<int>(), s["to_dp"].get<int>(),
                static_cast<long long>(s["after_step"].get<int64_t>()), static_cast<long long>(s["ms"].get<int64_t>()));
  }
}

TEST_F(ElasticFault, StragglerIsFlaggedAndReplacedByPolicy) {
  const RunResult r = run_case("straggler", "slow@2:any:2",
                               {"elastic.straggler_window=3", "elastic.straggler_policy=\"replace\""});
  expect_clean_finish(r);
  expect_same_losses("straggler", r);
  const fs::path ev = *root_ / "straggler" / "events.jsonl";
  const auto flagged = events_named(ev, "straggler");
  ASSERT_EQ(flagged.size(), 1u) << r.output;
  EXPECT_EQ(flagged[0]["slot"], 2);
  const auto det = events_named(ev, "failure_detected");
  ASSERT_EQ(det.size(), 1u) << r.output;
  EXPECT_EQ(det[0]["cause"], "straggler");
  const auto rec = events_named(ev, "recovered");
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(rec[0]["steps_lost"], 0);
  std::printf("[elastic straggler] slot 2 flagged at step %lld (compute %.0f ms vs peers' median %.0f ms), replaced in "
              "%.2f s\n",
              static_cast<long long>(flagged[0]["step"].get<int64_t>()), flagged[0]["compute_ms"].get<double>(),
              flagged[0]["peer_median_ms"].get<double>(), rec[0]["recovery_s"].get<double>());
}

TEST_F(ElasticFault, KillDuringCheckpointWrite) {
  const RunResult r = run_case("kill-ckpt", "kill@4:checkpoint:2", {"checkpoint.every=2"});
  expect_clean_finish(r);
  expect_same_losses("kill-ckpt", r);
  expect_recoveries("kill-ckpt", r, 1, "exit", 1000);
  // The interrupted checkpoint was written again and committed; retention keeps the last two.
  const fs::path ev = *root_ / "kill-ckpt" / "events.jsonl";
  std::vector<int64_t> committed;
  for (const auto& e : events_named(ev, "checkpoint_committed")) committed.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(committed, (std::vector<int64_t>{2, 4, 6, 8})) << r.output;
  EXPECT_TRUE(fs::exists(*root_ / "kill-ckpt" / "checkpoints" / "step_8" / "manifest.json"));
  EXPECT_FALSE(fs::exists(*root_ / "kill-ckpt" / "checkpoints" / "step_4.tmp"));
}

// The final save reaches the workers while the last step's snapshot is still landing
// (slot 1's part of step 8 lands 150 ms late, so its commit comes after the save command):
// the save writes that snapshot once it commits, it does not take a second snapshot of the
// step (which, a duplicate to the Trainer, would never commit: the save then waited past the
// step watchdog and the job went through a needless recovery).
TEST_F(ElasticFault, FinalSaveWhileTheLastSnapshotLands) {
  const RunResult r =
      run_case("late-landing", fmt::format("slow@{}:landing:1", kSteps), {"elastic.step_watchdog_ms=20000"});
  expect_clean_finish(r);
  expect_same_losses("late-landing", r);
  const fs::path ev = *root_ / "late-landing" / "events.jsonl";
  EXPECT_EQ(events_named(ev, "failure_detected").size(), 0u) << r.output;
  EXPECT_EQ(events_named(ev, "final_checkpoint_failed").size(), 0u) << r.output;
  std::vector<int64_t> committed;
  for (const auto& e : events_named(ev, "checkpoint_committed"))
    committed.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(committed, (std::vector<int64_t>{kSteps})) << r.output;
  EXPECT_TRUE(
      fs::exists(*root_ / "late-landing" / "checkpoints" / fmt::format("step_{}", kSteps) / "manifest.json"));
}

// A part of the newest snapshot damaged in the keeper's memory (a flipped byte): the
// restore finds it by the slice checksums, the snapshot is marked unusable with a clear
// event, and every rank goes back to the one before (K = 2: snapshots after steps 0, 2,
// 4, ...; slot 2 damages its part of step 4 in step 6, slot 1 dies in step 6).
TEST_F(ElasticFault, DamagedSnapshotIsSkippedForThePreviousOne) {
  const RunResult r =
      run_case("damaged", "corrupt@6:forward:2,kill@6:alltoall:1", {"elastic.snapshot_every=2"});
  expect_clean_finish(r);
  expect_same_losses("damaged", r);
  const fs::path ev = *root_ / "damaged" / "events.jsonl";
  const auto unusable = events_named(ev, "snapshot_unusable");
  ASSERT_EQ(unusable.size(), 1u) << r.output;
  EXPECT_EQ(unusable[0]["step"], 4);
  EXPECT_EQ(unusable[0]["slot"], 2);
  EXPECT_NE(unusable[0]["error"].get<std::string>().find("checksum"), std::string::npos)
      << unusable[0].dump();
  std::vector<int64_t> restored;
  for (const auto& e : events_named(ev, "restore_from_snapshot"))
    restored.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(restored, (std::vector<int64_t>{4, 2})) << r.output;
  const auto rec = events_named(ev, "recovered");
  ASSERT_EQ(rec.size(), 1u) << r.output;
  // Steps 3..5 run again; the driver counts as lost those it had seen complete: with two
  // step commands in flight, step 5's report may not have reached it when step 6 failed.
  const int64_t lost = rec[0]["steps_lost"].get<int64_t>();
  EXPECT_GE(lost, 2);
  EXPECT_LE(lost, 3);
  EXPECT_LE(rec[0]["recovery_s"].get<double>(), 10.0) << r.output;
  std::printf(
      "[elastic damaged] slot 2's part of snapshot 4 damaged: '%s'; restored snapshot 2, recovery %.2f s, "
      "steps lost %lld\n",
      unusable[0]["error"].get<std::string>().c_str(), rec[0]["recovery_s"].get<double>(),
      static_cast<long long>(lost));
}

// Every snapshot a rank still holds damaged: the job goes back to the newest checkpoint
// committed before the restore (written from the committed snapshots of steps 2 and 4).
// Normally that is step 4's. On a loaded machine step 4's checkpoint may still be in
// flight at step 6 (a load run saw slot 1 killed before its part was written, then a 20 s
// disk stall): the job must then take step 2's, never a damaged snapshot or nothing.
TEST_F(ElasticFault, NoUsableSnapshotRestoresTheCheckpoint) {
  const RunResult r = run_case("no-snapshot", "corrupt@6:forward:2,corrupt@6:alltoall:2,kill@6:sync:1",
                               {"elastic.snapshot_every=2", "checkpoint.every=2"});
  expect_clean_finish(r);
  expect_same_losses("no-snapshot", r);
  const fs::path ev = *root_ / "no-snapshot" / "events.jsonl";
  std::vector<int64_t> unusable;
  for (const auto& e : events_named(ev, "snapshot_unusable")) unusable.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(unusable, (std::vector<int64_t>{4, 2})) << r.output;
  // The newest checkpoint committed before the restore, in the events' order.
  int64_t newest = -1, restored = -1, restores = 0;
  for (const auto& e : troupe::test::read_jsonl(ev)) {
    const std::string name = e.value("event", "");
    if (name == "checkpoint_committed" && restores == 0) newest = std::max(newest, e["step"].get<int64_t>());
    if (name == "restore_from_checkpoint") {
      ++restores;
      restored = e["step"].get<int64_t>();
    }
  }
  ASSERT_EQ(restores, 1) << r.output;
  EXPECT_TRUE(newest == 2 || newest == 4) << "newest committed checkpoint before the restore: " << newest;
  EXPECT_EQ(restored, newest) << r.output;
  const auto rec = events_named(ev, "recovered");
  ASSERT_EQ(rec.size(), 1u) << r.output;
  // The steps after the restored one up to step 5 run again; step 5 counts as lost only
  // when its report had reached the driver before step 6 failed (two commands in flight).
  EXPECT_LE(rec[0]["steps_lost"].get<int64_t>(), 5 - restored);
  std::printf(
      "[elastic no-snapshot] snapshots 4 and 2 damaged: restored the step-%lld checkpoint, recovery %.2f s\n",
      static_cast<long long>(restored), rec[0]["recovery_s"].get<double>());
}

// A full disk during a checkpoint write: the checkpoint directory is a 4 MiB tmpfs the
// test mounts, mostly taken by a filler file (a checkpoint of this job is ~0.8 MB: the
// step-2 one fits, the step-4 one does not). The write fails with an error event naming
// the reason, the step-2 checkpoint stays whole and valid, training goes on; once space is
// freed (the filler removed, as an operator would) the next checkpoints commit.
TEST_F(ElasticFault, DiskFullDuringACheckpointKeepsThePreviousOneAndTheJob) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a tmpfs needs root";
  const fs::path dir = *root_ / "disk-full-ckpt";
  fs::create_directories(dir);
  ASSERT_EQ(::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=4m,mode=0700"), 0) << std::strerror(errno);
  struct Unmount {
    fs::path d;
    ~Unmount() { ::umount2(d.c_str(), MNT_DETACH); }
  } unmount{dir};
  const fs::path filler = dir / "filler";
  {
    std::ofstream f(filler, std::ios::binary);
    const std::string block(64 * 1024, 'x');
    for (int i = 0; i < (4096 - 1000) / 64; ++i) f << block;  // leaves ~1000 KiB
    ASSERT_TRUE(f.good());
  }
  const fs::path run_dir = *root_ / "disk-full";
  bool freed = false;
  auto tick = [&] {
    if (freed) return;
    for (const auto& e : events_named(run_dir / "events.jsonl", "checkpoint_failed")) {
      (void)e;
      std::error_code ec;
      fs::remove(filler, ec);
      freed = true;
    }
  };
  const RunResult r = run_case(
      "disk-full", "", {"checkpoint.every=2", fmt::format("checkpoint.dir=\"{}\"", dir.string())}, tick);
  expect_clean_finish(r);
  expect_same_losses("disk-full", r);
  const fs::path ev = run_dir / "events.jsonl";
  const auto failed = events_named(ev, "checkpoint_failed");
  ASSERT_GE(failed.size(), 1u) << r.output;
  EXPECT_EQ(failed[0]["step"], 4) << failed[0].dump();
  EXPECT_NE(failed[0]["error"].get<std::string>().find("No space left on device"), std::string::npos)
      << failed[0].dump();
  std::vector<int64_t> committed;
  for (const auto& e : events_named(ev, "checkpoint_committed"))
    committed.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(committed, (std::vector<int64_t>{2, 6, 8})) << r.output;
  // The checkpoint before the failure is whole: every slice's checksum holds.
  auto rd = troupe::checkpoint::CheckpointReader::open((dir / "step_2").string(),
                                                       troupe::checkpoint::VerifyMode::kChecksums);
  ASSERT_TRUE(rd.ok()) << rd.status().to_string();
  EXPECT_EQ(rd.value()->step(), 2);
  EXPECT_TRUE(events_named(ev, "failure_detected").empty()) << r.output;
  std::printf(
      "[elastic disk-full] step 4's checkpoint failed ('%s'); step 2's stayed valid; the job went on and "
      "committed steps 6 and 8 once space was freed\n",
      failed[0]["error"].get<std::string>().c_str());
}

// The same job with and without a worker killed -9 (restored from the snapshot): every
// loss bitwise equal. `troupe run` (the scheduler's agent holds the snapshots) or the
// standalone launcher (it holds them itself).
void expect_bitwise_after_kill(const fs::path& root, const std::string& name, const std::string& parallel,
                               const std::string& fault, bool troupe_run, int64_t snapshot_every,
                               int64_t expect_snapshot) {
  auto command = [&](const std::string& dir, const std::string& inject) {
    troupe::test::TrainMoeCommand c;
    c.run_dir = root / dir;
    c.sets = troupe::test::tiny_model_sets({.steps = kSteps, .data_dir = root / "data"});
    c.sets.push_back(fmt::format("elastic.heartbeat_timeout_ms={}", kHeartbeatTimeoutMs));
    c.sets.push_back(fmt::format("elastic.snapshot_every={}", snapshot_every));
    if (!inject.empty()) c.sets.push_back(fmt::format("test.inject=\"{}\"", inject));
    c.parallel = parallel;
    std::vector<std::string> a = c.argv();
    // The scheduler's silence verdicts get 5 s, on the job's processes as in
    // TroupeRunReplacesWorkersThroughTheScheduler and on the embedded agent: a loaded
    // machine can starve either for seconds, and what is checked here is the restore.
    if (troupe_run) {
      a.insert(a.begin(), {TROUPE_CLI_BIN, "run", "--nproc", "4", "--heartbeat-timeout-ms", "5000",
                           "--agent-timeout-ms", "5000", "--"});
    }
    return a;
  };
  const RunResult base =
      run(command(name + "-base", ""), {}, root / (name + "-base.log"), std::chrono::seconds(180));
  ASSERT_EQ(base.exit_code, 0) << base.output;
  const RunResult r = run(command(name, fault), {}, root / (name + ".log"), std::chrono::seconds(180));
  std::printf("[elastic %s] %s, %s: ran in %.1f s\n", name.c_str(), parallel.c_str(), fault.c_str(),
              r.seconds);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(r.group_empty_after_exit) << "a process of the job outlived it";
  const auto ref = latest_step_records(root / (name + "-base") / "metrics.jsonl");
  const auto got = latest_step_records(root / name / "metrics.jsonl");
  ASSERT_EQ(got.size(), ref.size()) << r.output;
  ASSERT_EQ(static_cast<int64_t>(ref.size()), kSteps);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i]["loss"].get<double>(), ref[i]["loss"].get<double>()) << name << " step " << i + 1;
  }
  const fs::path ev = root / name / "events.jsonl";
  const auto restore = events_named(ev, "restore_from_snapshot");
  ASSERT_EQ(restore.size(), 1u) << r.output;
  // The newest snapshot, or on a loaded machine the one before it: the newest may still be
  // landing when the fault comes (a snapshot counts once every rank's part has landed).
  EXPECT_LE(restore[0]["step"].get<int64_t>(), expect_snapshot) << r.output;
  EXPECT_GE(restore[0]["step"].get<int64_t>(), expect_snapshot - snapshot_every) << r.output;
  const auto det = events_named(ev, "failure_detected");
  const auto rec = events_named(ev, "recovered");
  ASSERT_EQ(det.size(), 1u) << r.output;
  ASSERT_EQ(rec.size(), 1u) << r.output;
  // From the fault (the worker's record of it, just before it kills itself) to the
  // driver's detection. This includes the kernel's end of the killed process, which once
  // took ~1 s on a 2-core machine with two busy loops and another suite running (the
  // driver saw the exit 4 ms after the agent did): hence the margin.
  const int64_t detection_ms = det[0]["detection_ms"].get<int64_t>();
  EXPECT_LE(detection_ms, 3000) << r.output;
  // Under `troupe run` the agent reports the exit at once (DESIGN "Detection"): from its
  // record of the process's end (scheduler_events.jsonl) to the driver's detection.
  std::string since_exit;
  if (troupe_run) {
    std::optional<int64_t> exited_ms;
    for (const auto& e : troupe::test::read_jsonl(root / name / "scheduler_events.jsonl")) {
      if (!exited_ms && e.value("type", "") == "proc_exited" && e.value("signal", 0) == 9)
        exited_ms = e.value("exited_at_ms", int64_t{0});
    }
    ASSERT_TRUE(exited_ms.has_value())
        << "no proc_exited event of the killed worker in scheduler_events.jsonl";
    const int64_t since = det[0]["detected_ms"].get<int64_t>() - *exited_ms;
    EXPECT_LE(since, 1000) << r.output;
    since_exit = fmt::format(" ({} ms after its agent saw the process end)", since);
  }
  EXPECT_LE(rec[0]["recovery_s"].get<double>(), 10.0) << r.output;
  EXPECT_LE(rec[0]["steps_lost"].get<int64_t>(), snapshot_every);
  std::printf(
      "[elastic %s] kill -9: detection %lld ms%s, restored the snapshot of step %lld, recovery %.2f s, steps "
      "lost %lld (<= K %lld); the %zu losses bitwise equal to the fault-free run\n",
      name.c_str(), static_cast<long long>(detection_ms), since_exit.c_str(),
      static_cast<long long>(restore[0]["step"].get<int64_t>()), rec[0]["recovery_s"].get<double>(),
      static_cast<long long>(rec[0]["steps_lost"].get<int64_t>()), static_cast<long long>(snapshot_every),
      got.size());
}

// `troupe run --nproc 4 ... --parallel n=4` (dp=1: no rank has a data-parallel peer),
// snapshots every 2 steps held by the agent: slot 2 killed in step 7, every rank goes back
// to the snapshot of step 6.
TEST_F(ElasticFault, NoDataParallelPeerRestoresTheSnapshotBitwise) {
  expect_bitwise_after_kill(*root_, "n4", "n=4", "kill@7:alltoall:2", /*troupe_run=*/true, 2, 6);
}

// pp=2, dp=2 under the standalone launcher (the launcher holds the snapshots): slot 3 (the
// second stage of dp replica 1) killed in step 5's gradient reduce-scatter.
TEST_F(ElasticFault, PipelineDataParallelRestoresTheSnapshotBitwise) {
  expect_bitwise_after_kill(*root_, "pp2dp2", "pp=2,dp=2", "kill@5:sync:3", /*troupe_run=*/false, 3, 3);
}

TEST_F(ElasticFault, MalformedControlMessagesAreDroppedAndTheJobGoesOn) {
  // Mid-run, an outside process reads the actors' endpoints from the job's store and sends
  // every training actor (the trainer, and stage/attention/experts of every worker) a
  // message of an unknown type, a status query whose bytes are garbage, a valid status
  // query (which must still be answered), and raw garbage frames to each endpoint. Each
  // bad message is refused (an error reply or a logged error); the job goes on and its
  // losses equal the fault-free run.
  const fs::path dir = *root_ / "malformed";
  int phase = 0;
  int refused = 0, answered = 0, actors_seen = 0;
  std::string problems;
  auto tick = [&] {
    if (phase != 0 || latest_step_records(dir / "metrics.jsonl").size() < 2) return;
    phase = 1;
    auto store = troupe::comm::FileStore::open(dir / "rendezvous");
    if (!store.ok()) {
      problems += store.status().to_string();
      return;
    }
    troupe::actors::ActorSystemOptions o;
    o.node_id = "intruder";
    o.threads = 1;
    troupe::control::TransportOptions t;
    t.bind_endpoint = "";  // a client only
    o.network = t;
    auto sys = troupe::actors::ActorSystem::create(std::move(o));
    if (!sys.ok()) {
      problems += sys.status().to_string();
      return;
    }
    zmq::context_t ctx;
    std::mt19937 rng(7);
    const auto status = nlohmann::json::parse(std::ifstream(dir / "status.json"), nullptr, false);
    std::vector<std::pair<std::string, std::string>> targets{{"driver", "trainer"}};  // node, actor
    for (const auto& a : status.value("actors", nlohmann::json::array())) {
      if (a.value("role", "") != "trainer") targets.emplace_back(a.value("node", ""), a.value("id", ""));
    }
    const auto started = events_named(dir / "events.jsonl", "job_started");
    if (started.empty()) {
      problems += "no job_started event; ";
      return;
    }
    const std::string job = started[0]["job"].get<std::string>();
    std::set<std::string> connected;
    for (const auto& [node, actor] : targets) {
      // Workers publish under their slot ("w3" -> "actors/3"), the driver as "actors/driver".
      const std::string k =
          job + "/elastic/actors/" + (node == "driver" ? std::string("driver") : node.substr(1));
      auto ep = (*store)->get(k, troupe::comm::deadline_in(std::chrono::seconds(5)));
      if (!ep.ok()) {
        problems += fmt::format("no endpoint for {}: {}; ", node, ep.status().to_string());
        continue;
      }
      const std::string endpoint = nlohmann::json::parse(*ep)["endpoint"].get<std::string>();
      if (connected.insert(node).second) {
        (void)(*sys)->connect(node, endpoint);
        // Raw garbage frames straight at the endpoint (no envelope at all).
        zmq::socket_t s(ctx, zmq::socket_type::dealer);
        s.set(zmq::sockopt::linger, 0);
        s.connect(endpoint);
        for (int i = 0; i < 20; ++i) {
          std::string junk(1 + rng() % 300, '\0');
          for (char& ch : junk) ch = static_cast<char>(rng());
          (void)s.send(zmq::buffer(junk), zmq::send_flags::dontwait);
        }
      }
      const troupe::actors::ActorRef ref(node, actor);
      ++actors_seen;
      auto bad1 = (*sys)->ask<troupe::actors::Ack>(ref, UnknownMessage{"??"}, std::chrono::seconds(5));
      auto bad2 =
          (*sys)->ask<troupe::actors::Ack>(ref, GarbledStatusQuery{"not capnp"}, std::chrono::seconds(5));
      (void)(*sys)->tell(ref, UnknownMessage{"a tell"});
      auto good = (*sys)->ask<troupe::training::ActorStatus>(ref, troupe::training::ActorStatusQuery{"test"},
                                                             std::chrono::seconds(5));
      for (auto* f : {&bad1, &bad2}) {
        auto r = f->get();
        if (!r.ok())
          ++refused;
        else
          problems += fmt::format("{} accepted a bad message; ", ref.to_string());
      }
      auto g = good.get();
      if (g.ok() && g->id == actor)
        ++answered;
      else
        problems += fmt::format("{} did not answer a valid query: {}; ", ref.to_string(),
                                g.ok() ? g->id : g.status().to_string());
    }
    (*sys)->shutdown();
  };
  const RunResult r = run_case("malformed", "slow@1:any:0", {}, tick);
  expect_clean_finish(r);
  expect_same_losses("malformed", r);
  EXPECT_EQ(phase, 1) << r.output;
  EXPECT_TRUE(problems.empty()) << problems;
  EXPECT_EQ(actors_seen, 13);  // the trainer + 3 actors on each of 4 workers
  EXPECT_EQ(refused, 2 * actors_seen);
  EXPECT_EQ(answered, actors_seen);
  EXPECT_TRUE(events_named(dir / "events.jsonl", "failure_detected").empty()) << r.output;
  std::printf(
      "[elastic malformed] %d actors: %d bad messages refused, %d valid queries answered, the job went on\n",
      actors_seen, refused, answered);
}

// An elastic job's checkpoint is Troupe's one format: plain `train_moe train --resume` loads
// it into another layout (dp=1, n=2: the ZeRO-1 moments resharded from dp=2), and an
// elastic job resumes from it too (--resume at dp=2, n=1); both continue
// the elastic run's steps 5..8 within 1e-6. `troupe checkpoints --dir` lists it.
TEST_F(ElasticFault, CheckpointResumesInAnotherLayoutWithPlainTrainMoe) {
  const RunResult saved = run_case("ckpt-format", "", {"checkpoint.every=4"});
  expect_clean_finish(saved);
  expect_same_losses("ckpt-format", saved);
  const auto ref = latest_step_records(*root_ / "ckpt-format" / "metrics.jsonl");
  ASSERT_EQ(static_cast<int64_t>(ref.size()), kSteps);
  const fs::path step4 = *root_ / "ckpt-format" / "checkpoints" / "step_4";
  ASSERT_TRUE(fs::exists(step4 / "manifest.json")) << saved.output;
  // The same config, so the same global batch (and data order) as the saved run at dp=2:
  // the micro-batches per replica follow from the layout.
  auto resumed = [&](const std::string& name, const std::string& layout) {
    std::vector<std::string> a = args(name);
    a.back() = layout;  // the value of --parallel
    a.push_back("--resume");
    a.push_back(step4.string());
    const RunResult r = run(a, {}, *root_ / (name + ".log"), std::chrono::seconds(180));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
    const auto got = latest_step_records(*root_ / name / "metrics.jsonl");
    // Steps 1..4 are not run again (no records), 5..8 are.
    double worst = 0;
    int compared = 0;
    for (const auto& g : got) {
      const int64_t step = g["step"].get<int64_t>();
      if (step <= 4) continue;
      const double d = rel_diff(ref[static_cast<size_t>(step - 1)]["loss"].get<double>(), g["loss"].get<double>());
      EXPECT_LE(d, 1e-6) << name << " step " << step;
      worst = std::max(worst, d);
      ++compared;
    }
    EXPECT_EQ(compared, kSteps - 4) << r.output;
    std::printf("[elastic %s] resumed the elastic checkpoint of step 4 at %s: steps 5..%lld, max relative loss "
                "difference vs the elastic run %.3g (%.1f s)\n",
                name.c_str(), layout.c_str(), static_cast<long long>(kSteps), worst, r.seconds);
  };
  resumed("ckpt-format-dp1", "dp=1,n=2");
  resumed("ckpt-format-n1", "dp=2,n=1");
  const RunResult ls = run({TROUPE_CLI_BIN, "checkpoints", "--dir", (*root_ / "ckpt-format" / "checkpoints").string(), "--json"},
                           {}, *root_ / "ckpt-format-ls.log", std::chrono::seconds(60));
  ASSERT_EQ(ls.exit_code, 0) << ls.output;
  const nlohmann::json j = nlohmann::json::parse(ls.output);
  std::vector<int64_t> steps;
  for (const auto& c : j["checkpoints"]) {
    EXPECT_TRUE(c["valid"].get<bool>()) << c.dump();
    EXPECT_EQ(c["layout"], "pp=1,dp=2,n=2") << c.dump();
    steps.push_back(c["step"].get<int64_t>());
  }
  std::sort(steps.begin(), steps.end());
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 8})) << ls.output;
}

TEST_F(ElasticFault, DataPlaneConnectionCutRebuildsWithoutReplacement) {
  // Slot 1 closes its own data-plane connections mid all-to-all but lives on: the peers'
  // errors are reported, nobody died or went silent, so every worker rebuilds in place.
  const RunResult r = run_case("cut", "cut@3:alltoall:1");
  expect_clean_finish(r);
  expect_same_losses("cut", r);
  expect_recoveries("cut", r, 1, "comm_error", 1000);
  const fs::path ev = *root_ / "cut" / "events.jsonl";
  EXPECT_EQ(events_named(ev, "worker_started").size(), 4u) << "nobody is replaced";
  EXPECT_TRUE(events_named(ev, "worker_killed").empty());
}

TEST_F(ElasticFault, HangInsideAStepIsCaughtByTheWatchdog) {
  // Slot 2's step thread blocks while its heartbeat goes on: the step watchdog fires, the
  // world is rebuilt, and slot 2, which never takes the new plan over, is killed and replaced.
  // The join timeout also bounds the replacement's start (exec to first beat): 3 s was
  // once too short on a loaded 2-core machine, and the replacement itself was replaced.
  constexpr int64_t kJoinMs = 5000;
  const RunResult r =
      run_case("hang", "hang@3:alltoall:2",
               {"elastic.step_watchdog_ms=2000", fmt::format("elastic.join_timeout_ms={}", kJoinMs)});
  expect_clean_finish(r);
  expect_same_losses("hang", r);
  const fs::path ev = *root_ / "hang" / "events.jsonl";
  const auto det = events_named(ev, "failure_detected");
  ASSERT_EQ(det.size(), 2u) << r.output;
  EXPECT_EQ(det[0]["cause"], "watchdog");
  EXPECT_EQ(det[1]["cause"], "join_timeout");
  EXPECT_EQ(det[1]["slots"], nlohmann::json::array({2}));
  const int64_t d = det[0]["detection_ms"].get<int64_t>();
  EXPECT_LE(d, 2000 + 1000);
  const auto rec = events_named(ev, "recovered");
  ASSERT_EQ(rec.size(), 1u);
  // Recovery waits out the join timeout before the wedged worker is replaced.
  const double recovery_limit_s = static_cast<double>(kJoinMs) / 1000 + 7;
  EXPECT_LE(rec[0]["recovery_s"].get<double>(), recovery_limit_s);
  EXPECT_EQ(rec[0]["steps_lost"], 0);
  std::printf(
      "[elastic hang] detection %lld ms (target <= watchdog 2000 + 1000), the wedged worker replaced after "
      "the %lld ms join timeout; recovery %.2f s (target <= join timeout + 7 s), steps lost %lld\n",
      static_cast<long long>(d), static_cast<long long>(kJoinMs), rec[0]["recovery_s"].get<double>(),
      static_cast<long long>(rec[0]["steps_lost"].get<int64_t>()));
}

TEST_F(ElasticFault, TroupeRunReplacesWorkersThroughTheScheduler) {
  // `troupe run` (no flag: the driver claims the supervision): the embedded scheduler and agent start the
  // driver and the 4 workers; a SIGSTOPped worker (found by the driver's heartbeat check, killed through the
  // scheduler) and then a killed one (its exit reported by the agent, passed to the driver through the job's
  // store) are replaced by processes the scheduler places.
  baseline();
  std::vector<std::string> a = args("troupe-run", "stop@3:forward:2,kill@5:alltoall:0");
  // The scheduler's own silence verdicts (the driver's beats and the embedded agent's
  // included) get 5 s: the stopped worker is the driver's to find
  // (elastic.heartbeat_timeout_ms, 3 s), and on a loaded machine a starved driver or agent
  // must not restart the job.
  a.insert(a.begin(), {TROUPE_CLI_BIN, "run", "--nproc", "4", "--heartbeat-timeout-ms", "5000",
                       "--agent-timeout-ms", "5000", "--"});
  const RunResult r = run(a, {}, *root_ / "troupe-run.log", std::chrono::seconds(180));
  std::printf("[elastic troupe-run] ran in %.1f s\n", r.seconds);
  expect_clean_finish(r);
  expect_same_losses("troupe-run", r);
  const fs::path ev = *root_ / "troupe-run" / "events.jsonl";
  const auto det = events_named(ev, "failure_detected");
  const auto rec = events_named(ev, "recovered");
  ASSERT_EQ(det.size(), 2u) << r.output;
  ASSERT_EQ(rec.size(), 2u) << r.output;
  EXPECT_EQ(det[0]["cause"], "heartbeat");
  EXPECT_EQ(det[1]["cause"], "exit");
  EXPECT_LE(det[0]["detection_ms"].get<int64_t>(), kHeartbeatTimeoutMs + 1000);
  // The kill: the agent reports the exit at once (DESIGN "Detection"), so from its record
  // of the process's end (scheduler_events.jsonl) to the driver's detection is bounded at
  // 1 s. From the worker's own fault record it also holds the injector's store of that
  // record, a durable write through the scheduler that once took 3.6 s in a load run
  // (the process died only after it): a looser bound there.
  std::optional<int64_t> exited_ms;
  for (const auto& e : troupe::test::read_jsonl(*root_ / "troupe-run" / "scheduler_events.jsonl")) {
    if (!exited_ms && e.value("type", "") == "proc_exited" && e.value("proc", "") == "worker-0" &&
        e.value("signal", 0) == 9)
      exited_ms = e.value("exited_at_ms", int64_t{0});
  }
  ASSERT_TRUE(exited_ms.has_value()) << "no proc_exited event of worker-0 in scheduler_events.jsonl";
  const int64_t since_exit = det[1]["detected_ms"].get<int64_t>() - *exited_ms;
  EXPECT_LE(since_exit, 1000) << r.output;
  EXPECT_LE(det[1]["detection_ms"].get<int64_t>(), 5000);
  std::printf("[elastic troupe-run] the kill detected %lld ms after the agent saw worker-0 end\n",
              static_cast<long long>(since_exit));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_LE(rec[i]["recovery_s"].get<double>(), 10.0);
    // At most the steps since the newest committed snapshot: with steps in flight the
    // stopped worker may have started the next step before its part of the last one landed.
    EXPECT_LE(rec[i]["steps_lost"].get<int64_t>(), kSnapshotEvery);
    std::printf("[elastic troupe-run] failure %zu (%s): detection %lld ms, recovery %.2f s, steps lost %lld\n", i + 1,
                det[i]["cause"].get<std::string>().c_str(), static_cast<long long>(det[i]["detection_ms"].get<int64_t>()),
                rec[i]["recovery_s"].get<double>(), static_cast<long long>(rec[i]["steps_lost"].get<int64_t>()));
  }
}

TEST_F(ElasticFault, TroupeReplaceScaleAndStatusCommands) {
  // `troupe replace|scale|status <run dir>` against the running job (slot 0 is slowed by
  // 150 ms a step so the commands land mid-run).
  const fs::path dir = *root_ / "cli";
  int phase = 0;
  std::vector<RunResult> cmds;
  auto troupe = [&](std::vector<std::string> a, const std::string& log) {
    a.insert(a.begin(), TROUPE_CLI_BIN);
    cmds.push_back(run(a, {}, *root_ / log, std::chrono::seconds(60)));
  };
  auto tick = [&] {
    if (phase == 0 && !latest_step_records(dir / "metrics.jsonl").empty()) {
      phase = 1;
      troupe({"status", dir.string()}, "cli-status1.log");
      // The refusal first, while most of the steps are left: asked last, on a loaded
      // machine it came after the job had finished ("the job ended before answering").
      troupe({"scale", dir.string(), "--dp", "3"}, "cli-scale-refused.log");
      // The scale is asked as soon as the replacement's epoch opened (while `troupe
      // replace` still waits for its recovery), so the job still runs when it is taken:
      // asked after the replace returned, on a loaded machine it came after the last step.
      auto replaced = std::async(std::launch::async, [&] {
        return run({TROUPE_CLI_BIN, "replace", dir.string(), "1"}, {}, *root_ / "cli-replace.log",
                   std::chrono::seconds(60));
      });
      const auto opened_by = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (events_named(dir / "events.jsonl", "epoch_opened").empty() &&
             std::chrono::steady_clock::now() < opened_by) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      RunResult scaled = run({TROUPE_CLI_BIN, "scale", dir.string(), "--dp", "1"}, {},
                             *root_ / "cli-scale.log", std::chrono::seconds(60));
      cmds.push_back(replaced.get());
      cmds.push_back(std::move(scaled));
      troupe({"status", dir.string()}, "cli-status2.log");
      troupe({"top", dir.string(), "--once", "--events", "1000"}, "cli-top.log");
    }
  };
  // Slot 0 sleeps twelve times in every step (150 ms each: ~1.8 s a step): the job still
  // runs when the scale, asked after the replacement's epoch opened, is taken, even when
  // the CLI's processes start slowly on a loaded machine (at ~0.6 s a step, a fresh-clone
  // run once saw the job finish first; at ~1.2 s, a load run whose replacement took 1.5 s
  // to recover).
  const std::string slow = "slow@1:any:0,slow@1:forward:0,slow@1:alltoall:0,slow@1:sync:0";
  const RunResult r = run_case("cli", slow + "," + slow + "," + slow, {}, tick);
  expect_clean_finish(r);
  expect_same_losses("cli", r);
  ASSERT_EQ(cmds.size(), 6u) << r.output;
  EXPECT_EQ(cmds[0].exit_code, 0) << cmds[0].output;
  EXPECT_NE(cmds[0].output.find("dp 2"), std::string::npos) << cmds[0].output;
  // The launcher's keeper: what it holds of the workers' snapshots.
  EXPECT_NE(cmds[0].output.find("snapshots every 1 steps: newest committed step"), std::string::npos)
      << cmds[0].output;
  EXPECT_NE(cmds[0].output.find(" MiB"), std::string::npos) << cmds[0].output;
  EXPECT_EQ(cmds[1].exit_code, 1) << cmds[1].output;  // above the elastic bound (the configured dp=2)
  EXPECT_NE(cmds[1].output.find("refused"), std::string::npos) << cmds[1].output;
  EXPECT_EQ(cmds[2].exit_code, 0) << cmds[2].output;
  EXPECT_NE(cmds[2].output.find("replaced worker slot 1"), std::string::npos) << cmds[2].output;
  EXPECT_NE(cmds[2].output.find("steps lost 0"), std::string::npos) << cmds[2].output;
  EXPECT_EQ(cmds[3].exit_code, 0) << cmds[3].output;
  EXPECT_NE(cmds[3].output.find("scaled dp 2 -> 1"), std::string::npos) << cmds[3].output;
  EXPECT_EQ(cmds[4].exit_code, 0) << cmds[4].output;
  EXPECT_NE(cmds[4].output.find("dp 1"), std::string::npos) << cmds[4].output;
  // troupe top --once: metrics, the workers of status.json with their last step's times,
  // and the replacement and rescale among the recent events.
  EXPECT_EQ(cmds[5].exit_code, 0) << cmds[5].output;
  for (const char* s : {"tokens/s", "workers (status.json): epoch", "dp 1", "COMPUTE_MS", "cause=replace", "recovered", "scaled"}) {
    EXPECT_NE(cmds[5].output.find(s), std::string::npos) << s << "\n" << cmds[5].output;
  }
  {
    std::ifstream in(dir / "status.json");
    const nlohmann::json st = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(st.is_object());
    for (const auto& w : st["workers"]) EXPECT_TRUE(w.contains("compute_ms")) << st.dump();
  }
  for (const auto& c : cmds) std::printf("[elastic cli] %s", c.output.c_str());
}

}  // namespace
