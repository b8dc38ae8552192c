// tests/kernels/op_table_test.cc — runs every case of the op table on the CPU backend:
// forward against the double-precision reference, backward against central finite
// differences of that reference (in double), with f32 storage and again with bf16
// storage (float tensors held in bf16, the CUDA backend's activation format); and checks
// that the table covers every op.
#include "tests/kernels/op_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <ostream>
#include <random>
#include <set>

namespace troupe::kernels::testing {
namespace {

constexpr uint64_t kSeed = 20260521;
constexpr int64_t kMaxProbes = 48;  // finite-difference probes per input (random subset beyond)
constexpr double kStep = 1e-5;

const std::vector<OpCase>& cases() {
  static const std::vector<OpCase> kCases = all_op_cases(kSeed);
  return kCases;
}

// Every case with f32 storage, and with bf16 storage where the case allows it.
std::vector<OpRun> runs(bool backward) {
  std::vector<OpRun> r = op_runs(cases(), backward, [](const OpCase&) { return true; });
  if (backward) {
    std::erase_if(r, [](const OpRun& run) { return !cases()[run.index].cpu_finite_differences; });
  }
  return r;
}

std::string run_name(const ::testing::TestParamInfo<OpRun>& info) {
  return op_run_name(info.param);
}

std::pair<double, double> tolerances(double atol, double rtol, DType storage) {
  if (storage == DType::kBF16) return {std::max(atol, kBf16Atol), std::max(rtol, kBf16Rtol)};
  return {atol, rtol};
}

double loss_of(const OpCase& c, const HostTensors& outputs, const HostTensors& douts) {
  double l = 0.0;
  for (size_t j = 0; j < c.loss_outputs.size(); ++j) {
    const HostTensor& o = outputs[static_cast<size_t>(c.loss_outputs[j])];
    for (int64_t i = 0; i < o.numel(); ++i) l += douts[j][i] * o[i];
  }
  return l;
}

class OpTableCpu : public ::testing::TestWithParam<OpRun> {};
class OpTableCpuBackward : public ::testing::TestWithParam<OpRun> {};

TEST_P(OpTableCpu, ForwardMatchesReference) {
  const OpCase& c = cases()[GetParam().index];
  const DType storage = GetParam().storage;
  ASSERT_TRUE(c.forward && c.reference) << c.name;
  auto dev = make_cpu_test_device();
  dev->set_float_storage(storage);
  const HostTensors inputs = inputs_for_storage(c, storage);
  const HostTensors got = c.forward(*dev, upload_inputs(*dev, c, inputs));
  const HostTensors want = c.reference(inputs);
  ASSERT_EQ(got.size(), want.size()) << c.name;
  const auto [atol, rtol] = tolerances(c.atol, c.rtol, storage);
  for (size_t o = 0; o < want.size(); ++o) {
    const std::string err = compare(got[o], want[o], atol, rtol, fmt::format("{} output {}", c.name, o));
    EXPECT_TRUE(err.empty()) << err;
  }
}

TEST_P(OpTableCpuBackward, MatchesFiniteDifferences) {
  const OpCase& c = cases()[GetParam().index];
  const DType storage = GetParam().storage;
  auto dev = make_cpu_test_device();
  dev->set_float_storage(storage);
  const HostTensors inputs = inputs_for_storage(c, storage);
  const HostTensors douts = make_douts(c, c.reference(inputs), kSeed + GetParam().index, storage);
  Tensors dev_douts;
  for (const HostTensor& d : douts) dev_douts.push_back(dev->upload(d));
  const HostTensors grads = c.backward(*dev, upload_inputs(*dev, c, inputs), dev_douts);
  ASSERT_EQ(grads.size(), c.grad_inputs.size()) << c.name;
  const auto [atol, rtol] = tolerances(c.grad_atol, c.grad_rtol, storage);
  std::mt19937_64 gen(kSeed ^ GetParam().index);
  for (size_t g = 0; g < grads.size(); ++g) {
    const size_t input = static_cast<size_t>(c.grad_inputs[g]);
    const int64_t n = inputs[input].numel();
    HostTensor got = grads[g];
    ASSERT_EQ(got.shape, inputs[input].shape) << c.name << " gradient " << g;
    if (g < c.grad_init.size() && !c.grad_init[g].v.empty()) {
      // The accumulating buffer started from grad_init as the device stored it.
      const HostTensor init = round_for_storage(c.grad_init[g], storage);
      for (int64_t i = 0; i < n; ++i) got[i] -= init[i];
    }
    std::vector<int64_t> probes(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) probes[i] = i;
    if (n > kMaxProbes) {
      std::shuffle(probes.begin(), probes.end(), gen);
      probes.resize(kMaxProbes);
    }
    HostTensor got_probed = HostTensor::zeros({static_cast<int64_t>(probes.size())});
    HostTensor fd = HostTensor::zeros({static_cast<int64_t>(probes.size())});
    HostTensors x = inputs;
    for (size_t p = 0; p < probes.size(); ++p) {
      const int64_t i = probes[p];
      const double x0 = x[input][i];
      const double h = kStep * std::max(1.0, std::fabs(x0));
      x[input][i] = x0 + h;
      const double lp = loss_of(c, c.reference(x), douts);
      x[input][i] = x0 - h;
      const double lm = loss_of(c, c.reference(x), douts);
      x[input][i] = x0;
      fd[static_cast<int64_t>(p)] = (lp - lm) / (2 * h);
      got_probed[static_cast<int64_t>(p)] = got[i];
    }
    const std::string err =
        compare(got_probed, fd, atol, rtol, fmt::format("{} d/d input {}", c.name, input));
    EXPECT_TRUE(err.empty()) << err;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, OpTableCpu, ::testing::ValuesIn(runs(false)), run_name);
INSTANTIATE_TEST_SUITE_P(Cases, OpTableCpuBackward, ::testing::ValuesIn(runs(true)), run_name);

TEST(OpTable, CoversEveryOpForwardAndBackward) {
  std::set<std::string> forward, backward;
  std::set<std::string> names;
  for (const OpCase& c : cases()) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case name " << c.name;
    for (const std::string& op : c.ops) {
      forward.insert(op);
      if (c.backward) backward.insert(op);
    }
  }
  for (const std::string& op : forward) EXPECT_TRUE(backend_implements(cpu_backend(), op)) << op;
  for (const std::string& op : forward_op_names()) EXPECT_TRUE(forward.count(op)) << op << " has no case";
  for (const std::string& op : backward_op_names()) {
    EXPECT_TRUE(backward.count(op)) << op << " is not checked against finite differences";
  }
}

}  // namespace
}  // namespace troupe::kernels::testing
