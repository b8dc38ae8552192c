// training/app/preflight.cc — preflight_check (preflight.h).
#include "training/app/preflight.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "data/token_data.h"

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace troupe::training {

namespace {

std::string gib(uint64_t b) {
  const double g = static_cast<double>(b) / (1024.0 * 1024.0 * 1024.0);
  if (g >= 1024.0 * 1024.0) return fmt::format("{:.1f} PiB", g / (1024.0 * 1024.0));
  if (g >= 1024.0) return fmt::format("{:.1f} TiB", g / 1024.0);
  if (g >= 1.0) return fmt::format("{:.1f} GiB", g);
  return fmt::format("{:.1f} MiB", g * 1024.0);
}

// A cgroup's memory limit (v2 memory.max, else v1 memory.limit_in_bytes); 0: none.
uint64_t cgroup_limit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string v;
    if (!(in >> v) || v == "max") continue;
    char* end = nullptr;
    const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
    // v1 reports "no limit" as a huge page-aligned number.
    if (end != v.c_str() && *end == '\0' && x > 0 && x < (1ULL << 60)) return x;
  }
  return 0;
}

uint64_t mem_total() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemTotal:") return kb * 1024;
  }
  return 0;
}

}  // namespace

MemoryEstimate estimate_rank_memory(const layers::TrainConfig& tc) {
  const layers::ModelConfig& m = tc.model;
  int64_t expert = 0;
  for (int64_t i = 0; i < m.n_layers; ++i) {
    if (m.is_moe_block(i)) expert += m.moe.num_experts * 3 * m.d_model * m.moe.expert_hidden;
  }
  const int64_t total = m.num_params();
  const int64_t pp = std::max<int64_t>(1, tc.parallel.pp), n = std::max<int64_t>(1, tc.parallel.n);
  MemoryEstimate e;
  e.rank_params = (total - expert) / pp + expert / (pp * n);
  // 16 bytes a parameter, in doubles: a config can ask for more than 2^63 bytes.
  const double bytes = static_cast<double>(e.rank_params) * 16.0;
  e.rank_bytes = bytes >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(bytes);
  return e;
}

DeviceMemory device_memory(const layers::Ctx& ctx) {
  DeviceMemory d;
  if (ctx.on_device()) {
#if TROUPE_HAVE_CUDA
    size_t free_b = 0, total_b = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      d.bytes = total_b;
      d.what = fmt::format("GPU cuda:{}", dev);
    }
#endif
    return d;
  }
  const uint64_t total = mem_total(), limit = cgroup_limit();
  if (limit > 0 && (total == 0 || limit < total)) {
    d.bytes = limit;
    d.what = "this process's cgroup (its memory limit)";
  } else if (total > 0) {
    d.bytes = total;
    d.what = "this host (MemTotal)";
  }
  return d;
}

Status preflight_check(const layers::TrainConfig& tc, const layers::Ctx& ctx) {
  // ---- the data ----
  const int64_t vocab = tc.model.vocab_size;
  for (const char* split : {"train", "val"}) {
    TROUPE_ASSIGN_OR_RETURN(layers::TokenShards shards, layers::TokenShards::open(tc.data.dir, split));
    if (shards.size() <= tc.train.seq_len) {
      return invalid_argument(
          "{}: train.seq_len = {} but the {} split of {} holds {} tokens: a sequence needs seq_len + 1 of "
          "them",
          tc.source, tc.train.seq_len, split, tc.data.dir, shards.size());
    }
    TROUPE_RETURN_IF_ERROR(shards.check_token_ids(vocab));
  }
  // ---- the memory ----
  const MemoryEstimate need = estimate_rank_memory(tc);
  const DeviceMemory have = device_memory(ctx);
  if (have.bytes > 0 && need.rank_bytes > have.bytes) {
    return resource_exhausted(
        "{}: this model does not fit: each rank needs at least {} ({} parameters x 16 bytes: f32 values, "
        "gradients and two AdamW moments; layout pp={} dp={} n={}) but {} has {}. Make the model smaller or "
        "split it further (parallel.pp, parallel.n)",
        tc.source, gib(need.rank_bytes), need.rank_params, tc.parallel.pp, tc.parallel.dp, tc.parallel.n,
        have.what, gib(have.bytes));
  }
  return ok_status();
}

}  // namespace troupe::training
