// checkpoint/snapshot_segment.cc — memfd segments, their header, and landed parts read in
// place.
#include "checkpoint/snapshot_segment.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace troupe::checkpoint {

namespace {
constexpr char kMagic[8] = {'T', 'R', 'P', 'S', 'N', 'A', 'P', '1'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kPage = 4096;
uint64_t round_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}
}  // namespace

const char* segment_state_name(uint32_t state) {
  switch (static_cast<SegmentState>(state)) {
    case SegmentState::kEmpty:
      return "empty";
    case SegmentState::kWriting:
      return "writing";
    case SegmentState::kLanded:
      return "landed";
  }
  return "unknown";
}

uint64_t segment_size_for(uint64_t data_bytes, uint64_t part_capacity) {
  return kSegmentDataOffset + round_up(data_bytes, kPage) +
         round_up(std::max<uint64_t>(part_capacity, 1), kPage);
}

Result<FileHandle> create_segment(const std::string& name, uint64_t bytes) {
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return io_error("memfd_create {}: {}", name, std::strerror(errno));
  FileHandle h(fd);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return resource_exhausted("snapshot segment {} of {} bytes: ftruncate: {}", name, bytes,
                              std::strerror(errno));
  }
  return h;
}

Result<std::unique_ptr<SegmentMap>> SegmentMap::map(int fd, bool writable) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return io_error("snapshot segment: fstat: {}", std::strerror(errno));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < kSegmentDataOffset)
    return data_loss("snapshot segment of {} bytes is smaller than its header", size);
  void* p = ::mmap(nullptr, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return io_error("snapshot segment: mmap of {} bytes: {}", size, std::strerror(errno));
  return std::unique_ptr<SegmentMap>(new SegmentMap(static_cast<std::byte*>(p), size));
}

SegmentMap::~SegmentMap() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

uint64_t SegmentMap::data_capacity() const {
  return size_ - kSegmentDataOffset;
}

SegmentHeader SegmentMap::read_header() const {
  // The state is stored last by the writer (release): read it first (acquire), then the rest.
  const uint32_t state = std::atomic_ref<uint32_t>(header()->state).load(std::memory_order_acquire);
  SegmentHeader h;
  std::memcpy(&h, header(), sizeof(h));
  h.state = state;
  return h;
}

void begin_segment(SegmentMap& m, int64_t step) {
  SegmentHeader* h = m.header();
  std::atomic_ref<uint32_t>(h->state).store(static_cast<uint32_t>(SegmentState::kWriting),
                                            std::memory_order_release);
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  h->version = kVersion;
  h->step = step;
}

Status seal_segment(SegmentMap& m, const ManifestPart& part, uint64_t data_bytes, uint64_t saved_bytes) {
  if (data_bytes > m.data_capacity()) {
    return out_of_range("snapshot part of {} bytes does not fit its segment of {}", data_bytes,
                        m.data_capacity());
  }
  const std::string json = part_to_json(part).dump();
  const uint64_t part_offset = kSegmentDataOffset + round_up(data_bytes, kPage);
  if (part_offset + json.size() > m.size()) {
    return out_of_range("snapshot part JSON of {} bytes does not fit its segment ({} of {} bytes free)",
                        json.size(), m.size() - std::min(m.size(), part_offset), m.size());
  }
  std::memcpy(m.base() + part_offset, json.data(), json.size());
  SegmentHeader* h = m.header();
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  h->version = kVersion;
  h->step = part.step;
  h->data_bytes = data_bytes;
  h->saved_bytes = saved_bytes;
  h->part_offset = part_offset;
  h->part_bytes = json.size();
  h->part_xxh64 = XXH64(json.data(), json.size(), 0);
  std::atomic_ref<uint32_t>(h->state).store(static_cast<uint32_t>(SegmentState::kLanded),
                                            std::memory_order_release);
  return ok_status();
}

