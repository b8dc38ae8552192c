// training/checkpointing/snapshots.cc — Snapshotter and restore_snapshot (snapshots.h).
#include "training/checkpointing/snapshots.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "checkpoint/writer.h"
#include "core/parallel_layout.h"
#include "training/parallel/elastic_comm.h"

namespace troupe::training {

using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kAlign = 64;
uint64_t align_up(uint64_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
}

// Threads for the slice checksums of one part (xxHash64 runs at several GB/s a core).
int checksum_threads() {
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u));
}

}  // namespace

Result<std::unique_ptr<Snapshotter>> Snapshotter::create(std::shared_ptr<checkpoint::SnapshotClient> keeper,
                                                         Stage& stage, SnapshotterOptions options) {
  std::unique_ptr<Snapshotter> s(new Snapshotter(std::move(keeper), stage, std::move(options)));
  TROUPE_RETURN_IF_ERROR(s->layout());
  TROUPE_ASSIGN_OR_RETURN(checkpoint::SnapshotClient::Generations g,
                          s->keeper_->attach(s->o_.job, s->o_.rank, s->segment_bytes_));
  s->node_ = g.node;
  s->endpoint_ = g.endpoint;
  for (int i = 0; i < 2; ++i) {
    s->maps_[i] = std::shared_ptr<checkpoint::SegmentMap>(std::move(g.maps[i]));
    s->gen_step_[i] =
        g.gens[i].state == static_cast<uint32_t>(checkpoint::SegmentState::kLanded) ? g.gens[i].step : -1;
  }
  // Page-locking the generations (GPU) takes a while for a large state: the snapshot thread
  // does it first, while training goes on; a snapshot waits for it.
  s->tasks_.push_back(Task{Task::Kind::kPin, -1, -1, {}, ""});
  s->committed_ = s->o_.restored_step;
  for (int i = 0; i < 2; ++i) {
    if (s->committed_ >= 0 && s->gen_step_[i] == s->committed_ && s->committed_gen_ < 0)
      s->committed_gen_ = i;
  }
  s->snapshot_thread_ = std::thread([p = s.get()] { p->snapshot_loop(); });
  s->writer_thread_ = std::thread([p = s.get()] { p->writer_loop(); });
  return s;
}

Snapshotter::~Snapshotter() {
  {
    std::unique_lock lock(mu_);
    // The work queued finishes (a copy in flight must land before its segment goes).
    cv_.wait(lock, [&] { return tasks_.empty() && landing_ < 0; });
    stop_ = true;
  }
  cv_.notify_all();
  if (snapshot_thread_.joinable()) snapshot_thread_.join();
  if (writer_thread_.joinable()) writer_thread_.join();
  (void)stage_.snapshot_wait();
  for (auto& m : maps_) {
    if (m) stage_.unpin_host(m->base());
  }
}

Status Snapshotter::layout() {
  TROUPE_ASSIGN_OR_RETURN(std::vector<Stage::SnapshotTensor> ts, stage_.snapshot_tensors());
  const ParallelLayout l = stage_.state_layout();
  part_ = checkpoint::ManifestPart{};
  part_.rank = o_.rank;
  part_.world_size = l.world_size();
  part_.layout = l;
  part_.coords = l.coord(o_.rank);
  nlohmann::json unsaved = nlohmann::json::array();
  uint64_t off = 0;
  saved_bytes_ = 0;
  for (const Stage::SnapshotTensor& t : ts) {
    off = align_up(off);
    offsets_.push_back(off);
    checkpoint::StoredSlice s;
    s.file = checkpoint::shard_file_name(o_.rank);
    s.offset = off;
    s.length = t.entry.tensor.nbytes();
    for (size_t d = 0; d < t.entry.global_shape.size(); ++d) {
      s.box.push_back({t.entry.offsets.empty() ? 0 : t.entry.offsets[d],
                       t.entry.tensor.shape()[static_cast<int64_t>(d)]});
    }
    s.rank = o_.rank;
    part_.tensors.push_back(
        checkpoint::TensorRecord{t.entry.name, t.entry.tensor.dtype(), t.entry.global_shape, {std::move(s)}});
    off += t.entry.tensor.nbytes();
    if (t.saved) {
      saved_bytes_ = off;  // the saved tensors come first: a prefix
    } else {
      unsaved.push_back(t.entry.name);
    }
  }
  data_bytes_ = off;
  // The manifest's largest form: every checksum and number at full width.
  checkpoint::ManifestPart widest = part_;
  widest.step = INT64_MAX;
  for (auto& t : widest.tensors) t.slices[0].xxh64 = UINT64_MAX;
  widest.state = stage_.rank_state();
  widest.state["step"] = widest.state["adam_steps"] = INT64_MAX;
  widest.state["unsaved"] = unsaved;
  const uint64_t json_bytes = checkpoint::part_to_json(widest).dump().size();
  segment_bytes_ = checkpoint::segment_size_for(data_bytes_, json_bytes + json_bytes / 4 + 4096);
  part_.state = nlohmann::json{{"unsaved", unsaved}};
  return ok_status();
}

