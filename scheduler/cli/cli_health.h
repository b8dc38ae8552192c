// scheduler/cli/cli_health.h — defines render_health_table: the workers' latest health reports
// of one job (the "health" part of its status document, scheduler/daemons/health_monitor.h) as the
// table `troupe status <job> --health` and `troupe top <job>` print.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace troupe::sched {

// One row per process: age of its report, host CPU busy and steal, the process's CPU,
// run-queue wait and throttling, RSS, network, TCP retransmits, step compute time, and
// with a GPU its SM clock, power, temperature, utilisation, memory, ECC and XID errors;
// then the detector's flags. "" when no report arrived yet.
std::string render_health_table(const nlohmann::json& health);

}  // namespace troupe::sched
