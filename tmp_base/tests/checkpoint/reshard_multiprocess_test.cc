// tests/checkpoint/reshard_multiprocess_test.cc — four real child processes save a small
// MoE model's state (weights, router biases, ZeRO-1 optimizer state, step) concurrently
// at layout pp=2 × n=2; the checkpoint then loads bitwise at n=4, dp=2, n=4×dp=2, pp=4,
// pp=2×dp=2×n=2 and in one process, with every expert landing on the rank that owns it.
// A writer killed with SIGKILL mid-save leaves the previous checkpoint as the one loaded.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kLayers = 4, kExperts = 8, kD = 8, kF = 12, kVocab = 16;

struct TensorSpec {
  std::string name;
  Shape shape;
  DType dtype;
  TensorPlacement placement;
};

// The state of the model under `l`, as the training app would describe it: each layer on
// stage layer*pp/L; attention and router replicated within the stage; experts sharded over
// n; one ZeRO-1 flat buffer of Adam "m" state per (stage, n rank), split over dp.
std::vector<TensorSpec> model_specs(const ParallelLayout& l) {
  std::vector<TensorSpec> params;
  params.push_back({"embed.weight", {kVocab, kD}, DType::kF32, TensorPlacement::replicated(0)});
  for (int i = 0; i < kLayers; ++i) {
    const int stage = i * l.pp() / kLayers;
    const std::string p = "layers." + std::to_string(i);
    params.push_back({p + ".attn.wqkv", {kD, 3 * kD}, DType::kBF16, TensorPlacement::replicated(stage)});
    params.push_back({p + ".moe.router", {kExperts, kD}, DType::kF32, TensorPlacement::replicated(stage)});
    params.push_back({p + ".moe.router_bias", {kExperts}, DType::kF32, TensorPlacement::replicated(stage)});
    params.push_back(
        {p + ".moe.experts.w1", {kExperts, kD, kF}, DType::kF32, TensorPlacement::experts(stage)});
  }
  params.push_back({"head.weight", {kVocab, kD}, DType::kF32, TensorPlacement::replicated(l.pp() - 1)});
  // ZeRO-1 buffers: per stage, the local elements of each parameter in order.
  std::vector<int64_t> flat_total(static_cast<size_t>(l.pp()), 0);
  std::vector<TensorSpec> opt;
  for (const TensorSpec& s : params) {
    if (s.dtype != DType::kF32 || s.name.find("router_bias") != std::string::npos) continue;
    const bool ex = s.placement.expert_sharded;
    const int64_t local = shape_numel(s.shape) / (ex ? l.n() : 1);
    int64_t& total = flat_total[static_cast<size_t>(s.placement.stage)];
    opt.push_back({"opt.m." + s.name,
                   {shape_numel(s.shape)},
                   DType::kF32,
                   TensorPlacement::zero(s.placement.stage, ex, total, 0)});
    total += local;
  }
  for (TensorSpec& s : opt) s.placement.zero_flat_total = flat_total[static_cast<size_t>(s.placement.stage)];
  params.insert(params.end(), opt.begin(), opt.end());
  params.push_back({"step", {}, DType::kI64, TensorPlacement::replicated()});
  return params;
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The global value of a tensor at `step`. Expert weights encode their expert index
// (step*1e5 + expert*1000 + position) so that a permuted expert cannot go unnoticed.
Tensor global_tensor(const TensorSpec& s, int64_t step) {
  const int64_t n = shape_numel(s.shape);
  std::vector<float> v(static_cast<size_t>(n));
  const bool experts =
      s.name.find("experts") != std::string::npos && s.name.find("opt.") == std::string::npos;
  const uint64_t seed = std::hash<std::string>{}(s.name) ^ static_cast<uint64_t>(step) * 0x1000193ull;
  for (int64_t i = 0; i < n; ++i) {
    if (experts) {
      v[static_cast<size_t>(i)] = static_cast<float>(step * 100000 + (i / (kD * kF)) * 1000 + i % (kD * kF));
    } else if (s.dtype == DType::kI64) {
      v[static_cast<size_t>(i)] = static_cast<float>(step);
    } else {
      v[static_cast<size_t>(i)] =
          static_cast<float>(mix(seed + static_cast<uint64_t>(i)) >> 40) / 16777216.0f - 0.5f;
    }
  }
  return Tensor::from_floats(s.shape, v, s.dtype);
}

Tensor narrow_to(const Tensor& t, const Slice& box) {
  Tensor v = t;
  for (size_t d = 0; d < box.size(); ++d) v = v.narrow(static_cast<int64_t>(d), box[d].start, box[d].length);
  return v.contiguous();
}

// The body of one rank's process: save its slices of step `step` and wait until durable.
int run_rank(const std::string& run, const ParallelLayout& l, int rank, int64_t step, uint64_t rate) {
  WriterOptions wo{run, l, rank};
  wo.max_bytes_per_second = rate;
  if (rate > 0) wo.write_chunk_bytes = 256;
  auto w = CheckpointWriter::create(wo);
  if (!w.ok()) return 2;
  const ParallelCoord c = (*w)->coords();
  std::vector<SaveEntry> entries;
  for (const TensorSpec& s : model_specs(l)) {
    auto box = save_slice(s.name, s.shape, s.placement, l, c);
    if (!box.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, box.status().to_string().c_str());
      return 3;
    }
    if (!box->has_value()) continue;
    std::vector<int64_t> offsets;
    for (const Range& r : **box) offsets.push_back(r.start);
    entries.push_back(SaveEntry{s.name, s.shape, offsets, narrow_to(global_tensor(s, step), **box)});
  }
  auto h = (*w)->save(step, entries, {{"rng", "rank-" + std::to_string(rank)}});
  if (!h.ok()) return 4;
  Status st = h->wait();
  if (!st.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, st.to_string().c_str());
    return 5;
  }
  return 0;
}