bool Snapshotter::free_locked(int g) const {
  return landing_ != g && !gen_on_disk_[g] && !gen_uncommitted_[g] && g != committed_gen_;
}

void Snapshotter::after_step(int64_t step, bool ckpt, StepReply& reply) {
  const auto t0 = Clock::now();
  int gen = -1;
  {
    std::unique_lock lock(mu_);
    // One snapshot in flight at a time, into a free generation.
    const bool ok = cv_.wait_for(lock, o_.wait_limit, [&] {
      return cancelled_ || (pinned_ && landing_ < 0 && (free_locked(0) || free_locked(1)));
    });
    reply.snapshot_wait_ms = ms_since(t0);
    if (!ok || cancelled_) {
      const std::string why =
          cancelled_
              ? std::string("skipped: a newer membership epoch opened")
              : fmt::format(
                    "skipped: after {} ms no generation was free (newest committed step {}; generations "
                    "hold steps {} and {}{})",
                    o_.wait_limit.count(), committed_, gen_step_[0], gen_step_[1],
                    gen_on_disk_[0] || gen_on_disk_[1] ? ", one being written to disk" : "");
      reply.snapshot_errors.emplace_back(step, why);
      fmt::print(stderr, "snapshot: rank {} step {}: {}\n", o_.rank, step, why);
      std::fflush(stderr);
      return;
    }
    if (free_locked(0) && free_locked(1)) {
      gen = gen_step_[0] <= gen_step_[1] ? 0 : 1;
    } else {
      gen = free_locked(0) ? 0 : 1;
    }
    landing_ = gen;
    gen_step_[gen] = -1;
  }
  auto fail = [&](const Status& st) {
    std::lock_guard lock(mu_);
    landing_ = -1;
    reply.snapshot_errors.emplace_back(step, st.to_string());
    fmt::print(stderr, "snapshot: rank {} step {}: {}\n", o_.rank, step, st.to_string());
    std::fflush(stderr);
    cv_.notify_all();
  };
  // A push of what this generation held to another node stops before the copy overwrites
  // it: the keeper's leave is asked for where the copy runs (on the CPU the copier thread:
  // a round trip to the keeper costs the step thread nothing). A refusal leaves the
  // generation untouched and fails the landing (land()).
  const auto before_copy = [this, gen, step]() -> bool {
    Status st = keeper_->begin(o_.job, o_.rank, static_cast<uint32_t>(gen), step);
    if (st.ok()) checkpoint::begin_segment(*maps_[gen], step);
    std::lock_guard lock(mu_);
    begin_status_ = st;
    return st.ok();
  };
  if (Status st = stage_.snapshot_into(maps_[gen]->data(), offsets_, before_copy, &copy_sums_[gen]); !st.ok())
    return fail(st);
  {
    std::lock_guard lock(mu_);
    gen_step_[gen] = step;
    if (ckpt) ckpt_expected_.insert(step);
    tasks_.push_back(Task{Task::Kind::kLand, gen, step, stage_.rank_state(), ""});
  }
  cv_.notify_all();
  reply.snapshot = step;
  reply.snapshot_ms = ms_since(t0);
}

