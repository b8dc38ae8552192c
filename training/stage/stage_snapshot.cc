// training/stage/stage_snapshot.cc — the Stage's snapshot members (stage.h, "snapshots"):
// the asynchronous copy of its state (Stage::snapshot_tensors, stage_state.cc) into host
// memory after a step, and the restore from a snapshot's parts.
//
// The copy never stalls the step that follows it, and never reads a tensor the step is
// writing:
// - GPU: the state is first copied on the device (one staging buffer, on the compute
//   stream: stream-ordered after the step that made it, before the next one can change
//   it; HBM-to-HBM, milliseconds), then device -> host from the staging buffer on a
//   snapshot stream of its own while the next steps run. A new snapshot waits for the
//   previous device -> host copy before it reuses the staging buffer.
// - CPU: a copier thread copies the live buffers while the next step's forward and
//   backward run (they only read them), after its caller's before_copy (the keeper's
//   leave to overwrite the destination); the optimizer, the first thing that writes the
//   state, waits for it (snapshot_fence).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "training/stage/stage.h"

// The streaming state on the copier's stack (XXH64_state_t's definition).
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#if TROUPE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda/stream.h"
#include "core/gpu_check.h"
#include "kernels/cuda/context.h"
#endif

namespace troupe::training {

namespace {
// The copier copies and hashes this much at a time: well inside a core's L2, so the hash
// reads what the copy just wrote from cache, not from memory.
constexpr size_t kCopyHashChunk = 64 * 1024;
}  // namespace

// Threads: snapshot_into, snapshot_fence and the destructor run on the step thread;
// snapshot_wait may run on another (the worker's snapshot thread) at the same time.
struct Stage::SnapshotCopy {
  std::mutex mu;
  // CPU: the copier thread of the copy in flight and its completion (waitable by many).
  std::thread copier;
  std::shared_future<void> copied;
  // GPU: the staging buffer, the stream and the event that ends the device -> host copy.
  void* staging = nullptr;
  size_t staging_bytes = 0;
  bool gpu_pending = false;
#if TROUPE_HAVE_CUDA
  cuda::CudaStream stream;
  cuda::CudaEvent staged, landed;
#endif
  std::map<void*, size_t> pinned;

