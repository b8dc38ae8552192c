// training/app/app.cc — run_app: the wiring between an app's main() and the Trainer
// (trainer.h). Rendezvous: under the scheduler (TROUPE_SCHEDULER set), the scheduler's
// store for the job; otherwise a FileStore in <run dir>/rendezvous.
#include "training/app/app.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "comm/rendezvous_store.h"
#include "core/env.h"
#include "core/job_env.h"
#include "core/parallel_layout.h"
#include "data/tokenizer.h"
#include "interop/hf_checkpoint.h"
#include "scheduler/client/health_reporter.h"
#include "scheduler/client/job_context.h"
#include "scheduler/client/scheduler_store.h"
#include "training/app/gradcheck.h"
#include "training/app/preflight.h"
#include "training/driver/trainer.h"

namespace troupe::training {

namespace fs = std::filesystem;

void add_run_options(CLI::App& cli, RunOptions& o) {
  cli.add_option("--config", o.config, "TOML config (e.g. apps/configs/tiny.toml)");
  cli.add_option("--set", o.overrides, "override a config key: --set train.steps=10 (repeatable)");
  cli.add_option("--run-dir", o.run_dir,
                 "where metrics.jsonl, events.jsonl and checkpoints go (default runs/<config>)");
  cli.add_option("--backend", o.backend, "cpu (default) or cuda (one GPU per worker)")
      ->each([&o](const std::string&) { o.backend_given = true; });
  cli.add_option("--parallel", o.parallel,
                 "parallel layout overriding [parallel]: e.g. pp=2,dp=2 or dp=2,n=2,dispatch=allgather "
                 "(several ranks: started locally, or by `troupe run --nproc N`)");
  cli.add_option("--resume", o.resume,
                 "continue from the newest valid checkpoint of a run directory (or a checkpoints "
                 "directory, or one step_<N> checkpoint), resharded to the current layout");
  cli.add_option(
      "--init-from", o.init_from,
      "start from a Hugging Face model directory (config.json + safetensors of a Mixtral or Qwen3-MoE): "
      "its architecture replaces [model]'s, its weights the initialisation; any layout");
  cli.add_flag("--gradcheck", o.gradcheck,
               "instead of training: check every parameter's gradient against finite differences of the "
               "loss (on the CPU, layout 1x1x1, random tokens; no data needed)");
  cli.add_flag("--allow-test-config", o.allow_test_config,
               "accept the config's [bench] and [test] sections (switches for comparison, fault "
               "injection): benchmarks and tests only (docs/config.md)");
}

Result<std::vector<std::string>> parallel_overrides(const std::string& spec) {
  Result<LayoutItems> items = parse_layout_items(spec);
  if (!items.ok()) return items.status().with_context("--parallel");
  // Only the parts given override the config's [parallel] table.
  std::vector<std::string> out;
  if (items->pp) out.push_back(fmt::format("parallel.pp={}", *items->pp));
  if (items->dp) out.push_back(fmt::format("parallel.dp={}", *items->dp));
  if (items->n) out.push_back(fmt::format("parallel.n={}", *items->n));
  for (const auto& [k, v] : items->other) {
    if (k == "compression") {
      out.push_back(fmt::format("parallel.compression={}", v));
    } else if (k == "dispatch") {
      out.push_back(fmt::format("parallel.dispatch=\"{}\"", v));
    } else {
      return invalid_argument("--parallel: unknown key '{}' (known: pp, dp, n, dispatch, compression)", k);
    }
  }
  return out;
}

Result<std::vector<std::string>> all_overrides(const RunOptions& o) {
  std::vector<std::string> overrides = o.overrides;
  if (!o.parallel.empty()) {
    TROUPE_ASSIGN_OR_RETURN(std::vector<std::string> extra, parallel_overrides(o.parallel));
    overrides.insert(overrides.end(), extra.begin(), extra.end());
  }
  if (!o.init_from.empty()) {
    if (!o.resume.empty()) {
      return invalid_argument(
          "--init-from starts a run from a Hugging Face model; --resume continues a Troupe run "
          "(give one of them)");
    }
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<interop::HfCheckpoint> hf,
                            interop::HfCheckpoint::open(o.init_from));
    std::vector<std::string> extra = interop::model_overrides(hf->config().model);
    for (const std::string& e : extra) {
      const std::string key = e.substr(0, e.find('='));
      for (const std::string& u : o.overrides) {
        if (u.substr(0, u.find('=')) == key && u != e) {
          return invalid_argument("--set {} conflicts with --init-from {}: its config.json gives {}", u,
                                  o.init_from, e);
        }
      }
    }
    extra.push_back(
        fmt::format("train.init_from=\"{}\"", fs::absolute(o.init_from).lexically_normal().string()));
    overrides.insert(overrides.end(), extra.begin(), extra.end());
  }
  return overrides;
}

