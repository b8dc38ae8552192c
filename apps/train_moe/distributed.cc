// apps/train_moe/distributed.cc — train_moe's distributed modes: the driver (Trainer),
// the worker (Stage host) and the standalone launcher used when train_moe is run with a
// multi-rank layout outside `troupe run`. See commands.h (run_distributed) and
// docs/parallelism.md.
//
// Rendezvous: under the scheduler (TROUPE_SCHEDULER set), the scheduler's store for the
// job and epoch; otherwise a FileStore in <run dir>/rendezvous. Keys are namespaced by job
// id and epoch (TROUPE_JOB_ID / TROUPE_EPOCH; a fresh id from the standalone launcher).
// Used by Gloo and to exchange the workers' actor endpoints. Step control: the Trainer asks the
// workers' Stage actors (TROUPE_CONTROL=actors, the default) or, with
// TROUPE_CONTROL=store, passes the same messages through the store.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "actors/training/actor_control.h"
#include "actors/training/checkpointing.h"
#include "actors/training/trainer.h"
#include "apps/train_moe/commands.h"
#include "apps/train_moe/device.h"
#include "apps/train_moe/elastic_launch.h"
#include "comm/rendezvous_store.h"
#include "layers/token_data.h"
#include "layers/tokenizer.h"
#include "layers/train_config.h"
#include "scheduler/job_context.h"
#include "scheduler/scheduler_store.h"

extern char** environ;

