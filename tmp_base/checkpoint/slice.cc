// checkpoint/slice.cc — box arithmetic and the N-d region copy.
#include "checkpoint/slice.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace troupe::checkpoint {

Slice full_slice(const Shape& shape) {
  Slice s;
  s.reserve(shape.size());
  for (int64_t d : shape) s.push_back(Range{0, d});
  return s;
}

Shape slice_shape(const Slice& s) {
  Shape out;
  out.reserve(s.size());
  for (const Range& r : s) out.push_back(r.length);
  return out;
}

int64_t slice_numel(const Slice& s) {
  int64_t n = 1;
  for (const Range& r : s) n *= r.length;
  return n;
}

std::string slice_to_string(const Slice& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("{}:{}", s[i].start, s[i].end());
  }
  return out + "]";
}

std::optional<Slice> intersect(const Slice& a, const Slice& b) {
  TROUPE_CHECK_EQ(a.size(), b.size(), "intersect of slices of different rank");
  Slice out(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const int64_t lo = std::max(a[i].start, b[i].start);
    const int64_t hi = std::min(a[i].end(), b[i].end());
    if (hi <= lo) return std::nullopt;
    out[i] = Range{lo, hi - lo};
  }
  return out;
}

Status check_slice_within(const Slice& s, const Shape& global, std::string_view what) {
  if (s.size() != global.size()) {
    return invalid_argument("{}: slice {} has {} dimensions, the tensor {} has {}", what, slice_to_string(s),
                            s.size(), shape_to_string(global), global.size());
  }
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i].start < 0 || s[i].length < 0 || s[i].end() > global[i]) {
      return invalid_argument("{}: slice {} does not lie inside shape {} (dimension {})", what,
                              slice_to_string(s), shape_to_string(global), i);
    }
  }
  return ok_status();
}

void copy_region(const std::byte* src, const Slice& src_box, std::byte* dst, const Slice& dst_box,
                 const Slice& region, size_t element_size) {
  const size_t rank = region.size();
  TROUPE_CHECK(src_box.size() == rank && dst_box.size() == rank, "copy_region: rank mismatch");
  if (slice_numel(region) == 0) return;
  if (rank == 0) {
    std::memcpy(dst, src, element_size);
    return;
  }
  const Shape src_shape = slice_shape(src_box);
  const Shape dst_shape = slice_shape(dst_box);
  const Shape src_strides = contiguous_strides(src_shape);
  const Shape dst_strides = contiguous_strides(dst_shape);
  for (size_t i = 0; i < rank; ++i) {
    TROUPE_CHECK(region[i].start >= src_box[i].start && region[i].end() <= src_box[i].end() &&
                     region[i].start >= dst_box[i].start && region[i].end() <= dst_box[i].end(),
                 "copy_region: region {} outside src {} or dst {}", slice_to_string(region),
                 slice_to_string(src_box), slice_to_string(dst_box));
  }
  // Fold trailing dimensions that are whole in region, src and dst into one contiguous run.
  size_t inner = rank - 1;
  int64_t run = region[inner].length;
  while (inner > 0 && region[inner].length == src_shape[inner] && region[inner].length == dst_shape[inner]) {
    --inner;
    run *= region[inner].length;
  }
  const size_t run_bytes = static_cast<size_t>(run) * element_size;
  // Odometer over dimensions [0, inner), starting at region's origin.
  std::vector<int64_t> idx(inner, 0);
  for (;;) {
    int64_t src_off = 0, dst_off = 0;
    for (size_t d = 0; d <= inner; ++d) {
      const int64_t g = region[d].start + (d < inner ? idx[d] : 0);
      src_off += (g - src_box[d].start) * src_strides[d];
      dst_off += (g - dst_box[d].start) * dst_strides[d];
    }
    std::memcpy(dst + static_cast<size_t>(dst_off) * element_size,
                src + static_cast<size_t>(src_off) * element_size, run_bytes);
    size_t d = inner;
    while (d > 0) {
      --d;
      if (++idx[d] < region[d].length) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (inner == 0) return;
  }
}

}  // namespace troupe::checkpoint
