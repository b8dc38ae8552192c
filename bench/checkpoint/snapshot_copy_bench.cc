// bench/checkpoint/snapshot_copy_bench.cc — the copies a GPU snapshot makes, measured on the
// host it runs on: what sets the snapshot interval K (docs/elastic.md "Snapshots").
//
//   snapshot_copy_bench [--gb 16] [--repeat 3] [--threads 8]
//
// For a state of GB gigabytes (bench_1b: 12 bytes a parameter, 1.33e9 parameters = 16 GB):
//   1. device -> device into a staging buffer (the part of a snapshot on the step's critical
//      path: the compute stream copies it before the next step's kernels);
//   2. device -> host into a shared-memory segment (memfd, what a node's snapshot keeper
//      hands a worker) page-locked with cudaHostRegister: the copy on the snapshot stream,
//      while the next steps run;
//   3. the same into pageable memory (what an unpinned copy would get);
//   4. xxHash64 of the host copy, 1 and THREADS threads (the slice checksums a part lands
//      with, off the step).
// GB/s = bytes / seconds (1 GB = 1e9 B), the best of REPEAT; printed next to the peaks:
// HBM3e 4.8 TB/s (H200; a copy reads and writes, so at most half of it), PCIe Gen5 x16
// 64 GB/s per direction. Without CUDA or a GPU it says so and exits 77.
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double hash_gbps(const std::byte* p, size_t n, int threads, int repeat) {
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    const size_t chunk = (n + threads - 1) / threads;
    std::atomic<uint64_t> sink{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t a = std::min(n, t * chunk), b = std::min(n, a + chunk);
        sink += XXH64(p + a, b - a, 0);
      });
    }
    for (auto& th : pool) th.join();
    best = std::min(best, secs(t0));
  }
  return static_cast<double>(n) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the copies and checksums of a GPU snapshot"};
  double gb = 16;
  int repeat = 3, threads = 8;
  app.add_option("--gb", gb, "state size in GB (bench_1b: 16)");
  app.add_option("--repeat", repeat, "runs of each measurement (the best is printed)");
  app.add_option("--threads", threads, "checksum threads");
  CLI11_PARSE(app, argc, argv);
#if !TROUPE_HAVE_CUDA
  fmt::print("snapshot_copy_bench: this build has no CUDA\n");
  return 77;
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    fmt::print("snapshot_copy_bench: no CUDA device\n");
    return 77;
  }
  const size_t n = static_cast<size_t>(gb * 1e9);
  void* dev = nullptr;
  void* staging = nullptr;
  if (cudaMalloc(&dev, n) != cudaSuccess || cudaMalloc(&staging, n) != cudaSuccess) {
    fmt::print("snapshot_copy_bench: cannot allocate 2 x {:.1f} GB on the device\n", gb);
    return 1;
  }
  cudaMemset(dev, 1, n);
  cudaStream_t compute = nullptr, side = nullptr;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  auto timed = [&](auto&& op, cudaStream_t s) {
    double best = 1e30;
    for (int r = 0; r < repeat; ++r) {
      cudaStreamSynchronize(s);
      const auto t0 = Clock::now();
      op();
      cudaStreamSynchronize(s);
      best = std::min(best, secs(t0));
    }
    return best;
  };
  const double d2d =
      timed([&] { cudaMemcpyAsync(staging, dev, n, cudaMemcpyDeviceToDevice, compute); }, compute);
  // The keeper's segment: a memfd mapped shared, page-locked.
  const int fd = memfd_create("snapshot-copy-bench", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0) {
    fmt::print("snapshot_copy_bench: memfd of {:.1f} GB failed\n", gb);
    return 1;
  }
  auto* seg = static_cast<std::byte*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  if (seg == MAP_FAILED) return 1;
  std::memset(seg, 0, n);  // the pages exist (a keeper's segment is reused across snapshots)
  const auto t_reg = Clock::now();
  const bool pinned = cudaHostRegister(seg, n, cudaHostRegisterPortable) == cudaSuccess;
  const double reg_s = secs(t_reg);
  const double d2h_pinned =
      timed([&] { cudaMemcpyAsync(seg, staging, n, cudaMemcpyDeviceToHost, side); }, side);
  std::vector<std::byte> pageable(n);
  std::memset(pageable.data(), 0, n);
  const double d2h_pageable =
      timed([&] { cudaMemcpyAsync(pageable.data(), staging, n, cudaMemcpyDeviceToHost, side); }, side);
  const double h1 = hash_gbps(seg, n, 1, repeat), hn = hash_gbps(seg, n, threads, repeat);
  fmt::print("snapshot copies of a {:.2f} GB state (GB/s = bytes / seconds, best of {}):\n", n / 1e9, repeat);
  fmt::print(
      "  device -> device staging (critical path): {:8.3f} s {:8.1f} GB/s   (peak HBM3e 4800 GB/s, a copy <= "
      "2400)\n",
      d2d, n / d2d / 1e9);
  fmt::print(
      "  device -> pinned memfd segment (side):    {:8.3f} s {:8.1f} GB/s   (peak PCIe Gen5 x16 64 GB/s){}\n",
      d2h_pinned, n / d2h_pinned / 1e9,
      pinned ? fmt::format("; cudaHostRegister {:.2f} s once", reg_s)
             : std::string("; cudaHostRegister FAILED: pageable"));
  fmt::print("  device -> pageable memory:                {:8.3f} s {:8.1f} GB/s\n", d2h_pageable,
             n / d2h_pageable / 1e9);
  fmt::print("  xxHash64 of the host copy: {:.1f} GB/s on 1 thread, {:.1f} GB/s on {} threads ({:.3f} s)\n",
             h1, hn, threads, n / (hn * 1e9));
  if (pinned) cudaHostUnregister(seg);
  munmap(seg, n);
  close(fd);
  cudaFree(dev);
  cudaFree(staging);
  return 0;
#endif
}
