// training/worker/elastic.cc — ElasticPlan, fault injection and the elastic worker loop
// (elastic.h).
#include "training/worker/elastic.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "checkpoint/snapshot_client.h"
#include "checkpoint/snapshot_keeper.h"
#include "comm/control/host_addr.h"
#include "core/env.h"
#include "core/job_env.h"
#include "core/process_memory.h"
#include "data/token_data.h"
#include "training/checkpointing/checkpointing.h"
#include "training/checkpointing/snapshots.h"
#include "training/control.h"
#include "training/role_actors.h"
#include "training/stage/stage.h"

namespace troupe::training {

using Clock = std::chrono::steady_clock;

nlohmann::json ElasticPlan::to_json() const {
  nlohmann::json parts = nlohmann::json::array();
  for (const PartSource& s : snapshot_parts)
    parts.push_back({{"endpoints", s.endpoints}, {"xxh64", s.xxh64}});
  return nlohmann::json{{"epoch", epoch},
                        {"dp", dp},
                        {"grad_accum", grad_accum},
                        {"slots", slots},
                        {"has_state", has_state},
                        {"step_done", step_done},
                        {"seq", seq},
                        {"reason", reason},
                        {"checkpoint", checkpoint},
                        {"ckpt_every", ckpt_every},
                        {"ckpt_dir", ckpt_dir},
                        {"snapshot_step", snapshot_step},
                        {"snapshot_every", snapshot_every},
                        {"snapshot_dp", snapshot_dp},
                        {"snapshot_committed", snapshot_committed},
                        {"snapshot_parts", parts}};
}

Result<ElasticPlan> ElasticPlan::from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return data_loss("elastic: plan is not a JSON object: {}", text.substr(0, 200));
  try {
    ElasticPlan p;
    p.epoch = j.at("epoch").get<uint64_t>();
    p.dp = j.at("dp").get<int64_t>();
    p.grad_accum = j.at("grad_accum").get<int64_t>();
    p.slots = j.at("slots").get<std::vector<int>>();
    p.has_state = j.at("has_state").get<std::vector<bool>>();
    p.step_done = j.at("step_done").get<int64_t>();
    p.seq = j.at("seq").get<int64_t>();
    p.reason = j.value("reason", "");
    p.checkpoint = j.value("checkpoint", "");
    p.ckpt_every = j.value("ckpt_every", int64_t{0});
    p.ckpt_dir = j.value("ckpt_dir", "");
    p.snapshot_step = j.value("snapshot_step", int64_t{-1});
    p.snapshot_every = j.value("snapshot_every", int64_t{0});
    p.snapshot_dp = j.value("snapshot_dp", int64_t{0});
    p.snapshot_committed = j.value("snapshot_committed", int64_t{-1});
    for (const auto& s : j.value("snapshot_parts", nlohmann::json::array())) {
      p.snapshot_parts.push_back(
          PartSource{s.at("endpoints").get<std::vector<std::string>>(), s.at("xxh64").get<uint64_t>()});
    }
    if (p.slots.size() != p.has_state.size() || p.dp < 1 || p.grad_accum < 1) {
      return data_loss("elastic: inconsistent plan: {}", text.substr(0, 200));
    }
    return p;
  } catch (const std::exception& e) {
    return data_loss("elastic: malformed plan ({}): {}", e.what(), text.substr(0, 200));
  }
}

int ElasticPlan::rank_of_slot(int slot) const {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] == slot) return static_cast<int>(i);
  }
  return -1;
}

std::string elastic_key(const std::string& job, const std::string& rest) { return job + "/elastic/" + rest; }

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<std::vector<FaultSpec>> parse_faults(const std::string& spec) {
  std::vector<FaultSpec> out;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string::npos) comma = spec.size();
    const std::string item = spec.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) continue;
    FaultSpec f;
    const size_t at = item.find('@'), c1 = item.find(':'), c2 = item.rfind(':');
    if (at == std::string::npos || c1 == std::string::npos || c2 == c1 || c1 < at) {
      return invalid_argument("test.inject: '{}' is not <kill|stop>@<step>:<phase>:<slot>", item);
    }
    const std::string action = item.substr(0, at);
    if (action == "kill") {
      f.action = FaultSpec::Action::kKill;
    } else if (action == "stop") {
      f.action = FaultSpec::Action::kStop;
    } else if (action == "slow") {
      f.action = FaultSpec::Action::kSlow;
    } else if (action == "cut") {
      f.action = FaultSpec::Action::kCut;
    } else if (action == "hang") {
      f.action = FaultSpec::Action::kHang;
    } else if (action == "cutctl") {
      f.action = FaultSpec::Action::kCutControl;
    } else if (action == "corrupt") {
      f.action = FaultSpec::Action::kCorrupt;
    } else {
      return invalid_argument(
          "test.inject: unknown action '{}' (kill, stop, slow, cut, hang, cutctl or corrupt)", action);
    }
    f.phase = item.substr(c1 + 1, c2 - c1 - 1);
    if (f.phase != "forward" && f.phase != "alltoall" && f.phase != "sync" && f.phase != "checkpoint" &&
        f.phase != "snapshot" && f.phase != "any" && f.phase != "start") {
      return invalid_argument(
          "test.inject: unknown phase '{}' (forward, alltoall, sync, snapshot, checkpoint, any, start)",
          f.phase);
    }
    char* end = nullptr;
    const std::string step_s = item.substr(at + 1, c1 - at - 1), slot_s = item.substr(c2 + 1);
    f.step = std::strtoll(step_s.c_str(), &end, 10);
    const bool start = f.phase == "start";
    if (step_s.empty() || *end != '\0' || (start ? f.step != 0 : f.step < 1))
      return invalid_argument("test.inject: bad step in '{}' (phase start: step 0, else >= 1)", item);
    if (start && f.action != FaultSpec::Action::kSlow)
      return invalid_argument("test.inject: '{}': phase start takes only slow (slow@0:start:<slot>)", item);
    f.slot = static_cast<int>(std::strtol(slot_s.c_str(), &end, 10));
    if (slot_s.empty() || *end != '\0' || f.slot < 0)
      return invalid_argument("test.inject: bad slot in '{}'", item);
    out.push_back(f);
  }
  return out;
}

