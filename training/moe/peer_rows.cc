// training/moe/peer_rows.cc — PeerRows: CUDA IPC row buffers of an n-group's GPUs.
#include "training/moe/peer_rows.h"

#include <unistd.h>

#include <cstring>
#include <functional>

#include "core/check.h"
#include "core/logging.h"
#include "training/parallel/elastic_comm.h"
#include "training/parallel/group_ops.h"

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::training {

uint64_t PeerRows::generation() const {
  const auto* e = dynamic_cast<const ElasticComm*>(&group_);
  return e != nullptr ? e->generation() : 0;
}

comm::WorkPtr PeerRows::barrier(const comm::OpOptions& o) {
  return group_.all_reduce(flag_, comm::ReduceOp::kSum, o);
}

#if TROUPE_HAVE_CUDA

namespace {

constexpr size_t kHandles = 3;
constexpr size_t kSlotBytes = kHandles * sizeof(cudaIpcMemHandle_t);

// Waits, on the host, until every member has completed what it enqueued before (set-up).
void sync_all(comm::Communicator& g, const layers::Ctx& c, const Tensor& flag, CommTime& t,
              std::string_view what) {
  comm::OpOptions o = t.op_options();
  o.stream = c.ex.cuda->stream;
  t.wait(g.all_reduce(flag, comm::ReduceOp::kSum, o), what);
  CUDA_CHECK(cudaStreamSynchronize(c.ex.cuda->stream));
}

// Every member's bytes, rank-major (set-up only: reads the result on the host).
std::vector<uint8_t> gather_bytes(comm::Communicator& g, const layers::Ctx& c, CommTime& t,
                                  const std::vector<uint8_t>& mine, std::string_view what) {
  const int64_t len = static_cast<int64_t>(mine.size()), n = g.size();
  Tensor host = Tensor::empty({len}, DType::kU8);
  std::memcpy(host.data_ptr(), mine.data(), mine.size());
  Tensor in = c.to_device(host);
  Tensor out = c.empty({n * len}, DType::kU8);
  comm::OpOptions o = t.op_options();
  o.stream = c.ex.cuda->stream;
  t.wait(g.all_gather(in, out, o), what);
  const Tensor back = c.to_host(out);
  const auto* p = static_cast<const uint8_t*>(back.data_ptr());
  return std::vector<uint8_t>(p, p + n * len);
}

// The number of members that report `failed` (every member gets the same count).
int64_t count_failures(comm::Communicator& g, const layers::Ctx& c, CommTime& t, bool failed) {
  std::vector<uint8_t> mine{static_cast<uint8_t>(failed ? 1 : 0)};
  const std::vector<uint8_t> all = gather_bytes(g, c, t, mine, "peer rows agreement");
  int64_t bad = 0;
  for (uint8_t v : all) bad += v;
  return bad;
}

}  // namespace

PeerRows::~PeerRows() {
  release();
}

void PeerRows::release() {
  for (void* q : opened_) {
    if (q != nullptr) cudaIpcCloseMemHandle(q);  // best effort: the peer may be gone
  }
  opened_.clear();
  for (void*& b : own_) {
    if (b != nullptr) cudaFree(b);
    b = nullptr;
  }
  for (void*& b : tables_) {
    if (b != nullptr) cudaFree(b);
    b = nullptr;
  }
  rows_ = row_bytes_ = 0;
}

bool PeerRows::map(const layers::Ctx& c, CommTime& t, int64_t rows, int64_t row_bytes) {
  const int n = group_.size(), me = group_.rank();
  // Every member runs the same collectives here, whatever it held before (a replacement
  // holds nothing): nobody may still be moving rows through the old buffers, nor hold
  // them open, when they are freed.
  CUDA_CHECK(cudaDeviceSynchronize());
  sync_all(group_, c, flag_, t, "peer rows release");
  for (void* q : opened_) {
    if (q != nullptr) cudaIpcCloseMemHandle(q);
  }
  opened_.clear();
  sync_all(group_, c, flag_, t, "peer rows release");
  release();
  const size_t sizes[kHandles] = {static_cast<size_t>(rows * row_bytes),
                                  static_cast<size_t>(rows) * sizeof(float),
                                  static_cast<size_t>(rows * row_bytes)};
  std::vector<uint8_t> mine(kSlotBytes);
  for (size_t b = 0; b < kHandles; ++b) {
    CUDA_CHECK(cudaMalloc(&own_[b], sizes[b]));
    cudaIpcMemHandle_t handle;
    CUDA_CHECK(cudaIpcGetMemHandle(&handle, own_[b]));
    std::memcpy(mine.data() + b * sizeof(handle), &handle, sizeof(handle));
  }
  const std::vector<uint8_t> all = gather_bytes(group_, c, t, mine, "peer rows handles");
  std::vector<void*> ptrs(kHandles * static_cast<size_t>(n), nullptr);  // [buffer][rank]
  bool failed = false;
  for (int q = 0; q < n; ++q) {
    for (size_t b = 0; b < kHandles; ++b) {
      void* ptr = own_[b];
      if (q != me) {
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, all.data() + static_cast<size_t>(q) * kSlotBytes + b * sizeof(handle),
                    sizeof(handle));
        ptr = nullptr;
        const cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          make_logger("train")->warn("peer rows: cannot map rank {}'s buffer: {}", q,
                                     cudaGetErrorString(err));
          failed = true;
          ptr = nullptr;
        } else {
          opened_.push_back(ptr);
        }
      }
      ptrs[b * static_cast<size_t>(n) + static_cast<size_t>(q)] = ptr;
    }
  }
  if (count_failures(group_, c, t, failed) > 0) {
    release();
    return false;
  }
  for (size_t b = 0; b < kHandles; ++b) {
    CUDA_CHECK(cudaMalloc(&tables_[b], sizeof(void*) * static_cast<size_t>(n)));
    CUDA_CHECK(cudaMemcpy(tables_[b], ptrs.data() + b * static_cast<size_t>(n),
                          sizeof(void*) * static_cast<size_t>(n), cudaMemcpyHostToDevice));
  }
  rows_ = rows;
  row_bytes_ = row_bytes;
  mapped_generation_ = generation();
  return true;
}

