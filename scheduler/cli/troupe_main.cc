// scheduler/cli/troupe_main.cc — the `troupe` command line: parses arguments with CLI11 and
// calls the commands of scheduler/cli/cli.h.
//
//   troupe run --nproc N [--backend cpu|cuda] [--max-restarts K] -- <app> [args]
//   troupe submit --nproc N [...] -- <app> [args]
//   troupe status [JOB] [--json]      troupe logs JOB [--worker W] [--follow]
//   troupe cancel JOB                 troupe keygen PREFIX | --check FILE
//   troupe wait JOB                   (exits with the job's exit status)
//   troupe top JOB|RUN_DIR [--once] [--interval S]
// Every command that talks to a scheduler takes --scheduler ADDR (default
// $TROUPE_SCHEDULER, else tcp://127.0.0.1:7460), --curve-key and --scheduler-key.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "core/env.h"
#include "core/logging.h"
#include "scheduler/cli/cli.h"
#include "scheduler/cli/cli_elastic.h"
#include "scheduler/cli/cli_top.h"

namespace {

using troupe::sched::CliConnection;
using troupe::sched::JobSpec;

struct SpecFlags {
  JobSpec spec;
  std::vector<std::string> env;
  std::vector<std::string> command;  // positional, when no "--" is given
};

void add_spec_options(CLI::App* cmd, SpecFlags& f, bool nproc_required = true) {
  auto* np =
      cmd->add_option("--nproc,-n", f.spec.nproc,
                      nproc_required ? "Number of worker processes"
                                     : "Number of worker processes (in a Slurm allocation: $SLURM_NTASKS)")
          ->check(CLI::Range(1, 100000));
  if (nproc_required) np->required();
  cmd->add_option("--backend", f.spec.backend, "cpu or cuda (cuda: one GPU per worker)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--max-restarts", f.spec.max_restarts, "Restarts of the job's workers after a failure")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--max-driver-restarts", f.spec.max_driver_restarts, "Restarts of a driver that dies")
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--layout", f.spec.layout, "Parallel layout pp=P,dp=D,n=N (n workers share a node)");
  cmd->add_option("--name", f.spec.name, "A name for the job");
  cmd->add_option("--env,-e", f.env, "KEY=VALUE added to every process's environment");
  cmd->add_option("--checkpoint-dir", f.spec.checkpoint_dir, "Checkpoint directory (TROUPE_CHECKPOINT_DIR)");
  cmd->add_option("--work-dir", f.spec.work_dir, "Working directory of the processes");
  cmd->add_option("--heartbeat-timeout-ms", f.spec.heartbeat_timeout_ms,
                  "A process that said hello and is silent this long is declared dead");
  cmd->add_option(
         "--health-policy", f.spec.health_policy,
         "When the faulty-machine detector flags a worker: flag (default), replace it, or drain its agent")
      ->check(CLI::IsMember({"flag", "replace", "drain"}));
  cmd->add_flag("!--no-driver", f.spec.driver, "Run only the workers, no driver process");
  cmd->add_flag(
      "--elastic", f.spec.elastic,
      "The driver supervises the workers from the start (train_moe's driver claims this itself: no flag "
      "needed); a lost worker is then reported to it instead of restarting all workers");
  cmd->add_option("command", f.command, "The program and its arguments (after --)");
}

// Fills spec.argv (the words after "--", else the positionals) and spec.env.
bool finish_spec(CLI::App* cmd, SpecFlags& f, const std::vector<std::string>& after_dashes) {
  f.spec.argv = after_dashes.empty() ? f.command : after_dashes;
  if (f.spec.argv.empty()) {
    std::fprintf(stderr, "troupe %s: no command given (troupe %s --nproc N -- <app> [args])\n",
                 cmd->get_name().c_str(), cmd->get_name().c_str());
    return false;
  }
  for (const auto& kv : f.env) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "troupe: --env '%s' is not KEY=VALUE\n", kv.c_str());
      return false;
    }
    f.spec.env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return true;
}