namespace troupe::train_moe {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

Result<std::vector<std::string>> parse_parallel_flag(const std::string& spec) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    const std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      return invalid_argument("--parallel: '{}' is not key=value (e.g. --parallel pp=2,n=2)", item);
    }
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "pp" || k == "dp" || k == "n" || k == "compression") {
      out.push_back(fmt::format("parallel.{}={}", k, v));
    } else if (k == "dispatch") {
      out.push_back(fmt::format("parallel.dispatch=\"{}\"", v));
    } else {
      return invalid_argument("--parallel: unknown key '{}' (known: pp, dp, n, dispatch, compression)", k);
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

namespace {

const char* env(const char* name) { return std::getenv(name); }

Result<int64_t> env_int(const char* name, int64_t dflt) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0') return invalid_argument("{}='{}' is not an integer", name, v);
  return static_cast<int64_t>(x);
}

// Local worker processes of the standalone launcher. Each dies with the launcher
// (PR_SET_PDEATHSIG), and stop() ends and reaps every one.
class LocalWorkers {
 public:
  ~LocalWorkers() { stop(std::chrono::milliseconds(3000)); }

  Status start(const std::vector<std::string>& argv, int world, const std::string& job) {
    std::vector<std::string> base_env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string v(*e);
      bool ours = false;  // the variables set below replace any inherited ones
      for (const char* k : {"TROUPE_ROLE=", "TROUPE_RANK=", "TROUPE_WORLD_SIZE=", "TROUPE_JOB_ID=", "TROUPE_EPOCH="}) {
        ours |= v.rfind(k, 0) == 0;
      }
      if (!ours) base_env.push_back(v);
    }
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> envs = base_env;
      envs.push_back("TROUPE_ROLE=worker");
      envs.push_back(fmt::format("TROUPE_RANK={}", r));
      envs.push_back(fmt::format("TROUPE_WORLD_SIZE={}", world));
      envs.push_back("TROUPE_JOB_ID=" + job);
      envs.push_back("TROUPE_EPOCH=0");
      std::vector<char*> cargv, cenv;
      for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
      cargv.push_back(nullptr);
      for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
      cenv.push_back(nullptr);
      const pid_t parent = getpid();
      const pid_t pid = fork();
      if (pid < 0) return io_error("cannot fork worker {}", r);
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(125);
        execve("/proc/self/exe", cargv.data(), cenv.data());
        _exit(127);
      }
      pids_.push_back(pid);
      alive_.push_back(true);
    }
    return ok_status();
  }

  // OK while every worker runs (or has exited 0 after the job's stop).
  Status check() {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (!alive_[i]) continue;
      int status = 0;
      const pid_t r = waitpid(pids_[i], &status, WNOHANG);
      if (r == pids_[i]) {
        alive_[i] = false;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          return aborted("worker rank {} (pid {}) {} {}", i, pids_[i],
                         WIFEXITED(status) ? "exited with status" : "was killed by signal",
                         WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        }
        if (!stopping_) return aborted("worker rank {} (pid {}) exited before the job ended", i, pids_[i]);
      }
    }
    return ok_status();
  }

  // Waits for every worker to exit by itself within `grace`, then kills the rest.
  Status wait_all(std::chrono::milliseconds grace) {
    stopping_ = true;
    const auto deadline = Clock::now() + grace;
    Status first;
    while (Clock::now() < deadline) {
      Status st = check();
      if (!st.ok() && first.ok()) first = st;
      bool any = false;
      for (bool a : alive_) any |= a;
      if (!any) return first;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop(std::chrono::milliseconds(0));
    return first.ok() ? deadline_exceeded("workers did not exit within {} ms after stop", grace.count()) : first;
  }

  void stop(std::chrono::milliseconds grace) {
    stopping_ = true;
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (alive_[i]) kill(pids_[i], SIGTERM);
    }
    const auto deadline = Clock::now() + grace;
    for (size_t i = 0; i < pids_.size(); ++i) {
      while (alive_[i]) {
        int status = 0;
        const pid_t r = waitpid(pids_[i], &status, WNOHANG);
        if (r == pids_[i] || r < 0) {
          alive_[i] = false;
          break;
        }
        if (Clock::now() >= deadline) {
          kill(pids_[i], SIGKILL);
          waitpid(pids_[i], &status, 0);
          alive_[i] = false;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }

 private:
  std::vector<pid_t> pids_;
  std::vector<bool> alive_;
  bool stopping_ = false;
};

Status copy_file(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return io_error("cannot copy {} to {}: {}", from, to, ec.message());
  return ok_status();
}

constexpr std::chrono::milliseconds kCommandTimeout{600000};

// comm's store interface over the scheduler's rendezvous store (the app wires the two
// together: comm never includes scheduler code).
class SchedulerRendezvous final : public comm::RendezvousStore {
 public:
  explicit SchedulerRendezvous(std::unique_ptr<sched::SchedulerStore> s) : s_(std::move(s)) {}
  Status set(std::string_view key, std::string_view value) override { return s_->set(key, value); }
  Result<std::string> get(std::string_view key, comm::Deadline deadline) override { return s_->get(key, deadline); }
  Status wait(const std::vector<std::string>& keys, comm::Deadline deadline) override {
    return s_->wait(keys, deadline);
  }
  Result<bool> contains(std::string_view key) override { return s_->contains(key); }
  void disconnect() { s_->disconnect(); }  // elastic fault injection (cutctl)

 private:
  std::unique_ptr<sched::SchedulerStore> s_;
};

Result<std::unique_ptr<comm::RendezvousStore>> open_store(const std::string& run_dir) {
  const char* sched_addr = env("TROUPE_SCHEDULER");
  if (sched_addr != nullptr && *sched_addr != '\0' && env("TROUPE_ROLE") != nullptr) {
    TROUPE_ASSIGN_OR_RETURN(std::optional<sched::JobContext> ctx, sched::JobContext::from_env());
    if (ctx) {
      TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<sched::SchedulerStore> s, sched::SchedulerStore::connect(*ctx));
      return std::unique_ptr<comm::RendezvousStore>(std::make_unique<SchedulerRendezvous>(std::move(s)));
    }
  }
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::FileStore> fs, comm::FileStore::open(run_dir + "/rendezvous"));
  return std::unique_ptr<comm::RendezvousStore>(std::move(fs));
}

Result<bool> use_actors() {
  const char* v = env("TROUPE_CONTROL");
  const std::string mode = v ? v : "actors";
  if (mode == "actors") return true;
  if (mode == "store") return false;
  return invalid_argument("TROUPE_CONTROL='{}' (expected actors or store)", mode);
}

// The store key through which the driver tells the workers which checkpoint to resume
// from (it picks and verifies it once; every worker then reads its own slices).
std::string resume_key(const comm::StoreNamespace& ns) { return ns.prefix() + "ckpt/resume"; }

