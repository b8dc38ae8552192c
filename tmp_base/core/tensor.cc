// core/tensor.cc — Tensor views and host-side copies.
#include "core/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>

namespace troupe {

std::string shape_to_string(const Shape& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

Storage::Storage(Allocator& alloc, size_t bytes)
    : alloc_(&alloc), data_(alloc.allocate(bytes)), bytes_(bytes), device_(alloc.device()) {}

Storage::Storage(void* external, size_t bytes, Device device)
    : data_(external), bytes_(bytes), device_(device) {}

Storage::~Storage() {
  if (alloc_ != nullptr) alloc_->deallocate(data_, bytes_);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Allocator& alloc) {
  for (int64_t d : shape) TROUPE_CHECK_GE(d, 0, "negative dimension in {}", shape_to_string(shape));
  Tensor t;
  t.storage_ = std::make_shared<Storage>(alloc, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype));
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Allocator& alloc) {
  Tensor t = empty(shape, dtype, alloc);
  TROUPE_CHECK(alloc.device().is_cpu(), "Tensor::zeros on {}: use kernels::fill", alloc.device());
  if (t.nbytes() > 0) std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

Tensor Tensor::from_floats(const Shape& shape, std::span<const float> values, DType dtype) {
  TROUPE_CHECK_EQ(static_cast<int64_t>(values.size()), shape_numel(shape));
  Tensor t = empty(shape, dtype);
  convert_dtype(values.data(), DType::kF32, t.data_ptr(), dtype, values.size());
  return t;
}

Tensor Tensor::from_ints(const Shape& shape, std::span<const int32_t> values) {
  TROUPE_CHECK_EQ(static_cast<int64_t>(values.size()), shape_numel(shape));
  Tensor t = empty(shape, DType::kI32);
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * 4);
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.storage_ =
      std::make_shared<Storage>(data, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), device);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  TROUPE_CHECK(d >= 0 && d < dim(), "dim {} out of range for {}", d, describe());
  return shape_[static_cast<size_t>(d)];
}

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != acc) return false;
    acc *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  TROUPE_CHECK(defined(), "data_ptr() of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  TROUPE_CHECK(is_contiguous(), "view() of a non-contiguous tensor {}", describe());
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      TROUPE_CHECK_EQ(infer, -1, "two -1 in view shape");
      infer = static_cast<int64_t>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    TROUPE_CHECK(known > 0 && numel() % known == 0, "cannot view {} as {}", describe(),
                 shape_to_string(shape));
    s[static_cast<size_t>(infer)] = numel() / known;
  }
  TROUPE_CHECK_EQ(shape_numel(s), numel(), "cannot view {} as {}", describe(), shape_to_string(shape));
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  if (d < 0) d += dim();
  TROUPE_CHECK(d >= 0 && d < dim());
  TROUPE_CHECK(start >= 0 && length >= 0 && start + length <= shape_[d], "narrow({}, {}, {}) of {}", d, start,
               length, describe());
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = length;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  if (d < 0) d += dim();
  Tensor t = narrow(d, index, 1);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  if (d0 < 0) d0 += dim();
  if (d1 < 0) d1 += dim();
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

namespace {
// Calls f(src_elem_offset, linear_index) for every element in logical order.
template <typename F>
void for_each_index(const Shape& shape, const Shape& strides, F&& f) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  std::vector<int64_t> idx(shape.size(), 0);
  int64_t off = 0;
  for (int64_t lin = 0; lin < n; ++lin) {
    f(off, lin);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  TROUPE_CHECK(device().is_cpu() && src.device().is_cpu(), "copy_from is host-only here");
  TROUPE_CHECK(shape_ == src.shape_, "copy_from: shape {} vs {}", shape_to_string(shape_),
               shape_to_string(src.shape_));
  if (is_contiguous() && src.is_contiguous()) {
    convert_dtype(src.data_ptr(), src.dtype_, data_ptr(), dtype_, static_cast<size_t>(numel()));
    return;
  }
  const size_t ses = src.element_size(), des = element_size();
  const char* sb = static_cast<const char*>(src.data_ptr());
  char* db = static_cast<char*>(data_ptr());
  std::vector<int64_t> dst_offsets;
  dst_offsets.reserve(static_cast<size_t>(numel()));
  for_each_index(shape_, strides_, [&](int64_t off, int64_t) { dst_offsets.push_back(off); });
  for_each_index(src.shape_, src.strides_, [&](int64_t off, int64_t lin) {
    convert_dtype(sb + off * static_cast<int64_t>(ses), src.dtype_,
                  db + dst_offsets[lin] * static_cast<int64_t>(des), dtype_, 1);
  });
}

Tensor Tensor::clone(Allocator& alloc) const {
  Tensor t = empty(shape_, dtype_, alloc);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::contiguous() const {
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::to_dtype(DType type) const {
  Tensor t = empty(shape_, type);
  t.copy_from(*this);
  return t;
}

void Tensor::fill(float value) {
  TROUPE_CHECK(device().is_cpu(), "fill() is host-only; use kernels::fill on {}", device());
  Tensor one = from_floats({1}, std::span<const float>(&value, 1), dtype_);
  const size_t es = element_size();
  char* db = static_cast<char*>(data_ptr());
  for_each_index(shape_, strides_, [&](int64_t off, int64_t) {
    std::memcpy(db + off * static_cast<int64_t>(es), one.data_ptr(), es);
  });
}

float Tensor::item(std::initializer_list<int64_t> index) const {
  TROUPE_CHECK_EQ(static_cast<int64_t>(index.size()), dim());
  int64_t off = 0;
  size_t d = 0;
  for (int64_t i : index) {
    TROUPE_CHECK(i >= 0 && i < shape_[d], "index {} out of range in dim {} of {}", i, d, describe());
    off += i * strides_[d++];
  }
  float out;
  convert_dtype(static_cast<const char*>(data_ptr()) + off * static_cast<int64_t>(element_size()), dtype_,
                &out, DType::kF32, 1);
  return out;
}

std::vector<float> Tensor::to_floats() const {
  TROUPE_CHECK(device().is_cpu(), "to_floats() is host-only");
  std::vector<float> out(static_cast<size_t>(numel()));
  Tensor dst = wrap(out.data(), shape_, DType::kF32);
  dst.copy_from(*this);
  return out;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_to_string(shape_), device());
}

}  // namespace troupe
