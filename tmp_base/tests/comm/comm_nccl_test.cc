// tests/comm/comm_nccl_test.cc — the NCCL Communicator on real GPUs (label gpu): one
// process per GPU, spawned by re-executing this binary (CUDA must not be initialised
// before a fork). Scenarios: every operation and dtype on 1 GPU and on 2 GPUs against a
// host reference; a recv that is never matched hits its deadline, the watchdog aborts,
// the peer is told through the store and aborts too, and both rebuild in a new epoch.
// Exits 77 (skipped) when no GPU is visible.
#include <cuda_runtime.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_communicator.h"
#include "tests/comm/comm_test_util.h"

extern char** environ;

namespace troupe::comm {
namespace {

using namespace std::chrono_literals;
using Millis = std::chrono::milliseconds;

float value(int rank, int64_t i) {
  return static_cast<float>((rank * 7 + i * 3) % 29 - 14) * 0.25f;
}

std::vector<float> host_values(int rank, int64_t n, DType dt, int salt = 0) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = value(rank + salt, i);
  if (dt == DType::kI32 || dt == DType::kI64)
    for (auto& x : v) x = std::round(x * 4);
  return Tensor::from_floats({n}, v, dt).to_floats();  // rounded to dt
}

// A device tensor (owned by a cudaMalloc'd Storage kept alive by the returned guard).
struct DeviceTensor {
  Tensor t;
  void* ptr = nullptr;
  DeviceTensor(int64_t n, DType dt, int device) {
    cudaMalloc(&ptr, std::max<size_t>(1, n * dtype_size(dt)));
    cudaMemset(ptr, 0x7f, std::max<size_t>(1, n * dtype_size(dt)));  // poison
    t = Tensor::wrap(ptr, {n}, dt, Device::cuda(device));
  }
  ~DeviceTensor() { cudaFree(ptr); }
  void upload(const std::vector<float>& v) {
    Tensor h = Tensor::from_floats({static_cast<int64_t>(v.size())}, v, t.dtype());
    cudaMemcpy(ptr, h.data_ptr(), h.nbytes(), cudaMemcpyHostToDevice);
  }
  std::vector<float> download() const {
    Tensor h = Tensor::empty({t.numel()}, t.dtype());
    cudaMemcpy(h.data_ptr(), ptr, h.nbytes(), cudaMemcpyDeviceToHost);
    return h.to_floats();
  }
};

std::unique_ptr<Communicator> connect(RendezvousStore& store, int rank, int size, uint64_t epoch,
                                      Millis op_timeout) {
  CommSpec spec;
  spec.store = &store;
  spec.ns = StoreNamespace{"gpujob", epoch};
  spec.rank = rank;
  spec.size = size;
  spec.options.op_timeout = op_timeout;
  spec.options.init_timeout = 60s;
  auto c = make_nccl_communicator(spec, NcclOptions{rank});
  if (!c.ok()) {
    std::fprintf(stderr, "[rank %d] connect: %s\n", rank, c.status().to_string().c_str());
    std::_Exit(5);
  }
  return std::move(c).value();
}

int child_ops(RendezvousStore& store, int r, int n) {
  auto c = connect(store, r, n, 0, 30s);
  cudaStream_t user_stream;
  cudaStreamCreate(&user_stream);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      const int64_t len = 100003;
      DeviceTensor t(len, dt, r);
      t.upload(host_values(r, len, dt));
      OpOptions opts;
      if (dt == DType::kF32) opts.stream = user_stream;  // caller's stream
      CHILD_CHECK_OK(c->all_reduce(t.t, op, opts)->wait());
      std::vector<float> want(len, op == ReduceOp::kSum ? 0.0f : -1e30f);
      for (int q = 0; q < n; ++q) {
        auto v = host_values(q, len, dt);
        for (int64_t i = 0; i < len; ++i)
          want[i] = op == ReduceOp::kSum ? want[i] + v[i] : std::max(want[i], v[i]);
      }
      CHILD_CHECK(t.download() == want, "all_reduce {} {}", dtype_name(dt), reduce_op_name(op));
      const int64_t m = 4099;
      DeviceTensor in(m * n, dt, r), out(m, dt, r);
      in.upload(host_values(r, m * n, dt));
      CHILD_CHECK_OK(c->reduce_scatter(in.t, out.t, op)->wait());
      std::vector<float> rs(m, op == ReduceOp::kSum ? 0.0f : -1e30f);
      for (int q = 0; q < n; ++q) {
        auto v = host_values(q, m * n, dt);
        for (int64_t i = 0; i < m; ++i)
          rs[i] = op == ReduceOp::kSum ? rs[i] + v[r * m + i] : std::max(rs[i], v[r * m + i]);
      }
      CHILD_CHECK(out.download() == rs, "reduce_scatter {} {}", dtype_name(dt), reduce_op_name(op));
    }
  }
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2}) {
    const int64_t len = 3001;
    DeviceTensor in(len, dt, r), out(len * n, dt, r);
    in.upload(host_values(r, len, dt));
    CHILD_CHECK_OK(c->all_gather(in.t, out.t)->wait());
    std::vector<float> want;
    for (int q = 0; q < n; ++q) {
      auto v = host_values(q, len, dt);
      want.insert(want.end(), v.begin(), v.end());
    }
    CHILD_CHECK(out.download() == want, "all_gather {}", dtype_name(dt));

    const int64_t chunk = 1237;
    DeviceTensor a_in(chunk * n, dt, r), a_out(chunk * n, dt, r);
    a_in.upload(host_values(r, chunk * n, dt));
    CHILD_CHECK_OK(c->all_to_all(a_in.t, a_out.t)->wait());
    want.clear();
    for (int q = 0; q < n; ++q) {
      auto v = host_values(q, chunk * n, dt);
      want.insert(want.end(), v.begin() + r * chunk, v.begin() + (r + 1) * chunk);
    }
    CHILD_CHECK(a_out.download() == want, "all_to_all {}", dtype_name(dt));

    auto count = [&](int from, int to) -> int64_t { return ((from * 3 + to * 5) % 4) * 1001; };
    std::vector<int64_t> sc(n), rc(n);
    int64_t sn = 0, rn = 0;
    for (int p = 0; p < n; ++p) {
      sc[p] = count(r, p);
      rc[p] = count(p, r);
      sn += sc[p];
      rn += rc[p];
    }
    DeviceTensor v_in(sn, dt, r), v_out(rn, dt, r);
    v_in.upload(host_values(r, sn, dt, 50));
    CHILD_CHECK_OK(c->all_to_all_v(v_in.t, sc, v_out.t, rc)->wait());
    want.clear();
    for (int q = 0; q < n; ++q) {
      int64_t off = 0, qn = 0;
      for (int p = 0; p < r; ++p) off += count(q, p);
      for (int p = 0; p < n; ++p) qn += count(q, p);
      auto v = host_values(q, qn, dt, 50);
      want.insert(want.end(), v.begin() + off, v.begin() + off + count(q, r));
    }
    CHILD_CHECK(v_out.download() == want, "all_to_all_v {}", dtype_name(dt));

    DeviceTensor b(777, dt, r);
    b.upload(host_values(r, 777, dt));
    CHILD_CHECK_OK(c->broadcast(b.t, n - 1)->wait());
    CHILD_CHECK(b.download() == host_values(n - 1, 777, dt), "broadcast {}", dtype_name(dt));

    if (n > 1) {
      DeviceTensor s(5000, dt, r), d(5000, dt, r);
      s.upload(host_values(r, 5000, dt, 9));
      auto ws = c->send(s.t, (r + 1) % n);
      auto wr = c->recv(d.t, (r + n - 1) % n);
      CHILD_CHECK_OK(ws->wait());
      CHILD_CHECK_OK(wr->wait());
      CHILD_CHECK(d.download() == host_values((r + n - 1) % n, 5000, dt, 9), "send/recv {}", dtype_name(dt));
    }
  }
  CHILD_CHECK_OK(c->barrier()->wait());
  DeviceTensor f8(16, DType::kF8E4M3, r);
  CHILD_CHECK(c->all_reduce(f8.t, ReduceOp::kSum)->wait().code() == StatusCode::kInvalidArgument);
  Tensor host = Tensor::zeros({4}, DType::kF32);
  CHILD_CHECK(c->all_reduce(host, ReduceOp::kSum)->wait().code() == StatusCode::kInvalidArgument);
  CHILD_CHECK_OK(c->health());
  c.reset();
  cudaStreamDestroy(user_stream);
  return 0;
}

