// tests/kernels/op_table_cuda_test.cc — runs every case of the op table on the CUDA
// backend and on the CPU backend with the same inputs (and the same upstream gradients)
// and compares the results within each case's cross-backend tolerance.
//
// Exits 77 (ctest: skipped) when no GPU is visible or the build has no CUDA backend.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <ostream>

#include "kernels/backend.h"
#include "tests/kernels/op_table.h"

#if defined(TROUPE_HAVE_CUDA)
#include "kernels/cuda/context.h"
#endif

namespace troupe::kernels::testing {
namespace {

constexpr uint64_t kSeed = 20260521;

#define TEST_CUDA_CHECK(call)                                                            \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    TROUPE_CHECK(err_ == cudaSuccess, "{} failed: {}", #call, cudaGetErrorString(err_)); \
  } while (0)

// Plain cudaMalloc/cudaFree device memory for test tensors (synchronous, simple).
class CudaTestAllocator final : public Allocator {
 public:
  explicit CudaTestAllocator(int device) : device_(device) {}
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    TEST_CUDA_CHECK(cudaMalloc(&p, bytes));
    in_use_ += bytes;
    return p;
  }
  void deallocate(void* p, size_t bytes) override {
    if (p == nullptr) return;
    TEST_CUDA_CHECK(cudaFree(p));
    in_use_ -= bytes;
  }
  Device device() const override { return Device::cuda(device_); }
  size_t bytes_in_use() const override { return in_use_; }
  size_t peak_bytes_in_use() const override { return in_use_; }
  void reset_peak() override {}

 private:
  int device_;
  size_t in_use_ = 0;
};

class CudaTestDevice final : public TestDevice {
 public:
  CudaTestDevice(Exec ex, Allocator& alloc) : ex_(ex), alloc_(alloc) {}
  const Exec& exec() const override { return ex_; }
  const char* name() const override { return "cuda"; }

  Tensor upload(const HostTensor& h, DType dtype) override {
    Tensor host = cpu_.upload(h, dtype);
    Tensor t = Tensor::empty(h.shape, dtype, alloc_);
    if (t.nbytes() > 0)
      TEST_CUDA_CHECK(cudaMemcpy(t.data_ptr(), host.data_ptr(), t.nbytes(), cudaMemcpyHostToDevice));
    return t;
  }

  HostTensor download(const Tensor& t) override {
    if (t.device().is_cpu()) return cpu_.download(t);
    TEST_CUDA_CHECK(cudaDeviceSynchronize());  // ops are asynchronous on the context's stream
    Tensor host = Tensor::empty(t.shape(), t.dtype());
    if (t.nbytes() > 0)
      TEST_CUDA_CHECK(cudaMemcpy(host.data_ptr(), t.data_ptr(), t.nbytes(), cudaMemcpyDeviceToHost));
    return cpu_.download(host);
  }

  Tensor poisoned(const Shape& shape, DType dtype) override {
    Tensor t = Tensor::empty(shape, dtype, alloc_);
    if (t.nbytes() > 0)
      TEST_CUDA_CHECK(cudaMemset(t.data_ptr(), dtype == DType::kI32 ? 0x7f : 0xff, t.nbytes()));
    return t;
  }

 private:
  Exec ex_;
  Allocator& alloc_;
  std::unique_ptr<TestDevice> cpu_holder_ = make_cpu_test_device();
  TestDevice& cpu_ = *cpu_holder_;
};

CudaTestDevice* g_cuda = nullptr;  // set by main() before the tests run

const std::vector<OpCase>& cases() {
  static const std::vector<OpCase> kCases = all_op_cases(kSeed);
  return kCases;
}

Tensors upload_all(TestDevice& dev, const HostTensors& hs) {
  Tensors ts;
  for (const HostTensor& h : hs) ts.push_back(dev.upload(h));
  return ts;
}

// The table runs with f32 float storage here, and again with bf16 storage for the cases
// that ask for it (cuda_bf16_storage); the CUDA backend's other bf16 paths are compared
// with the CPU backend by kernels_cuda_bf16_test.
std::vector<OpRun> runs(bool backward) {
  return op_runs(cases(), backward, [](const OpCase& c) { return c.cuda_bf16_storage; });
}