void Snapshotter::on_commit(const SnapshotCommitted& c) {
  if (c.epoch != o_.epoch) return;
  if (c.abandoned) {
    std::lock_guard lock(mu_);
    for (int g = 0; g < 2; ++g) {
      if (gen_step_[g] == c.step && g != committed_gen_) gen_uncommitted_[g] = false;
    }
    save_on_commit_.erase(c.step);
    if (ckpt_expected_.erase(c.step) > 0) ckpt_errors_.emplace_back(c.step, "its snapshot was abandoned");
    cv_.notify_all();
    return;
  }
  std::string to;
  for (const auto& [node, ep] : c.copy_to) {
    if (node == node_) to = ep;
  }
  {
    std::lock_guard lock(mu_);
    // The snapshot this rank restored may come again, asking for its checkpoint (the one
    // the failure interrupted): only that is done then. A save that came while this
    // snapshot was landing writes it, whatever the commit says (the Trainer may have decided
    // it before the save).
    const bool ckpt = c.checkpoint || save_on_commit_.count(c.step) > 0;
    if (c.step < committed_ || (c.step == committed_ && !ckpt)) return;
    save_on_commit_.erase(save_on_commit_.begin(), save_on_commit_.upper_bound(c.step));
    const bool fresh = c.step > committed_;
    committed_ = c.step;
    // The generation committed: the one this rank landed for the step (else one holding it
    // already: the restored snapshot).
    int gen = -1;
    for (int g = 0; g < 2; ++g) {
      if (gen_step_[g] == c.step && landing_ != g && (gen < 0 || gen_uncommitted_[g])) gen = g;
    }
    if (fresh && gen >= 0) committed_gen_ = gen;
    for (int g = 0; g < 2; ++g) {
      if (gen_step_[g] <= c.step) gen_uncommitted_[g] = false;  // older ones never commit now
    }
    if (ckpt && gen >= 0 && !o_.ckpt_dir.empty()) {
      if (!gen_on_disk_[gen]) {
        gen_on_disk_[gen] = true;  // before anything can pick it once a newer snapshot commits
        disk_.emplace_back(gen, c.step);
        ckpt_expected_.erase(c.step);
        ckpt_writing_.insert(c.step);
      }
    } else if (ckpt) {
      ckpt_errors_.emplace_back(c.step, "this rank holds no landed part of that step to write");
      ckpt_expected_.erase(c.step);
    }
    // Checkpoints this rank expected at older steps were not committed: they never will be.
    for (auto it = ckpt_expected_.begin(); it != ckpt_expected_.end() && *it < c.step;) {
      ckpt_errors_.emplace_back(*it, "its snapshot was superseded before it was committed");
      it = ckpt_expected_.erase(it);
    }
    if (!ckpt) ckpt_expected_.erase(c.step);
    if (fresh) tasks_.push_back(Task{Task::Kind::kCommit, gen, c.step, {}, to});
  }
  cv_.notify_all();
}

int Snapshotter::pending_gen_locked(int64_t step) const {
  for (int g = 0; g < 2; ++g) {
    if (gen_step_[g] == step && (landing_ == g || gen_uncommitted_[g])) return g;
  }
  return -1;
}

bool Snapshotter::write_committed_locked(int64_t step) {
  if (committed_ != step || committed_gen_ < 0 || gen_step_[committed_gen_] != step || o_.ckpt_dir.empty())
    return false;
  if (!gen_on_disk_[committed_gen_]) {
    gen_on_disk_[committed_gen_] = true;
    disk_.emplace_back(committed_gen_, step);
    ckpt_writing_.insert(step);
  }
  return true;
}

void Snapshotter::save(int64_t step, StepReply& reply) {
  {
    std::lock_guard lock(mu_);
    // Under way or written: a checkpoint step's own snapshot, or a save tried before.
    if (ckpt_expected_.count(step) > 0 || ckpt_writing_.count(step) > 0 || written_.count(step) > 0) return;
    if (write_committed_locked(step)) {
      cv_.notify_all();
      return;
    }
    // The step's snapshot is landing or waits for its commit: the Trainer commits it (with
    // its checkpoint when the save came first) or abandons it; report(wait_ckpt) waits for
    // that, and on_commit writes it.
    if (pending_gen_locked(step) >= 0 && !o_.ckpt_dir.empty()) {
      ckpt_expected_.insert(step);
      save_on_commit_.insert(step);
      return;
    }
  }
  after_step(step, /*checkpoint=*/true, reply);
}