namespace {

// Fault injection state (one worker process).
struct FaultState {
  std::vector<FaultSpec> specs;
  std::vector<bool> fired;
  std::vector<int64_t> slowed_step;  // kSlow: the last step it slept in
  std::atomic<int64_t> step{0};
  int slot = 0;
  comm::RendezvousStore* store = nullptr;
  std::string job;
  std::function<void()> cut;          // aborts this worker's communicators
  std::function<void()> cut_control;  // closes its control-plane connection (may be empty)
  std::function<void()> corrupt;      // damages the newest intact snapshot part it holds
};
FaultState* g_faults = nullptr;

bool phase_matches(const std::string& phase, std::string_view what) {
  if (phase == "any") return true;
  if (phase == "forward") return what.rfind("ulysses seq->head", 0) == 0;
  if (phase == "alltoall") return what.rfind("expert dispatch", 0) == 0;
  if (phase == "sync") return what.rfind("grads", 0) == 0 || what.rfind("bf16 grads", 0) == 0;
  if (phase == "checkpoint") return what.rfind("checkpoint write", 0) == 0;
  if (phase == "snapshot") return what.rfind("snapshot of step", 0) == 0;
  return false;
}

void fault_hook(std::string_view what) {
  FaultState* fs = g_faults;
  if (fs == nullptr) return;
  for (size_t i = 0; i < fs->specs.size(); ++i) {
    const FaultSpec& f = fs->specs[i];
    if (f.action == FaultSpec::Action::kSlow) {
      const int64_t step = fs->step.load();
      if (f.slot == fs->slot && step >= f.step && fs->slowed_step[i] != step && phase_matches(f.phase, what)) {
        fs->slowed_step[i] = step;
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
      }
      continue;
    }
    // A checkpoint is written by the snapshot's writer thread while later steps run, and a
    // snapshot's point is met after the next step may have been launched ahead: both points
    // name their own step.
    int64_t at = fs->step.load();
    for (const std::string_view own :
         {std::string_view("checkpoint write of step "), std::string_view("snapshot of step ")}) {
      if (what.rfind(own, 0) == 0)
        at = std::strtoll(std::string(what.substr(own.size())).c_str(), nullptr, 10);
    }
    if (fs->fired[i] || f.slot != fs->slot || f.step != at || !phase_matches(f.phase, what)) continue;
    fs->fired[i] = true;
    (void)fs->store->set(elastic_key(fs->job, fmt::format("fault/{}", fs->slot)),
                         nlohmann::json{{"ts_ms", wall_ms()}, {"what", std::string(what)}, {"step", f.step}}.dump());
    const char* name = f.action == FaultSpec::Action::kKill      ? "SIGKILL"
                       : f.action == FaultSpec::Action::kStop    ? "SIGSTOP"
                       : f.action == FaultSpec::Action::kCut     ? "a data-plane cut"
                       : f.action == FaultSpec::Action::kHang    ? "a hang"
                       : f.action == FaultSpec::Action::kCorrupt ? "a damaged snapshot part"
                                                                 : "a control-connection cut";
    fmt::print(stderr, "elastic: slot {} injects {} at step {} during '{}'\n", fs->slot, name, f.step, what);
    std::fflush(stderr);
    switch (f.action) {
      case FaultSpec::Action::kKill: raise(SIGKILL); break;
      case FaultSpec::Action::kStop: raise(SIGSTOP); break;
      case FaultSpec::Action::kCut:
        if (fs->cut) fs->cut();
        break;
      case FaultSpec::Action::kCutControl:
        if (fs->cut_control) fs->cut_control();
        break;
      case FaultSpec::Action::kCorrupt:
        if (fs->corrupt) fs->corrupt();
        break;
      case FaultSpec::Action::kHang:
        while (true) std::this_thread::sleep_for(std::chrono::seconds(1));  // until killed
      case FaultSpec::Action::kSlow: break;
    }
  }
}

layers::TrainConfig layout_config(const layers::TrainConfig& tc, const ElasticPlan& plan) {
  layers::TrainConfig out = tc;
  out.parallel.dp = plan.dp;
  out.train.grad_accum = plan.grad_accum;
  return out;
}

// The store the Stage's communicators rendezvous through: waits are cut into short slices
// and give up (kAborted) once `cancel` is set — a worker joining an epoch that failed
// while it joined (a peer died during the rebuild) must not wait out the init timeout.
class CancellableStore final : public comm::RendezvousStore {
 public:
  CancellableStore(comm::RendezvousStore& base, const std::atomic<bool>& cancel) : base_(base), cancel_(cancel) {}
  Status set(std::string_view key, std::string_view value) override { return base_.set(key, value); }
  Result<std::string> get(std::string_view key, comm::Deadline deadline) override {
    while (true) {
      if (cancel_.load()) return aborted("rendezvous on '{}' cancelled: a newer membership epoch opened", key);
      Result<std::string> r = base_.get(key, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
      if (r.ok() || r.status().code() != StatusCode::kDeadlineExceeded || Clock::now() >= deadline) return r;
    }
  }
  Status wait(const std::vector<std::string>& keys, comm::Deadline deadline) override {
    while (true) {
      if (cancel_.load()) return aborted("rendezvous cancelled: a newer membership epoch opened");
      Status st = base_.wait(keys, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
      if (st.ok() || st.code() != StatusCode::kDeadlineExceeded || Clock::now() >= deadline) return st;
    }
  }
  Result<bool> contains(std::string_view key) override { return base_.contains(key); }

 private:
  comm::RendezvousStore& base_;
  const std::atomic<bool>& cancel_;
};

class ElasticWorker {
 public:
  ElasticWorker(const layers::TrainConfig& tc, ProgramFactory program, TolerantStore& store, std::string job,
                int slot, uint64_t epoch, const layers::Ctx& ctx, actors::ActorSystem* driver_system,
                observe::StepProbe* steps)
      : driver_system_(driver_system),
        tc_(tc),
        program_(std::move(program)),
        store_(store),
        job_(std::move(job)),
        slot_(slot),
        epoch_(epoch),
        ctx_(ctx),
        steps_(steps),
        comm_store_(store, cancel_) {}
  ~ElasticWorker() {
    stop_watcher_ = true;
    if (watcher_.joinable()) watcher_.join();
    actors_.reset();       // no plan or commit handler runs on a half-destroyed worker
    snapshotter_.reset();  // before the Stage it copies
  }

  Status run();
  // Fault injection (step thread): aborts this worker's communicators.
  void cut_connections() {
    if (stage_) stage_->abort_comms("fault injection: connections cut");
  }
  // Fault injection: damages the newest intact snapshot part this rank holds.
  void corrupt_snapshot() {
    std::lock_guard<std::mutex> lock(mu_);
    if (snapshotter_) snapshotter_->corrupt_newest();
  }

 private:
  std::string key(const std::string& rest) const { return elastic_key(job_, rest); }
  Result<ElasticPlan> read_plan(uint64_t epoch, std::chrono::milliseconds timeout);
  // The stage actor got the plan of a new epoch: remember it, and if it opens the next
  // epoch, abort the communicators as the watcher would (a step in progress unwinds).
  void on_plan(const ElasticPlan& plan);
  // Aborts the communicators for the opening of epoch `next` (once; caller holds mu_).
  void abort_for(uint64_t next, const char* how);
  bool has_plan(uint64_t epoch);
  Result<std::unique_ptr<Stage>> make_stage(const ElasticPlan& plan, int rank);
  // Adopts `plan` (stage built or rebuilt, state synced), then places this worker's actors
  // for its rank.
  Status join(const ElasticPlan& plan);
  Status join_epoch(const ElasticPlan& plan);
  // The keeper of this node's snapshots (TROUPE_SNAPSHOT_KEEPER, else one in this process).
  Status connect_keeper();
  // This epoch's snapshots of this rank (after a restore of `restored_step`, or -1).
  Status start_snapshots(int64_t restored_step);
  void watch();
  // Moves the commands the Trainer sent into queue_ (waiting at most `wait` for the
  // first): those of the current epoch from `seq` on, in order; older ones are dropped.
  void take_commands(std::chrono::milliseconds wait, int64_t seq);
  // Whether a snapshot (or a checkpoint's) is due after step `step`.
  bool snapshot_due(int64_t step) const;
  // Runs step `cmd.step` into `reply`: launches it (unless it was launched ahead), launches
  // the next queued step ahead of finishing it where the Stage and this step allow (no
  // snapshot due after it), then finishes it and starts its snapshot when one is due.
  Status run_step_command(const Command& cmd, StepReply& reply);

  actors::ActorSystem* driver_system_;  // a worker in the driver's process: its system (else null)
  layers::TrainConfig tc_;
  ProgramFactory program_;  // the app's stage program
  TolerantStore& store_;
  std::string job_;
  int slot_;
  std::mutex mu_;                 // guards stage_ swaps, epoch_/adopting_ against the watcher
  uint64_t epoch_;                // current epoch (main thread writes under mu_)
  layers::Ctx ctx_;               // where the Stage lives (the CPU, or this worker's GPU)
  observe::StepProbe* steps_;     // step timings for the health reports (may be null)
  uint64_t adopting_ = 0;         // highest epoch whose plan the main thread took over
  uint64_t aborted_for_ = 0;      // highest epoch whose opening aborted the communicators (under mu_)
  // Plans the Trainer sent the stage actor (ElasticPlan messages), by epoch (under mu_);
  // the store's record is the fallback.
  std::map<uint64_t, ElasticPlan> sent_plans_;
  bool plan_via_message_ = false;  // the last plan read came as a message
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<WorkerActors> actors_;  // the actors placed on this worker (role_actors.h)
  nlohmann::json ready_info_;             // what join_epoch tells the Trainer with "ready"
  int rank_ = -1;
  int64_t dp_ = 0;
  // Checkpoints: every ckpt_every_ steps into ckpt_dir_ (0: off), written from the
  // committed snapshot of that step; snapshots every snapshot_every_ steps.
  int64_t ckpt_every_ = 0;
  int64_t snapshot_every_ = 0;
  std::string ckpt_dir_;
  std::unique_ptr<checkpoint::SnapshotKeeper> own_keeper_;  // when no node keeper serves this worker
  std::shared_ptr<checkpoint::SnapshotClient> keeper_;
  std::unique_ptr<Snapshotter> snapshotter_;  // swapped under mu_ (the commit handler reads it)
  int64_t failed_snapshot_ = -1;              // the snapshot a failed join could not restore
  std::thread watcher_;
  std::atomic<bool> stop_watcher_{false};
  // Commands of the current epoch received and not yet served, in seq order (the Trainer
  // keeps up to train.steps_in_flight steps in flight), and the step launched ahead of its
  // command being served (-1: none).
  std::deque<StepCommand> queue_;
  int64_t launched_ahead_ = -1;
  std::atomic<bool> cancel_{false};  // set when epoch_+1 opened: in-progress rendezvous give up
  CancellableStore comm_store_;
};

Result<ElasticPlan> ElasticWorker::read_plan(uint64_t epoch, std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = sent_plans_.find(epoch); it != sent_plans_.end()) {
      plan_via_message_ = true;
      return it->second;
    }
  }
  TROUPE_ASSIGN_OR_RETURN(std::string text, store_.get(key(fmt::format("plan/{}", epoch)), comm::deadline_in(timeout)));
  plan_via_message_ = false;
  return ElasticPlan::from_json(text);
}

bool ElasticWorker::has_plan(uint64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sent_plans_.count(epoch) != 0) return true;
  }
  // During a store outage the plan can only come as a message: the step thread does not
  // wait for the store to answer.
  if (store_.in_outage()) return false;
  Result<bool> has = store_.try_contains(key(fmt::format("plan/{}", epoch)));
  return has.ok() && has.value();
}

