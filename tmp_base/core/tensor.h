// core/tensor.h — defines Shape, Storage (refcounted device memory) and Tensor (a typed,
// strided view of a Storage).
//
// Ownership: a Storage owns its bytes and returns them to its Allocator when the last
// Tensor referring to it goes away. Tensors are cheap to copy (they share storage);
// views (slice, view, transpose, narrow) share storage too. clone() copies.
// Thread safety: a Tensor may be read from several threads; writes need the caller's
// synchronisation, as with any buffer.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/check.h"
#include "core/dtype.h"

namespace troupe {

using Shape = std::vector<int64_t>;

std::string shape_to_string(const Shape& s);
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

class Storage {
 public:
  Storage(Allocator& alloc, size_t bytes);
  // Wraps memory owned elsewhere (no deallocation); `device` says where it lives.
  Storage(void* external, size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  Allocator* alloc_ = nullptr;  // null for external memory
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;  // undefined tensor: defined() is false

  // Uninitialised tensor from `alloc` (host by default).
  static Tensor empty(const Shape& shape, DType dtype, Allocator& alloc = cpu_allocator());
  // Zero-filled. On a non-CPU allocator the caller fills (kernels::fill) instead.
  static Tensor zeros(const Shape& shape, DType dtype, Allocator& alloc = cpu_allocator());
  // Host tensor holding a copy of `values` (converted to dtype).
  static Tensor from_floats(const Shape& shape, std::span<const float> values, DType dtype = DType::kF32);
  static Tensor from_ints(const Shape& shape, std::span<const int32_t> values);
  // View of external memory, not owned.
  static Tensor wrap(void* data, const Shape& shape, DType dtype, Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;
  int64_t offset() const { return offset_; }  // in elements

  // Raw pointer to element 0 of this view.
  void* data_ptr() const;
  template <typename T>
  T* data() const {
    TROUPE_CHECK(dtype_of_v<T> == dtype_, "data<{}>() on a {} tensor", dtype_name(dtype_of_v<T>),
                 dtype_name(dtype_));
    return static_cast<T*>(data_ptr());
  }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Views (share storage).
  Tensor view(const Shape& shape) const;  // contiguous only; one -1 allowed
  Tensor flatten() const { return view({numel()}); }
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;  // drops `dim`
  Tensor transpose(int64_t d0, int64_t d1) const;

  // Copies.
  Tensor clone(Allocator& alloc = cpu_allocator()) const;  // same device kind as alloc; host only here
  Tensor contiguous() const;                               // host: copy if not contiguous
  Tensor to_dtype(DType t) const;                          // host conversion
  // Host: copies `src` (same shape, any dtype, any strides) into this tensor.
  void copy_from(const Tensor& src);
  void fill(float value);  // host only

  // Host element access for tests and references (any float dtype read as float).
  float item(std::initializer_list<int64_t> index) const;
  std::vector<float> to_floats() const;  // host, any dtype, in logical order
  std::string describe() const;          // "f32[2, 3] cpu"

 private:
  std::shared_ptr<Storage> storage_;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;
  DType dtype_ = DType::kF32;
};

}  // namespace troupe