Result<SnapshotPart> read_segment_part(std::shared_ptr<const SegmentMap> m, const std::string& where) {
  const SegmentHeader h = m->read_header();
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0)
    return data_loss("{}: not a snapshot segment", where);
  if (h.version != kVersion)
    return data_loss("{}: segment version {} (this build reads {})", where, h.version, kVersion);
  if (h.state != static_cast<uint32_t>(SegmentState::kLanded)) {
    return data_loss("{}: the part of step {} is {}, not landed", where, h.step, segment_state_name(h.state));
  }
  if (h.data_bytes > m->data_capacity() || h.saved_bytes > h.data_bytes ||
      h.part_offset < kSegmentDataOffset || h.part_offset > m->size() ||
      h.part_bytes > m->size() - h.part_offset) {
    return data_loss("{}: header out of bounds (data {} bytes, part at {} +{}, segment {})", where,
                     h.data_bytes, h.part_offset, h.part_bytes, m->size());
  }
  const char* json = reinterpret_cast<const char*>(m->base() + h.part_offset);
  if (XXH64(json, h.part_bytes, 0) != h.part_xxh64) {
    return data_loss("{}: the part of step {}: its manifest's checksum does not match", where, h.step);
  }
  const nlohmann::json j =
      nlohmann::json::parse(json, json + h.part_bytes, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return data_loss("{}: the part of step {}: its manifest is not JSON", where, h.step);
  TROUPE_ASSIGN_OR_RETURN(ManifestPart part, part_from_json(j, where));
  if (part.step != h.step)
    return data_loss("{}: header says step {}, its manifest {}", where, h.step, part.step);
  for (const TensorRecord& t : part.tensors) {
    for (const StoredSlice& s : t.slices) {
      if (s.offset > h.data_bytes || s.length > h.data_bytes - s.offset) {
        return data_loss("{}: tensor '{}' slice {} lies beyond the part's {} bytes", where, t.name,
                         slice_to_string(s.box), h.data_bytes);
      }
    }
  }
  SnapshotPart p;
  p.part = std::move(part);
  p.data = m->data();
  p.data_bytes = h.data_bytes;
  p.saved_bytes = h.saved_bytes;
  p.part_xxh64 = h.part_xxh64;
  p.keep = std::move(m);
  return p;
}

Status verify_snapshot_part(const SnapshotPart& p, int threads) {
  struct Item {
    const TensorRecord* t;
    const StoredSlice* s;
  };
  std::vector<Item> items;
  for (const TensorRecord& t : p.part.tensors) {
    for (const StoredSlice& s : t.slices) items.push_back({&t, &s});
  }
  std::atomic<size_t> next{0};
  std::atomic<size_t> bad{items.size()};
  auto work = [&] {
    for (size_t i = next++; i < items.size(); i = next++) {
      const StoredSlice& s = *items[i].s;
      if (XXH64(p.data + s.offset, s.length, 0) != s.xxh64) {
        size_t cur = bad.load();
        while (i < cur && !bad.compare_exchange_weak(cur, i)) {
        }
      }
    }
  };
  const int n = std::clamp(threads, 1, 64);
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (bad.load() < items.size()) {
    const Item& it = items[bad.load()];
    return data_loss("snapshot part of rank {} (step {}): checksum mismatch in tensor '{}' slice {}",
                     p.part.rank, p.part.step, it.t->name, slice_to_string(it.s->box));
  }
  return ok_status();
}

Status read_part_region(const SnapshotPart& p, const std::string& name, const Slice& box, Tensor& dst,
                        int64_t& covered) {
  covered = 0;
  for (const TensorRecord& t : p.part.tensors) {
    if (t.name != name) continue;
    if (t.dtype != dst.dtype()) {
      return failed_precondition("snapshot tensor '{}' is {} but the destination is {}", name,
                                 dtype_name(t.dtype), dtype_name(dst.dtype()));
    }
    for (const StoredSlice& s : t.slices) {
      const std::optional<Slice> region = intersect(s.box, box);
      if (!region || slice_numel(*region) == 0) continue;
      copy_region(p.data + s.offset, s.box, static_cast<std::byte*>(dst.data_ptr()), box, *region,
                  dtype_size(t.dtype));
      covered += slice_numel(*region);
    }
  }
  return ok_status();
}

ManifestPart saved_subset(const ManifestPart& p) {
  std::set<std::string> unsaved;
  if (p.state.is_object() && p.state.contains("unsaved") && p.state["unsaved"].is_array()) {
    for (const auto& n : p.state["unsaved"]) {
      if (n.is_string()) unsaved.insert(n.get<std::string>());
    }
  }
  ManifestPart out = p;
  out.tensors.clear();
  for (const TensorRecord& t : p.tensors) {
    if (!unsaved.count(t.name)) out.tensors.push_back(t);
  }
  out.state.erase("unsaved");
  return out;
}

}  // namespace troupe::checkpoint