void ElasticWorker::abort_for(uint64_t next, const char* how) {
  if (aborted_for_ >= next) return;
  if (epoch_ + 1 == next) cancel_ = true;
  // Only while the main thread has not taken the plan over (it rebuilds the
  // communicators, which must not be aborted).
  if (adopting_ < next && stage_)
    stage_->abort_comms(fmt::format("membership epoch {} opened ({})", next, how));
  aborted_for_ = next;
}

void ElasticWorker::on_plan(const ElasticPlan& plan) {
  std::lock_guard<std::mutex> lock(mu_);
  if (plan.epoch <= epoch_) return;  // an old plan (taken over already)
  sent_plans_.emplace(plan.epoch, plan);
  if (plan.epoch == epoch_ + 1) abort_for(plan.epoch, "message");
  // Wakes the idle loop: a command of a later epoch, dropped once it sees the plan.
  actors_->wake();
}

Result<std::unique_ptr<Stage>> ElasticWorker::make_stage(const ElasticPlan& plan, int rank) {
  const layers::TrainConfig tc = layout_config(tc_, plan);
  TROUPE_ASSIGN_OR_RETURN(layers::TokenShards train, layers::TokenShards::open(tc.data.dir, "train"));
  TROUPE_ASSIGN_OR_RETURN(layers::TokenShards val, layers::TokenShards::open(tc.data.dir, "val"));
  comm::StoreNamespace ns;
  ns.job = job_;
  ns.epoch = plan.epoch;
  return Stage::create(tc, rank, program_, comm_store_, ns, std::move(train), std::move(val), ctx_);
}