int child_deadline(RendezvousStore& store, int r, int n) {
  constexpr auto kTimeout = 2s;
  auto c = connect(store, r, n, 0, kTimeout);
  if (r == 0) {
    DeviceTensor t(1024, DType::kF32, r);
    auto start = Clock::now();
    Status st = c->recv(t.t, 1)->wait();  // never sent
    auto elapsed = Clock::now() - start;
    CHILD_CHECK(st.code() == StatusCode::kDeadlineExceeded, "{}", st.to_string());
    CHILD_CHECK(elapsed < kTimeout + 3s, "took {} ms", std::chrono::duration_cast<Millis>(elapsed).count());
    CHILD_CHECK(!c->health().ok());
    CHILD_CHECK(!c->barrier()->wait().ok());
    CHILD_CHECK_OK(store.set("gpujob/abort", "peer 0 timed out"));  // what the control plane would broadcast
  } else {
    auto why = store.get("gpujob/abort", deadline_in(30s));
    CHILD_CHECK_OK(why.status());
    c->abort(why.ok() ? *why : "no word");
    CHILD_CHECK(c->health().code() == StatusCode::kAborted);
  }
  c.reset();  // aborted: released without ncclCommDestroy
  auto c2 = connect(store, r, n, 1, 30s);
  DeviceTensor u(8, DType::kF32, r);
  u.upload(std::vector<float>(8, float(r + 1)));
  CHILD_CHECK_OK(c2->all_reduce(u.t, ReduceOp::kSum)->wait());
  CHILD_CHECK(u.download() == std::vector<float>(8, float(n * (n + 1) / 2)));
  return 0;
}