void Snapshotter::snapshot_off_schedule(int64_t step, bool checkpoint, StepReply& reply) {
  {
    std::lock_guard lock(mu_);
    const bool committed = committed_ == step && committed_gen_ >= 0 && gen_step_[committed_gen_] == step;
    if (committed || pending_gen_locked(step) >= 0) return;
  }
  after_step(step, checkpoint, reply);
}

Status Snapshotter::land(int gen, int64_t step, const nlohmann::json& rank_state) {
  TROUPE_RETURN_IF_ERROR(stage_.snapshot_wait());
  {
    std::lock_guard lock(mu_);
    TROUPE_RETURN_IF_ERROR(begin_status_);  // the keeper's leave to overwrite the generation
  }
  checkpoint::ManifestPart part = part_;
  part.step = step;
  part.state = rank_state;
  part.state["unsaved"] = part_.state["unsaved"];
  // Every slice's checksum (the checkpoint format's xxHash64): the CPU copier's, made
  // while it copied; else (a GPU's device -> host copy) a pass over the part, on a few threads.
  const std::vector<uint64_t>& sums = copy_sums_[gen];
  if (sums.size() == part.tensors.size()) {
    for (size_t i = 0; i < sums.size(); ++i) part.tensors[i].slices[0].xxh64 = sums[i];
  } else {
    const std::byte* data = maps_[gen]->data();
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i = next++; i < part.tensors.size(); i = next++) {
        checkpoint::StoredSlice& s = part.tensors[i].slices[0];
        s.xxh64 = XXH64(data + s.offset, s.length, 0);
      }
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < checksum_threads(); ++i) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
  }
  TROUPE_RETURN_IF_ERROR(checkpoint::seal_segment(*maps_[gen], part, data_bytes_, saved_bytes_));
  return keeper_->landed(o_.job, o_.rank, static_cast<uint32_t>(gen), step);
}

void Snapshotter::snapshot_loop() {
  while (true) {
    Task t;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      t = std::move(tasks_.front());
    }
    if (t.kind == Task::Kind::kPin) {
      for (auto& m : maps_) stage_.pin_host(m->base(), m->size());
      std::lock_guard lock(mu_);
      pinned_ = true;
    } else if (t.kind == Task::Kind::kLand) {
      fault_point(fmt::format("landing of step {}", t.step));  // test.inject's phase "landing"
      const Status st = land(t.gen, t.step, t.rank_state);
      SnapshotLanded l;
      l.epoch = o_.epoch;
      l.rank = o_.rank;
      l.slot = o_.slot;
      l.step = t.step;
      l.node = node_;
      l.endpoint = endpoint_;
      {
        std::lock_guard lock(mu_);
        if (st.ok()) {
          gen_uncommitted_[t.gen] = true;
          l.xxh64 = maps_[t.gen]->read_header().part_xxh64;
          l.bytes = maps_[t.gen]->size();
        } else {
          gen_step_[t.gen] = -1;
          snap_errors_.emplace_back(t.step, st.to_string());
          l.error = st.to_string();
          save_on_commit_.erase(t.step);
          if (ckpt_expected_.erase(t.step) > 0)
            ckpt_errors_.emplace_back(t.step, fmt::format("its snapshot could not be made: {}", l.error));
        }
        landing_ = -1;
      }
      if (o_.send_landed) o_.send_landed(l);
    } else {
      // The keeper learns of the commit after the part's landing (this queue's order).
      const Status st = keeper_->commit(o_.job, o_.rank, t.step, t.copy_to);
      if (!st.ok()) {
        std::lock_guard lock(mu_);
        snap_errors_.emplace_back(t.step, st.to_string());
      }
    }
    {
      std::lock_guard lock(mu_);
      tasks_.pop_front();
    }
    cv_.notify_all();
  }
}