Status ElasticWorker::join(const ElasticPlan& plan) {
  actors_->set_state(plan.epoch == 0 ? "joining" : "recovering");
  TROUPE_RETURN_IF_ERROR(join_epoch(plan));
  // The actors of this rank exist before the Trainer learns the worker is ready (its
  // first command goes to stage.<rank>).
  const std::map<std::string, int64_t> params = stage_->params_by_role();
  TROUPE_RETURN_IF_ERROR(actors_->place(rank_, plan.epoch, params));
  actors_->step_done(stage_->steps_done(), 0.0);
  ready_info_["roles"] = hosted_roles(params);  // the actors the Trainer monitors
  // Which process this is, where (troupe status lists them; under the scheduler the
  // Trainer did not start it).
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
  ready_info_["pid"] = static_cast<int64_t>(getpid());
  ready_info_["host"] = std::string(host);
  ready_info_["plan_via"] = plan.epoch == 0 ? "start" : plan_via_message_ ? "message" : "store";
  return store_.set(key(fmt::format("ready/{}/{}", plan.epoch, slot_)), ready_info_.dump());
}

Status ElasticWorker::join_epoch(const ElasticPlan& plan) {
  // Tells the driver this worker took the plan over (a worker that never does is wedged).
  TROUPE_RETURN_IF_ERROR(store_.set(key(fmt::format("adopted/{}/{}", plan.epoch, slot_)), std::to_string(wall_ms())));
  const int rank = plan.rank_of_slot(slot_);
  comm::StoreNamespace ns;
  ns.job = job_;
  ns.epoch = plan.epoch;
  // The snapshots of the old epoch end first (a copy in flight lands before the state
  // changes; outside the lock: the watcher beats meanwhile).
  std::unique_ptr<Snapshotter> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::move(snapshotter_);
  }
  old.reset();
  // The Stage of this epoch: the same one with its communicators rebuilt when the rank
  // and dp stay, else a new one.
  const bool kept = stage_ && plan.epoch > 0 && plan.dp == dp_ && rank == rank_;
  if (kept) {
    TROUPE_RETURN_IF_ERROR(stage_->rebuild_comms(ns));
  } else {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<Stage> s, make_stage(plan, rank));
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = std::move(s);
  }
  rank_ = rank;
  dp_ = plan.dp;
  ready_info_ = nlohmann::json{{"ts_ms", wall_ms()}, {"rank", rank}};
  int64_t restored = -1;
  if (plan.snapshot_step >= 0) {
    // Every rank goes back to the snapshot, from its node's keeper (or through it from
    // the keeper holding the part's copy); a survivor ahead of it (steps in flight) too.
    const auto t0 = Clock::now();
    if (!keeper_)
      return failed_precondition("elastic: the plan restores a snapshot but this worker has no keeper");
    std::vector<std::string> parts;
    if (Status st = restore_snapshot(*keeper_, job_, plan, rank, *stage_, &parts); !st.ok()) {
      failed_snapshot_ = plan.snapshot_step;
      return Status(StatusCode::kDataLoss, st.message());
    }
    restored = plan.snapshot_step;
    ready_info_["from"] = fmt::format("snapshot {}", plan.snapshot_step);
    ready_info_["parts"] = parts;
    ready_info_["restore_ms"] = std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
  } else if (!plan.checkpoint.empty()) {
    // Every rank goes back to the checkpoint (no usable snapshot; or a resumed job).
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                            checkpoint::CheckpointReader::open(plan.checkpoint));
    if (reader->step() != plan.step_done) {
      return failed_precondition("elastic: checkpoint {} is of step {}, the plan says {}", plan.checkpoint,
                                 reader->step(), plan.step_done);
    }
    // Any saved layout (the job may have changed dp since the save): each rank reads its
    // owned slices.
    const int64_t adam = reader->manifest().metadata.value("adam_steps", reader->step());
    TROUPE_RETURN_IF_ERROR(stage_->restore(slice_source(*reader), adam));
    ready_info_["from"] = plan.checkpoint;
  } else if (plan.epoch > 0) {
    // Nobody was lost: a rank keeps its live state if it is exactly after step_done (the
    // interrupted command's optimizer, the first writer of the state, had not run; with
    // steps in flight a rank may have completed a later step: then it refuses, and the
    // Trainer restores a snapshot).
    if (!kept || stage_->steps_done() != plan.step_done) {
      // Aborted, not a permanent failure: the Trainer's next attempt restores a snapshot.
      return aborted(
          "elastic: rank {} cannot keep its state for epoch {}: it {} (the plan goes back to step {})", rank,
          plan.epoch,
          kept ? fmt::format("has run {} steps", stage_->steps_done()) : std::string("has a new stage"),
          plan.step_done);
    }
    stage_->clear_interrupted_step();
    ready_info_["from"] = "kept";
    restored = plan.snapshot_committed;  // the newest committed snapshot stays in this rank's memory
  } else if (plan.step_done == 0) {
    // A fresh start: a run started from a Hugging Face model (train.init_from) reads its
    // slices of it.
    TROUPE_RETURN_IF_ERROR(init_from_hf(*stage_, layout_config(tc_, plan)));
  }
  ready_info_["step_done"] = stage_->steps_done();
  TROUPE_RETURN_IF_ERROR(start_snapshots(restored));
  // A state that no snapshot holds yet (a fresh start, a checkpoint) is snapshotted at
  // once: a failure before the first scheduled snapshot then loses no more than K steps.
  // (Not in a one-process run: nothing would restore from it.)
  if (snapshotter_ && restored < 0 && snapshot_every_ > 0) {
    StepReply r;
    snapshotter_->after_step(plan.step_done, SnapshotDue::kNow, r);
    if (!r.snapshot_errors.empty())
      fmt::print(stderr, "elastic: slot {}: no snapshot of the starting state\n", slot_);
  }
  return ok_status();
}

