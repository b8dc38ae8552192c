// tests/kernels/op_table_test.cc — runs every case of the op table on the CPU backend:
// forward against the double-precision reference, backward against central finite
// differences of that reference (in double), and checks that the table covers every op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <random>
#include <set>

#include "tests/kernels/op_table.h"

namespace troupe::kernels::testing {
namespace {

constexpr uint64_t kSeed = 20260521;
constexpr int64_t kMaxProbes = 48;  // finite-difference probes per input (random subset beyond)
constexpr double kStep = 1e-5;

const std::vector<OpCase>& cases() {
  static const std::vector<OpCase> kCases = all_op_cases(kSeed);
  return kCases;
}

Tensors upload_all(TestDevice& dev, const HostTensors& hs) {
  Tensors ts;
  for (const HostTensor& h : hs) ts.push_back(dev.upload(h));
  return ts;
}

double loss_of(const OpCase& c, const HostTensors& outputs, const HostTensors& douts) {
  double l = 0.0;
  for (size_t j = 0; j < c.loss_outputs.size(); ++j) {
    const HostTensor& o = outputs[static_cast<size_t>(c.loss_outputs[j])];
    for (int64_t i = 0; i < o.numel(); ++i) l += douts[j][i] * o[i];
  }
  return l;
}

std::vector<size_t> cases_with_backward() {
  std::vector<size_t> r;
  for (size_t i = 0; i < cases().size(); ++i)
    if (cases()[i].backward) r.push_back(i);
  return r;
}

class OpTableCpu : public ::testing::TestWithParam<size_t> {};
class OpTableCpuBackward : public ::testing::TestWithParam<size_t> {};

TEST_P(OpTableCpu, ForwardMatchesReference) {
  const OpCase& c = cases()[GetParam()];
  ASSERT_TRUE(c.forward && c.reference) << c.name;
  auto dev = make_cpu_test_device();
  const HostTensors got = c.forward(*dev, upload_all(*dev, c.inputs));
  const HostTensors want = c.reference(c.inputs);
  ASSERT_EQ(got.size(), want.size()) << c.name;
  for (size_t o = 0; o < want.size(); ++o) {
    const std::string err = compare(got[o], want[o], c.atol, c.rtol, fmt::format("{} output {}", c.name, o));
    EXPECT_TRUE(err.empty()) << err;
  }
}

TEST_P(OpTableCpuBackward, MatchesFiniteDifferences) {
  const OpCase& c = cases()[GetParam()];
  auto dev = make_cpu_test_device();
  const HostTensors outputs = c.reference(c.inputs);
  const HostTensors douts = make_douts(c, outputs, kSeed + GetParam());
  const HostTensors grads = c.backward(*dev, upload_all(*dev, c.inputs), upload_all(*dev, douts));
  ASSERT_EQ(grads.size(), c.grad_inputs.size()) << c.name;
  std::mt19937_64 gen(kSeed ^ GetParam());
  for (size_t g = 0; g < grads.size(); ++g) {
    const size_t input = static_cast<size_t>(c.grad_inputs[g]);
    const int64_t n = c.inputs[input].numel();
    HostTensor got = grads[g];
    ASSERT_EQ(got.shape, c.inputs[input].shape) << c.name << " gradient " << g;
    if (g < c.grad_init.size() && !c.grad_init[g].v.empty()) {
      for (int64_t i = 0; i < n; ++i) got[i] -= c.grad_init[g][i];
    }
    std::vector<int64_t> probes(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) probes[i] = i;
    if (n > kMaxProbes) {
      std::shuffle(probes.begin(), probes.end(), gen);
      probes.resize(kMaxProbes);
    }
    HostTensor got_probed = HostTensor::zeros({static_cast<int64_t>(probes.size())});
    HostTensor fd = HostTensor::zeros({static_cast<int64_t>(probes.size())});
    HostTensors x = c.inputs;
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
        compare(got_probed, fd, c.grad_atol, c.grad_rtol, fmt::format("{} d/d input {}", c.name, input));
    EXPECT_TRUE(err.empty()) << err;
  }
}

std::string case_test_name(const ::testing::TestParamInfo<size_t>& info) {
  std::string s = cases()[info.param].name;
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Cases, OpTableCpu, ::testing::Range<size_t>(0, cases().size()), case_test_name);
INSTANTIATE_TEST_SUITE_P(Cases, OpTableCpuBackward, ::testing::ValuesIn(cases_with_backward()), case_test_name);

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
  for (const std::string& op : forward_op_names()) EXPECT_TRUE(forward.count(op)) << op << " has no case";
  for (const std::string& op : backward_op_names()) {
    EXPECT_TRUE(backward.count(op)) << op << " is not checked against finite differences";
  }
}

}  // namespace
}  // namespace troupe::kernels::testing