bool PeerRows::same_host(const layers::Ctx& c, CommTime& t) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string id = host;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof(boot), f) != nullptr) id += boot;
    std::fclose(f);
  }
  const uint64_t h = std::hash<std::string>{}(id);
  std::vector<uint8_t> mine(sizeof(h));
  std::memcpy(mine.data(), &h, sizeof(h));
  const std::vector<uint8_t> all = gather_bytes(group_, c, t, mine, "peer rows hosts");
  for (int q = 0; q < group_.size(); ++q) {
    if (std::memcmp(all.data() + static_cast<size_t>(q) * sizeof(h), &h, sizeof(h)) != 0) return false;
  }
  return true;
}

bool PeerRows::reserve(const layers::Ctx& c, CommTime& t, int64_t rows, int64_t row_bytes) {
  if (own_[0] != nullptr && rows <= rows_ && row_bytes <= row_bytes_ && generation() == mapped_generation_)
    return true;
  // Known to take the host counts in this epoch: no collective (reserve is asked per MoE block).
  if (host_counts_ && generation() == hosts_generation_) return false;
  TROUPE_CHECK(c.on_device() && c.ex.cuda != nullptr, "PeerRows needs a CUDA Ctx");
  if (!flag_.defined()) flag_ = c.zeros({1}, DType::kF32);
  // The same answer on every member (they compare the same table), so every member takes
  // the same path; asked again in every epoch, since a replacement may sit elsewhere.
  hosts_generation_ = generation();
  host_counts_ = !same_host(c, t);
  if (host_counts_) {
    if (!warned_)
      make_logger("train")->warn(
          "parallel.device_dispatch: the n-group spans hosts; expert counts go through the host");
    warned_ = true;
    return false;
  }
  const int64_t want_rows = std::max(rows, generation() == mapped_generation_ ? rows_ : 0);
  const int64_t want_bytes = std::max(row_bytes, generation() == mapped_generation_ ? row_bytes_ : 0);
  if (map(c, t, want_rows, want_bytes)) return true;
  TROUPE_CHECK(!required_,
               "parallel.device_dispatch: the GPUs of this n-group cannot map each other's memory (CUDA IPC, "
               "peer access); set parallel.device_dispatch = false");
  make_logger("train")->warn(
      "parallel.device_dispatch: the GPUs of this n-group cannot map each other's memory (CUDA IPC, peer "
      "access); expert counts go through the host");
  host_counts_ = true;
  return false;
}

#else  // no CUDA: nothing is ever mapped

PeerRows::~PeerRows() = default;
void PeerRows::release() {}
bool PeerRows::map(const layers::Ctx&, CommTime&, int64_t, int64_t) {
  return false;
}
bool PeerRows::same_host(const layers::Ctx&, CommTime&) {
  return false;
}
bool PeerRows::reserve(const layers::Ctx&, CommTime&, int64_t, int64_t) {
  return false;
}

#endif

}  // namespace troupe::training
