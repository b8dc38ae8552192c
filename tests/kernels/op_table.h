// tests/kernels/op_table.h — the table of op test cases shared by every backend's test.
//
// An OpCase owns seeded host inputs and knows how to run its op on any TestDevice
// (forward, and backward when the op has one), returning host copies of the results. The
// CPU test (op_table_test.cc) checks forward results against the case's double-precision
// reference and backward results against central finite differences of that reference;
// the CUDA test (op_table_cuda_test.cc) runs the same cases on CUDA and compares with the
// CPU backend. A new op joins by adding cases in op_table.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/ops.h"

namespace troupe::kernels::testing {

// A host tensor in double precision: f32 values (already rounded to float, so that the
// double reference sees exactly what the device sees) or i32 values.
struct HostTensor {
  Shape shape;
  DType dtype = DType::kF32;  // kF32, kI32, or an fp8 dtype for quantized data
  std::vector<double> v;

  int64_t numel() const { return static_cast<int64_t>(v.size()); }
  double& operator[](int64_t i) { return v[static_cast<size_t>(i)]; }
  double operator[](int64_t i) const { return v[static_cast<size_t>(i)]; }
  static HostTensor zeros(const Shape& shape, DType dtype = DType::kF32);
  static HostTensor scalar(double x);
};

// Moves data between the host and one backend's device, and allocates outputs there.
class TestDevice {
 public:
  virtual ~TestDevice() = default;
  virtual const Exec& exec() const = 0;
  virtual const char* name() const = 0;
  // The dtype of float tensors a case does not type explicitly: f32, or bf16 to run the
  // table on bf16 storage (the CUDA backend's activation format).
  DType float_storage() const { return float_storage_; }
  void set_float_storage(DType t) { float_storage_ = t; }

  // A device tensor holding `h` converted to `dtype` (default: h.dtype, with f32 meaning
  // float_storage()).
  virtual Tensor upload(const HostTensor& h, DType dtype) = 0;
  Tensor upload(const HostTensor& h) { return upload(h, h.dtype == DType::kF32 ? float_storage_ : h.dtype); }
  // Host copy of a device (or host) tensor.
  virtual HostTensor download(const Tensor& t) = 0;
  // An output tensor filled with poison (NaN for floats, 0x7f7f7f7f for i32), so that an
  // element the op forgets to write fails the comparison.
  virtual Tensor poisoned(const Shape& shape, DType dtype) = 0;
  Tensor poisoned(const Shape& shape) { return poisoned(shape, float_storage_); }

 private:
  DType float_storage_ = DType::kF32;
};

// The CPU backend's TestDevice.
std::unique_ptr<TestDevice> make_cpu_test_device();

using HostTensors = std::vector<HostTensor>;
using Tensors = std::vector<Tensor>;

struct OpCase {
  std::string name;              // unique, e.g. "matmul/tn/b3"
  std::vector<std::string> ops;  // the ops.h functions it exercises
  HostTensors inputs;
  // Inputs that stay f32 under bf16 storage (the op requires f32 there, e.g. a router bias).
  std::vector<int> f32_inputs;
  // Whether the case also runs with bf16 float storage (see TestDevice::float_storage).
  bool bf16_storage = true;
  // Whether the CUDA test also runs it with bf16 storage on both backends (tolerances
  // widened as for bf16 against the reference); other cases' bf16 kernels are compared with
  // the CPU backend by kernels_cuda_bf16_test.
  bool cuda_bf16_storage = false;

  // Runs the op on `dev` with `in` (uploads of `inputs`); returns host copies of outputs.
  std::function<HostTensors(TestDevice& dev, const Tensors& in)> forward;
  // The double-precision reference of forward (null where none is meaningful).
  std::function<HostTensors(const HostTensors& in)> reference;
  double atol = 1e-5, rtol = 1e-4;  // forward vs reference

