// checkpoint/slice.h — defines Range and Slice (a box of index ranges inside a global
// tensor), their intersection, and copy_region, the N-d strided copy that moves the
// overlap of two boxes from one contiguous buffer into another.
//
// Resharding is built on this: a stored slice and a requested slice are both boxes in
// the same global index space; whatever they share is copied, element for element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace troupe::checkpoint {

// [start, start + length) along one dimension.
struct Range {
  int64_t start = 0;
  int64_t length = 0;
  int64_t end() const { return start + length; }
  friend bool operator==(const Range&, const Range&) = default;
};

// One Range per dimension; a 0-d tensor (scalar) has an empty Slice.
using Slice = std::vector<Range>;

Slice full_slice(const Shape& shape);
Shape slice_shape(const Slice& s);
int64_t slice_numel(const Slice& s);
// "[0:4, 2:6]" (half-open, start:end).
std::string slice_to_string(const Slice& s);

// The common box of a and b (same rank), or nullopt when they share no element.
std::optional<Slice> intersect(const Slice& a, const Slice& b);

// OK when `s` has the rank of `global` and lies inside it; otherwise InvalidArgument
// naming `what` (e.g. the tensor name).
Status check_slice_within(const Slice& s, const Shape& global, std::string_view what);

// Copies the elements of `region` (global coordinates; must lie inside both boxes) from
// `src`, a row-major buffer holding box `src_box`, into `dst`, a row-major buffer holding
// box `dst_box`. Trailing dimensions that are whole in both boxes are copied as one run.
void copy_region(const std::byte* src, const Slice& src_box, std::byte* dst, const Slice& dst_box,
                 const Slice& region, size_t element_size);

}  // namespace troupe::checkpoint
