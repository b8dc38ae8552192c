// scheduler/client/health_reporter.cc — HealthReporter (health_reporter.h).
#include "scheduler/client/health_reporter.h"

#include <fmt/format.h>
#include <unistd.h>

namespace troupe::sched {

Result<std::unique_ptr<HealthReporter>> HealthReporter::start(const JobContext& ctx, HealthReporterOptions o,
                                                              std::shared_ptr<observe::StepProbe> steps) {
  const std::string id = fmt::format("health:{}:{}:{}:{}", ctx.job_id, ctx.name, ctx.epoch, getpid());
  TROUPE_ASSIGN_OR_RETURN(auto conn,
                          ClientEndpoint::connect(ctx.session_endpoint(), ctx.session_security(), id));
  std::unique_ptr<HealthReporter> r(new HealthReporter());
  r->thread_ = std::thread([stop = &r->stop_, conn = std::shared_ptr<ClientEndpoint>(std::move(conn)), ctx, o,
                            steps = std::move(steps)]() {
    observe::HealthSampler sampler(o.sampler, steps);
    if (!sampler.gpu_unavailable().empty()) {
      fmt::print(stderr, "{}: health reports carry no GPU metrics: {}\n", ctx.name,
                 sampler.gpu_unavailable());
      std::fflush(stderr);
    }
    auto next = std::chrono::steady_clock::now();
    while (!stop->load()) {
      HealthReport rep{ctx.job_id, ctx.name, ctx.epoch, static_cast<int32_t>(getpid()), wall_ms(), {}};
      for (auto& m : sampler.sample()) rep.metrics.emplace_back(std::move(m.name), m.value);
      conn->send(Message{0, std::move(rep)});  // a lost report is only a gap: nothing to retry
      next += o.interval;
      // Sleep in short slices so the destructor does not wait a whole interval.
      while (!stop->load() && std::chrono::steady_clock::now() < next)
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
            std::chrono::milliseconds(50), next - std::chrono::steady_clock::now()));
      if (std::chrono::steady_clock::now() - next > o.interval) next = std::chrono::steady_clock::now();
    }
  });
  return r;
}

HealthReporter::~HealthReporter() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

}  // namespace troupe::sched
