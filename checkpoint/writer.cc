// checkpoint/writer.cc — snapshot, background shard writes and the driver's commit.
#include "checkpoint/writer.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <unordered_set>

#include "checkpoint/file_io.h"
#include "checkpoint/reader.h"
#include "core/logging.h"

namespace troupe::checkpoint {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {
constexpr size_t kEntryAlignment = 64;
// Direct I/O wants the memory, the file offset and the length aligned to the device's
// logical block: a page covers every block size in use.
constexpr uint64_t kDirectAlign = 4096;
constexpr uint64_t kDirectMinBytes = 64 * 1024;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::shared_ptr<spdlog::logger> logger() {
  static auto l = make_logger("ckpt");
  return l;
}
}  // namespace

// ---- SaveHandle ------------------------------------------------------------------------

Status SaveHandle::wait() const {
  if (!state_) return failed_precondition("wait() on an empty SaveHandle");
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

Status SaveHandle::wait_for(std::chrono::milliseconds timeout) const {
  if (!state_) return failed_precondition("wait_for() on an empty SaveHandle");
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    return deadline_exceeded("checkpoint save of step {} still running after {} ms", state_->step, timeout.count());
  }
  return state_->status;
}

bool SaveHandle::done() const {
  if (!state_) return false;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

SaveStats SaveHandle::stats() const {
  if (!state_) return {};
  std::lock_guard lock(state_->mu);
  return state_->stats;
}

int64_t SaveHandle::step() const { return state_ ? state_->step : -1; }

// ---- CheckpointWriter ------------------------------------------------------------------

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::create(WriterOptions options) {
  if (options.run_dir.empty()) return invalid_argument("checkpoint writer: run_dir is empty");
  TROUPE_RETURN_IF_ERROR(options.layout.check_rank(options.rank));
  const ParallelCoord coords = options.layout.coord(options.rank);
  if (options.write_chunk_bytes == 0) return invalid_argument("checkpoint writer: write_chunk_bytes is 0");
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(options), coords));
}

CheckpointWriter::CheckpointWriter(WriterOptions options, ParallelCoord coords)
    : options_(std::move(options)), coords_(coords) {}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