// Child processes, killed and reaped on every path out of a test.
class Children {
 public:
  ~Children() {
    for (pid_t p : pids_) {
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
  }
  template <typename Fn>
  pid_t spawn(Fn fn) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = fn();
      } catch (...) {
        rc = 6;
      }
      std::fflush(nullptr);
      ::_exit(rc);
    }
    if (pid > 0) pids_.push_back(pid);
    return pid;
  }
  // Exit status (or 128+signal), or -1 on timeout.
  int wait(pid_t pid, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      int st = 0;
      const pid_t r = ::waitpid(pid, &st, WNOHANG);
      if (r == pid) {
        pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end());
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (Clock::now() >= deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  std::vector<pid_t> pids_;
};

// Saves step `step` with every rank of `l` in its own process, concurrently, and commits.
void save_with_processes(const std::string& run, const ParallelLayout& l, int64_t step) {
  Children kids;
  std::vector<pid_t> pids;
  for (int r = 0; r < l.world_size(); ++r)
    pids.push_back(kids.spawn([&, r] { return run_rank(run, l, r, step, 0); }));
  for (int r = 0; r < l.world_size(); ++r) {
    ASSERT_EQ(kids.wait(pids[static_cast<size_t>(r)], std::chrono::seconds(30)), 0) << "rank " << r;
  }
  ASSERT_TRUE(wait_for_parts(run, step, l.world_size(), std::chrono::seconds(5)).ok());
  FinalizeOptions fo;
  fo.world_size = l.world_size();
  fo.info.data_position = {{"sample", step * 32}};
  auto f = finalize_checkpoint(run, step, fo);
  ASSERT_TRUE(f.ok()) << f.status();
}

// Which expert each row of an expert block holds, decoded from its values; -1 for a row
// whose values do not all agree with one expert at `step`.
std::vector<int> experts_in(const Tensor& block, int64_t step) {
  std::vector<int> out;
  const std::vector<float> v = block.to_floats();
  const int64_t row = kD * kF;
  for (int64_t e = 0; e < block.size(0); ++e) {
    const auto id =
        static_cast<int>((v[static_cast<size_t>(e * row)] - static_cast<float>(step * 100000)) / 1000);
    for (int64_t i = 0; i < row; ++i) {
      if (v[static_cast<size_t>(e * row + i)] != static_cast<float>(step * 100000 + id * 1000 + i)) {
        out.push_back(-1);
        goto next;
      }
    }
    out.push_back(id);
  next:;
  }
  return out;
}

// Loads the checkpoint as every rank of `l` would: each rank reads exactly the slices it
// owns under `l` and compares them bitwise with the global truth.
void check_load(const CheckpointReader& reader, const ParallelLayout& l, int64_t step) {
  for (int rank = 0; rank < l.world_size(); ++rank) {
    const ParallelCoord c = l.coord(rank);
    for (const TensorSpec& s : model_specs(l)) {
      auto box = owned_slice(s.name, s.shape, s.placement, l, c);
      ASSERT_TRUE(box.ok()) << box.status();
      if (!box->has_value()) continue;
      auto got = reader.read(s.name, **box);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(testing::bitwise_equal(*got, narrow_to(global_tensor(s, step), **box)))
          << s.name << " " << slice_to_string(**box) << " rank " << rank << " of " << l.to_string();
      if (s.placement.expert_sharded && !s.placement.zero_sharded) {
        const Range want = *expert_range(kExperts, l.n(), c.n);
        std::vector<int> expect(static_cast<size_t>(want.length));
        for (int64_t k = 0; k < want.length; ++k)
          expect[static_cast<size_t>(k)] = static_cast<int>(want.start + k);
        ASSERT_EQ(experts_in(*got, step), expect)
            << s.name << " on rank " << rank << " (" << c.to_string() << ")";
      }
    }
  }
}

TEST(Reshard, SaveAtPp2N2LoadsBitwiseAtEveryLayout) {
  testing::TempDir dir;
  const std::string run = dir.sub("run");
  save_with_processes(run, ParallelLayout{2, 1, 2}, 10);
  if (HasFatalFailure()) return;
  auto reader = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->layout(), (ParallelLayout{2, 1, 2}));
  EXPECT_EQ((*reader)->manifest().ranks.size(), 4u);
  EXPECT_EQ((*reader)->manifest().ranks[3].state["rng"], "rank-3");
  EXPECT_EQ((*reader)->manifest().data_position["sample"], 320);
  for (ParallelLayout l :
       {ParallelLayout{1, 1, 1}, ParallelLayout{1, 1, 4}, ParallelLayout{1, 2, 1}, ParallelLayout{1, 2, 4},
        ParallelLayout{4, 1, 1}, ParallelLayout{2, 2, 2}, ParallelLayout{2, 1, 2}, ParallelLayout{1, 1, 8}}) {
    SCOPED_TRACE(l.to_string());
    check_load(**reader, l, 10);
    if (HasFatalFailure()) return;
  }
}

