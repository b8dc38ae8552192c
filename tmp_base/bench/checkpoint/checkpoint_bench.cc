// bench/checkpoint/checkpoint_bench.cc — bench_checkpoint: checkpoint save and load
// throughput, and the time training is blocked per save.
//
// R ranks (threads, each with its own CheckpointWriter, layout n=R) save T f32 tensors
// whose dim 0 is split over the ranks, then the driver commits. Figures (GB = 1e9 bytes):
//   blocked      = time inside save() (snapshot copy to host memory; max over ranks)
//   snapshot     = bytes / snapshot time (all ranks' bytes over the slowest rank's copy;
//                  compare: single-thread memcpy bandwidth)
//   save         = bytes / (first save() call → last rank durable + finalize)
//   verify load  = bytes / open_latest_valid(kChecksums) (reads and hashes every slice)
//   read load    = bytes / read_full() of every tensor  (page cache warm, then cold after
//                  posix_fadvise(DONTNEED) on the shard files)
#include <fcntl.h>
#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "checkpoint/reader.h"
#include "checkpoint/writer.h"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::checkpoint;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double gbps(uint64_t bytes, double s) {
  return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0;
}

double memcpy_gbps(size_t bytes) {
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
  std::memcpy(b.data(), a.data(), bytes);  // fault in
  const auto t0 = Clock::now();
  std::memcpy(b.data(), a.data(), bytes);
  return gbps(bytes, since(t0));
}