Result<SaveHandle> CheckpointWriter::save(int64_t step, const std::vector<SaveEntry>& entries,
                                          nlohmann::json rank_state) {
  const auto t0 = Clock::now();
  if (step < 0) return invalid_argument("checkpoint step {} is negative", step);
  // Check every entry before touching the previous save or the buffer.
  std::unordered_set<std::string> names;
  std::vector<Slice> boxes;
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const SaveEntry& e : entries) {
    if (e.name.empty()) return invalid_argument("checkpoint entry with an empty name");
    if (!names.insert(e.name).second) return invalid_argument("tensor '{}' added twice to one save", e.name);
    if (!e.tensor.defined()) return invalid_argument("tensor '{}' is undefined", e.name);
    if (!e.tensor.device().is_cpu()) {
      return invalid_argument("tensor '{}' is on {}: copy it to host memory before save()", e.name,
                              e.tensor.device());
    }
    if (e.tensor.dim() != static_cast<int64_t>(e.global_shape.size())) {
      return invalid_argument("tensor '{}': local tensor {} has {} dimensions, global shape {} has {}", e.name,
                              e.tensor.describe(), e.tensor.dim(), shape_to_string(e.global_shape),
                              e.global_shape.size());
    }
    if (!e.offsets.empty() && e.offsets.size() != e.global_shape.size()) {
      return invalid_argument("tensor '{}': {} offsets for {} dimensions", e.name, e.offsets.size(),
                              e.global_shape.size());
    }
    Slice box(e.global_shape.size());
    for (size_t d = 0; d < box.size(); ++d) box[d] = Range{e.offsets.empty() ? 0 : e.offsets[d], e.tensor.shape()[d]};
    TROUPE_RETURN_IF_ERROR(check_slice_within(box, e.global_shape, fmt::format("tensor '{}'", e.name)));
    total = (total + kEntryAlignment - 1) / kEntryAlignment * kEntryAlignment;
    offsets.push_back(total);
    total += e.tensor.nbytes();
    boxes.push_back(std::move(box));
  }

  // One save in flight: wait for the previous one (its outcome stays in its handle).
  if (thread_.joinable()) thread_.join();
  // A part left by an earlier, crashed attempt at this step must not pass for this
  // save's "done" marker while the new shard is being written.
  {
    std::error_code ec;
    fs::remove(fs::path(options_.run_dir) / tmp_dir_name(step) / part_file_name(options_.rank), ec);
  }

  const auto t_snap = Clock::now();
  std::shared_ptr<std::vector<std::byte>> buf;
  {
    std::lock_guard lock(mu_);
    // Reuse the buffer: its pages are already mapped.
    buf = buffer_ ? buffer_ : std::make_shared<std::vector<std::byte>>();
  }
  buf->resize(total);
  ManifestPart part;
  part.step = step;
  part.rank = options_.rank;
  part.world_size = options_.layout.world_size();
  part.layout = options_.layout;
  part.coords = coords_;
  part.state = std::move(rank_state);
  size_t prev_end = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SaveEntry& e = entries[i];
    std::memset(buf->data() + prev_end, 0, offsets[i] - prev_end);  // alignment padding
    Tensor dst = Tensor::wrap(buf->data() + offsets[i], e.tensor.shape(), e.tensor.dtype());
    if (e.tensor.numel() > 0) dst.copy_from(e.tensor);
    prev_end = offsets[i] + e.tensor.nbytes();
    StoredSlice s;
    s.file = shard_file_name(options_.rank);
    s.offset = offsets[i];
    s.length = e.tensor.nbytes();
    s.box = boxes[i];
    s.rank = options_.rank;
    part.tensors.push_back(TensorRecord{e.name, e.tensor.dtype(), e.global_shape, {std::move(s)}});
  }
  const double snapshot_s = seconds_since(t_snap);
  {
    std::lock_guard lock(mu_);
    buffer_ = buf;
  }

  auto st = std::make_shared<SaveHandle::State>();
  st->step = step;
  st->stats.bytes = total;
  st->stats.snapshot_seconds = snapshot_s;
  st->stats.blocked_seconds = seconds_since(t0);
  SaveHandle h;
  h.state_ = st;
  thread_ = std::thread([this, step, part = std::move(part), t0, st]() mutable {
    write_in_background(step, std::move(part), t0, st);
  });
  return h;
}

void CheckpointWriter::write_in_background(int64_t step, ManifestPart part, Clock::time_point t0,
                                           std::shared_ptr<SaveHandle::State> st) {
  const auto t_write = Clock::now();
  std::shared_ptr<std::vector<std::byte>> buf;
  {
    std::lock_guard lock(mu_);
    buf = buffer_;
  }
  auto run = [&]() -> Status {
    for (TensorRecord& t : part.tensors) {
      StoredSlice& s = t.slices[0];
      s.xxh64 = XXH64(buf->data() + s.offset, s.length, 0);
    }
    ShardWrite w;
    w.run_dir = options_.run_dir;
    w.part = &part;
    w.data = buf->data();
    w.bytes = buf->size();
    w.fsync = options_.fsync;
    w.max_bytes_per_second = options_.max_bytes_per_second;
    w.chunk_bytes = options_.write_chunk_bytes;
    return write_rank_shard(w);
  };
  Status status = run();
  if (!status.ok()) {
    status = status.with_context(fmt::format("checkpoint step {} rank {}", step, options_.rank));
    logger()->error("{}", status.to_string());
  }
  std::lock_guard lock(st->mu);
  st->stats.write_seconds = seconds_since(t_write);
  st->stats.total_seconds = seconds_since(t0);
  st->status = status;
  st->done = true;
  st->cv.notify_all();
}