  // Backward, when the op has one. The scalar loss is L = sum over o in loss_outputs of
  // dot(dout_o, forward(in)[o]); backward returns dL/d inputs[i] for i in grad_inputs.
  std::vector<int> grad_inputs;
  std::vector<int> loss_outputs;
  // When set, every dout is this constant instead of random (ops whose backward takes a
  // scalar upstream gradient, like cross-entropy's grad_scale).
  double uniform_dout = 0.0;
  std::function<HostTensors(TestDevice& dev, const Tensors& in, const Tensors& douts)> backward;
  // Per gradient: the initial contents of an accumulating gradient buffer (empty = none);
  // the harness subtracts it before comparing.
  HostTensors grad_init;
  double grad_atol = 2e-4, grad_rtol = 2e-3;  // backward vs finite differences
  // Whether the CPU test probes this backward by finite differences. Off for cases sized for
  // another backend's kernels (rows enough to give a CUDA block several): their reference
  // is too slow to probe, and a smaller case checks the same arithmetic; the CUDA test still
  // compares their backward with the CPU backend's.
  bool cpu_finite_differences = true;

  // Tolerances of another backend against the CPU backend.
  double cross_atol = 2e-3, cross_rtol = 2e-2;
};

// Every case of every op, with inputs drawn from `seed`.
std::vector<OpCase> all_op_cases(uint64_t seed);

// Names of every op of kernels/ops.h with a forward role and with a backward role, for
// the coverage check.
const std::vector<std::string>& forward_op_names();
const std::vector<std::string>& backward_op_names();

// Whether backend `b` has the entry op `op` runs on (matmul_backward runs on matmul).
// Aborts on a name that is no op of kernels/ops.h.
bool backend_implements(const Backend& b, const std::string& op);

// Compares got against want elementwise (|got - want| <= atol + rtol |want|, exact for
// integer dtypes; NaN never passes). Returns "" on success, else a description of the
// first mismatches.
std::string compare(const HostTensor& got, const HostTensor& want, double atol, double rtol,
                    const std::string& what);

// Random upstream gradients (or the uniform constant) for a case's loss outputs, rounded
// to `storage` (f32 or bf16) so that the reference sees exactly what the device does.
HostTensors make_douts(const OpCase& c, const HostTensors& outputs, uint64_t seed,
                       DType storage = DType::kF32);

// `h` as a device with float storage `storage` holds it (rounded to bf16 when bf16).
HostTensor round_for_storage(HostTensor h, DType storage);

// The case's inputs as a device with float storage `storage` sees them: float inputs
// (other than f32_inputs) rounded to bf16 when storage is bf16.
HostTensors inputs_for_storage(const OpCase& c, DType storage);

// Uploads every input of a case (f32_inputs as f32, other float inputs in the device's
// float storage, integer inputs as they are).
Tensors upload_inputs(TestDevice& dev, const OpCase& c, const HostTensors& inputs);

// One case of the table under one float storage: the parameter of the table's test suites.
struct OpRun {
  size_t index;  // into the table the runs were made from
  DType storage;
  std::string case_name;
};
// How gtest prints a run in failure messages.
void PrintTo(const OpRun& r, std::ostream* os);
// The runs of `table`: every case with f32 storage, then with bf16 storage the cases that
// allow it (OpCase::bf16_storage) and pass `with_bf16`; only cases with a backward when
// `backward` is set.
std::vector<OpRun> op_runs(const std::vector<OpCase>& table, bool backward,
                           const std::function<bool(const OpCase&)>& with_bf16);
// A run's test name: the case's name ("/bf16" appended for bf16 storage), every other
// character than a letter or digit replaced by '_'.
std::string op_run_name(const OpRun& r);

// Tolerances widened for bf16 storage (outputs rounded to 8 significant bits).
inline constexpr double kBf16Atol = 2e-2;
inline constexpr double kBf16Rtol = 2e-2;

}  // namespace troupe::kernels::testing