// Spawns `n` copies of this binary in child mode; true if all exit 0 within `timeout`.
bool run_scenario(const char* self, const std::string& scenario, int n, std::chrono::seconds timeout) {
  testing::TempDir dir;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> args = {
        self, "--child", scenario, std::to_string(r), std::to_string(n), dir.path().string()};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self, nullptr, nullptr, argv.data(), environ) != 0) {
      std::fprintf(stderr, "posix_spawn failed\n");
      for (pid_t p : pids) {
        ::kill(p, SIGKILL);
        ::waitpid(p, nullptr, 0);
      }
      return false;
    }
    pids.push_back(pid);
  }
  bool ok = true;
  auto deadline = Clock::now() + timeout;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    for (;;) {
      pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got == pids[r]) break;
      if (Clock::now() >= deadline) {
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], &status, 0);
        std::fprintf(stderr, "%s/%d: rank %d timed out\n", scenario.c_str(), n, r);
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) ok = false;
  }
  std::printf("[%s] %s on %d GPU(s)\n", ok ? "  PASSED" : "  FAILED", scenario.c_str(), n);
  return ok;
}

}  // namespace
}  // namespace troupe::comm

int main(int argc, char** argv) {
  using namespace troupe::comm;
  if (argc >= 2 && std::strcmp(argv[1], "--child") == 0) {
    // --child <scenario> <rank> <size> <store dir>: never fall through to the parent path
    // (a child that did would spawn children of its own, forever).
    if (argc != 6) {
      std::fprintf(stderr, "usage: %s --child <scenario> <rank> <size> <store dir>\n", argv[0]);
      return 2;
    }
    std::string scenario = argv[2];
    int rank = std::atoi(argv[3]), size = std::atoi(argv[4]);
    auto store = FileStore::open(argv[5]);
    if (!store.ok()) return 4;
    int code = scenario == "ops" ? child_ops(**store, rank, size) : child_deadline(**store, rank, size);
    return code != 0 ? code : (testing::child_failures() > 0 ? 1 : 0);
  }
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // never NVLink multicast on the shared hosts (children inherit)
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("no GPU visible (%s): skipped\n", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    return 77;
  }
  const char* self = "/proc/self/exe";
  char path[4096];
  ssize_t len = ::readlink(self, path, sizeof(path) - 1);
  if (len <= 0) return 2;
  path[len] = 0;
  bool ok = run_scenario(path, "ops", 1, std::chrono::seconds(120));
  if (count >= 2) {
    ok = run_scenario(path, "ops", 2, std::chrono::seconds(180)) && ok;
    ok = run_scenario(path, "deadline", 2, std::chrono::seconds(120)) && ok;
  } else {
    std::printf("only one GPU: two-GPU scenarios not run\n");
  }
  return ok ? 0 : 1;
}