Status write_rank_shard(const ShardWrite& w) {
  const ManifestPart& part = *w.part;
  if (w.chunk_bytes == 0) return invalid_argument("write_rank_shard: chunk size 0");
  if (w.verify) {
    for (const TensorRecord& t : part.tensors) {
      for (const StoredSlice& s : t.slices) {
        if (s.offset > w.bytes || s.length > w.bytes - s.offset) {
          return data_loss("rank {} step {}: tensor '{}' slice {} lies beyond its {} bytes", part.rank,
                           part.step, t.name, slice_to_string(s.box), w.bytes);
        }
        if (XXH64(w.data + s.offset, s.length, 0) != s.xxh64) {
          return data_loss("rank {} step {}: tensor '{}' slice {} does not match its checksum: not written",
                           part.rank, part.step, t.name, slice_to_string(s.box));
        }
      }
    }
  }
  const std::string tmp = (fs::path(w.run_dir) / tmp_dir_name(part.step)).string();
  TROUPE_RETURN_IF_ERROR(make_dirs(tmp));
  // A part left by an earlier attempt at this step must not pass for this write's marker.
  std::error_code ec;
  fs::remove(fs::path(tmp) / part_file_name(part.rank), ec);
  const std::string path = (fs::path(tmp) / shard_file_name(part.rank)).string();
  // Direct I/O where the bytes allow it (page-aligned memory, at least a few pages: the
  // snapshot segments): the device reads the shard from this memory, instead of the kernel
  // copying it into the page cache first and writing it back at the fsync — on a busy CPU
  // that copy, the cache's bookkeeping and later the deletion of those cached pages were
  // most of a checkpoint's cost. The unaligned tail, and every file system that refuses
  // O_DIRECT (tmpfs), take the buffered path; the file's bytes are the same.
  const bool aligned = reinterpret_cast<uintptr_t>(w.data) % kDirectAlign == 0 &&
                       w.bytes >= kDirectMinBytes && w.chunk_bytes % kDirectAlign == 0;
  Result<FileHandle> opened = open_file(path, O_WRONLY | O_CREAT | O_TRUNC | (aligned ? O_DIRECT : 0));
  bool direct = aligned && opened.ok();
  if (aligned && !opened.ok()) opened = open_file(path, O_WRONLY | O_CREAT | O_TRUNC);
  if (!opened.ok()) return opened.status();
  FileHandle f = std::move(opened).value();
  // Leaves direct I/O for the rest of the file (its unaligned tail, a refusal, a short write).
  auto go_buffered = [&]() -> Status {
    if (!direct) return ok_status();
    direct = false;
    const int fl = ::fcntl(f.fd(), F_GETFL);
    if (fl < 0 || ::fcntl(f.fd(), F_SETFL, fl & ~O_DIRECT) != 0) return errno_status("fcntl", path, errno);
    return ok_status();
  };
  const auto t_io = Clock::now();
  for (uint64_t off = 0; off < w.bytes; off += w.chunk_bytes) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(w.chunk_bytes, w.bytes - off));
    size_t done = 0;
    while (direct && done < n) {
      const size_t want = (n - done) / kDirectAlign * kDirectAlign;
      if (want == 0) break;
      const ssize_t r = ::pwrite(f.fd(), w.data + off + done, want, static_cast<off_t>(off + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && errno != EINVAL) return errno_status("write", path, errno);
      // EINVAL: this file system takes no direct I/O after all; a short write (a disk
      // filling up) leaves an unaligned offset: the buffered path goes on from there (and
      // reports ENOSPC by its name).
      const bool whole = r > 0 && static_cast<size_t>(r) == want;
      if (r > 0) done += static_cast<size_t>(r);
      if (!whole) TROUPE_RETURN_IF_ERROR(go_buffered());
    }
    if (done < n) {
      TROUPE_RETURN_IF_ERROR(go_buffered());
      TROUPE_RETURN_IF_ERROR(pwrite_all(f.fd(), w.data + off + done, n - done, off + done, path));
    }
    if (w.max_bytes_per_second > 0) {
      const double due = static_cast<double>(off + n) / static_cast<double>(w.max_bytes_per_second);
      const double ahead = due - seconds_since(t_io);
      if (ahead > 0) std::this_thread::sleep_for(std::chrono::duration<double>(ahead));
    }
  }
  if (w.fsync) TROUPE_RETURN_IF_ERROR(fsync_fd(f.fd(), path));
  // The part is the rank's "done" marker: written only after its shard is durable, and
  // renamed into place (whoever polls for it sees all of it or nothing). The directory's
  // entries (the shard's and the part's) are not fsynced here, once a rank: the commit
  // (finalize_checkpoint) fsyncs step_<N>.tmp once, before its rename.
  const std::string part_path = (fs::path(tmp) / part_file_name(part.rank)).string();
  const std::string part_tmp = part_path + ".tmp";
  TROUPE_RETURN_IF_ERROR(write_file(part_tmp, part_to_json(part).dump(1), w.fsync));
  if (::rename(part_tmp.c_str(), part_path.c_str()) != 0)
    return errno_status("rename to " + part_path, part_tmp, errno);
  return ok_status();
}

