// actors/training/app.cc — run_app: the wiring between an app's main() and the Trainer
// (trainer.h). Rendezvous: under the scheduler (TROUPE_SCHEDULER set), the scheduler's
// store for the job; otherwise a FileStore in <run dir>/rendezvous.
#include "actors/training/app.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "actors/training/preflight.h"
#include "actors/training/trainer.h"
#include "comm/rendezvous_store.h"
#include "core/parallel_layout.h"
#include "layers/tokenizer.h"
#include "scheduler/job_context.h"
#include "scheduler/scheduler_store.h"

namespace troupe::training {

namespace fs = std::filesystem;

void add_run_options(CLI::App& cli, RunOptions& o) {
  cli.add_option("--config", o.config, "TOML config (e.g. apps/configs/tiny.toml)");
  cli.add_option("--set", o.overrides, "override a config key: --set train.steps=10 (repeatable)");
  cli.add_option("--run-dir", o.run_dir,
                 "where metrics.jsonl, events.jsonl and checkpoints go (default runs/<config>)");
  cli.add_option("--backend", o.backend, "cpu (default) or cuda (one GPU per worker)");
  cli.add_option("--parallel", o.parallel,
                 "parallel layout overriding [parallel]: e.g. pp=2,dp=2 or dp=2,n=2,dispatch=allgather "
                 "(several ranks: started locally, or by `troupe run --nproc N`)");
  cli.add_option("--resume", o.resume,
                 "continue from the newest valid checkpoint of a run directory (or a checkpoints "
                 "directory, or one step_<N> checkpoint), resharded to the current layout");
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
  return overrides;
}

Result<layers::TrainConfig> load_run_config(const RunOptions& o) {
  if (o.config.empty()) return invalid_argument("--config is required");
  TROUPE_ASSIGN_OR_RETURN(std::vector<std::string> overrides, all_overrides(o));
  return layers::load_train_config(o.config, overrides);
}

namespace {

const char* env(const char* name) {
  return std::getenv(name);
}

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
  const char* sched_addr = env("TROUPE_SCHEDULER");
  if (sched_addr != nullptr && *sched_addr != '\0' && env("TROUPE_ROLE") != nullptr) {
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
  if (tc.data.dir.empty()) {
    return invalid_argument("{}: data.dir is not set (the output of train_moe prepare)", tc.source);
  }
  const std::string run_dir = o.run_dir.empty() ? "runs/" + fs::path(o.config).stem().string() : o.run_dir;
  TROUPE_ASSIGN_OR_RETURN(std::vector<std::string> overrides, all_overrides(o));
  const char* role_env = env("TROUPE_ROLE");
  const std::string role = role_env ? role_env : "";
  if (!role.empty() && role != "driver" && role != "worker") {
    return invalid_argument("TROUPE_ROLE='{}' (expected driver or worker)", role);
  }
  if (tc.train.expert_grads != DType::kF32 && role != "worker") {
    fmt::print(
        "note: train.expert_grads = \"{}\" applies to train_moe's single-process loop; the Trainer's stages "
        "keep f32 gradients (their reductions and buckets are f32)\n",
        dtype_name(tc.train.expert_grads));
  }
  if (tc.train.split_master && role != "worker") {
    fmt::print(
        "note: train.master_weights = \"split\" applies to train_moe's single-process loop; the Trainer's "
        "stages keep f32 master values (their buckets, checkpoints and copies read them)\n");
  }
  if (role == "worker") {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> store, open_store(run_dir));
    std::function<void()> cut_control;
    if (auto* sr = dynamic_cast<SchedulerRendezvous*>(store.get())) cut_control = [sr] { sr->disconnect(); };
    return run_worker_process(tc, app.program, *store, std::move(cut_control), ctx);
  }

  // ---- the driver (troupe run / submit) or the standalone launcher --------------------
  if (!role.empty()) {
    // The scheduler starts as many workers as --nproc asked for: they must fill the layout.
    const char* ws = env("TROUPE_WORLD_SIZE");
    if (ws != nullptr && *ws != '\0' && std::strtoll(ws, nullptr, 10) != tc.parallel.world()) {
      return invalid_argument(
          "{}: layout pp={} dp={} n={} needs {} workers but the job has {} "
          "(troupe run --nproc {})",
          tc.source, tc.parallel.pp, tc.parallel.dp, tc.parallel.n, tc.parallel.world(), ws,
          tc.parallel.world());
    }
  }
  // Nothing is written and no worker is started before the data and the memory are known
  // to fit (the layout was checked above).
  TROUPE_RETURN_IF_ERROR(preflight_check(tc, ctx));
  TROUPE_RETURN_IF_ERROR(prepare_run_dir(tc, o.config, overrides, run_dir));
  TrainerOptions to;
  to.app = app.name;
  to.argv = o.argv;
  to.config = o.config;
  to.overrides = overrides;
  to.resume = o.resume;
  to.run_dir = run_dir;
  to.gpu = o.backend == "cuda";
  if (to.gpu && app.flops_per_token) to.flops_per_token = app.flops_per_token(tc);
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
      to.publish_placement = [session,
                              epoch = jc->epoch](const std::vector<std::pair<std::string, std::string>>& p) {
        return session->place_actors(epoch, p, std::chrono::milliseconds(10000)).status();
      };
    }
  }
  return run_trainer(to, tc, std::move(scheduled));
}

}  // namespace troupe::training