Status ElasticWorker::connect_keeper() {
  if (snapshot_every_ <= 0 && ckpt_dir_.empty()) return ok_status();
  const std::optional<std::string> path = env::get(job_env::kSnapshotKeeper);
  if (driver_system_ != nullptr || !path) {
    // Nobody holds this node's snapshots (a one-process run, whose worker cannot fail alone;
    // a launcher without a keeper): a keeper in this process still makes checkpoints, but
    // its snapshots die with the worker.
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    TROUPE_ASSIGN_OR_RETURN(own_keeper_,
                            checkpoint::SnapshotKeeper::start(
                                {.node = fmt::format("{}-worker{}", host, slot_), .host_addr = ""}));
    if (driver_system_ == nullptr) {
      fmt::print(
          stderr,
          "elastic: slot {}: no snapshot keeper serves this worker ({} is not set): its snapshots live "
          "in its own process and do not survive it\n",
          slot_, job_env::kSnapshotKeeper);
      std::fflush(stderr);
    }
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::SnapshotClient> c,
                            checkpoint::SnapshotClient::connect(own_keeper_->socket_path()));
    keeper_ = std::move(c);
    return ok_status();
  }
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::SnapshotClient> c,
                          checkpoint::SnapshotClient::connect(*path));
  keeper_ = std::move(c);
  return ok_status();
}