// ---- the driver's side -----------------------------------------------------------------

Status wait_for_parts(const std::string& run_dir, int64_t step, int world_size, std::chrono::milliseconds timeout) {
  const fs::path tmp = fs::path(run_dir) / tmp_dir_name(step);
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::vector<int> missing;
    for (int r = 0; r < world_size; ++r) {
      std::error_code ec;
      if (!fs::exists(tmp / part_file_name(r), ec)) missing.push_back(r);
    }
    if (missing.empty()) return ok_status();
    if (Clock::now() >= deadline) {
      return deadline_exceeded("checkpoint step {}: after {} ms, ranks [{}] have not finished writing into {}", step,
                               timeout.count(), fmt::join(missing, ", "), tmp.string());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

namespace {

// Moves a directory out of the way first (a rename is atomic), then deletes it, so a crash
// mid-delete never leaves a half-deleted `step_<N>` that looks like a checkpoint.
Status remove_dir(const fs::path& dir) {
  const fs::path trash = dir.string() + ".deleting";
  std::error_code ec;
  fs::rename(dir, trash, ec);
  if (ec) return io_error("rename {} to {}: {}", dir.string(), trash.string(), ec.message());
  fs::remove_all(trash, ec);
  if (ec) return io_error("remove {}: {}", trash.string(), ec.message());
  return ok_status();
}

// The tokenizer is the same file in every checkpoint of a run: a hard link to the newest
// committed checkpoint's copy when that holds the same bytes (committed checkpoints are
// never written again, and its data was fsynced when it was first written), else a copy,
// fsynced; finalize_checkpoint fsyncs the directory entry.
Status place_tokenizer(const fs::path& run, int64_t step, const fs::path& to, const std::string& bytes,
                       bool fsync) {
  for (const auto& [s, dir] : list_checkpoints(run.string())) {
    if (s >= step) continue;
    const fs::path from = fs::path(dir) / to.filename();
    Result<std::string> prev = read_whole_file(from.string());
    if (prev.ok() && *prev == bytes && ::link(from.c_str(), to.c_str()) == 0) return ok_status();
    break;  // only the newest one is tried: a cross-device or refused link copies
  }
  return write_file(to.string(), bytes, fsync);
}

}  // namespace

Result<FinalizeResult> finalize_checkpoint(const std::string& run_dir, int64_t step, const FinalizeOptions& opt) {
  if (opt.world_size < 1) return invalid_argument("finalize: world_size {} < 1", opt.world_size);
  if (opt.keep_last < 1) return invalid_argument("finalize: keep_last {} < 1", opt.keep_last);
  const fs::path run(run_dir);
  const fs::path tmp = run / tmp_dir_name(step);
  const fs::path final_dir = run / step_dir_name(step);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) return already_exists("checkpoint {} already exists", final_dir.string());
  if (!fs::is_directory(tmp, ec)) return not_found("checkpoint step {}: no temporary directory {}", step, tmp.string());

  std::vector<ManifestPart> parts;
  for (int r = 0; r < opt.world_size; ++r) {
    const std::string path = (tmp / part_file_name(r)).string();
    auto text = read_whole_file(path);
    if (!text.ok()) {
      return not_found("checkpoint step {}: rank {} has not completed its save ({} missing: {})", step, r, path,
                       text.status().message());
    }
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return data_loss("checkpoint step {}: {} is not valid JSON", step, path);
    TROUPE_ASSIGN_OR_RETURN(ManifestPart p, part_from_json(j, path));
    if (p.rank != r || p.step != step) {
      return data_loss("{}: holds rank {} step {}, expected rank {} step {}", path, p.rank, p.step, r, step);
    }
    // The part is written after its shard, so a short shard here is real damage.
    const std::string shard = (tmp / shard_file_name(r)).string();
    uint64_t need = 0;
    for (const TensorRecord& t : p.tensors)
      for (const StoredSlice& s : t.slices) need = std::max(need, s.offset + s.length);
    TROUPE_ASSIGN_OR_RETURN(uint64_t have, file_size(shard));
    if (have < need) return data_loss("checkpoint step {}: {} has {} bytes, its part needs {}", step, shard, have, need);
    parts.push_back(std::move(p));
  }
  TROUPE_ASSIGN_OR_RETURN(Manifest m, merge_parts(parts, opt.info));
  m.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  if (!opt.info.tokenizer_path.empty()) {
    auto bytes = read_whole_file(opt.info.tokenizer_path);
    if (!bytes.ok()) return bytes.status().with_context("checkpoint tokenizer");
    const std::string name = fs::path(opt.info.tokenizer_path).filename().string();
    if (name == kManifestFile || name == kLatestFile || name.starts_with("rank_")) {
      return invalid_argument("tokenizer file name '{}' clashes with a checkpoint file", name);
    }
    TROUPE_RETURN_IF_ERROR(place_tokenizer(run, step, tmp / name, *bytes, opt.fsync));
    m.tokenizer = TokenizerRecord{name, bytes->size(), XXH64(bytes->data(), bytes->size(), 0)};
  }
  // Inside step_<N>.tmp, which is no checkpoint until its rename, the manifest needs no
  // write-and-rename of its own: the file is fsynced, then the directory once (the entries
  // of every rank's shard and part, the tokenizer's and the manifest's), then renamed.
  TROUPE_RETURN_IF_ERROR(write_file((tmp / kManifestFile).string(), manifest_to_json(m).dump(1), opt.fsync));
  if (opt.fsync) TROUPE_RETURN_IF_ERROR(fsync_dir(tmp.string()));
  // The commit point.
  fs::rename(tmp, final_dir, ec);
  if (ec) return io_error("rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  // `latest` (a hint: readers take the newest committed directory whatever it says) is
  // renamed into the run directory too; its write's one fsync of the run directory makes
  // both renames durable: the checkpoint is committed when this returns.
  TROUPE_RETURN_IF_ERROR(write_file_durably((run / kLatestFile).string(), step_dir_name(step) + "\n"));

  FinalizeResult out;
  out.path = final_dir.string();
  out.bytes = m.total_bytes();
  // Retention, and temporary directories of older steps (crashed or abandoned saves).
  std::set<int64_t> steps;
  std::vector<fs::path> stale_tmp;
  for (const auto& de : fs::directory_iterator(run, ec)) {
    const std::string name = de.path().filename().string();
    if (auto s = parse_step_dir_name(name)) {
      steps.insert(*s);
    } else if (name.ends_with(".tmp") && name.starts_with("step_")) {
      auto s2 = parse_step_dir_name(name.substr(0, name.size() - 4));
      if (s2 && *s2 < step) stale_tmp.push_back(de.path());
    } else if (name.ends_with(".deleting") && name.starts_with("step_")) {
      stale_tmp.push_back(de.path());  // a deletion interrupted by a crash
    }
  }
  while (static_cast<int>(steps.size()) > opt.keep_last) {
    const int64_t oldest = *steps.begin();
    steps.erase(steps.begin());
    const fs::path dir = run / step_dir_name(oldest);
    Status st = remove_dir(dir);
    if (!st.ok()) {
      logger()->warn("retention: {}", st.to_string());
    } else {
      out.removed.push_back(dir.string());
    }
  }
  for (const fs::path& p : stale_tmp) {
    logger()->info("removing {} left by an unfinished save or deletion", p.string());
    fs::remove_all(p, ec);
    if (ec) logger()->warn("remove {}: {}", p.string(), ec.message());
  }
  logger()->info("checkpoint {} committed: {} tensors, {} bytes, {} ranks", out.path, m.tensors.size(), out.bytes,
                 opt.world_size);
  return out;
}

}  // namespace troupe::checkpoint