void expect_same(const OpCase& c, DType storage, const HostTensors& cuda, const HostTensors& cpu,
                 const char* what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << c.name;
  double atol = c.cross_atol, rtol = c.cross_rtol;
  if (storage == DType::kBF16) {
    atol = std::max(atol, kBf16Atol);
    rtol = std::max(rtol, kBf16Rtol);
  }
  for (size_t o = 0; o < cpu.size(); ++o) {
    const std::string err =
        compare(cuda[o], cpu[o], atol, rtol, fmt::format("{} {} {} (cuda vs cpu)", c.name, what, o));
    EXPECT_TRUE(err.empty()) << err;
  }
}

class OpTableCuda : public ::testing::TestWithParam<OpRun> {};
class OpTableCudaBackward : public ::testing::TestWithParam<OpRun> {};

// The first op of the case that the CUDA backend lacks ("" when it has them all). Every
// op must exist on CUDA: a missing one fails its case (checked before calling it, which
// would abort the whole test binary).
std::string missing_op(const OpCase& c) {
  for (const std::string& op : c.ops)
    if (!backend_implements(*cuda_backend(), op)) return op;
  return "";
}

TEST_P(OpTableCuda, ForwardMatchesCpu) {
  const OpCase& c = cases()[GetParam().index];
  const DType storage = GetParam().storage;
  ASSERT_EQ(missing_op(c), "") << c.name << ": this op is missing from the CUDA backend";
  auto cpu = make_cpu_test_device();
  cpu->set_float_storage(storage);
  g_cuda->set_float_storage(storage);  // every run sets it: the device is shared
  const HostTensors want = c.forward(*cpu, upload_inputs(*cpu, c, c.inputs));
  const HostTensors got = c.forward(*g_cuda, upload_inputs(*g_cuda, c, c.inputs));
  expect_same(c, storage, got, want, "output");
}

TEST_P(OpTableCudaBackward, MatchesCpu) {
  const OpCase& c = cases()[GetParam().index];
  const DType storage = GetParam().storage;
  ASSERT_EQ(missing_op(c), "") << c.name << ": this op is missing from the CUDA backend";
  auto cpu = make_cpu_test_device();
  cpu->set_float_storage(storage);
  g_cuda->set_float_storage(storage);  // every run sets it: the device is shared
  const HostTensors douts = make_douts(c, c.reference(c.inputs), kSeed + GetParam().index, storage);
  const HostTensors want = c.backward(*cpu, upload_inputs(*cpu, c, c.inputs), upload_all(*cpu, douts));
  const HostTensors got =
      c.backward(*g_cuda, upload_inputs(*g_cuda, c, c.inputs), upload_all(*g_cuda, douts));
  expect_same(c, storage, got, want, "gradient");
}

std::string run_name(const ::testing::TestParamInfo<OpRun>& info) {
  return op_run_name(info.param);
}

INSTANTIATE_TEST_SUITE_P(Cases, OpTableCuda, ::testing::ValuesIn(runs(false)), run_name);
INSTANTIATE_TEST_SUITE_P(Cases, OpTableCudaBackward, ::testing::ValuesIn(runs(true)), run_name);

}  // namespace
}  // namespace troupe::kernels::testing

int main(int argc, char** argv) {
  using namespace troupe::kernels;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device visible: skipping\n");
    return 77;
  }
  if (cuda_backend() == nullptr) {
    std::printf("this build has no CUDA backend: skipping\n");
    return 77;
  }
#if defined(TROUPE_HAVE_CUDA)
  ::testing::InitGoogleTest(&argc, argv);
  TEST_CUDA_CHECK(cudaSetDevice(0));
  CudaContext ctx(0, /*stream=*/nullptr);
  troupe::kernels::testing::CudaTestAllocator alloc(0);
  troupe::kernels::testing::CudaTestDevice dev(Exec{troupe::Device::cuda(0), &ctx}, alloc);
  troupe::kernels::testing::g_cuda = &dev;
  const int rc = RUN_ALL_TESTS();
  troupe::kernels::testing::g_cuda = nullptr;
  return rc;
#else
  (void)argc;
  (void)argv;
  return 77;
#endif
}
