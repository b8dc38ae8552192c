// tests/observe/health_job.cc — the job of the detector test and of the fault bench
// (bench/faults): a data-parallel-shaped loop that a troupe-scheduler runs as N workers.
// Each step computes (HJ_WORK_PASSES passes over a 16 MiB array: CPU and memory
// bandwidth), all-reduces a 64 KiB gradient-sized buffer over Gloo with every other
// worker (so a slow worker slows everyone, as in training), and waits for the next
// HJ_PERIOD_MS tick; every HJ_CKPT_EVERY steps it writes HJ_CKPT_BYTES to HJ_CKPT_DIR and
// fsyncs (a checkpoint). Every second it reports its machine's health to the scheduler
// with its step timings (scheduler/client/health_reporter.h), as a train_moe worker does.
//
// It stops when the file HJ_STOP_FILE exists (rank 0 sees it; the flag travels in the
// all-reduce, so every rank stops after the same step) or after HJ_STEPS steps. Rank 0
// appends "<step> <wall ms>" lines to HJ_PROGRESS (when set) every 10 steps.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "comm/gloo_communicator.h"
#include "observe/health.h"
#include "scheduler/client/health_reporter.h"
#include "scheduler/client/job_context.h"
#include "scheduler/client/scheduler_store.h"

namespace {

using Clock = std::chrono::steady_clock;

long env_long(const char* name, long dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtol(v, nullptr, 10) : dflt;
}
std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

int run() {
  auto ctx = troupe::sched::JobContext::from_env();
  if (!ctx.ok() || !ctx->has_value()) {
    fmt::print(stderr, "health_job: not started by troupe ({})\n",
               ctx.ok() ? "no TROUPE_JOB_ID" : ctx.status().to_string());
    return 2;
  }
  const troupe::sched::JobContext& jc = **ctx;
  if (jc.is_driver()) return 0;  // the job runs without a driver (--no-driver); nothing to do
  auto steps = std::make_shared<troupe::observe::StepProbe>();
  auto reporter = troupe::sched::HealthReporter::start(jc, {}, steps);
  if (!reporter.ok()) {
    fmt::print(stderr, "health_job: {}\n", reporter.status().to_string());
    return 1;
  }
  auto store = troupe::sched::SchedulerStore::connect(jc);
  if (!store.ok()) {
    fmt::print(stderr, "health_job: {}\n", store.status().to_string());
    return 1;
  }
  troupe::comm::CommSpec spec;
  spec.store = store->get();
  spec.ns = {jc.job_id, jc.epoch};
  spec.rank = jc.rank;
  spec.size = jc.world_size;
  // Injected stalls (SIGSTOP bursts) last seconds: the collectives wait them out.
  spec.options.op_timeout = std::chrono::milliseconds(120000);
  spec.options.init_timeout = std::chrono::milliseconds(120000);
  auto comm = troupe::comm::make_gloo_communicator(spec);
  if (!comm.ok()) {
    fmt::print(stderr, "health_job: {}\n", comm.status().to_string());
    return 1;
  }
  const long period_ms = env_long("HJ_PERIOD_MS", 200);
  const long passes = env_long("HJ_WORK_PASSES", 2);
  const long max_steps = env_long("HJ_STEPS", 1L << 40);
  const long ckpt_every = env_long("HJ_CKPT_EVERY", 0);
  const long ckpt_bytes = env_long("HJ_CKPT_BYTES", 8L << 20);
  const std::string ckpt_dir = env_str("HJ_CKPT_DIR"), stop_file = env_str("HJ_STOP_FILE"),
                    progress = env_str("HJ_PROGRESS");
  std::vector<float> data(size_t{4} << 20, 1.0f);  // 16 MiB
  std::vector<char> ckpt(static_cast<size_t>(ckpt_bytes), 'c');
  troupe::Tensor grad = troupe::Tensor::zeros({16384}, troupe::DType::kF32);
  auto next = Clock::now();
  float sink = 0;
  for (long step = 1; step <= max_steps; ++step) {
    const auto t0 = Clock::now();
    for (long p = 0; p < passes; ++p) {
      float acc = 0;
      for (size_t i = 0; i < data.size(); i += 4) acc += data[i] * 1.0001f;
      sink += acc;
    }
    const auto t1 = Clock::now();
    float* g = grad.data<float>();
    for (int i = 0; i < 16384; ++i) g[i] = 1.0f;
    g[0] = (jc.rank == 0 && !stop_file.empty() && std::filesystem::exists(stop_file)) ? 1e6f : 0.0f;
    const troupe::Status st = (*comm)->all_reduce(grad, troupe::comm::ReduceOp::kSum)->wait();
    if (!st.ok()) {
      fmt::print(stderr, "health_job: step {}: {}\n", step, st.to_string());
      return 1;
    }
    const auto t2 = Clock::now();
    const double compute_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    const double comm_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
    steps->record_step(compute_ms + comm_ms, compute_ms, comm_ms);
    if (ckpt_every > 0 && !ckpt_dir.empty() && step % ckpt_every == 0) {
      steps->begin_io();
      const std::string path = fmt::format("{}/{}.ckpt", ckpt_dir, jc.name);
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ssize_t w = ::write(fd, ckpt.data(), ckpt.size());
        (void)w;
        ::fsync(fd);
        ::close(fd);
      }
      steps->end_io();
    }
    if (jc.rank == 0 && !progress.empty() && step % 10 == 0) {
      std::ofstream(progress, std::ios::app) << step << " "
                                             << std::chrono::duration_cast<std::chrono::milliseconds>(
                                                    std::chrono::system_clock::now().time_since_epoch())
                                                    .count()
                                             << "\n";
    }
    if (g[0] > 0) break;  // rank 0 saw the stop file
    next += std::chrono::milliseconds(period_ms);
    const auto now = Clock::now();
    if (next > now) {
      std::this_thread::sleep_until(next);
    } else {
      next = now;  // behind (a stall): the schedule restarts from here
    }
  }
  return sink == 42.0f ? 3 : 0;  // keeps the compute from being optimised away
}

}  // namespace

int main() {
  return run();
}
