// training/driver/run_metrics.h — defines RunMetrics: what a training run's driver shows
// dashboards besides metrics.jsonl ([observe] in the config, training/run_config.h):
//
// - TensorBoard (observe.tensorboard, default on): event files in <run dir>/tensorboard
//   (`tensorboard --logdir <run dir>`): a scalar "train/<key>" for every number of each
//   metrics.jsonl record (loss, lm_loss, aux_loss, grad_norm, lr, tokens_per_s, step_ms,
//   mfu, comm_ms, val_loss, ckpt_blocked_ms, ...; "train/comm_by_kind_ms/<kind>"), per MoE
//   layer "moe/load_max_over_mean/layer_<l>" and a histogram of its experts' token counts
//   "moe/expert_load/layer_<l>", and "elastic/recoveries", "elastic/steps_lost",
//   "elastic/recovery_s" from the events.
// - Prometheus (observe.prometheus_listen = "HOST:PORT"; off by default): /metrics with
//   troupe_train_step, troupe_train_loss, troupe_train_lm_loss, troupe_train_aux_loss,
//   troupe_train_grad_norm, troupe_train_lr, troupe_train_tokens_per_second,
//   troupe_train_tokens_total, troupe_train_step_seconds, troupe_train_mfu,
//   troupe_train_val_loss, troupe_train_comm_seconds (rank 0's communication per step),
//   troupe_train_comm_exposed_seconds (the world's mean), troupe_train_checkpoint_blocked_seconds,
//   troupe_train_expert_load_max{layer}, troupe_train_expert_load_mean{layer},
//   troupe_train_expert_load_max_over_mean{layer}, troupe_train_recoveries_total,
//   troupe_train_steps_lost_total, troupe_train_last_recovery_seconds, each labelled
//   troupe_job="<TROUPE_JOB_ID or the run directory's name>". The bound URL is printed and
//   written to <run dir>/metrics_url (port 0 picks one).
//
// Threading: the driver's loop calls on_step/on_event; scrapes run on the Exposer's threads.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"
#include "observe/metrics_server.h"
#include "observe/tensorboard.h"
#include "training/run_config.h"

namespace prometheus {
class Registry;
class Gauge;
class Counter;
template <typename T>
class Family;
}  // namespace prometheus

namespace troupe::training {

class RunMetrics {
 public:
  // Off loopback without credentials only when the job's agent runs --insecure
  // (TROUPE_INSECURE=1), as for its control plane.
  static Result<std::unique_ptr<RunMetrics>> open(const layers::ObserveOptions& o,
                                                  const std::string& run_dir);
  ~RunMetrics();

  // A metrics.jsonl record (the step's, with "step"). A TensorBoard write that fails is
  // said once and TensorBoard is turned off; training goes on.
  void on_step(const nlohmann::json& rec);
  // An events.jsonl record: "recovered" adds to the recoveries and steps lost.
  void on_event(const nlohmann::json& e);
  std::string url() const { return server_ ? server_->url() : std::string(); }

 private:
  RunMetrics() = default;
  prometheus::Gauge& gauge(const std::string& name, const std::map<std::string, std::string>& extra = {});
  void tb_scalar(int64_t step, const std::string& tag, double v, double wall);

  std::string job_;
  std::unique_ptr<observe::TensorBoardWriter> tb_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<observe::MetricsServer> server_;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> families_;
  prometheus::Family<prometheus::Counter>* recoveries_ = nullptr;
  prometheus::Family<prometheus::Counter>* steps_lost_ = nullptr;
  int64_t last_step_ = 0;
  double recoveries_n_ = 0, steps_lost_n_ = 0;
};

}  // namespace troupe::training