  ~SnapshotCopy() {
    if (copier.joinable()) copier.join();
#if TROUPE_HAVE_CUDA
    if (gpu_pending) landed.synchronize();
    if (staging != nullptr) cudaFree(staging);
    for (const auto& [p, n] : pinned) cudaHostUnregister(p);
#endif
  }
};

void Stage::SnapshotCopyDeleter::operator()(SnapshotCopy* c) const {
  delete c;
}

void Stage::init_snapshot_copy() {
  snap_.reset(new SnapshotCopy);
}

Status Stage::snapshot_into(std::byte* dst, const std::vector<uint64_t>& offsets,
                            std::function<bool()> before_copy, std::vector<uint64_t>* checksums) {
  if (checksums != nullptr) checksums->clear();
  TROUPE_ASSIGN_OR_RETURN(std::vector<SnapshotTensor> ts, snapshot_tensors());
  if (ts.size() != offsets.size()) {
    return invalid_argument("snapshot_into: {} offsets for {} tensors", offsets.size(), ts.size());
  }
  TROUPE_RETURN_IF_ERROR(snapshot_wait());  // one copy at a time
  SnapshotCopy& c = *snap_;
  if (c.copier.joinable()) c.copier.join();
  uint64_t end = 0;
  for (size_t i = 0; i < ts.size(); ++i)
    end = std::max<uint64_t>(end, offsets[i] + ts[i].entry.tensor.nbytes());
  if (!ctx_.on_device()) {
    // Views of the live host buffers: only the optimizer writes them (it waits).
    std::promise<void> done;
    {
      std::lock_guard lock(c.mu);
      c.copied = done.get_future().share();
    }
    c.copier = std::thread([ts = std::move(ts), dst, offsets, done = std::move(done),
                            before_copy = std::move(before_copy), checksums]() mutable {
      if (before_copy && !before_copy()) {
        done.set_value();
        return;
      }
      std::vector<uint64_t> sums;
      if (checksums != nullptr) sums.reserve(ts.size());
      XXH64_state_t hash;
      for (size_t i = 0; i < ts.size(); ++i) {
        const Tensor& t = ts[i].entry.tensor;
        const size_t n = t.numel() > 0 ? t.nbytes() : 0;
        const auto* from = static_cast<const std::byte*>(t.data_ptr());
        std::byte* to = dst + offsets[i];
        if (checksums == nullptr) {
          if (n > 0) std::memcpy(to, from, n);
          continue;
        }
        XXH64_reset(&hash, 0);
        for (size_t off = 0; off < n; off += kCopyHashChunk) {
          const size_t len = std::min(kCopyHashChunk, n - off);
          std::memcpy(to + off, from + off, len);
          XXH64_update(&hash, to + off, len);  // the bytes just written, still in cache
        }
        sums.push_back(XXH64_digest(&hash));
      }
      if (checksums != nullptr) *checksums = std::move(sums);
      done.set_value();
    });
    return ok_status();
  }
#if TROUPE_HAVE_CUDA
  if (before_copy && !before_copy()) return ok_status();
  bind_device();
  const int dev = ctx_.ex.device.index;
  if (c.staging_bytes < end) {
    if (c.staging != nullptr) CUDA_CHECK(cudaFree(c.staging));
    c.staging = nullptr;
    if (cudaMalloc(&c.staging, end) != cudaSuccess) {
      (void)cudaGetLastError();
      c.staging_bytes = 0;
      return resource_exhausted("snapshot: no device memory for the {} byte staging copy of rank {}'s state",
                                end, rank_);
    }
    c.staging_bytes = end;
  }
  if (c.stream.get() == nullptr) {
    c.stream = cuda::CudaStream::create(dev);
    c.staged = cuda::CudaEvent::create(dev, /*timing=*/false);
    c.landed = cuda::CudaEvent::create(dev, /*timing=*/false);
  }
  const cudaStream_t compute = ctx_.ex.cuda->stream;
  auto* staging = static_cast<std::byte*>(c.staging);
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i].entry.tensor;
    if (t.numel() == 0) continue;
    CUDA_CHECK(
        cudaMemcpyAsync(staging + offsets[i], t.data_ptr(), t.nbytes(), cudaMemcpyDeviceToDevice, compute));
  }
  c.staged.record(compute);
  c.staged.wait_on(c.stream.get());
  // The staging buffer mirrors the host layout (gaps between tensors are the alignment
  // padding, zero in both), copied in chunks: a copy engine serves its queue in order, and
  // another stream's copy finds a turn between two chunks instead of after gigabytes.
  constexpr uint64_t kChunk = uint64_t{256} << 20;
  for (uint64_t at = 0; at < end; at += kChunk) {
    CUDA_CHECK(cudaMemcpyAsync(dst + at, staging + at, std::min(kChunk, end - at), cudaMemcpyDeviceToHost,
                               c.stream.get()));
  }
  c.landed.record(c.stream.get());
  std::lock_guard lock(c.mu);
  c.gpu_pending = true;
  return ok_status();
#else
  (void)dst;
  (void)before_copy;
  return unimplemented("snapshot on {}: this build has no CUDA", ctx_.ex.device);
#endif
}

Status Stage::snapshot_wait() {
  SnapshotCopy& c = *snap_;
  std::shared_future<void> copied;
  bool gpu = false;
  {
    std::lock_guard lock(c.mu);
    copied = c.copied;
    gpu = c.gpu_pending;
  }
  if (copied.valid()) copied.wait();
#if TROUPE_HAVE_CUDA
  if (gpu) {
    bind_device();
    c.landed.synchronize();
    std::lock_guard lock(c.mu);
    c.gpu_pending = false;
  }
#else
  (void)gpu;
#endif
  return ok_status();
}

void Stage::snapshot_fence() {
  // The GPU's copy reads the staging buffer only: nothing to hold back.
  if (ctx_.on_device()) return;
  std::shared_future<void> copied;
  {
    std::lock_guard lock(snap_->mu);
    copied = snap_->copied;
  }
  if (copied.valid()) copied.wait();
}