Status adopt_job_flags(RunOptions& o) {
  if (std::optional<std::string> job_backend = env::get(job_env::kBackend)) {
    if (!o.backend_given) {
      o.backend = *job_backend;
    } else if (o.backend != *job_backend) {
      return invalid_argument(
          "the job was submitted with --backend {} (troupe run/submit; it decides the GPU placement) but the "
          "app was given --backend {}: give both the same",
          *job_backend, o.backend);
    }
  }
  if (std::optional<std::string> job_layout = env::get(job_env::kLayout); job_layout && o.parallel.empty()) {
    o.parallel = *job_layout;  // run_app checks a config's own [parallel] against it
  }
  return ok_status();
}

Result<layers::TrainConfig> load_run_config(const RunOptions& o) {
  if (o.config.empty()) return invalid_argument("--config is required");
  TROUPE_ASSIGN_OR_RETURN(std::vector<std::string> overrides, all_overrides(o));
  return layers::load_train_config(
      o.config, overrides,
      o.allow_test_config ? layers::TestSections::kAdmit : layers::TestSections::kRefuse);
}

namespace {

// The copy gets the mode of a new file of the run (0666 less train.umask), not the
// source's: copy_file keeps the source's permission bits.
Status copy_file(const std::string& from, const std::string& to, const layers::TrainConfig& tc) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return io_error("cannot copy {} to {}: {}", from, to, ec.message());
  const auto mask = static_cast<unsigned>(std::strtol(tc.train.umask.c_str(), nullptr, 8));
  fs::permissions(to, static_cast<fs::perms>(0666u & ~mask), fs::perm_options::replace, ec);
  if (ec) return io_error("cannot set the mode of {}: {}", to, ec.message());
  return ok_status();
}

// comm's store interface over the scheduler's rendezvous store (comm never includes
// scheduler code; this file wires the two together).
class SchedulerRendezvous final : public comm::RendezvousStore {
 public:
  explicit SchedulerRendezvous(std::unique_ptr<sched::SchedulerStore> s) : s_(std::move(s)) {}
  Status set(std::string_view key, std::string_view value) override { return s_->set(key, value); }
  Result<std::string> get(std::string_view key, comm::Deadline deadline) override {
    return s_->get(key, deadline);
  }
  Status wait(const std::vector<std::string>& keys, comm::Deadline deadline) override {
    return s_->wait(keys, deadline);
  }
  Result<bool> contains(std::string_view key) override { return s_->contains(key); }
  void disconnect() { s_->disconnect(); }  // elastic fault injection (cutctl)

 private:
  std::unique_ptr<sched::SchedulerStore> s_;
};

Result<std::unique_ptr<comm::RendezvousStore>> open_store(const std::string& run_dir) {
  if (env::get(job_env::kScheduler) && env::get(job_env::kRole)) {
    TROUPE_ASSIGN_OR_RETURN(std::optional<sched::JobContext> ctx, sched::JobContext::from_env());
    if (ctx) {
      TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<sched::SchedulerStore> s, sched::SchedulerStore::connect(*ctx));
      return std::unique_ptr<comm::RendezvousStore>(std::make_unique<SchedulerRendezvous>(std::move(s)));
    }
  }
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::FileStore> fs,
                          comm::FileStore::open(run_dir + "/rendezvous"));
  return std::unique_ptr<comm::RendezvousStore>(std::move(fs));
}

}  // namespace

Result<std::string> resolve_run_dir(const RunOptions& o) {
  if (!o.run_dir.empty()) return o.run_dir;
  const std::string dir = "runs/" + fs::path(o.config).stem().string();
  TROUPE_ASSIGN_OR_RETURN(const int64_t driver_restarts, env::get_int(job_env::kDriverRestarts, 0, 0));
  if (env::get_or(job_env::kRole) == "worker" || driver_restarts > 0) return dir;
  std::error_code ec;
  if (!fs::exists(fs::path(dir) / "metrics.jsonl", ec)) return dir;
  // Resuming from a checkpoint of that very directory continues its metrics.
  if (!o.resume.empty()) {
    const fs::path from = fs::weakly_canonical(o.resume, ec), here = fs::weakly_canonical(dir, ec);
    const auto [mismatch, _] = std::mismatch(here.begin(), here.end(), from.begin(), from.end());
    if (mismatch == here.end()) return dir;
  }
  return failed_precondition(
      "the default run directory {} holds an earlier run ({}/metrics.jsonl) that this run would overwrite: "
      "name a new one with --run-dir <dir>, or continue that run with --resume {}",
      dir, dir, dir);
}