TEST(Reshard, ExpertDecoderCatchesAPermutedExpert) {
  // The check used above must fail on a block whose experts are swapped.
  TensorSpec s{"layers.0.moe.experts.w1", {kExperts, kD, kF}, DType::kF32, TensorPlacement::experts(0)};
  const Tensor g = global_tensor(s, 3);
  Tensor swapped = Tensor::empty({2, kD, kF}, DType::kF32);
  swapped.narrow(0, 0, 1).copy_from(g.narrow(0, 5, 1));
  swapped.narrow(0, 1, 1).copy_from(g.narrow(0, 4, 1));
  EXPECT_EQ(experts_in(swapped, 3), (std::vector<int>{5, 4}));
  EXPECT_EQ(experts_in(g.narrow(0, 4, 2), 3), (std::vector<int>{4, 5}));
}

TEST(Reshard, KilledWriterLeavesThePreviousCheckpointValid) {
  testing::TempDir dir;
  const std::string run = dir.sub("run");
  const ParallelLayout l{2, 1, 2};
  save_with_processes(run, l, 10);
  if (HasFatalFailure()) return;

  // Step 20: rank 1 writes slowly and is killed with SIGKILL once its shard has started.
  Children kids;
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) {
    pids.push_back(kids.spawn([&, r] { return run_rank(run, l, r, 20, r == 1 ? 512 : 0); }));
  }
  const std::string shard1 = run + "/step_20.tmp/" + shard_file_name(1);
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  std::error_code ec;
  while (!(fs::exists(shard1, ec) && fs::file_size(shard1, ec) > 0) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_GT(fs::file_size(shard1, ec), 0u) << "rank 1 never started writing";
  ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
  EXPECT_EQ(kids.wait(pids[1], std::chrono::seconds(10)), 128 + SIGKILL);
  for (int r : {0, 2, 3}) EXPECT_EQ(kids.wait(pids[static_cast<size_t>(r)], std::chrono::seconds(30)), 0);
  ASSERT_FALSE(fs::exists(run + "/step_20.tmp/" + part_file_name(1))) << "rank 1 finished before the kill";

  // The driver cannot commit step 20, and says which rank is missing.
  FinalizeOptions fo;
  fo.world_size = 4;
  auto f = finalize_checkpoint(run, 20, fo);
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("rank 1"), std::string::npos) << f.status();
  EXPECT_FALSE(fs::exists(run + "/step_20"));

  auto reader = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->step(), 10);
  check_load(**reader, ParallelLayout{1, 1, 1}, 10);
  check_load(**reader, ParallelLayout{1, 2, 4}, 10);

  // Training goes on: the next checkpoint commits and clears the abandoned directory.
  save_with_processes(run, l, 30);
  EXPECT_FALSE(fs::exists(run + "/step_20.tmp"));
  auto next = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ((*next)->step(), 30);
  check_load(**next, ParallelLayout{1, 1, 4}, 30);
}

}  // namespace
}  // namespace troupe::checkpoint