// A worker's checkpoint duties: with --resume, load its slices of the checkpoint the
// driver chose (resharded to this layout); with checkpoint.every, a writer for "save".
Result<std::unique_ptr<training::RankCheckpointer>> worker_checkpoints(const layers::TrainConfig& tc,
                                                                       const std::string& run_dir, bool resume,
                                                                       comm::RendezvousStore& store,
                                                                       const comm::StoreNamespace& ns,
                                                                       training::Stage& stage) {
  if (resume) {
    TROUPE_ASSIGN_OR_RETURN(std::string path, store.get(resume_key(ns), comm::deadline_in(kCommandTimeout)));
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointReader> reader,
                            checkpoint::CheckpointReader::open(path, checkpoint::VerifyMode::kStructure));
    TROUPE_RETURN_IF_ERROR(stage.load_checkpoint(*reader));
  }
  if (tc.checkpoint.every <= 0) return std::unique_ptr<training::RankCheckpointer>();
  return training::RankCheckpointer::create(training::checkpoint_dir_for(tc, run_dir), stage.state_layout(), stage.rank(),
                                            static_cast<uint64_t>(tc.checkpoint.max_mb_per_s * 1e6));
}

Status run_worker(const layers::TrainConfig& tc, const std::string& run_dir, const comm::StoreNamespace& ns,
                  int rank, const RunDevice& dev, bool resume) {
  TROUPE_ASSIGN_OR_RETURN(bool actors, use_actors());
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> store, open_store(run_dir));
  // Failures before serving are reported through the store in both control modes (the
  // driver's supervision reads them).
  training::StoreStepServer store_server(*store, ns.prefix(), rank);
  auto fail = [&](const Status& st) {
    (void)store_server.report_error(st.to_string());
    return st;
  };
  Result<layers::TokenShards> train = layers::TokenShards::open(tc.data.dir, "train");
  if (!train.ok()) return fail(train.status());
  Result<layers::TokenShards> val = layers::TokenShards::open(tc.data.dir, "val");
  if (!val.ok()) return fail(val.status());
  Result<std::unique_ptr<training::Stage>> stage =
      training::Stage::create(tc, rank, *store, ns, std::move(train).value(), std::move(val).value(), dev.ctx());
  if (!stage.ok()) return fail(stage.status().with_context(fmt::format("worker rank {}", rank)));
  Result<std::unique_ptr<training::RankCheckpointer>> ckpt =
      worker_checkpoints(tc, run_dir, resume, *store, ns, *stage.value());
  if (!ckpt.ok()) return fail(ckpt.status().with_context(fmt::format("worker rank {}", rank)));
  if (!actors) return training::run_stage_host(*stage.value(), store_server, kCommandTimeout, ckpt->get());
  Result<std::unique_ptr<training::ActorStepServer>> server = training::ActorStepServer::start(*store, ns.prefix(), rank);
  if (!server.ok()) return fail(server.status());
  const Status st = training::run_stage_host(*stage.value(), *server.value(), kCommandTimeout, ckpt->get());
  if (!st.ok()) return fail(st);
  return st;
}

}  // namespace

