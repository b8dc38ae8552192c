// apps/train_moe/elastic_launch.h — train_moe's elastic mode (TROUPE_ELASTIC=1 with a
// multi-rank layout): the standalone launcher that supervises its worker processes,
// replaces failed ones live, rescales data parallelism at step boundaries and records
// every failure and recovery in <run dir>/events.jsonl (docs/elastic.md).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "apps/train_moe/commands.h"
#include "comm/rendezvous_store.h"
#include "layers/train_config.h"

namespace troupe::train_moe {

// True when TROUPE_ELASTIC is "1".
bool elastic_enabled();

// The launcher (no TROUPE_ROLE): runs the whole job. `tc` is the loaded configuration.
Status run_elastic_launcher(const TrainOptions& o, const std::string& run_dir, const layers::TrainConfig& tc);

// The driver of a troupe-scheduler job (TROUPE_ROLE=driver): the same protocol, with the
// scheduler starting, killing and watching the workers (scheduler/scheduler_elastic.cc).
Status run_elastic_scheduled_driver(const TrainOptions& o, const std::string& run_dir, const layers::TrainConfig& tc,
                                    std::unique_ptr<comm::RendezvousStore> store);

// A worker (TROUPE_ROLE=worker; TROUPE_ELASTIC_SLOT or TROUPE_RANK, TROUPE_ELASTIC_EPOCH,
// TROUPE_JOB_ID).
// `cut_control` closes the worker's control-plane connection (cutctl fault; may be empty).
Status run_elastic_worker_process(const layers::TrainConfig& tc, comm::RendezvousStore& store,
                                  std::function<void()> cut_control = {});

}  // namespace troupe::train_moe
