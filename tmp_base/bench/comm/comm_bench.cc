// bench/comm/comm_bench.cc — communication benchmark: bus bandwidth per operation and
// message size for the Gloo (CPU) and NCCL (GPU) Communicators, with the formula printed
// (nccl-tests conventions), and the compression codecs' throughput and error.
//
//   comm_bench --backend gloo --ranks 4 --max-bytes 16M
//   comm_bench --backend nccl                # one process per visible GPU, up to 1 GiB
//   comm_bench_nccl --backend nccl           # the same, built without Gloo (for GPU hosts without libgloo)
//
// The launcher re-executes this binary once per rank (--child), with a FileStore in a
// temporary directory; rank 0 prints. Each point: warm-up, barrier, `iters` operations
// issued back to back, wait for all; time = max over ranks of (elapsed / iters).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "comm/compression.h"
#ifndef TROUPE_COMM_BENCH_NCCL_ONLY
#include "comm/gloo_communicator.h"
#endif
#ifdef TROUPE_HAVE_NCCL
#include <cuda_runtime.h>

#include "comm/nccl_communicator.h"
#endif

extern char** environ;

namespace troupe::comm {
namespace {

using namespace std::chrono_literals;

struct Config {
  std::string backend = "gloo";
  int ranks = 0;
  std::string min_bytes = "1K";
  std::string max_bytes;
  std::string ops = "all_reduce,reduce_scatter,all_gather,all_to_all,all_to_all_v,broadcast,send_recv";
  std::string dtype = "bf16";
  int iters = 0;  // 0: by size
  bool codecs = true;
  // Child mode.
  int rank = -1;
  std::string store_dir;
};

Result<int64_t> parse_bytes(const std::string& s) {
  if (s.empty()) return invalid_argument("empty size");
  size_t pos = 0;
  double v = std::stod(s, &pos);
  std::string unit = s.substr(pos);
  int64_t mult = 1;
  if (unit == "K" || unit == "KiB")
    mult = 1 << 10;
  else if (unit == "M" || unit == "MiB")
    mult = 1 << 20;
  else if (unit == "G" || unit == "GiB")
    mult = int64_t{1} << 30;
  else if (!unit.empty())
    return invalid_argument("size '{}': unknown unit '{}' (K, M, G)", s, unit);
  return static_cast<int64_t>(v * mult);
}

// Bus-bandwidth factor per operation (nccl-tests): busbw = algbw * factor(n).
struct OpInfo {
  const char* name;
  const char* formula;
  double (*factor)(int n);
};
const OpInfo kOps[] = {
    {"all_reduce", "busbw = 2(n-1)/n * S/t, S = buffer bytes", [](int n) { return 2.0 * (n - 1) / n; }},
    {"reduce_scatter", "busbw = (n-1)/n * S/t, S = input bytes", [](int n) { return double(n - 1) / n; }},
    {"all_gather", "busbw = (n-1)/n * S/t, S = output bytes", [](int n) { return double(n - 1) / n; }},
    {"all_to_all", "busbw = (n-1)/n * S/t, S = send bytes per rank", [](int n) { return double(n - 1) / n; }},
    {"all_to_all_v", "busbw = (n-1)/n * S/t, S = send bytes per rank (uneven counts)",
     [](int n) { return double(n - 1) / n; }},
    {"broadcast", "busbw = S/t, S = buffer bytes", [](int) { return 1.0; }},
    {"send_recv", "busbw = S/t, S = bytes each rank sends (ring: to r+1, from r-1)", [](int) { return 1.0; }},
};

// Buffers of one point on the communicator's device.
struct Buffer {
  Tensor t;
  void* device_ptr = nullptr;
  ~Buffer() {
#ifdef TROUPE_HAVE_NCCL
    if (device_ptr) cudaFree(device_ptr);
#endif
  }
};

std::unique_ptr<Buffer> make_buffer(const Communicator& c, int64_t numel, DType dt) {
  auto b = std::make_unique<Buffer>();
  if (c.device().is_cpu()) {
    b->t = Tensor::empty({numel}, dt);
    std::memset(b->t.data_ptr(), 0, b->t.nbytes());
  } else {
#ifdef TROUPE_HAVE_NCCL
    cudaMalloc(&b->device_ptr, std::max<size_t>(1, numel * dtype_size(dt)));
    cudaMemset(b->device_ptr, 0, std::max<size_t>(1, numel * dtype_size(dt)));
    b->t = Tensor::wrap(b->device_ptr, {numel}, dt, c.device());
#endif
  }
  return b;
}

// Seconds per operation (max over ranks), or a negative value on error.
double time_op(Communicator& c, const std::string& op, int64_t bytes, DType dt, int iters) {
  const int n = c.size(), r = c.rank();
  const int64_t esize = static_cast<int64_t>(dtype_size(dt));
  int64_t numel = std::max<int64_t>(n, bytes / esize / n * n);
  std::unique_ptr<Buffer> a, b;
  std::vector<int64_t> sc, rc;
  std::function<WorkPtr()> issue;
  if (op == "all_reduce") {
    a = make_buffer(c, numel, dt);
    issue = [&] { return c.all_reduce(a->t, ReduceOp::kSum); };
  } else if (op == "reduce_scatter") {
    a = make_buffer(c, numel, dt);
    b = make_buffer(c, numel / n, dt);
    issue = [&] { return c.reduce_scatter(a->t, b->t, ReduceOp::kSum); };
  } else if (op == "all_gather") {
    a = make_buffer(c, numel / n, dt);
    b = make_buffer(c, numel, dt);
    issue = [&] { return c.all_gather(a->t, b->t); };
  } else if (op == "all_to_all") {
    a = make_buffer(c, numel, dt);
    b = make_buffer(c, numel, dt);
    issue = [&] { return c.all_to_all(a->t, b->t); };
  } else if (op == "all_to_all_v") {
    // Uneven but balanced: rank r sends (1 + ((r + p) % n)) / mean units to p.
    auto units = [&](int from, int to) { return int64_t{1} + (from + to) % n; };
    int64_t total_units = 0;
    for (int p = 0; p < n; ++p) total_units += units(r, p);
    const int64_t unit = std::max<int64_t>(1, numel / total_units);
    int64_t sn = 0, rn = 0;
    for (int p = 0; p < n; ++p) {
      sc.push_back(units(r, p) * unit);
      rc.push_back(units(p, r) * unit);
      sn += sc.back();
      rn += rc.back();
    }
    a = make_buffer(c, sn, dt);
    b = make_buffer(c, rn, dt);
    issue = [&] { return c.all_to_all_v(a->t, sc, b->t, rc); };
  } else if (op == "broadcast") {
    a = make_buffer(c, numel, dt);
    issue = [&] { return c.broadcast(a->t, 0); };
  } else if (op == "send_recv") {
    if (n < 2) return -1;
    a = make_buffer(c, numel, dt);
    b = make_buffer(c, numel, dt);
    issue = [&] {
      auto ws = c.send(a->t, (r + 1) % n);
      auto wr = c.recv(b->t, (r + n - 1) % n);
      Status st = ws->wait();
      (void)wr->wait();
      return st.ok() ? wr : ws;
    };
  } else {
    return -1;
  }
  for (int i = 0; i < 2; ++i) {
    if (!issue()->wait().ok()) return -1;
  }
  if (!c.barrier()->wait().ok()) return -1;
  auto start = Clock::now();
  std::vector<WorkPtr> works;
  for (int i = 0; i < iters; ++i) works.push_back(issue());
  if (!wait_all(works).ok()) return -1;
  double secs = std::chrono::duration<double>(Clock::now() - start).count() / iters;
  // Max over ranks, through the communicator itself (on the host for Gloo).
  auto m = make_buffer(c, 1, DType::kF32);
  float v = static_cast<float>(secs);
  if (c.device().is_cpu()) {
    m->t.data<float>()[0] = v;
  } else {
#ifdef TROUPE_HAVE_NCCL
    cudaMemcpy(m->device_ptr, &v, sizeof(v), cudaMemcpyHostToDevice);
#endif
  }
  if (!c.all_reduce(m->t, ReduceOp::kMax)->wait().ok()) return -1;
  if (c.device().is_cpu()) {
    v = m->t.data<float>()[0];
  } else {
#ifdef TROUPE_HAVE_NCCL
    cudaMemcpy(&v, m->device_ptr, sizeof(v), cudaMemcpyDeviceToHost);
#endif
  }
  return v;
}

void bench_collectives(Communicator& c, const Config& cfg, int64_t lo, int64_t hi, DType dt) {
  const int n = c.size();
  std::vector<std::string> ops;
  for (size_t pos = 0; pos <= cfg.ops.size();) {
    size_t comma = cfg.ops.find(',', pos);
    if (comma == std::string::npos) comma = cfg.ops.size();
    if (comma > pos) ops.push_back(cfg.ops.substr(pos, comma - pos));
    pos = comma + 1;
  }
  for (const auto& op : ops) {
    const OpInfo* info = nullptr;
    for (const auto& o : kOps)
      if (op == o.name) info = &o;
    if (info == nullptr) {
      if (c.rank() == 0) std::printf("unknown op '%s'\n", op.c_str());
      continue;
    }
    if (c.rank() == 0) {
      std::printf("\n%s on %s, %d ranks, %s   [%s; algbw = S/t; n = %d; GB = 1e9 B]\n", op.c_str(),
                  std::string(c.backend()).c_str(), n, std::string(dtype_name(dt)).c_str(), info->formula, n);
      std::printf("%12s %8s %12s %12s %12s\n", "bytes", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    for (int64_t bytes = lo; bytes <= hi; bytes *= 4) {
      int iters = cfg.iters > 0 ? cfg.iters
                                : static_cast<int>(std::clamp<int64_t>((int64_t{64} << 20) / bytes, 10, 200));
      double t = time_op(c, op, bytes, dt, iters);
      if (c.rank() == 0) {
        if (t <= 0) {
          std::printf("%12lld %8d %12s\n", static_cast<long long>(bytes), iters, "error");
        } else {
          double algbw = bytes / t / 1e9;
          std::printf("%12lld %8d %12.1f %12.3f %12.3f\n", static_cast<long long>(bytes), iters, t * 1e6,
                      algbw, algbw * info->factor(n));
        }
        std::fflush(stdout);
      }
    }
  }
}

// Codec throughput and error (host tensors over the Gloo communicator).
void bench_codecs(Communicator& c) {
  const int n = c.size(), r = c.rank();
  std::mt19937 gen(1234 + r);
  std::normal_distribution<float> d(0.0f, 1.0f);
  if (r == 0)
    std::printf(
        "\ncodecs (host, %d ranks; rel. error = ||x' - x||_2 / ||x||_2 against the uncompressed result)\n",
        n);
  // Local conversions.
  {
    const int64_t rows = 4096, cols = 1024;
    std::vector<float> v(rows * cols);
    for (auto& x : v) x = d(gen);
    Tensor x = Tensor::from_floats({rows, cols}, v);
    auto t0 = Clock::now();
    auto q = quantize_rows_fp8(x).value();
    auto t1 = Clock::now();
    auto back = dequantize_rows_fp8(q, DType::kF32).value();
    auto t2 = Clock::now();
    double err = relative_l2_error(back.data<float>(), v.data(), v.size());
    if (r == 0) {
      double gb = x.nbytes() / 1e9;
      std::printf(
          "  fp8 e4m3 per-row quantise:   %7.2f GB/s of f32 input, dequantise %7.2f GB/s, rel. error %.4f\n",
          gb / std::chrono::duration<double>(t1 - t0).count(),
          gb / std::chrono::duration<double>(t2 - t1).count(), err);
    }
  }
  // bf16 reduce-scatter vs fp32 reduce-scatter.
  {
    const int64_t m = (4 << 20) / n;  // 16 MiB of fp32 gradients per rank
    std::vector<float> g(m * n);
    for (auto& x : g) x = d(gen) * 1e-3f;
    Tensor grad = Tensor::from_floats({m * n}, g);
    Tensor out = Tensor::empty({m}, DType::kF32);
    Bf16ReduceScatter codec(c, {.error_feedback = true, .measure_error = true});
    (void)codec.run(grad, out);
    const int iters = 5;
    (void)c.barrier()->wait();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) (void)c.reduce_scatter(grad, out, ReduceOp::kSum)->wait();
    auto t1 = Clock::now();
    Bf16ReduceScatter timed(c, {.error_feedback = true, .measure_error = false});
    for (int i = 0; i < iters; ++i) (void)timed.run(grad, out);
    auto t2 = Clock::now();
    if (r == 0) {
      double f32 = std::chrono::duration<double>(t1 - t0).count() / iters * 1e3;
      double b16 = std::chrono::duration<double>(t2 - t1).count() / iters * 1e3;
      std::printf(
          "  grad reduce-scatter 16 MiB/rank: fp32 %.2f ms, bf16 codec (a2a + fp32 sum + feedback) %.2f ms, "
          "wire bytes %.2fx less, rel. error %.2e\n",
          f32, b16, double(codec.stats().bytes_uncompressed) / codec.stats().bytes_on_wire,
          codec.stats().last_rel_l2_error);
    }
  }
  // fp8 token dispatch vs bf16 all_to_all_v.
  {
    const int64_t hidden = 1024, rows_per_peer = 512;
    std::vector<float> v(rows_per_peer * n * hidden);
    for (auto& x : v) x = d(gen);
    Tensor tokens = Tensor::from_floats({rows_per_peer * n, hidden}, v, DType::kBF16);
    Tensor out = Tensor::empty({rows_per_peer * n, hidden}, DType::kBF16);
    std::vector<int64_t> rows(n, rows_per_peer), elems(n, rows_per_peer * hidden);
    Fp8TokenDispatch dispatch(c);
    (void)dispatch.run(tokens, rows, out, rows);
    const int iters = 5;
    (void)c.barrier()->wait();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i)
      (void)c.all_to_all_v(tokens.flatten(), elems, out.flatten(), elems)->wait();
    auto t1 = Clock::now();
    for (int i = 0; i < iters; ++i) (void)dispatch.run(tokens, rows, out, rows);
    auto t2 = Clock::now();
    if (r == 0) {
      std::printf(
          "  token dispatch %lld x %lld bf16/rank: bf16 all_to_all_v %.2f ms, fp8 codec (quantise + 2 a2a + "
          "dequantise) %.2f ms, rel. error %.4f\n",
          static_cast<long long>(rows_per_peer * n), static_cast<long long>(hidden),
          std::chrono::duration<double>(t1 - t0).count() / iters * 1e3,
          std::chrono::duration<double>(t2 - t1).count() / iters * 1e3, dispatch.stats().last_rel_l2_error);
    }
  }
}

int run_child(const Config& cfg) {
  auto store = FileStore::open(cfg.store_dir);
  if (!store.ok()) return 4;
  CommSpec spec;
  spec.store = store->get();
  spec.ns = StoreNamespace{"bench", 0};
  spec.rank = cfg.rank;
  spec.size = cfg.ranks;
  spec.options.op_timeout = 300s;
  spec.options.init_timeout = 120s;
  Result<std::unique_ptr<Communicator>> c = unimplemented("backend {}", cfg.backend);
  if (cfg.backend == "gloo") {
#ifndef TROUPE_COMM_BENCH_NCCL_ONLY
    c = make_gloo_communicator(spec);
#else
    c = unimplemented("comm_bench_nccl has no Gloo backend: use comm_bench");
#endif
  } else if (cfg.backend == "nccl") {
#ifdef TROUPE_HAVE_NCCL
    c = make_nccl_communicator(spec, NcclOptions{cfg.rank});
#else
    c = unimplemented("this build has no NCCL");
#endif
  }
  if (!c.ok()) {
    std::fprintf(stderr, "[rank %d] %s\n", cfg.rank, c.status().to_string().c_str());
    return 5;
  }
  auto lo = parse_bytes(cfg.min_bytes), hi = parse_bytes(cfg.max_bytes);
  auto dt = dtype_from_name(cfg.dtype);
  if (!lo.ok() || !hi.ok() || !dt) return 6;
  bench_collectives(**c, cfg, *lo, *hi, *dt);
  if (cfg.codecs && cfg.backend == "gloo") bench_codecs(**c);
  return 0;
}

}  // namespace
}  // namespace troupe::comm

