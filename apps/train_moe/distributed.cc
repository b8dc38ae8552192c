// apps/train_moe/distributed.cc — train_moe with a multi-rank layout: the wiring between
// the app and the framework's Trainer (actors/training/trainer.h). The role comes from the
// launcher: TROUPE_ROLE=worker runs a worker; TROUPE_ROLE=driver (under troupe-scheduler)
// or no role (the standalone launcher) runs the Trainer. Every distributed run survives a
// lost worker (docs/elastic.md); [elastic] in the config tunes how.
//
// Rendezvous: under the scheduler (TROUPE_SCHEDULER set), the scheduler's store for the
// job; otherwise a FileStore in <run dir>/rendezvous.

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "actors/training/trainer.h"
#include "apps/train_moe/commands.h"
#include "apps/train_moe/device.h"
#include "comm/rendezvous_store.h"
#include "core/parallel_layout.h"
#include "layers/tokenizer.h"
#include "layers/train_config.h"
#include "scheduler/job_context.h"
#include "scheduler/scheduler_store.h"

namespace troupe::train_moe {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

Result<std::vector<std::string>> parse_parallel_flag(const std::string& spec) {
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

namespace {

const char* env(const char* name) { return std::getenv(name); }

Status copy_file(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return io_error("cannot copy {} to {}: {}", from, to, ec.message());
  return ok_status();
}

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

}  // namespace

Status run_distributed(const TrainOptions& o, const std::string& run_dir, RunDevice& dev) {
  TROUPE_ASSIGN_OR_RETURN(layers::TrainConfig tc, layers::load_train_config(o.config, o.overrides));
  const char* role_env = env("TROUPE_ROLE");
  const std::string role = role_env ? role_env : "";
  if (!role.empty() && role != "driver" && role != "worker") {
    return invalid_argument("TROUPE_ROLE='{}' (expected driver or worker)", role);
  }
  if (role == "worker") {
    TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<comm::RendezvousStore> store, open_store(run_dir));
    std::function<void()> cut_control;
    if (auto* sr = dynamic_cast<SchedulerRendezvous*>(store.get())) cut_control = [sr] { sr->disconnect(); };
    if (dev.is_cuda()) fmt::print("train_moe: worker on {}\n", dev.name());
    return training::run_worker_process(tc, *store, std::move(cut_control), dev.ctx());
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
  training::TrainerOptions to;
  to.argv = o.argv;
  to.config = o.config;
  to.overrides = o.overrides;
  to.resume = o.resume;
  to.run_dir = run_dir;
  to.gpu = o.backend == "cuda";
  if (to.gpu) {
    // Model FLOPs per token: 6 * active parameters + 6 * L * s * d (causal attention).
    to.flops_per_token = 6.0 * static_cast<double>(tc.model.num_active_params()) +
                         6.0 * static_cast<double>(tc.model.n_layers * tc.train.seq_len * tc.model.d_model);
  }
  std::unique_ptr<comm::RendezvousStore> scheduled;
  std::shared_ptr<sched::SchedulerSession> session;
  if (role == "driver") {
    TROUPE_ASSIGN_OR_RETURN(scheduled, open_store(run_dir));
    // The actor placement of each epoch goes into the scheduler's durable state.
    TROUPE_ASSIGN_OR_RETURN(std::optional<sched::JobContext> ctx, sched::JobContext::from_env());
    if (ctx) {
      TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<sched::SchedulerSession> s,
                              sched::SchedulerSession::connect(*ctx));
      session = std::move(s);
      to.publish_placement = [session,
                              epoch = ctx->epoch](const std::vector<std::pair<std::string, std::string>>& p) {
        return session->place_actors(epoch, p, std::chrono::milliseconds(10000)).status();
      };
    }
  }
  return training::run_trainer(to, tc, std::move(scheduled));
}

}  // namespace troupe::train_moe
