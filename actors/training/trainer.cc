// actors/training/trainer.cc — Trainer (driver) and run_stage_host (worker).
#include "actors/training/trainer.h"

#include <cmath>

#include <fmt/format.h>

namespace troupe::training {

using Clock = std::chrono::steady_clock;

nlohmann::json step_report_json(const StepReport& r) {
  nlohmann::json j{{"step", r.step},         {"loss", r.loss},       {"lm_loss", r.lm_loss},
                        {"aux_loss", r.aux_loss}, {"grad_norm", r.grad_norm}, {"lr", r.lr},
                        {"step_tokens", r.tokens}, {"expert_load", r.expert_load}, {"step_ms", r.step_ms},
                        {"comm_ms", r.comm_ms},   {"compute_ms", r.compute_ms}, {"comm_ms_mean", r.comm_ms_mean},
                        {"comm_by_kind_ms", r.comm_by_kind_ms}};
  if (r.peak_bytes >= 0) j["peak_bytes"] = r.peak_bytes;
  return j;
}

nlohmann::json data_position_json(const layers::TrainConfig& tc, int64_t step, int64_t tokens_seen) {
  return nlohmann::json{{"next_step", step + 1},
                        {"samples_consumed", step * tc.global_batch()},
                        {"tokens_seen", tokens_seen},
                        {"global_batch", tc.global_batch()},
                        {"seq_len", tc.train.seq_len},
                        {"seed", tc.train.seed}};
}

Trainer::Trainer(const layers::TrainConfig& tc, StepDriver& driver, std::ostream& metrics, TrainerOptions opts)
    : tc_(tc), driver_(driver), metrics_(metrics), opts_(std::move(opts)) {}

Result<nlohmann::json> Trainer::call(Command::Kind kind, int64_t step) {
  return driver_.call(Command{seq_++, kind, step}, opts_.command_timeout, opts_.supervise);
}

Status Trainer::run() {
  TROUPE_ASSIGN_OR_RETURN(nlohmann::json v0, call(Command::Kind::kEval, 0));
  val0_ = last_val_ = v0.value("val_loss", 0.0);
  const int64_t start = opts_.first_step - 1;
  fmt::print("{}step {} | val_loss {:.4f}\n", start > 0 ? "resumed | " : "", start, val0_);
  nlohmann::json rec0{{"step", start}, {"val_loss", val0_}, {"tokens", opts_.tokens_seen}};
  if (start > 0) rec0["resumed"] = true;
  metrics_ << rec0.dump() << "\n";
  metrics_.flush();
  const auto t_start = Clock::now();
  int64_t tokens_seen = opts_.tokens_seen;
  for (int64_t step = opts_.first_step; step <= tc_.train.steps; ++step) {
    const auto t0 = Clock::now();
    TROUPE_ASSIGN_OR_RETURN(nlohmann::json rec, call(Command::Kind::kStep, step));
    const double wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double loss = rec.value("loss", NAN);
    if (!std::isfinite(loss)) return aborted("step {}: the loss is {} (diverged)", step, loss);
    const int64_t step_tokens = rec.value("step_tokens", int64_t{0});
    tokens_seen += step_tokens;
    rec.erase("step_tokens");
    rec["tokens"] = tokens_seen;
    rec["tokens_per_s"] = static_cast<double>(step_tokens) / wall_s;
    rec["driver_step_ms"] = wall_s * 1e3;
    if (opts_.num_gpus > 0) {
      // Dense bf16 peak of one H100/H200 SXM (TFLOP/s), as the single-process app uses.
      constexpr double kPeakFlopsPerGpu = 989e12;
      rec["mfu"] = rec["tokens_per_s"].get<double>() * opts_.flops_per_token / (kPeakFlopsPerGpu * opts_.num_gpus);
    }
    // train.time_limit_s: stop after the step that ends past the budget (final validation
    // as at the last step), as the single-process app does.
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
    const bool out_of_time = tc_.train.time_limit_s > 0 && elapsed > tc_.train.time_limit_s && step < tc_.train.steps;
    const bool eval_now =
        (tc_.train.eval_every > 0 && step % tc_.train.eval_every == 0) || step == tc_.train.steps || out_of_time;
    if (eval_now) {
      TROUPE_ASSIGN_OR_RETURN(nlohmann::json ev, call(Command::Kind::kEval, step));
      last_val_ = ev.value("val_loss", NAN);
      rec["val_loss"] = last_val_;
    }
    if (opts_.checkpoints != nullptr &&
        checkpoint_due(tc_.checkpoint.every, step, step == tc_.train.steps || out_of_time)) {
      TROUPE_RETURN_IF_ERROR(save_checkpoint(step, tokens_seen, rec));
    }
    metrics_ << rec.dump() << "\n";
    metrics_.flush();
    if (step % tc_.train.log_every == 0 || step == 1 || eval_now) {
      fmt::print("step {}/{} | loss {:.4f} | lm {:.4f} | aux {:.4f} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s | "
                 "{:.0f} ms (compute {:.0f}, comm {:.0f}){}{}\n",
                 step, tc_.train.steps, loss, rec.value("lm_loss", 0.0), rec.value("aux_loss", 0.0),
                 rec.value("lr", 0.0), rec.value("grad_norm", 0.0), rec["tokens_per_s"].get<double>(),
                 rec.value("step_ms", 0.0), rec.value("compute_ms", 0.0), rec.value("comm_ms", 0.0),
                 rec.contains("mfu") ? fmt::format(" | mfu {:.1f}% | peak {:.1f} GiB", 100.0 * rec["mfu"].get<double>(),
                                                   rec.value("peak_bytes", 0.0) / 1073741824.0)
                                     : "",
                 eval_now ? fmt::format(" | val_loss {:.4f}", last_val_) : "");
      std::fflush(stdout);
    }
    if (out_of_time) {
      fmt::print("train_moe: time limit of {:.0f}s reached after step {}; stopping\n", tc_.train.time_limit_s, step);
      break;
    }
  }
  TROUPE_RETURN_IF_ERROR(call(Command::Kind::kStop, 0).status());
  if (opts_.checkpoints != nullptr) TROUPE_RETURN_IF_ERROR(opts_.checkpoints->finish());
  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  fmt::print("train_moe: done in {:.1f}s ({:.0f} tokens/s); val_loss {:.4f} -> {:.4f}\n", total_s,
             static_cast<double>(tokens_seen - opts_.tokens_seen) / std::max(total_s, 1e-9), val0_, last_val_);
  return ok_status();
}

Status Trainer::save_checkpoint(int64_t step, int64_t tokens_seen, nlohmann::json& rec) {
  const auto t0 = Clock::now();
  TROUPE_ASSIGN_OR_RETURN(nlohmann::json r, call(Command::Kind::kSave, step));
  // The whole pause of the job for this save: every worker's snapshot plus one control
  // round trip (ckpt_blocked_ms is rank 0's snapshot alone).
  rec["ckpt_driver_ms"] = std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
  if (r.contains("ckpt_error")) {
    // The step's checkpoint will not be committed (its committer sees the rank's error
    // marker); training goes on and the failure is the run's outcome at the end.
    fmt::print(stderr, "checkpoint: step {}: rank 0 could not save: {}\n", step, r["ckpt_error"].get<std::string>());
  }
  rec["ckpt_blocked_ms"] = r.value("ckpt_blocked_ms", 0.0);
  rec["ckpt_bytes_rank0"] = r.value("ckpt_bytes", uint64_t{0});
  opts_.checkpoints->commit(step, data_position_json(tc_, step, tokens_seen), nlohmann::json{{"adam_steps", step}});
  return ok_status();
}

namespace {

// A worker's "save": the stage's state (views of its host buffers) into the writer.
nlohmann::json save_stage_checkpoint(Stage& stage, RankCheckpointer* checkpoints, int64_t step) {
  if (checkpoints == nullptr) return nlohmann::json{{"ckpt_error", "this worker has no checkpoint directory"}};
  const auto t0 = Clock::now();
  Result<StageState> st = stage.export_state(StateScope::kSave, /*copy=*/false);
  if (st.ok() && st->step != step) {
    st = failed_precondition("asked to save step {} but the stage has run {} steps", step, st->step);
  }
  if (!st.ok()) {
    checkpoints->mark_failed(step, st.status());
    return nlohmann::json{{"ckpt_error", st.status().to_string()}};
  }
  Result<SaveFigures> f = checkpoints->save(*st);
  const double blocked_ms = std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
  if (!f.ok()) return nlohmann::json{{"ckpt_error", f.status().to_string()}, {"ckpt_blocked_ms", blocked_ms}};
  return nlohmann::json{{"ckpt_blocked_ms", blocked_ms}, {"ckpt_bytes", f->bytes}};
}

}  // namespace

Status run_stage_host(Stage& stage, StepServer& server, std::chrono::milliseconds command_timeout,
                      RankCheckpointer* checkpoints) {
  return server.serve(
      [&stage, checkpoints](const Command& cmd) -> nlohmann::json {
        switch (cmd.kind) {
          case Command::Kind::kStep: return step_report_json(stage.run_step(cmd.step));
          case Command::Kind::kEval: return nlohmann::json{{"val_loss", stage.evaluate()}};
          case Command::Kind::kSave: return save_stage_checkpoint(stage, checkpoints, cmd.step);
          case Command::Kind::kStop:
            if (checkpoints != nullptr) {
              const Status st = checkpoints->finish();
              if (!st.ok()) return nlohmann::json{{"stopped", true}, {"ckpt_error", st.to_string()}};
            }
            break;
        }
        return nlohmann::json{{"stopped", true}};
      },
      command_timeout);
}

}  // namespace troupe::training