void Snapshotter::writer_loop() {
  while (true) {
    std::pair<int, int64_t> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !disk_.empty(); });
      if (disk_.empty()) return;
      job = disk_.front();
    }
    const auto [gen, step] = job;
    Status st = [&]() -> Status {
      TROUPE_ASSIGN_OR_RETURN(
          checkpoint::SnapshotPart p,
          checkpoint::read_segment_part(maps_[gen], fmt::format("rank {}'s snapshot", o_.rank)));
      if (p.part.step != step) return data_loss("the generation holds step {}, not {}", p.part.step, step);
      const checkpoint::ManifestPart saved = checkpoint::saved_subset(p.part);
      fault_point(fmt::format("checkpoint write of step {}", step));
      checkpoint::ShardWrite w;
      w.run_dir = o_.ckpt_dir;
      w.part = &saved;
      w.data = p.data;
      w.bytes = p.saved_bytes;
      w.verify = true;
      w.max_bytes_per_second = o_.ckpt_bytes_per_s;
      return checkpoint::write_rank_shard(w);
    }();
    if (!st.ok()) st = st.with_context(fmt::format("checkpoint step {} rank {}", step, o_.rank));
    {
      std::lock_guard lock(mu_);
      if (st.ok()) {
        durable_.push_back(step);
        written_.insert(step);
      } else {
        ckpt_errors_.emplace_back(step, st.to_string());
        fmt::print(stderr, "checkpoint: rank {} could not write step {}: {}\n", o_.rank, step,
                   st.to_string());
        std::fflush(stderr);
      }
      ckpt_writing_.erase(step);
      gen_on_disk_[gen] = false;
      disk_.pop_front();
    }
    cv_.notify_all();
  }
}

void Snapshotter::corrupt_newest() {
  std::unique_lock lock(mu_);
  // The fault is a part damaged in memory after its checkpoint was written: a checkpoint
  // this rank still has to write (its commit not seen yet, or its write under way: on a
  // loaded machine both can lag a step or two) is written first. Damaged before, the write
  // would fail its checksums — another fault than the one injected.
  cv_.wait_for(lock, std::chrono::seconds(30),
               [&] { return ckpt_expected_.empty() && ckpt_writing_.empty(); });
  int gen = -1;
  for (int g = 0; g < 2; ++g) {
    if (gen_step_[g] < 0 || landing_ == g || corrupted_.count(gen_step_[g])) continue;
    if (gen < 0 || gen_step_[g] > gen_step_[gen]) gen = g;
  }
  if (gen < 0 || part_.tensors.empty()) return;
  std::byte* b = maps_[gen]->data() + part_.tensors[0].slices[0].offset;
  *b ^= std::byte{0x5a};
  corrupted_.insert(gen_step_[gen]);
  fmt::print(stderr, "snapshot: rank {}: fault injection damaged its part of step {} ('{}')\n", o_.rank,
             gen_step_[gen], part_.tensors[0].name);
  std::fflush(stderr);
}

void Snapshotter::cancel() {
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
  }
  cv_.notify_all();
}

void Snapshotter::report(StepReply& reply, bool wait_ckpt) {
  std::unique_lock lock(mu_);
  if (wait_ckpt) {
    const bool done = cv_.wait_for(lock, std::chrono::seconds(300), [&] {
      return cancelled_ || (ckpt_expected_.empty() && ckpt_writing_.empty());
    });
    if (!done || !ckpt_expected_.empty() || !ckpt_writing_.empty()) {
      const char* why = cancelled_ ? "a newer membership epoch opened first" : "not within 300 s";
      for (int64_t s : ckpt_expected_) ckpt_errors_.emplace_back(s, fmt::format("not committed: {}", why));
      for (int64_t s : ckpt_writing_) ckpt_errors_.emplace_back(s, fmt::format("not written: {}", why));
      ckpt_expected_.clear();
    }
  }
  reply.durable.insert(reply.durable.end(), durable_.begin(), durable_.end());
  durable_.clear();
  reply.ckpt_errors.insert(reply.ckpt_errors.end(), ckpt_errors_.begin(), ckpt_errors_.end());
  ckpt_errors_.clear();
  reply.snapshot_errors.insert(reply.snapshot_errors.end(), snap_errors_.begin(), snap_errors_.end());
  snap_errors_.clear();
  lock.unlock();
  if (Result<checkpoint::SnapReply> q = keeper_->query(o_.job); q.ok()) {
    for (const checkpoint::SnapHeld& h : q->held) {
      if (!h.replica && h.rank == o_.rank)
        reply.snapshot_replicated = std::max(reply.snapshot_replicated, h.replicated_step);
    }
  }
}