void Stage::pin_host(void* p, size_t bytes) {
#if TROUPE_HAVE_CUDA
  if (!ctx_.on_device() || p == nullptr || bytes == 0) return;
  {
    std::lock_guard lock(snap_->mu);
    if (snap_->pinned.count(p)) return;
  }
  bind_device();
  // Page-locked, the device -> host copy runs at the link's speed and asynchronously.
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) == cudaSuccess) {
    std::lock_guard lock(snap_->mu);
    snap_->pinned[p] = bytes;
  } else {
    (void)cudaGetLastError();  // pageable still works, staged by the driver
  }
#else
  (void)p;
  (void)bytes;
#endif
}

void Stage::unpin_host(void* p) {
#if TROUPE_HAVE_CUDA
  {
    std::lock_guard lock(snap_->mu);
    if (!snap_->pinned.count(p)) return;
  }
  (void)snapshot_wait();
  bind_device();
  cudaHostUnregister(p);
  std::lock_guard lock(snap_->mu);
  snap_->pinned.erase(p);
#else
  (void)p;
#endif
}

Status Stage::restore_own_part(const checkpoint::SnapshotPart& part, int64_t steps_done) {
  // First: what the interrupted step left (a launched step, parameter all-gathers on the
  // aborted communicators) must not be awaited by snapshot_tensors()'s settle(), which
  // would raise the old epoch's error (or find the step launched) in every new epoch.
  clear_interrupted_step();
  TROUPE_RETURN_IF_ERROR(snapshot_wait());
  TROUPE_ASSIGN_OR_RETURN(std::vector<SnapshotTensor> ts, snapshot_tensors());
  std::map<std::string, const checkpoint::TensorRecord*> recs;
  for (const checkpoint::TensorRecord& t : part.part.tensors) recs[t.name] = &t;
  // Everything is checked before anything is written.
  std::vector<const checkpoint::StoredSlice*> src(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const checkpoint::SaveEntry& e = ts[i].entry;
    auto it = recs.find(e.name);
    if (it == recs.end())
      return not_found("snapshot part of rank {}: no tensor '{}'", part.part.rank, e.name);
    const checkpoint::TensorRecord& r = *it->second;
    checkpoint::Slice box;
    for (size_t d = 0; d < e.global_shape.size(); ++d) {
      box.push_back({e.offsets.empty() ? 0 : e.offsets[d], e.tensor.shape()[static_cast<int64_t>(d)]});
    }
    if (r.dtype != e.tensor.dtype() || r.shape != e.global_shape || r.slices.size() != 1 ||
        r.slices[0].box != box || r.slices[0].length != e.tensor.nbytes()) {
      return failed_precondition(
          "snapshot part of rank {}: tensor '{}' is not what this rank holds ({} {} vs {} {})",
          part.part.rank, e.name, dtype_name(r.dtype),
          r.slices.empty() ? std::string("-") : checkpoint::slice_to_string(r.slices[0].box),
          dtype_name(e.tensor.dtype()), checkpoint::slice_to_string(box));
    }
    src[i] = &r.slices[0];
  }
  settle();  // nothing may still write the parameters
  bind_device();
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor dst = ts[i].entry.tensor;
    if (dst.numel() == 0) continue;
    const std::byte* from = part.data + src[i]->offset;
    if (ctx_.on_device()) {
      const Tensor host = Tensor::wrap(const_cast<std::byte*>(from), dst.shape(), dst.dtype());
      ctx_.copy_to_device(host, dst);
    } else {
      std::memcpy(dst.data_ptr(), from, dst.nbytes());
    }
  }
  if (ctx_.on_device()) synchronize();  // the part's memory may go once this returns
  refresh_working_copies();  // the copies the kernels read (and split halves) from the restored values
  opt_->set_steps_done(steps_done);
  return ok_status();
}

Status Stage::restore(const SliceSource& source, int64_t steps_done) {
  clear_interrupted_step();
  TROUPE_RETURN_IF_ERROR(snapshot_wait());
  return import_state(source, steps_done);
}

}  // namespace troupe::training