void add_connection(CLI::App* cmd, CliConnection& c) {
  cmd->add_option("--scheduler,-s", c.scheduler, "Scheduler address HOST:PORT (default $TROUPE_SCHEDULER or 127.0.0.1:7460)");
  cmd->add_option("--curve-key", c.curve_key, "This client's CURVE key pair file (troupe keygen)");
  cmd->add_option("--scheduler-key", c.scheduler_key, "The scheduler's public key file: turns CURVE on");
  cmd->add_option("--timeout-ms", c.timeout_ms, "How long to wait for the scheduler")->check(CLI::Range(1, 3600000));
}

}  // namespace

int main(int argc, char** argv) {
  troupe::init_logging(troupe::LoggingOptions{"troupe", "", spdlog::level::warn});
  // The CLI reports connection problems itself, in one line; the transport's own
  // warnings (peer down, reconnecting) would only repeat them.
  if (!troupe::env::get("SPDLOG_LEVEL")) troupe::make_logger("control")->set_level(spdlog::level::err);
  CLI::App app{"troupe: run and manage Troupe jobs"};
  app.require_subcommand(1);

  SpecFlags run_flags;
  troupe::sched::RunOptions run_opts;
  auto* run = app.add_subcommand("run", "Run a job on this machine: embedded scheduler and agent, a driver and N workers");
  add_spec_options(run, run_flags, /*nproc_required=*/false);
  run->add_option("--state-dir", run_opts.state_dir, "Keep the scheduler state and logs here (default: a temporary dir)");
  run->add_flag("--verbose,-v", run_opts.verbose, "Log what the embedded scheduler and agent do");
  run->add_flag("!--no-prefix", run_opts.prefix_output, "Print process output without the [name] prefix");
  run->add_option(
      "--metrics-listen", run_opts.metrics_listen,
      "Serve the embedded scheduler's Prometheus /metrics on HOST:PORT (loopback; port 0 picks one)");
  run->add_option("--detector", run_opts.detector,
                  "A faulty-machine detector threshold KEY=VALUE (docs/elastic.md); repeatable");
  run->add_option("--slots", run_opts.slots,
                  "Slots of the embedded agent (default: --nproc); more workers fail at once")
      ->check(CLI::Range(1, 1000000));
  run->add_option("--agent-timeout-ms", run_opts.agent_timeout_ms,
                  "The embedded agent silent this long is declared dead and the job restarted (default 3000)")
      ->check(CLI::Range(1, 1000000));

  SpecFlags submit_flags;
  CliConnection submit_conn;
  bool submit_json = false;
  auto* submit = app.add_subcommand("submit", "Submit a job to a running troupe-scheduler");
  add_spec_options(submit, submit_flags);
  add_connection(submit, submit_conn);
  submit->add_flag("--json", submit_json, "Print the reply as JSON");

  CliConnection status_conn;
  std::string status_job;
  bool status_json = false;
  bool status_actors = false;
  bool status_health = false;
  auto* status = app.add_subcommand("status", "Show jobs, their processes and the agents");
  status->add_option("job", status_job, "Only this job, with its processes");
  status->add_flag("--json", status_json, "Print JSON for scripts");
  status->add_flag(
      "--actors", status_actors,
      "With a training job or run directory: every actor (trainer, stage, attention and expert actors) "
      "with its worker, node, device, state and last step time");
  status->add_flag("--health", status_health,
                   "With a job: each worker's last health report (host, process, GPU, step time) and the "
                   "faulty-machine detector's flags");
  add_connection(status, status_conn);

  CliConnection logs_conn;
  std::string logs_job, logs_proc;
  int logs_worker = -1;
  bool logs_follow = false, logs_driver = false;
  auto* logs = app.add_subcommand("logs", "Print a job process's output (default: the driver)");
  logs->add_option("job", logs_job, "Job id")->required();
  auto* w = logs->add_option("--worker,-w", logs_worker, "Worker rank")->check(CLI::Range(0, 1000000));
  auto* d = logs->add_flag("--driver", logs_driver, "The driver's output");
  w->excludes(d);
  logs->add_flag("--follow,-f", logs_follow, "Keep printing until the job ends");
  add_connection(logs, logs_conn);

  CliConnection cancel_conn;
  std::string cancel_job;
  bool cancel_json = false;
  auto* cancel = app.add_subcommand("cancel", "Cancel a job: every process of it is stopped");
  cancel->add_option("job", cancel_job, "Job id")->required();
  cancel->add_flag("--json", cancel_json, "Print the job record as JSON");
  add_connection(cancel, cancel_conn);

  CliConnection wait_conn;
  std::string wait_job;
  bool wait_quiet = false;
  auto* waitc =
      app.add_subcommand("wait", "Wait for a job to end; exit with its exit status (130: cancelled)");
  waitc->add_option("job", wait_job, "Job id")->required();
  waitc->add_flag("--quiet,-q", wait_quiet, "Print nothing");
  add_connection(waitc, wait_conn);

  CliConnection ckpt_conn;
  std::string ckpt_job, ckpt_dir;
  bool ckpt_json = false;
  auto* ckpts = app.add_subcommand("checkpoints", "List a job's checkpoints (step, layout, size, state)");
  ckpts->add_option("job", ckpt_job, "Job id (its checkpoint directory is found from its record)");
  ckpts->add_option("--dir", ckpt_dir, "A checkpoint directory to list instead (no scheduler asked)");
  ckpts->add_flag("--json", ckpt_json, "Print JSON for scripts");
  add_connection(ckpts, ckpt_conn);
  // Elastic train_moe jobs (scheduler/cli/cli_elastic.h), addressed by run directory.
  std::string scale_dir;
  int scale_dp = 0, scale_wait = 60;
  auto* scale = app.add_subcommand("scale", "Rescale an elastic job's data parallelism at its next step boundary");
  CliConnection scale_conn, replace_conn;
  scale->add_option("job", scale_dir, "Run directory of a distributed train_moe job, or a scheduler job id")
      ->required();
  add_connection(scale, scale_conn);
  scale->add_option("--dp", scale_dp, "New data-parallel size (within the job's elastic bounds)")
      ->required()
      ->check(CLI::Range(1, 1000000));
  scale->add_option("--wait", scale_wait, "Seconds to wait for the job's answer (0: do not wait)");
  std::string replace_dir;
  int replace_slot = -1, replace_wait = 60;
  auto* replace = app.add_subcommand("replace", "Replace one worker of an elastic job (restored from a dp peer)");
  replace
      ->add_option("job", replace_dir, "Run directory of a distributed train_moe job, or a scheduler job id")
      ->required();
  add_connection(replace, replace_conn);
  replace->add_option("worker", replace_slot, "Worker slot (see troupe status <run dir>)")
      ->required()
      ->check(CLI::Range(0, 1000000));
  replace->add_option("--wait", replace_wait, "Seconds to wait for the job's answer (0: do not wait)");

  std::string drain_agent;
  int drain_wait = 60;
  CliConnection drain_conn;
  auto* drain = app.add_subcommand(
      "drain",
      "Move the workers of driver-supervised (e.g. train_moe) jobs off an agent (restored from dp peers)");
  drain->add_option("agent", drain_agent, "Agent id (see troupe status)")->required();
  drain->add_option("--wait", drain_wait, "Seconds to wait for each move");
  add_connection(drain, drain_conn);

  CliConnection top_conn;
  troupe::sched::TopOptions top_opts;
  auto* top = app.add_subcommand("top", "A live view of a job: step, loss, tokens/s, workers, stragglers, events");
  top->add_option("job", top_opts.target, "Job id, or the run directory of a train_moe run")->required();
  top->add_option("--interval", top_opts.interval_s, "Seconds between redraws (default 2)");
  top->add_flag("--once", top_opts.once, "Print one frame (no screen control codes) and exit");
  top->add_option("--events", top_opts.events, "Recent events shown")->check(CLI::Range(0, 10000));
  add_connection(top, top_conn);

  std::string keygen_prefix, keygen_check;
  auto* keygen = app.add_subcommand(
      "keygen",
      "Write a CURVE key pair: PREFIX.key (private, mode 0600) and PREFIX.pub; or --check a key file");
  auto* keygen_prefix_opt = keygen->add_option("prefix", keygen_prefix, "Path prefix of the two files");
  keygen->add_option("--check", keygen_check, "Validate a key file (.key or .pub) and print its public key")
      ->excludes(keygen_prefix_opt);

  // Everything after the first "--" is the job's command, untouched by CLI11 (so the
  // command's own options, like "-n", are never taken for ours).
  std::vector<std::string> after_dashes;
  int our_argc = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      our_argc = i;
      for (int k = i + 1; k < argc; ++k) after_dashes.emplace_back(argv[k]);
      break;
    }
  }
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);  // prints the message (or the help)
    return rc == 0 ? 0 : 2;
  }

  if (run->parsed()) {
    if (!finish_spec(run, run_flags, after_dashes)) return 2;
    run_opts.spec = run_flags.spec;
    run_opts.nproc_given = run->get_option("--nproc")->count() > 0;
    return troupe::sched::cli_run(run_opts);
  }
  if (submit->parsed()) {
    if (!finish_spec(submit, submit_flags, after_dashes)) return 2;
    return troupe::sched::cli_submit(submit_conn, submit_flags.spec, submit_json);
  }
  if (status->parsed()) {
    if (!status_job.empty() && troupe::sched::is_elastic_run_dir(status_job)) {
      return troupe::sched::cli_elastic_status(status_job, status_json, status_actors);
    }
    if (status_health && status_job.empty()) {
      fmt::print(stderr, "troupe status --health: give a job id\n");
      return 2;
    }
    const int rc = troupe::sched::cli_status(status_conn, status_job, status_json, status_health);
    if (rc == 0 && !status_job.empty() && !status_json &&
        !troupe::sched::print_elastic_job_status(status_conn, status_job, status_actors) && status_actors) {
      fmt::print(
          stderr,
          "troupe status --actors: job {} has no actor table (not a training job, or no step done yet)\n",
          status_job);
      return 1;
    }
    return rc;
  }
  if (drain->parsed()) return troupe::sched::cli_elastic_drain(drain_conn, drain_agent, drain_wait);
  if (scale->parsed()) return troupe::sched::cli_elastic_scale(scale_conn, scale_dir, scale_dp, scale_wait);
  if (replace->parsed()) {
    return troupe::sched::cli_elastic_replace(replace_conn, replace_dir, replace_slot, replace_wait);
  }
  if (logs->parsed()) {
    if (logs_worker >= 0) logs_proc = "worker-" + std::to_string(logs_worker);
    else if (logs_driver) logs_proc = "driver";
    return troupe::sched::cli_logs(logs_conn, logs_job, logs_proc, logs_follow);
  }
  if (cancel->parsed()) return troupe::sched::cli_cancel(cancel_conn, cancel_job, cancel_json);
  if (keygen->parsed()) {
    if (!keygen_check.empty()) return troupe::sched::cli_keygen_check(keygen_check);
    if (keygen_prefix.empty()) {
      std::fprintf(stderr, "troupe keygen: give a PREFIX (or --check FILE)\n");
      return 2;
    }
    return troupe::sched::cli_keygen(keygen_prefix);
  }
  if (waitc->parsed()) return troupe::sched::cli_wait(wait_conn, wait_job, wait_quiet);
  if (top->parsed()) return troupe::sched::cli_top(top_conn, top_opts);
  if (ckpts->parsed()) {
    if (ckpt_job.empty() && ckpt_dir.empty()) {
      std::fprintf(stderr, "troupe: checkpoints: give a job id or --dir\n");
      return 2;
    }
    return troupe::sched::cli_checkpoints(ckpt_conn, ckpt_job, ckpt_dir, ckpt_json);
  }
  return 2;
}