int main(int argc, char** argv) {
  using namespace troupe::comm;
  Config cfg;
  CLI::App app(
      "Troupe communication benchmark: bus bandwidth per operation and size; codec throughput and error");
  app.add_option("--backend", cfg.backend, "gloo (CPU) or nccl (GPU)")
      ->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--ranks", cfg.ranks, "processes (gloo default 2; nccl default: visible GPUs)");
  app.add_option("--min-bytes", cfg.min_bytes, "smallest message (K, M, G suffixes)");
  app.add_option("--max-bytes", cfg.max_bytes, "largest message (gloo default 16M, nccl 1G)");
  app.add_option("--ops", cfg.ops, "comma-separated operations");
  app.add_option("--dtype", cfg.dtype, "f32, bf16 (fp8e4m3 for data movement only)");
  app.add_option("--iters", cfg.iters, "timed iterations per point (0: by size)");
  app.add_flag("!--no-codecs", cfg.codecs, "skip the codec measurements");
  app.add_option("--child-rank", cfg.rank)->group("");
  app.add_option("--child-store", cfg.store_dir)->group("");
  CLI11_PARSE(app, argc, argv);
  if (cfg.max_bytes.empty()) cfg.max_bytes = cfg.backend == "nccl" ? "1G" : "16M";
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // never NVLink multicast on the shared hosts (children inherit)
  if (cfg.rank >= 0) return run_child(cfg);

  if (cfg.ranks <= 0) {
    cfg.ranks = 2;
#ifdef TROUPE_HAVE_NCCL
    if (cfg.backend == "nccl") {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        std::fprintf(stderr, "no GPU visible\n");
        return 77;
      }
      cfg.ranks = std::min(count, 8);
    }
#endif
  }
  std::printf("comm_bench: backend %s, %d ranks, %s .. %s, dtype %s\n", cfg.backend.c_str(), cfg.ranks,
              cfg.min_bytes.c_str(), cfg.max_bytes.c_str(), cfg.dtype.c_str());
  std::fflush(stdout);
  auto dir = std::filesystem::temp_directory_path() / fmt::format("troupe-comm-bench-{}", ::getpid());
  std::filesystem::create_directories(dir);
  char self[4096];
  ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return 2;
  self[len] = 0;
  std::vector<pid_t> pids;
  for (int r = 0; r < cfg.ranks; ++r) {
    std::vector<std::string> args = {
        self,           "--backend",       cfg.backend,     "--ranks",     std::to_string(cfg.ranks),
        "--min-bytes",  cfg.min_bytes,     "--max-bytes",   cfg.max_bytes, "--ops",
        cfg.ops,        "--dtype",         cfg.dtype,       "--iters",     std::to_string(cfg.iters),
        "--child-rank", std::to_string(r), "--child-store", dir.string()};
    if (!cfg.codecs) args.push_back("--no-codecs");
    std::vector<char*> cargv;
    for (auto& a : args) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self, nullptr, nullptr, cargv.data(), environ) != 0) {
      std::fprintf(stderr, "posix_spawn failed\n");
      break;
    }
    pids.push_back(pid);
  }
  int failures = 0;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) ++failures;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return failures == 0 && static_cast<int>(pids.size()) == cfg.ranks ? 0 : 1;
}