void drop_page_cache(const std::string& dir) {
  for (const auto& de : fs::directory_iterator(dir)) {
    const int fd = ::open(de.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

int run(const std::string& run_dir, uint64_t total_mb, uint64_t tensor_mb, int ranks, int saves,
        bool do_fsync) {
  const int64_t cols = 1024;
  const int64_t rows = static_cast<int64_t>(tensor_mb << 20) / (cols * 4) / ranks * ranks;
  const int num_tensors = static_cast<int>(std::max<uint64_t>(1, total_mb / tensor_mb));
  const uint64_t bytes = static_cast<uint64_t>(num_tensors) * rows * cols * 4;
  const ParallelLayout layout = ParallelLayout::make(1, 1, ranks).value();
  fmt::print("== {:.0f} MiB: {} f32 tensors [{}, {}], {} rank(s) (n={}), fsync {}\n",
             static_cast<double>(bytes) / (1 << 20), num_tensors, rows, cols, ranks, ranks,
             do_fsync ? "on" : "off");

  // Each rank's local tensors (its block of rows), filled with non-zero data.
  std::vector<std::vector<Tensor>> local(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    for (int t = 0; t < num_tensors; ++t) {
      Tensor x = Tensor::empty({rows / ranks, cols}, DType::kF32);
      float* p = x.data<float>();
      for (int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<float>((i * 31 + t * 7 + r) % 1000) * 0.001f;
      local[static_cast<size_t>(r)].push_back(x);
    }
  }
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  for (int r = 0; r < ranks; ++r) {
    WriterOptions wo{run_dir, layout, r};
    wo.fsync = do_fsync;
    auto w = CheckpointWriter::create(wo);
    if (!w.ok()) {
      fmt::print(stderr, "{}\n", w.status().to_string());
      return 1;
    }
    writers.push_back(std::move(*w));
  }
  for (int s = 1; s <= saves; ++s) {
    std::vector<double> blocked(static_cast<size_t>(ranks)), snap(static_cast<size_t>(ranks));
    std::vector<Status> status(static_cast<size_t>(ranks));
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        std::vector<SaveEntry> entries;
        for (int t = 0; t < num_tensors; ++t) {
          entries.push_back(SaveEntry{fmt::format("layers.{}.experts.w", t),
                                      {rows, cols},
                                      {rows / ranks * r, 0},
                                      local[static_cast<size_t>(r)][static_cast<size_t>(t)]});
        }
        auto h = writers[static_cast<size_t>(r)]->save(s, entries);
        if (!h.ok()) {
          status[static_cast<size_t>(r)] = h.status();
          return;
        }
        status[static_cast<size_t>(r)] = h->wait();
        blocked[static_cast<size_t>(r)] = h->stats().blocked_seconds;
        snap[static_cast<size_t>(r)] = h->stats().snapshot_seconds;
      });
    }
    for (auto& t : threads) t.join();
    for (const Status& st : status) {
      if (!st.ok()) {
        fmt::print(stderr, "save failed: {}\n", st.to_string());
        return 1;
      }
    }
    const double written = since(t0);
    const auto tf = Clock::now();
    FinalizeOptions fo;
    fo.world_size = ranks;
    fo.keep_last = 1;
    fo.fsync = do_fsync;
    auto f = finalize_checkpoint(run_dir, s, fo);
    if (!f.ok()) {
      fmt::print(stderr, "finalize failed: {}\n", f.status().to_string());
      return 1;
    }
    const double fin = since(tf);
    const double total = since(t0);
    const double max_blocked = *std::max_element(blocked.begin(), blocked.end());
    const double max_snap = *std::max_element(snap.begin(), snap.end());
    fmt::print(
        "  save #{} ({} buffer): blocked {:.3f} s (snapshot {:.3f} s) -> snapshot {:.2f} GB/s (all ranks); "
        "durable after {:.3f} s + finalize {:.3f} s = {:.3f} s -> save {:.2f} GB/s\n",
        s, s == 1 ? "new" : "reused", max_blocked, max_snap, gbps(bytes, max_snap), written, fin, total,
        gbps(bytes, total));
  }
  // Loads.
  auto t0 = Clock::now();
  auto reader = CheckpointReader::open_latest_valid(run_dir, VerifyMode::kChecksums);
  if (!reader.ok()) {
    fmt::print(stderr, "{}\n", reader.status().to_string());
    return 1;
  }
  const double verify = since(t0);
  auto read_all = [&]() -> double {
    const auto t = Clock::now();
    for (const auto& [name, rec] : (*reader)->manifest().tensors) {
      auto x = (*reader)->read_full(name);
      if (!x.ok()) {
        fmt::print(stderr, "{}\n", x.status().to_string());
        std::exit(1);
      }
    }
    return since(t);
  };
  const double warm = read_all();
  drop_page_cache((*reader)->path());
  const double cold = read_all();
  fmt::print(
      "  load: verify every checksum {:.3f} s -> {:.2f} GB/s; read_full all (page cache) {:.3f} s -> {:.2f} "
      "GB/s;"
      " read_full all (cold, after fadvise DONTNEED) {:.3f} s -> {:.2f} GB/s\n",
      verify, gbps(bytes, verify), warm, gbps(bytes, warm), cold, gbps(bytes, cold));
  return 0;
}

// The blocked time per save as training measured it: train_moe writes ckpt_blocked_ms
// (rank 0's time inside the save: snapshot into the writer's host buffer) into the
// metrics of each saving step. Printed beside the steps' own time.
int summarise_training(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    fmt::print(stderr, "bench_checkpoint: cannot read {}\n", path);
    return 1;
  }
  std::vector<double> blocked, step_ms, driver_ms;
  uint64_t bytes = 0;
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("loss")) continue;
    step_ms.push_back(j.value("step_ms", 0.0));
    if (j.contains("ckpt_blocked_ms")) {
      blocked.push_back(j["ckpt_blocked_ms"].get<double>());
      bytes = j.value("ckpt_bytes_rank0", bytes);
      if (j.contains("ckpt_driver_ms")) driver_ms.push_back(j["ckpt_driver_ms"].get<double>());
    }
  }
  if (blocked.empty()) {
    fmt::print("{}: no saving step (ckpt_blocked_ms) in {} steps\n", path, step_ms.size());
    return 1;
  }
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  };
  fmt::print(
      "{}: {} saves over {} steps: training blocked {:.2f} ms per save (mean; max {:.2f} ms){}{}; "
      "mean step {:.1f} ms\n",
      path, blocked.size(), step_ms.size(), mean(blocked), *std::max_element(blocked.begin(), blocked.end()),
      bytes ? fmt::format(", rank 0 shard {:.2f} MB", static_cast<double>(bytes) / 1e6) : "",
      driver_ms.empty()
          ? ""
          : fmt::format(", job paused {:.2f} ms (driver: all ranks + control round trip)", mean(driver_ms)),
      mean(step_ms));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_checkpoint: checkpoint save/load throughput and blocked time"};
  std::string dir;
  std::vector<uint64_t> sizes_mb{256, 1024};
  uint64_t tensor_mb = 16;
  int ranks = 1, saves = 3;
  bool no_fsync = false;
  app.add_option("--dir", dir, "run directory (default: a fresh one under $TMPDIR, removed at exit)");
  app.add_option("--sizes-mb", sizes_mb, "total checkpoint sizes in MiB")->delimiter(',');
  app.add_option("--tensor-mb", tensor_mb, "size of each tensor in MiB");
  app.add_option("--ranks", ranks, "ranks (threads with their own writer), layout n=ranks")
      ->check(CLI::Range(1, 64));
  app.add_option("--saves", saves, "saves per size (the first allocates the snapshot buffer)")
      ->check(CLI::Range(1, 100));
  app.add_flag("--no-fsync", no_fsync, "skip fsync (measures the page cache, not the disk)");
  std::vector<std::string> train_metrics;
  app.add_option("--train-metrics", train_metrics,
                 "summarise the blocked time per save of train_moe runs (their metrics.jsonl) instead");
  CLI11_PARSE(app, argc, argv);
  if (!train_metrics.empty()) {
    int rc = 0;
    for (const auto& m : train_metrics) rc |= summarise_training(m);
    return rc;
  }
  bool own_dir = dir.empty();
  if (own_dir) {
    std::string tmpl = (fs::temp_directory_path() / "troupe-ckpt-bench-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return 1;
    dir = tmpl;
  }
  fmt::print("bench_checkpoint in {} ({} hardware threads)\n", dir, std::thread::hardware_concurrency());
  fmt::print("formula: GB/s = bytes / seconds, 1 GB = 1e9 B; reference single-thread memcpy: {:.2f} GB/s\n",
             memcpy_gbps(256u << 20));
  int rc = 0;
  for (uint64_t mb : sizes_mb) {
    const std::string run_dir = (fs::path(dir) / fmt::format("size_{}", mb)).string();
    rc |= run(run_dir, mb, tensor_mb, ranks, saves, !no_fsync);
    std::error_code ec;
    fs::remove_all(run_dir, ec);
  }
  if (own_dir) fs::remove_all(dir);
  return rc;
}