Status ElasticWorker::start_snapshots(int64_t restored_step) {
  if (!keeper_) return ok_status();
  SnapshotterOptions o;
  o.job = job_;
  o.rank = rank_;
  o.slot = slot_;
  o.epoch = epoch_;
  o.every = snapshot_every_;
  o.ckpt_every = ckpt_every_;
  o.ckpt_dir = ckpt_dir_;
  o.ckpt_bytes_per_s = static_cast<uint64_t>(tc_.checkpoint.max_mb_per_s * 1e6);
  o.restored_step = restored_step;
  o.send_landed = [this](const SnapshotLanded& l) {
    if (!actors_->send(l).ok()) {
      fmt::print(stderr, "snapshot: slot {} could not tell the driver that step {} landed\n", slot_, l.step);
    }
  };
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<Snapshotter> s,
                          Snapshotter::create(keeper_, *stage_, std::move(o)));
  std::lock_guard<std::mutex> lock(mu_);
  snapshotter_ = std::move(s);
  return ok_status();
}

namespace {

void fill_step_reply(const StepReport& r, StepReply& m) {
  m.step = r.step;
  m.loss = r.loss;
  m.lm_loss = r.lm_loss;
  m.aux_loss = r.aux_loss;
  m.grad_norm = r.grad_norm;
  m.lr = r.lr;
  m.step_tokens = r.tokens;
  m.expert_load = r.expert_load;
  m.step_ms = r.step_ms;
  m.comm_ms = r.comm_ms;
  m.compute_ms = r.compute_ms;
  m.comm_ms_mean = r.comm_ms_mean;
  m.comm_by_kind_ms = r.comm_by_kind_ms;
  m.peak_bytes = r.peak_bytes;
  m.host_syncs = r.host_syncs;
  m.upload_waits = r.upload_waits;
  m.activation_bytes = r.activation_bytes;
  m.rss_peak_bytes = r.rss_peak_bytes;
  m.device_ms = r.device_ms;
  m.device_gap_ms = r.device_gap_ms;
}

}  // namespace

void ElasticWorker::watch() {
  int64_t beat = 0;
  // Polls: one attempt each, skipped while the store is out (TolerantStore), so an outage
  // never holds the worker, nor its exit, in a retry loop.
  while (!stop_watcher_) {
    (void)store_.try_set(key(fmt::format("hb/{}", slot_)), std::to_string(++beat));
    uint64_t next = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      next = epoch_ + 1;
    }
    Result<bool> has = store_.try_contains(key(fmt::format("plan/{}", next)));
    if (has.ok() && has.value()) {
      std::lock_guard<std::mutex> lock(mu_);
      abort_for(next, "store");
    }
    std::this_thread::sleep_for(kHeartbeatInterval);
  }
}

void ElasticWorker::take_commands(std::chrono::milliseconds wait, int64_t seq) {
  // Commands of an older epoch, or already served, are dropped; so is wake()'s marker.
  const auto keep = [&](const StepCommand& c) {
    const int64_t next = queue_.empty() ? seq : queue_.back().seq + 1;
    return c.epoch == epoch_ && c.seq >= next;
  };
  std::optional<StepCommand> c = actors_->next_command(wait);
  while (c) {
    if (keep(*c)) queue_.push_back(*c);
    c = actors_->next_command(std::chrono::milliseconds(0));
  }
}

bool ElasticWorker::snapshot_due(int64_t step) const {
  if (!snapshotter_) return false;
  return (snapshot_every_ > 0 && step % snapshot_every_ == 0) || (ckpt_every_ > 0 && step % ckpt_every_ == 0);
}

Status ElasticWorker::run_step_command(const Command& cmd, StepReply& reply) {
  if (g_faults != nullptr) g_faults->step = cmd.step;
  actors_->set_state("training");
  // A snapshot (and a checkpoint, written from it) after this step copies the state this
  // step leaves: the next step cannot be enqueued before the copy is, so it is not
  // launched ahead. Nor on the CPU, where launch_step runs the whole step: a step launched
  // ahead there would only hold this step's report back by a step (and a failure in it
  // would lose the report).
  const bool ahead_ok = ctx_.on_device() && stage_->can_launch_ahead() && !snapshot_due(cmd.step);
  if (launched_ahead_ == cmd.step) {
    reply.launched_ahead = true;  // enqueued while the step before was finishing
  } else {
    stage_->launch_step(cmd.step);
  }
  launched_ahead_ = -1;
  if (ahead_ok) {
    take_commands(std::chrono::milliseconds(0), cmd.seq + 1);
    const bool next_is_step = !queue_.empty() && queue_.front().seq == cmd.seq + 1 &&
                              static_cast<Command::Kind>(queue_.front().kind) == Command::Kind::kStep &&
                              queue_.front().step == cmd.step + 1;
    if (next_is_step) {
      // The fault points met while it is enqueued are that step's.
      if (g_faults != nullptr) g_faults->step = cmd.step + 1;
      stage_->launch_step(cmd.step + 1);
      launched_ahead_ = cmd.step + 1;
    }
  }
  const StepReport rep = stage_->finish_step(cmd.step);
  actors_->step_done(cmd.step, rep.step_ms);
  if (steps_ != nullptr) steps_->record_step(rep.step_ms, rep.compute_ms, rep.comm_ms);
  fill_step_reply(rep, reply);
  if (snapshotter_) {
    // The snapshot's copy runs while the next step does (nothing was launched ahead of it).
    snapshotter_->after_step(cmd.step, SnapshotDue::kSchedule, reply);
    // The step thread's time on it: what a checkpoint step stalls training by.
    if (reply.snapshot >= 0 && steps_ != nullptr) steps_->record_io(reply.snapshot_ms);
    fault_point(fmt::format("snapshot of step {}", cmd.step));
  }
  // The peak with this step's snapshot staging in it.
  reply.rss_peak_bytes = peak_resident_bytes();
  return ok_status();
}

