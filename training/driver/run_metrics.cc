// training/driver/run_metrics.cc — RunMetrics (run_metrics.h).
#include "training/driver/run_metrics.h"

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/env.h"
#include "core/job_env.h"

namespace troupe::training {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// metrics.jsonl keys -> (Prometheus gauge, scale to its unit).
const std::map<std::string, std::pair<std::string, double>>& prometheus_keys() {
  static const std::map<std::string, std::pair<std::string, double>> m = {
      {"step", {"troupe_train_step", 1}},
      {"loss", {"troupe_train_loss", 1}},
      {"lm_loss", {"troupe_train_lm_loss", 1}},
      {"aux_loss", {"troupe_train_aux_loss", 1}},
      {"grad_norm", {"troupe_train_grad_norm", 1}},
      {"lr", {"troupe_train_lr", 1}},
      {"tokens_per_s", {"troupe_train_tokens_per_second", 1}},
      {"tokens", {"troupe_train_tokens_total", 1}},
      {"step_ms", {"troupe_train_step_seconds", 1e-3}},
      {"mfu", {"troupe_train_mfu", 1}},
      {"val_loss", {"troupe_train_val_loss", 1}},
      {"comm_ms", {"troupe_train_comm_seconds", 1e-3}},
      {"comm_ms_mean", {"troupe_train_comm_exposed_seconds", 1e-3}},
      {"ckpt_blocked_ms", {"troupe_train_checkpoint_blocked_seconds", 1e-3}},
      {"load_imbalance", {"troupe_train_load_imbalance", 1}},
      {"dropped_tokens", {"troupe_train_dropped_tokens", 1}},
  };
  return m;
}

}  // namespace

Result<std::unique_ptr<RunMetrics>> RunMetrics::open(const layers::ObserveOptions& o,
                                                     const std::string& run_dir) {
  std::unique_ptr<RunMetrics> m(new RunMetrics());
  m->job_ = env::get_or(job_env::kJobId, std::filesystem::path(run_dir).filename().string());
  if (o.tensorboard) {
    TROUPE_ASSIGN_OR_RETURN(m->tb_, observe::TensorBoardWriter::open(run_dir + "/tensorboard"));
  }
  if (!o.prometheus_listen.empty()) {
    m->registry_ = std::make_shared<prometheus::Registry>();
    m->recoveries_ = &prometheus::BuildCounter()
                          .Name("troupe_train_recoveries_total")
                          .Help("recoveries from a lost, hung or replaced worker")
                          .Register(*m->registry_);
    m->steps_lost_ = &prometheus::BuildCounter()
                          .Name("troupe_train_steps_lost_total")
                          .Help("completed steps run again after recoveries")
                          .Register(*m->registry_);
    observe::MetricsServerOptions so{o.prometheus_listen, o.prometheus_auth_file,
                                     env::get_or(job_env::kInsecure) == "1"};
    TROUPE_ASSIGN_OR_RETURN(m->server_, observe::MetricsServer::start(so, m->registry_));
    std::ofstream(run_dir + "/metrics_url") << m->server_->url() << "\n";
    fmt::print("metrics: Prometheus /metrics at {}\n", m->server_->url());
  }
  return m;
}

RunMetrics::~RunMetrics() {
  if (tb_) (void)tb_->flush();
}

prometheus::Gauge& RunMetrics::gauge(const std::string& name,
                                     const std::map<std::string, std::string>& extra) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    auto& f = prometheus::BuildGauge()
                  .Name(name)
                  .Help("from the training run's metrics.jsonl")
                  .Register(*registry_);
    it = families_.emplace(name, &f).first;
  }
  std::map<std::string, std::string> labels = extra;
  labels["troupe_job"] = job_;
  return it->second->Add(labels);
}

void RunMetrics::tb_scalar(int64_t step, const std::string& tag, double v, double wall) {
  if (!tb_) return;
  Status s = tb_->scalar(step, tag, v, wall);
  if (!s.ok()) {
    fmt::print(stderr, "tensorboard: {}; no more event files this run\n", s.to_string());
    tb_.reset();
  }
}

void RunMetrics::on_step(const nlohmann::json& rec) {
  if (!rec.is_object() || !rec.contains("step")) return;
  const int64_t step = rec.value("step", int64_t{0});
  last_step_ = step;
  const double wall = now_s();
  for (const auto& [key, v] : rec.items()) {
    if (v.is_number() && key != "step") {
      tb_scalar(step, "train/" + key, v.get<double>(), wall);
    } else if (v.is_object() && key == "comm_by_kind_ms") {
      for (const auto& [kind, ms] : v.items()) {
        if (ms.is_number()) tb_scalar(step, "train/comm_by_kind_ms/" + kind, ms.get<double>(), wall);
      }
    }
    if (registry_ && v.is_number()) {
      auto it = prometheus_keys().find(key);
      if (it != prometheus_keys().end()) gauge(it->second.first).Set(v.get<double>() * it->second.second);
    }
  }
  // Expert load: per MoE layer, every expert's token count in the step.
  const nlohmann::json load = rec.value("expert_load", nlohmann::json::array());
  for (size_t l = 0; l < load.size(); ++l) {
    if (!load[l].is_array() || load[l].empty()) continue;
    std::vector<double> counts;
    for (const auto& c : load[l]) counts.push_back(c.is_number() ? c.get<double>() : 0.0);
    double sum = 0, mx = 0;
    for (double c : counts) sum += c, mx = std::max(mx, c);
    const double mean = sum / static_cast<double>(counts.size());
    const std::string layer = std::to_string(l);
    if (mean > 0) tb_scalar(step, "moe/load_max_over_mean/layer_" + layer, mx / mean, wall);
    if (tb_) {
      Status s = tb_->histogram(step, "moe/expert_load/layer_" + layer, observe::Histogram::of(counts), wall);
      if (!s.ok()) tb_scalar(step, "", 0, wall);  // reports and turns TensorBoard off
    }
    if (registry_) {
      gauge("troupe_train_expert_load_max", {{"layer", layer}}).Set(mx);
      gauge("troupe_train_expert_load_mean", {{"layer", layer}}).Set(mean);
      if (mean > 0) gauge("troupe_train_expert_load_max_over_mean", {{"layer", layer}}).Set(mx / mean);
    }
  }
  if (tb_) (void)tb_->flush();
}

void RunMetrics::on_event(const nlohmann::json& e) {
  if (e.value("event", "") != "recovered") return;
  const double lost = e.value("steps_lost", 0.0), secs = e.value("recovery_s", 0.0);
  recoveries_n_ += 1;
  steps_lost_n_ += lost;
  const double wall = now_s();
  tb_scalar(last_step_, "elastic/recoveries", recoveries_n_, wall);
  tb_scalar(last_step_, "elastic/steps_lost", steps_lost_n_, wall);
  tb_scalar(last_step_, "elastic/recovery_s", secs, wall);
  if (tb_) (void)tb_->flush();
  if (registry_) {
    recoveries_->Add({{"troupe_job", job_}}).Increment();
    steps_lost_->Add({{"troupe_job", job_}}).Increment(lost);
    gauge("troupe_train_last_recovery_seconds").Set(secs);
  }
}

}  // namespace troupe::training