Status prepare_run_dir(const layers::TrainConfig& tc, const std::string& config,
                       const std::vector<std::string>& overrides, const std::string& run_dir) {
  TROUPE_ASSIGN_OR_RETURN(layers::Tokenizer tok, layers::Tokenizer::load(tc.data.dir + "/tokenizer.json"));
  if (tok.vocab_size() > tc.model.vocab_size) {
    return invalid_argument("{}: model.vocab_size = {} is smaller than the tokenizer's {} tokens in {}",
                            tc.source, tc.model.vocab_size, tok.vocab_size(), tc.data.dir);
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return io_error("cannot create run directory {}: {}", run_dir, ec.message());
  TROUPE_RETURN_IF_ERROR(copy_file(tc.data.dir + "/tokenizer.json", run_dir + "/tokenizer.json", tc));
  TROUPE_RETURN_IF_ERROR(copy_file(config, run_dir + "/config.toml", tc));
  std::ofstream ov(run_dir + "/overrides.txt");
  for (const auto& s : overrides) ov << s << "\n";
  if (!ov) return io_error("cannot write {}/overrides.txt", run_dir);
  return ok_status();
}

void apply_file_mask(const layers::TrainConfig& tc) {
  ::umask(static_cast<mode_t>(std::strtol(tc.train.umask.c_str(), nullptr, 8) & 0777));
}

Status run_app(const App& app, const RunOptions& o, const layers::Ctx& ctx) {
  if (!app.program) return invalid_argument("{}: the app gives no stage program", app.name);
  TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, load_run_config(o));
  apply_file_mask(tc);
  if (app.check) TROUPE_RETURN_IF_ERROR(app.check(tc));
  if (tc.train.recompute_blocks && !app.recomputes_blocks) {
    return invalid_argument(
        "{}: train.recompute = \"blocks\" needs an app built on the transformer program base (its blocks on "
        "a tape); {} does not recompute blocks (train_moe: model.recompute_swiglu)",
        tc.source, app.name);
  }
  if (o.gradcheck) return run_gradcheck(app.name, app.program, tc);
  if (tc.data.dir.empty()) {
    return invalid_argument("{}: data.dir is not set (the output of troupe-prepare)", tc.source);
  }
  // A one-process run refuses what needs worker processes before it touches anything.
  const std::string role = env::get_or(job_env::kRole);
  if (runs_in_one_process(tc, !role.empty())) TROUPE_RETURN_IF_ERROR(check_one_process(tc));
  TROUPE_ASSIGN_OR_RETURN(const std::string run_dir, resolve_run_dir(o));
  TROUPE_ASSIGN_OR_RETURN(std::vector<std::string> overrides, all_overrides(o));
  if (!role.empty() && role != "driver" && role != "worker") {
    return invalid_argument("{}='{}' (expected driver or worker)", job_env::kRole, role);
  }
  if (tc.train.split_master && o.backend != "cuda" && role != "worker") {
    fmt::print(
        "note: train.master_weights = \"split\" keeps a matrix's f32 master as its bf16 working copy and a "
        "low half; CPU workers compute from the f32 masters themselves (no working copies) and keep them\n");
  }
  if (role == "worker") {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> store, open_store(run_dir));
    std::function<void()> cut_control;
    if (auto* sr = dynamic_cast<SchedulerRendezvous*>(store.get())) cut_control = [sr] { sr->disconnect(); };
    // Under the scheduler a worker reports its machine's health every second (the
    // scheduler's faulty-machine detector compares it with its peers).
    auto steps = std::make_shared<observe::StepProbe>();
    std::unique_ptr<sched::HealthReporter> health;
    // The standalone launcher's workers have a job id but no scheduler: no reports.
    Result<std::optional<sched::JobContext>> jc = sched::JobContext::from_env();
    if (jc.ok() && jc->has_value() && !(*jc)->scheduler.empty()) {
      sched::HealthReporterOptions ho;
      ho.sampler.gpu = o.backend == "cuda";
      Result<std::unique_ptr<sched::HealthReporter>> h = sched::HealthReporter::start(**jc, ho, steps);
      if (h.ok()) {
        health = std::move(h).value();
      } else {
        fmt::print(stderr, "worker: no health reports: {}\n", h.status().to_string());
      }
    }
    return run_worker_process(tc, app.program, *store, std::move(cut_control), ctx, steps.get());
  }

  // ---- the driver (troupe run / submit) or the standalone launcher --------------------
  if (!role.empty()) {
    // The scheduler starts as many workers as --nproc asked for: they must fill the layout.
    TROUPE_ASSIGN_OR_RETURN(const int64_t ws, env::get_int(job_env::kWorldSize, tc.parallel.world(), 1));
    if (ws != tc.parallel.world()) {
      return invalid_argument(
          "{}: layout pp={} dp={} n={} needs {} workers but the job has {} "
          "(troupe run --nproc {})",
          tc.source, tc.parallel.pp, tc.parallel.dp, tc.parallel.n, tc.parallel.world(), ws,
          tc.parallel.world());
    }
    // A job submitted with --layout runs that layout (adopt_job_flags made it the app's
    // --parallel when the app gave none); a config or --parallel saying otherwise is refused.
    if (std::optional<std::string> job_layout = env::get(job_env::kLayout)) {
      TROUPE_ASSIGN_OR_RETURN(const ParallelLayout l, ParallelLayout::parse(*job_layout));
      if (l.pp() != tc.parallel.pp || l.dp() != tc.parallel.dp || l.n() != tc.parallel.n) {
        return invalid_argument(
            "{}: the job was submitted with --layout {} but the app runs pp={} dp={} n={} (its config and "
            "--parallel): give the same layout to both, or only one of them",
            tc.source, l.to_string(), tc.parallel.pp, tc.parallel.dp, tc.parallel.n);
      }
    }
  }
  // Nothing is written and no worker is started before the data and the memory are known
  // to fit (the layout was checked above).
  TROUPE_RETURN_IF_ERROR(preflight_check(tc, ctx));
  TROUPE_RETURN_IF_ERROR(prepare_run_dir(tc, o.config, overrides, run_dir));
  if (!tc.train.init_from.empty() && o.resume.empty()) {
    // Checked here from the headers, before any worker starts; each worker then reads
    // only its own slices (init_from_hf).
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<interop::HfCheckpoint> hf,
                            interop::HfCheckpoint::open(tc.train.init_from));
    TROUPE_RETURN_IF_ERROR(hf->validate(tc.model).with_context("train.init_from"));
    fmt::print("{}: initialising from {} ({}, {} parameters, {} MoE blocks of {} experts)\n", app.name,
               tc.train.init_from, interop::family_name(hf->config().family), tc.model.num_params(),
               tc.model.moe_layers.size(), tc.model.moe.num_experts);
  }
  TrainerOptions to;
  to.app = app.name;
  to.argv = o.argv;
  to.config = o.config;
  to.overrides = overrides;
  to.resume = o.resume;
  to.run_dir = run_dir;
  to.gpu = o.backend == "cuda";
  if (to.gpu) to.flops_per_token = tc.model.train_flops_per_token(tc.train.seq_len);
  // A one-process run (no launcher, layout 1x1x1): the worker is a thread here, on this
  // process's device.
  to.program = app.program;
  to.worker_ctx = ctx;
  std::unique_ptr<comm::RendezvousStore> scheduled;
  std::shared_ptr<sched::SchedulerSession> session;
  std::unique_ptr<sched::HeartbeatThread> beats;
  if (role == "driver") {
    TROUPE_ASSIGN_OR_RETURN(scheduled, open_store(run_dir));
    // The actor placement of each epoch goes into the scheduler's durable state.
    TROUPE_ASSIGN_OR_RETURN(std::optional<sched::JobContext> jc, sched::JobContext::from_env());
    if (jc) {
      TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<sched::SchedulerSession> s,
                              sched::SchedulerSession::connect(*jc));
      session = std::move(s);
      // The driver is supervised like a worker: it beats to the scheduler, which replaces
      // it (restart_driver) when it stays silent past the job's heartbeat timeout (e.g.
      // SIGSTOPped). Its own thread: a driver busy in a long call is not silent.
      beats = sched::HeartbeatThread::start(session, jc->heartbeat_ms);
      // With the layout the workers run as: the scheduler knows the job only as --nproc N.
      to.publish_placement = [session, epoch = jc->epoch](
                                 const std::vector<std::pair<std::string, std::string>>& p,
                                 const std::string& layout) {
        return session->place_actors(epoch, p, std::chrono::milliseconds(10000), layout).status();
      };
    }
  }
  return run_trainer(to, tc, std::move(scheduled));
}

}  // namespace troupe::training