Status ElasticWorker::run() {
  set_throw_on_comm_error(true);
  std::string device = "cpu";
  if (ctx_.on_device()) {
    device = fmt::format("cuda:{}", env::get_or("CUDA_VISIBLE_DEVICES", "0"));
  }
  if (driver_system_ != nullptr) {
    TROUPE_ASSIGN_OR_RETURN(
        actors_, WorkerActors::start_in(*driver_system_, slot_, store_, key(fmt::format("actors/{}", slot_)),
                                        std::move(device)));
  } else {
    TROUPE_ASSIGN_OR_RETURN(actors_,
                            WorkerActors::start(slot_, control::host_addr(), store_,
                                                key(fmt::format("actors/{}", slot_)), std::move(device)));
  }
  // Plans of new epochs the Trainer sends the stage actor (rebuild), and snapshot commits.
  actors_->on_plan([this](const ElasticPlan& p) { on_plan(p); });
  actors_->on_commit([this](const SnapshotCommitted& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (snapshotter_) snapshotter_->on_commit(c);
  });
  // Replies and failure reports go to the driver's trainer actor.
  TROUPE_RETURN_IF_ERROR(
      actors_->connect_driver(store_, key("actors/driver"), std::chrono::milliseconds(120000)));
  TROUPE_ASSIGN_OR_RETURN(ElasticPlan plan, read_plan(epoch_, std::chrono::milliseconds(120000)));
  if (plan.rank_of_slot(slot_) < 0) return invalid_argument("elastic: slot {} is not in the plan of epoch {}", slot_, epoch_);
  // The job's snapshots and checkpoints (the driver's choice, the same in every plan).
  ckpt_every_ = plan.ckpt_every;
  snapshot_every_ = plan.snapshot_every;
  ckpt_dir_ = plan.ckpt_dir;
  if (ckpt_every_ > 0 && ckpt_dir_.empty()) {
    return invalid_argument("elastic: the plan asks for checkpoints every {} steps but names no directory",
                            ckpt_every_);
  }
  TROUPE_RETURN_IF_ERROR(connect_keeper());
  adopting_ = epoch_;
  watcher_ = std::thread([this] { watch(); });
  bool healthy = true;
  // The last failure was the data plane's (CommFailure: a peer's loss, an aborted
  // communicator): this worker is sound and waits for the Trainer to re-form the job.
  bool peer_failure = false;
  Status st = ok_status();
  try {
    st = join(plan);
  } catch (const CommFailure& e) {
    st = unavailable("{}", e.what());
    peer_failure = true;
  }
  if (!st.ok()) healthy = false;
  int64_t seq = plan.seq;
  auto served_at = Clock::now();  // when the last command was served (its reply sent)
  while (true) {
    if (!healthy) {
      (void)actors_->report(WorkerFailure{epoch_, slot_, rank_, static_cast<uint16_t>(st.code()),
                                          actor_id("stage", rank_), st.to_string(), wall_ms(),
                                          std::exchange(failed_snapshot_, -1)});
      if (peer_failure) {
        fmt::print(
            "elastic: slot {} (rank {}): epoch {} lost a peer on the data plane ({}); waiting for the "
            "trainer to re-form the job\n",
            slot_, rank_, epoch_, st.message());
        std::fflush(stdout);
      } else {
        fmt::print(stderr, "elastic: slot {} (rank {}) failed in epoch {}: {}\n", slot_, rank_, epoch_,
                   st.to_string());
        std::fflush(stderr);
      }
      // What was queued or launched belongs to the failed epoch.
      queue_.clear();
      launched_ahead_ = -1;
    }
    // Wait for a command of this epoch or for the next epoch's plan.
    const auto idle_deadline = Clock::now() + std::chrono::milliseconds(600000);
    bool new_epoch = false;
    while (true) {
      if (has_plan(epoch_ + 1)) {
        new_epoch = true;
        break;
      }
      if (healthy && !queue_.empty()) break;
      // Commands come to this worker's stage actor; one of an older epoch, or one already
      // served, is dropped (take_commands).
      take_commands(std::chrono::milliseconds(healthy ? 50 : 20), seq);
      if (!healthy) queue_.clear();
      if (store_.past_limit()) return store_.limit_status();
      if (Clock::now() > idle_deadline) return deadline_exceeded("elastic: slot {}: no command for 600 s", slot_);
    }
    if (new_epoch) {
      TROUPE_ASSIGN_OR_RETURN(ElasticPlan p, read_plan(epoch_ + 1, std::chrono::milliseconds(10000)));
      {
        std::lock_guard<std::mutex> lock(mu_);
        adopting_ = p.epoch;
        if (stage_) stage_->abort_comms("adopting a new epoch");
        epoch_ = p.epoch;
        cancel_ = false;
      }
      queue_.clear();
      launched_ahead_ = -1;
      if (p.rank_of_slot(slot_) < 0) {
        fmt::print(stderr, "elastic: slot {} leaves the job in epoch {} ({})\n", slot_, p.epoch, p.reason);
        return ok_status();
      }
      peer_failure = false;
      try {
        st = join(p);
      } catch (const CommFailure& e) {
        st = unavailable("{}", e.what());
        peer_failure = true;
      }
      healthy = st.ok();
      seq = p.seq;
      served_at = Clock::now();
      continue;
    }
    const StepCommand next = queue_.front();
    queue_.pop_front();
    seq = next.seq;
    const Command cmd{next.seq, static_cast<Command::Kind>(next.kind), next.step};
    StepReply reply;
    reply.seq = cmd.seq;
    reply.kind = next.kind;
    // Zero when the command was queued before the last one was served (the driver kept
    // this worker ahead), else what the worker idled waiting for it.
    reply.command_wait_ms = std::chrono::duration<double>(Clock::now() - served_at).count() * 1e3;
    try {
      switch (cmd.kind) {
        case Command::Kind::kStep:
          TROUPE_RETURN_IF_ERROR(run_step_command(cmd, reply));
          break;
        case Command::Kind::kEval:
          reply.val_loss = stage_->evaluate();
          break;
        case Command::Kind::kStop:
          break;
        case Command::Kind::kSave:      // the job's last checkpoint, made durable before the reply
        case Command::Kind::kSnapshot:  // a snapshot off the schedule (a planned membership change)
          if (stage_->steps_done() != cmd.step) {
            return failed_precondition("{} of step {}: this rank has run {} steps",
                                       command_kind_name(cmd.kind), cmd.step, stage_->steps_done());
          }
          if (!snapshotter_) {
            return failed_precondition("{} of step {}: this worker takes no snapshots",
                                       command_kind_name(cmd.kind), cmd.step);
          }
          // A save waits for the checkpoint of the step under way already (a checkpoint
          // step), else writes the committed snapshot of the step (the last step's, or a
          // second attempt after a failed write), else takes a snapshot to write.
          if (cmd.kind == Command::Kind::kSnapshot) {
            snapshotter_->after_step(cmd.step, SnapshotDue::kNow, reply);
          } else if (!snapshotter_->has_checkpoint(cmd.step) && !snapshotter_->write_committed(cmd.step)) {
            snapshotter_->after_step(cmd.step, SnapshotDue::kCheckpoint, reply);
          }
          break;
      }
    } catch (const CommFailure& e) {
      st = unavailable("{}", e.what());
      healthy = false;
      peer_failure = true;
      continue;
    }
    if (snapshotter_) {
      if (cmd.kind != Command::Kind::kStep && reply.snapshot >= 0 && steps_ != nullptr)
        steps_->record_io(reply.snapshot_ms);
      snapshotter_->report(reply, cmd.kind == Command::Kind::kStop || cmd.kind == Command::Kind::kSave);
    }
    if (cmd.kind == Command::Kind::kStop && keeper_) {
      // The job is over: this rank's snapshots (and their copies) can go.
      (void)keeper_->release(job_, rank_);
    }
    reply.rank = rank_;
    reply.slot = slot_;
    reply.epoch = epoch_;
    take_commands(std::chrono::milliseconds(0), seq + 1);
    reply.next_queued = !queue_.empty();
    TROUPE_RETURN_IF_ERROR(actors_->send(reply));
    served_at = Clock::now();
    ++seq;
    if (cmd.kind == Command::Kind::kStop) return ok_status();
  }
}

}  // namespace