Status run_distributed(const TrainOptions& o, const std::string& run_dir, RunDevice& dev) {
  TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, layers::load_train_config(o.config, o.overrides));
  const int world = static_cast<int>(tc.parallel.world());
  const char* role_env = env("TROUPE_ROLE");
  const std::string role = role_env ? role_env : "";
  if (!role.empty() && role != "driver" && role != "worker") {
    return invalid_argument("TROUPE_ROLE='{}' (expected driver or worker)", role);
  }
  TROUPE_ASSIGN_OR_RETURN(int64_t env_world, env_int("TROUPE_WORLD_SIZE", world));
  if (!role.empty() && env_world != world) {
    return invalid_argument("{}: layout pp={} dp={} n={} needs {} workers but the job has {} "
                            "(troupe run --nproc {})",
                            tc.source, tc.parallel.pp, tc.parallel.dp, tc.parallel.n, world, env_world, world);
  }
  TROUPE_ASSIGN_OR_RETURN(int64_t epoch, env_int("TROUPE_EPOCH", 0));
  comm::StoreNamespace ns;
  ns.epoch = static_cast<uint64_t>(epoch);
  if (elastic_enabled() && dev.is_cuda()) {
    return unimplemented("TROUPE_ELASTIC=1 (elastic recovery) runs CPU workers only so far; use --backend cpu, or "
                         "drop TROUPE_ELASTIC for GPU training (failures then stop the job; resume it with --resume)");
  }
  if (role == "worker") {
    if (elastic_enabled()) {  // apps/train_moe/elastic_launch.h
      TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> estore, open_store(run_dir));
      std::function<void()> cut_control;
      if (auto* sr = dynamic_cast<SchedulerRendezvous*>(estore.get())) cut_control = [sr] { sr->disconnect(); };
      return run_elastic_worker_process(tc, *estore, std::move(cut_control));
    }
    const char* job = env("TROUPE_JOB_ID");
    if (job == nullptr || *job == '\0') return invalid_argument("worker: TROUPE_JOB_ID is not set");
    ns.job = job;
    TROUPE_ASSIGN_OR_RETURN(int64_t rank, env_int("TROUPE_RANK", -1));
    if (rank < 0 || rank >= world) return invalid_argument("worker: TROUPE_RANK={} is not in [0, {})", rank, world);
    if (dev.is_cuda()) fmt::print("train_moe: worker rank {} on {}\n", rank, dev.name());
    return run_worker(tc, run_dir, ns, static_cast<int>(rank), dev, !o.resume.empty());
  }

  // ---- driver (troupe run) or standalone launcher -------------------------------------
  TROUPE_ASSIGN_OR_RETURN(layers::Tokenizer tok, layers::Tokenizer::load(tc.data.dir + "/tokenizer.json"));
  if (tok.vocab_size() > tc.model.vocab_size) {
    return invalid_argument("{}: model.vocab_size = {} is smaller than the tokenizer's {} tokens in {}", tc.source,
                            tc.model.vocab_size, tok.vocab_size(), tc.data.dir);
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return io_error("cannot create run directory {}: {}", run_dir, ec.message());
  TROUPE_RETURN_IF_ERROR(copy_file(tc.data.dir + "/tokenizer.json", run_dir + "/tokenizer.json"));
  TROUPE_RETURN_IF_ERROR(copy_file(o.config, run_dir + "/config.toml"));
  {
    std::ofstream ov(run_dir + "/overrides.txt");
    for (const auto& s : o.overrides) ov << s << "\n";
  }
  if (elastic_enabled()) {  // apps/train_moe/elastic_launch.h
    // --resume: the elastic driver opens the checkpoint and its workers load it.
    if (role == "driver") {
      TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> estore, open_store(run_dir));
      return run_elastic_scheduled_driver(o, run_dir, tc, std::move(estore));
    }
    return run_elastic_launcher(o, run_dir, tc);
  }
  // Resume: the driver picks the checkpoint (newest valid, checksums verified) once.
  std::unique_ptr<checkpoint::CheckpointReader> resume;
  training::TrainerOptions topts;
  if (!o.resume.empty()) {
    TROUPE_ASSIGN_OR_RETURN(resume, training::open_resume_checkpoint(o.resume));
    TROUPE_RETURN_IF_ERROR(training::check_resume_compatible(resume->manifest(), tc));
    topts.first_step = resume->step() + 1;
    topts.tokens_seen = resume->manifest().data_position.value("tokens_seen", int64_t{0});
    fmt::print("train_moe: resuming from {} (step {}, saved with layout {}) with layout pp={} dp={} n={}\n",
               resume->path(), resume->step(), resume->layout().to_string(), tc.parallel.pp, tc.parallel.dp,
               tc.parallel.n);
    TROUPE_RETURN_IF_ERROR(training::trim_metrics(run_dir + "/metrics.jsonl", resume->step()));
  }
  std::ofstream metrics(run_dir + "/metrics.jsonl", resume ? std::ios::app : std::ios::trunc);
  if (!metrics) return io_error("cannot write {}/metrics.jsonl", run_dir);
  std::unique_ptr<training::CheckpointCommitter> committer;
  if (tc.checkpoint.every > 0) {
    const std::string dir = training::checkpoint_dir_for(tc, run_dir);
    TROUPE_RETURN_IF_ERROR(training::prepare_checkpoint_dir(dir, topts.first_step - 1));
    training::CommitterOptions co;
    co.dir = dir;
    co.world_size = world;
    co.keep = static_cast<int>(tc.checkpoint.keep);
    TROUPE_ASSIGN_OR_RETURN(co.info, training::run_checkpoint_info(o.config, o.overrides, tc, run_dir + "/tokenizer.json"));
    committer = std::make_unique<training::CheckpointCommitter>(std::move(co));
    topts.checkpoints = committer.get();
  }

  LocalWorkers workers;
  if (role.empty()) {
    ns.job = fmt::format("local-{}-{}", getpid(), std::chrono::system_clock::now().time_since_epoch().count());
    fs::remove_all(run_dir + "/rendezvous", ec);  // keys of earlier local runs
  } else {
    const char* job = env("TROUPE_JOB_ID");
    if (job == nullptr || *job == '\0') return invalid_argument("driver: TROUPE_JOB_ID is not set");
    ns.job = job;
  }
  TROUPE_ASSIGN_OR_RETURN(bool actors, use_actors());
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> store, open_store(run_dir));
  if (resume) TROUPE_RETURN_IF_ERROR(store->set(resume_key(ns), fs::absolute(resume->path()).string()));
  fmt::print("train_moe: layout pp={} dp={} n={} ({} workers, dispatch {}, compression {}, control {}), "
             "{} parameters, {} tokens/step, {} steps, run dir {}\n",
             tc.parallel.pp, tc.parallel.dp, tc.parallel.n, world, tc.parallel.dispatch,
             tc.parallel.compression ? "bf16" : "off", actors ? "actors" : "store", tc.model.num_params(), tc.tokens_per_step(), tc.train.steps,
             run_dir);
  std::fflush(stdout);
  if (role.empty()) TROUPE_RETURN_IF_ERROR(workers.start(o.argv, world, ns.job));

  // Supervision while waiting: the launcher's own children, and worker-reported errors.
  const std::string prefix = ns.prefix();
  training::Supervisor supervise = [&workers, &store, prefix, world, launcher = role.empty()]() -> Status {
    if (launcher) TROUPE_RETURN_IF_ERROR(workers.check());
    for (int r = 0; r < world; ++r) {
      const std::string k = fmt::format("{}ctl/error/{}", prefix, r);
      TROUPE_ASSIGN_OR_RETURN(bool has, store->contains(k));
      if (has) {
        Result<std::string> err = store->get(k, comm::deadline_in(std::chrono::milliseconds(1000)));
        return aborted("worker rank {} failed: {}", r, err.ok() ? err.value() : err.status().to_string());
      }
    }
    return ok_status();
  };
  std::unique_ptr<training::StepDriver> driver;
  if (actors) {
    Result<std::unique_ptr<training::ActorStepDriver>> d =
        training::ActorStepDriver::start(*store, prefix, world, kCommandTimeout, supervise);
    if (!d.ok()) {
      workers.stop(std::chrono::milliseconds(1000));
      return d.status();
    }
    driver = std::move(d).value();
  } else {
    driver = std::make_unique<training::StoreStepDriver>(*store, prefix, world);
  }
  topts.command_timeout = kCommandTimeout;
  topts.supervise = supervise;
  if (dev.is_cuda()) {
    topts.num_gpus = world;
    // Model FLOPs per token (issue 10): 6 * active parameters + 6 * L * s * d (causal).
    topts.flops_per_token = 6.0 * static_cast<double>(tc.model.num_active_params()) +
                            6.0 * static_cast<double>(tc.model.n_layers * tc.train.seq_len * tc.model.d_model);
  }
  training::Trainer trainer(tc, *driver, metrics, topts);
  const Status st = trainer.run();
  driver.reset();
  if (!st.ok()) {
    workers.stop(std::chrono::milliseconds(1000));
    return st;
  }
  if (role.empty()) TROUPE_RETURN_IF_ERROR(workers.wait_all(std::chrono::milliseconds(30000)));
  return ok_status();
}

}  // namespace troupe::train_moe