// ---- restore ---------------------------------------------------------------------------

Status restore_snapshot(checkpoint::SnapshotClient& keeper, const std::string& job, const ElasticPlan& plan,
                        int rank, Stage& stage, std::vector<std::string>* sources) {
  const int64_t step = plan.snapshot_step;
  const ParallelLayout now = stage.state_layout();
  TROUPE_ASSIGN_OR_RETURN(ParallelLayout then,
                          ParallelLayout::make(now.pp(), static_cast<int>(plan.snapshot_dp), now.n()));
  if (static_cast<int>(plan.snapshot_parts.size()) != then.world_size()) {
    return invalid_argument("the plan names {} parts for the snapshot of step {} in layout {} ({} ranks)",
                            plan.snapshot_parts.size(), step, then.to_string(), then.world_size());
  }
  // Whose parts this rank reads: its own in the same layout; else every dp rank of its
  // (pp, n) column (what it holds is theirs, whatever dp is now).
  std::vector<int> need;
  if (then.dp() == now.dp()) {
    need.push_back(rank);
  } else {
    ParallelCoord c = now.coord(rank);
    for (int d = 0; d < then.dp(); ++d) {
      c.dp = d;
      need.push_back(then.rank_of(c));
    }
  }
  std::vector<checkpoint::SnapshotPart> parts;
  for (int r : need) {
    const PartSource& src = plan.snapshot_parts[static_cast<size_t>(r)];
    Result<checkpoint::SnapshotClient::Fetched> m =
        keeper.fetch(job, r, step, src.endpoints, std::chrono::minutes(10));
    if (!m.ok())
      return data_loss("the snapshot of step {}: rank {}'s part: {}", step, r, m.status().message());
    if (sources != nullptr) {
      sources->push_back(m->copy ? fmt::format("rank {}'s part: a copy on node {} of node {}'s", r,
                                               m->served_by, m->from_node)
                                 : fmt::format("rank {}'s part: on node {}", r, m->served_by));
    }
    Result<checkpoint::SnapshotPart> p = checkpoint::read_segment_part(
        m->map, fmt::format("the snapshot of step {}, rank {}'s part", step, r));
    if (!p.ok()) return data_loss("{}", p.status().message());
    if (p->part_xxh64 != src.xxh64) {
      return data_loss(
          "the snapshot of step {}: rank {}'s part is not the committed one (manifest checksum {} vs {})",
          step, r, checkpoint::xxh64_hex(p->part_xxh64), checkpoint::xxh64_hex(src.xxh64));
    }
    TROUPE_RETURN_IF_ERROR(checkpoint::verify_snapshot_part(*p, checksum_threads())
                               .with_context(fmt::format("the snapshot of step {}", step)));
    parts.push_back(std::move(p).value());
  }
  int64_t adam_steps = step;
  if (parts[0].part.state.is_object()) adam_steps = parts[0].part.state.value("adam_steps", step);
  // The same layout: the rank's own part, byte for byte into its buffers.
  if (then.dp() == now.dp()) return stage.restore_own_part(parts[0], adam_steps);
  SliceSource source = [&parts, step](const std::string& name, const Shape& global,
                                      const checkpoint::Slice& box, Tensor& dst) -> Status {
    int64_t covered = 0;
    for (const checkpoint::SnapshotPart& p : parts) {
      for (const checkpoint::TensorRecord& t : p.part.tensors) {
        if (t.name == name && t.shape != global) {
          return failed_precondition("the snapshot of step {}: tensor '{}' has shape {}, this model's is {}",
                                     step, name, shape_to_string(t.shape), shape_to_string(global));
        }
      }
      int64_t c = 0;
      TROUPE_RETURN_IF_ERROR(checkpoint::read_part_region(p, name, box, dst, c));
      covered += c;
    }
    // Parts of one column hold the replicated tensors each: covered may count them twice.
    if (covered < checkpoint::slice_numel(box)) {
      return data_loss("the snapshot of step {} holds {} of the {} elements of '{}' {} this rank needs", step,
                       covered, checkpoint::slice_numel(box), name, checkpoint::slice_to_string(box));
    }
    return ok_status();
  };
  return stage.restore(source, adam_steps);
}

}  // namespace troupe::training