Status run_elastic_worker(const layers::TrainConfig& tc, const ProgramFactory& program,
                          comm::RendezvousStore& base_store, const std::string& job, int slot, uint64_t epoch,
                          std::function<void()> cut_control, const layers::Ctx& ctx,
                          actors::ActorSystem* driver_system, observe::StepProbe* steps) {
  // A store outage (the scheduler restarting) must not end the worker, up to the job's limit.
  TolerantStore::Options so;
  so.outage_limit = std::chrono::milliseconds(tc.elastic.scheduler_outage_limit_ms);
  so.who = fmt::format("worker slot {}", slot);
  so.where = env::get_or(job_env::kScheduler);
  TolerantStore store(base_store, so);
  std::unique_ptr<FaultState> faults;
  if (!tc.elastic.inject.empty() && epoch == 0) {
    TROUPE_ASSIGN_OR_RETURN(std::vector<FaultSpec> specs, parse_faults(tc.elastic.inject));
    faults = std::make_unique<FaultState>();
    faults->specs = std::move(specs);
    faults->fired.assign(faults->specs.size(), false);
    faults->slowed_step.assign(faults->specs.size(), -1);
    faults->slot = slot;
    faults->store = &store;
    faults->job = job;
    faults->cut_control = std::move(cut_control);
    g_faults = faults.get();
    set_fault_hook(&fault_hook);
  }
  if (faults) {
    for (const FaultSpec& f : faults->specs) {
      if (f.phase != "start" || f.slot != slot) continue;
      // A worker slow to start (exec, loading, a busy host): no beat until it is up.
      const int64_t ms = 2 * tc.elastic.heartbeat_timeout_ms;
      fmt::print(stderr, "elastic: slot {} injects a slow start ({} ms before its first beat)\n", slot, ms);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
  }
  ElasticWorker w(tc, program, store, job, slot, epoch, ctx, driver_system, steps);
  if (faults) {
    faults->cut = [&w] { w.cut_connections(); };
    faults->corrupt = [&w] { w.corrupt_snapshot(); };
  }
  Status st = w.run();
  set_fault_hook(nullptr);
  g_faults = nullptr;
  return st;
}

}  // namespace troupe::training
