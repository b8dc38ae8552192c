// tests/kernels/op_table.cc — the op test cases (inputs, how to run each op on a
// TestDevice, double-precision references), the CPU TestDevice, and comparison helpers.
//
// The references here are written independently of kernels/cpu/: plain loops in double,
// following the formulas of kernels/ops.h.
#include "tests/kernels/op_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>

namespace troupe::kernels::testing {

// ---- HostTensor, CPU TestDevice, comparison ------------------------------------------

HostTensor HostTensor::zeros(const Shape& shape, DType dtype) {
  return HostTensor{shape, dtype, std::vector<double>(static_cast<size_t>(shape_numel(shape)), 0.0)};
}

HostTensor HostTensor::scalar(double x) {
  return HostTensor{{1}, DType::kF32, {x}};
}

namespace {

class CpuTestDevice final : public TestDevice {
 public:
  const Exec& exec() const override { return ex_; }
  const char* name() const override { return "cpu"; }

  Tensor upload(const HostTensor& h, DType dtype) override {
    Tensor t = Tensor::empty(h.shape, dtype);
    if (dtype == DType::kI32) {
      int32_t* p = t.data<int32_t>();
      for (int64_t i = 0; i < h.numel(); ++i) p[i] = static_cast<int32_t>(h[i]);
      return t;
    }
    std::vector<float> f(h.v.begin(), h.v.end());
    if (!f.empty()) convert_dtype(f.data(), DType::kF32, t.data_ptr(), dtype, f.size());
    return t;
  }

  HostTensor download(const Tensor& t) override {
    TROUPE_CHECK(t.device().is_cpu(), "CpuTestDevice::download of {}", t.describe());
    HostTensor h{t.shape(), t.dtype() == DType::kI32 ? DType::kI32 : DType::kF32, {}};
    h.v.resize(static_cast<size_t>(t.numel()));
    if (t.dtype() == DType::kI32) {
      const int32_t* p = t.data<int32_t>();
      for (int64_t i = 0; i < t.numel(); ++i) h[i] = p[i];
    } else if (t.numel() > 0) {
      std::vector<float> f = t.to_floats();
      for (int64_t i = 0; i < t.numel(); ++i) h[i] = f[static_cast<size_t>(i)];
    }
    return h;
  }

  Tensor poisoned(const Shape& shape, DType dtype) override {
    Tensor t = Tensor::empty(shape, dtype);
    if (t.nbytes() > 0) std::memset(t.data_ptr(), dtype == DType::kI32 ? 0x7f : 0xff, t.nbytes());
    return t;
  }

 private:
  Exec ex_ = Exec::cpu();
};

}  // namespace

std::unique_ptr<TestDevice> make_cpu_test_device() {
  return std::make_unique<CpuTestDevice>();
}

std::string compare(const HostTensor& got, const HostTensor& want, double atol, double rtol,
                    const std::string& what) {
  if (got.shape != want.shape) {
    return fmt::format("{}: shape {} vs expected {}", what, shape_to_string(got.shape),
                       shape_to_string(want.shape));
  }
  const bool exact = want.dtype == DType::kI32;
  std::string msg;
  int bad = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = got[i], w = want[i];
    const double tol = exact ? 0.0 : atol + rtol * std::fabs(w);
    const double err = std::fabs(g - w);
    if (!(err <= tol) && g != w) {  // NaN fails; equal infinities match
      if (bad < 5)
        msg += fmt::format("\n  {}[{}] = {:.9g}, expected {:.9g} (tol {:.3g})", what, i, g, w, tol);
      ++bad;
      if (!(err <= worst)) worst = err;
    }
  }
  if (bad == 0) return "";
  return fmt::format("{}: {} of {} elements differ (worst |diff| {:.3g}){}", what, bad, want.numel(), worst,
                     msg);
}

namespace {
double round_to(double x, DType storage) {
  const float f = static_cast<float>(x);
  return storage == DType::kBF16 ? bf16_bits_to_float(float_to_bf16_bits(f)) : f;
}
}  // namespace

HostTensors make_douts(const OpCase& c, const HostTensors& outputs, uint64_t seed, DType storage) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  HostTensors douts;
  for (int o : c.loss_outputs) {
    HostTensor d = HostTensor::zeros(outputs[static_cast<size_t>(o)].shape);
    for (double& x : d.v) x = round_to(c.uniform_dout != 0.0 ? c.uniform_dout : u(gen), storage);
    douts.push_back(std::move(d));
  }
  return douts;
}

HostTensor round_for_storage(HostTensor h, DType storage) {
  if (h.dtype == DType::kF32)
    for (double& x : h.v) x = round_to(x, storage);
  return h;
}

HostTensors inputs_for_storage(const OpCase& c, DType storage) {
  HostTensors in = c.inputs;
  for (size_t i = 0; i < in.size(); ++i) {
    const bool keep =
        std::find(c.f32_inputs.begin(), c.f32_inputs.end(), static_cast<int>(i)) != c.f32_inputs.end();
    if (!keep) in[i] = round_for_storage(std::move(in[i]), storage);
  }
  return in;
}

Tensors upload_inputs(TestDevice& dev, const OpCase& c, const HostTensors& inputs) {
  Tensors ts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool keep =
        std::find(c.f32_inputs.begin(), c.f32_inputs.end(), static_cast<int>(i)) != c.f32_inputs.end();
    ts.push_back(keep ? dev.upload(inputs[i], DType::kF32) : dev.upload(inputs[i]));
  }
  return ts;
}

const std::vector<std::string>& forward_op_names() {
  static const std::vector<std::string> kNames = {
      "fill", "cast", "add", "axpby", "scale", "sum", "sum_squares", "sum_rows", "matmul", "grouped_matmul",
      "embedding_forward", "rmsnorm_forward", "rope_forward", "attention_forward", "softmax_forward",
      "router_forward", "logsumexp_forward", "moe_dispatch_plan", "moe_permute", "moe_unpermute",
      "swiglu_forward", "cross_entropy_forward", "cross_entropy_forward_backward", "adamw_step",
      "adamw_step_multi", "sum_squares_multi", "master_split", "master_join", "quantize_fp8",
      "dequantize_fp8",
      // device-resident step statistics
      "sum_squares_into",
      // communication codecs
      "moe_permute_fp8", "sum_chunks"};
  return kNames;
}

const std::vector<std::string>& backward_op_names() {
  static const std::vector<std::string> kNames = {
      "matmul_backward",       "grouped_matmul_backward", "embedding_backward",     "rmsnorm_backward",
      "rope_backward",         "attention_backward",      "softmax_backward",       "router_backward",
      "logsumexp_backward",    "moe_permute_backward",    "moe_unpermute_backward", "swiglu_backward",
      "cross_entropy_backward"};
  return kNames;
}

bool backend_implements(const Backend& b, const std::string& op) {
#define TROUPE_OP_ENTRY(name)                                   \
  {                                                             \
#name, [](const Backend& be) { return be.name != nullptr; } \
  }
  static const std::vector<std::pair<std::string, bool (*)(const Backend&)>> kEntries = {
      TROUPE_OP_ENTRY(fill),
      TROUPE_OP_ENTRY(cast),
      TROUPE_OP_ENTRY(add),
      TROUPE_OP_ENTRY(axpby),
      TROUPE_OP_ENTRY(scale),
      TROUPE_OP_ENTRY(sum),
      TROUPE_OP_ENTRY(sum_squares),
      TROUPE_OP_ENTRY(sum_rows),
      TROUPE_OP_ENTRY(matmul),
      {"matmul_backward", [](const Backend& be) { return be.matmul != nullptr; }},
      TROUPE_OP_ENTRY(grouped_matmul),
      TROUPE_OP_ENTRY(grouped_matmul_backward),
      TROUPE_OP_ENTRY(embedding_forward),
      TROUPE_OP_ENTRY(embedding_backward),
      TROUPE_OP_ENTRY(rmsnorm_forward),
      TROUPE_OP_ENTRY(rmsnorm_backward),
      TROUPE_OP_ENTRY(rope_forward),
      TROUPE_OP_ENTRY(rope_backward),
      TROUPE_OP_ENTRY(attention_forward),
      TROUPE_OP_ENTRY(attention_backward),
      TROUPE_OP_ENTRY(softmax_forward),
      TROUPE_OP_ENTRY(softmax_backward),
      TROUPE_OP_ENTRY(router_forward),
      TROUPE_OP_ENTRY(router_backward),
      TROUPE_OP_ENTRY(logsumexp_forward),
      TROUPE_OP_ENTRY(logsumexp_backward),
      TROUPE_OP_ENTRY(moe_dispatch_plan),
      TROUPE_OP_ENTRY(moe_permute),
      TROUPE_OP_ENTRY(moe_permute_backward),
      TROUPE_OP_ENTRY(moe_unpermute),
      TROUPE_OP_ENTRY(moe_unpermute_backward),
      TROUPE_OP_ENTRY(swiglu_forward),
      TROUPE_OP_ENTRY(swiglu_backward),
      TROUPE_OP_ENTRY(cross_entropy_forward),
      TROUPE_OP_ENTRY(cross_entropy_backward),
      TROUPE_OP_ENTRY(cross_entropy_forward_backward),
      TROUPE_OP_ENTRY(adamw_step),
      TROUPE_OP_ENTRY(adamw_step_multi),
      TROUPE_OP_ENTRY(sum_squares_multi),
      TROUPE_OP_ENTRY(master_split),
      TROUPE_OP_ENTRY(master_join),
      TROUPE_OP_ENTRY(quantize_fp8),
      TROUPE_OP_ENTRY(dequantize_fp8),
      // device-resident step statistics
      TROUPE_OP_ENTRY(sum_squares_into),
      // ---- communication codecs ----
      TROUPE_OP_ENTRY(moe_permute_fp8),
      TROUPE_OP_ENTRY(sum_chunks),
  };
#undef TROUPE_OP_ENTRY
  for (const auto& [name, has] : kEntries)
    if (name == op) return has(b);
  TROUPE_UNREACHABLE("'{}' is no op of kernels/ops.h", op);
}

// ---- case building helpers -----------------------------------------------------------

namespace {

double as_f32(double x) {
  return static_cast<double>(static_cast<float>(x));
}
double as_bf16(double x) {
  return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(x)));
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  // Uniform in [lo, hi), rounded to f32.
  HostTensor uniform(const Shape& s, double lo = -1.0, double hi = 1.0) {
    HostTensor h = HostTensor::zeros(s);
    std::uniform_real_distribution<double> u(lo, hi);
    for (double& x : h.v) x = as_f32(u(gen_));
    return h;
  }
  // Integers in [lo, hi).
  HostTensor ints(const Shape& s, int64_t lo, int64_t hi) {
    HostTensor h = HostTensor::zeros(s, DType::kI32);
    for (double& x : h.v) x = static_cast<double>(lo + below(hi - lo));
    return h;
  }
  int64_t below(int64_t n) {
    return static_cast<int64_t>(std::uniform_int_distribution<uint64_t>(0, n - 1)(gen_));
  }
  std::mt19937_64& gen() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// Offsets [E+1] of segments with the given row counts.
HostTensor offsets_of(const std::vector<int64_t>& counts) {
  HostTensor o = HostTensor::zeros({static_cast<int64_t>(counts.size()) + 1}, DType::kI32);
  for (size_t e = 0; e < counts.size(); ++e) o.v[e + 1] = o.v[e] + static_cast<double>(counts[e]);
  return o;
}

// topk_idx [T,k] with k distinct experts per token drawn from the first `used` experts.
HostTensor random_topk(Rng& rng, int64_t tokens, int64_t k, int64_t used) {
  HostTensor idx = HostTensor::zeros({tokens, k}, DType::kI32);
  std::vector<int64_t> perm(static_cast<size_t>(used));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < used; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    for (int64_t j = 0; j < k; ++j) idx[t * k + j] = static_cast<double>(perm[j]);
  }
  return idx;
}

// Reference dispatch plan, computed expert by expert: expert e's kept copies are its
// first `capacity` (token, choice) copies in order, placed after all earlier experts'.
// Returns {row_map [T*k], counts [E], offsets [E+1]}.
HostTensors reference_plan(const HostTensor& topk, int64_t experts, int64_t capacity) {
  const int64_t copies = topk.numel();
  HostTensor rows = HostTensor::zeros({copies}, DType::kI32);
  HostTensor counts = HostTensor::zeros({experts}, DType::kI32);
  HostTensor offsets = HostTensor::zeros({experts + 1}, DType::kI32);
  for (double& r : rows.v) r = -1;
  int64_t next_row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    offsets[e] = static_cast<double>(next_row);
    int64_t kept = 0;
    for (int64_t c = 0; c < copies; ++c) {
      if (static_cast<int64_t>(topk[c]) != e) continue;
      if (capacity >= 0 && kept >= capacity) continue;
      rows[c] = static_cast<double>(next_row++);
      ++kept;
    }
    counts[e] = static_cast<double>(kept);
  }
  offsets[experts] = static_cast<double>(next_row);
  return {rows, counts, offsets};
}

std::string shape_tag(const Shape& s) {
  std::string r;
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "x" : "") + std::to_string(s[i]);
  return r;
}

// ---- memory and elementwise ----------------------------------------------------------

void add_elementwise_cases(std::vector<OpCase>& cases, Rng& rng) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    OpCase c;
    c.name = fmt::format("fill/{}", dtype_name(dt));
    c.ops = {"fill"};
    c.bf16_storage = false;                                    // the dtypes are the subject of the case
    const double value = dt == DType::kI32 ? 7.0 : 0.3671875;  // exact in bf16
    c.forward = [dt, value](TestDevice& dev, const Tensors&) {
      Tensor out = dev.poisoned({7, 5}, dt);
      fill(dev.exec(), out, static_cast<float>(value));
      return HostTensors{dev.download(out)};
    };
    c.reference = [dt, value](const HostTensors&) {
      HostTensor r = HostTensor::zeros({7, 5}, dt == DType::kI32 ? DType::kI32 : DType::kF32);
      for (double& x : r.v) x = value;
      return HostTensors{r};
    };
    cases.push_back(std::move(c));
  }
  // cast: f32 -> each narrower float type (read back as f32), and bf16 -> f32.
  struct CastSpec {
    DType from, to;
    double atol, rtol;
  };
  for (CastSpec s : {CastSpec{DType::kF32, DType::kBF16, 0.0, 1.0 / 256},
                     CastSpec{DType::kF32, DType::kF16, 1e-7, 1.0 / 2048},
                     CastSpec{DType::kF32, DType::kF8E4M3, 1.0 / 1024, 1.0 / 16},
                     CastSpec{DType::kF32, DType::kF8E5M2, 1.0 / 65536, 1.0 / 8},
                     CastSpec{DType::kBF16, DType::kF32, 0.0, 0.0}}) {
    OpCase c;
    c.name = fmt::format("cast/{}->{}", dtype_name(s.from), dtype_name(s.to));
    c.ops = {"cast"};
    c.bf16_storage = false;  // the dtypes are the subject of the case
    HostTensor x = rng.uniform({6, 11});
    if (s.from == DType::kBF16)
      for (double& v : x.v) v = as_bf16(v);  // representable: the cast must be exact
    c.inputs = {x};
    c.forward = [s, x](TestDevice& dev, const Tensors&) {
      Tensor src = dev.upload(x, s.from);
      Tensor dst = dev.poisoned(x.shape, s.to);
      cast(dev.exec(), src, dst);
      return HostTensors{dev.download(dst)};
    };
    c.reference = [](const HostTensors& in) { return HostTensors{in[0]}; };
    c.atol = s.atol;
    c.rtol = s.rtol;
    cases.push_back(std::move(c));
  }
  for (bool alias : {false, true}) {
    OpCase c;
    c.name = alias ? "add/out=a" : "add";
    c.ops = {"add"};
    c.inputs = {rng.uniform({5, 7}), rng.uniform({5, 7})};
    c.forward = [alias](TestDevice& dev, const Tensors& in) {
      Tensor a = dev.upload(dev.download(in[0]));  // a fresh copy: the op may write it
      Tensor out = alias ? a : dev.poisoned(a.shape());
      add(dev.exec(), a, in[1], out);
      return HostTensors{dev.download(out)};
    };
    c.reference = [](const HostTensors& in) {
      HostTensor r = in[0];
      for (int64_t i = 0; i < r.numel(); ++i) r[i] = in[0][i] + in[1][i];
      return HostTensors{r};
    };
    cases.push_back(std::move(c));
  }
  for (float beta : {-1.25f, 0.0f}) {
    OpCase c;
    c.name = fmt::format("axpby/beta={}", beta);
    c.ops = {"axpby"};
    c.inputs = {rng.uniform({33}), rng.uniform({33})};
    const float alpha = 0.75f;
    c.forward = [alpha, beta](TestDevice& dev, const Tensors& in) {
      // beta == 0 must ignore y's old contents, so y starts poisoned then.
      Tensor y = beta == 0.0f ? dev.poisoned({33}) : dev.upload(dev.download(in[1]));
      axpby(dev.exec(), alpha, in[0], beta, y);
      return HostTensors{dev.download(y)};
    };
    c.reference = [alpha, beta](const HostTensors& in) {
      HostTensor r = in[1];
      for (int64_t i = 0; i < r.numel(); ++i)
        r[i] = alpha * in[0][i] + (beta == 0.0f ? 0.0 : beta * in[1][i]);
      return HostTensors{r};
    };
    cases.push_back(std::move(c));
  }
  {
    OpCase c;
    c.name = "scale";
    c.ops = {"scale"};
    c.inputs = {rng.uniform({4, 9})};
    c.forward = [](TestDevice& dev, const Tensors& in) {
      Tensor x = dev.upload(dev.download(in[0]));
      scale(dev.exec(), x, -1.5f);
      return HostTensors{dev.download(x)};
    };
    c.reference = [](const HostTensors& in) {
      HostTensor r = in[0];
      for (double& v : r.v) v *= -1.5;
      return HostTensors{r};
    };
    cases.push_back(std::move(c));
  }
  for (const Shape& s : {Shape{1000}, Shape{3, 17}}) {
    OpCase c;
    c.name = "sum,sum_squares/" + shape_tag(s);
    c.ops = {"sum", "sum_squares"};
    c.inputs = {rng.uniform(s, -2.0, 3.0)};
    c.forward = [](TestDevice& dev, const Tensors& in) {
      return HostTensors{HostTensor::scalar(sum(dev.exec(), in[0])),
                         HostTensor::scalar(sum_squares(dev.exec(), in[0]))};
    };
    c.reference = [](const HostTensors& in) {
      double s1 = 0.0, s2 = 0.0;
      for (double v : in[0].v) {
        s1 += v;
        s2 += v * v;
      }
      return HostTensors{HostTensor::scalar(s1), HostTensor::scalar(s2)};
    };
    c.atol = 1e-9;
    c.rtol = 1e-9;  // both accumulate in double
    cases.push_back(std::move(c));
  }
  for (bool accumulate : {false, true}) {
    OpCase c;
    c.name = accumulate ? "sum_rows/accumulate" : "sum_rows";
    c.ops = {"sum_rows"};
    c.inputs = {rng.uniform({9, 6}), rng.uniform({6})};
    c.forward = [accumulate](TestDevice& dev, const Tensors& in) {
      Tensor out = accumulate ? dev.upload(dev.download(in[1])) : dev.poisoned({6});
      sum_rows(dev.exec(), in[0], out, accumulate);
      return HostTensors{dev.download(out)};
    };
    c.reference = [accumulate](const HostTensors& in) {
      HostTensor r = HostTensor::zeros({6});
      for (int64_t i = 0; i < 9; ++i)
        for (int64_t j = 0; j < 6; ++j) r[j] += in[0][i * 6 + j];
      if (accumulate)
        for (int64_t j = 0; j < 6; ++j) r[j] += in[1][j];
      return HostTensors{r};
    };
    cases.push_back(std::move(c));
  }
}

// ---- matmul ----------------------------------------------------------------------------

struct MatmulSpec {
  int64_t batch;  // 0: 2-D
  bool b_shared;  // batched a with a 2-D b
  int64_t m, k, n;
  bool ta, tb;
  float alpha, beta;
  bool accumulate_grads;
  bool a_shared = false;  // a 2-D a with a batched b
};

HostTensor reference_matmul(const HostTensor& a, const HostTensor& b, const HostTensor* c0,
                            const MatmulSpec& s) {
  const int64_t batches = std::max<int64_t>(s.batch, 1);
  HostTensor out = HostTensor::zeros(s.batch ? Shape{s.batch, s.m, s.n} : Shape{s.m, s.n});
  for (int64_t bi = 0; bi < batches; ++bi) {
    const int64_t ao = s.a_shared ? 0 : bi * s.m * s.k, bo = s.b_shared ? 0 : bi * s.k * s.n;
    const int64_t oo = bi * s.m * s.n;
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        double acc = 0.0;
        for (int64_t kk = 0; kk < s.k; ++kk) {
          const double av = s.ta ? a[ao + kk * s.m + i] : a[ao + i * s.k + kk];
          const double bv = s.tb ? b[bo + j * s.k + kk] : b[bo + kk * s.n + j];
          acc += av * bv;
        }
        out[oo + i * s.n + j] = s.alpha * acc + (c0 ? s.beta * (*c0)[oo + i * s.n + j] : 0.0);
      }
    }
  }
  return out;
}

void add_matmul_cases(std::vector<OpCase>& cases, Rng& rng) {
  std::vector<MatmulSpec> specs;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) specs.push_back({0, false, 5, 7, 3, ta, tb, 1.0f, 0.0f, false});
  specs.push_back({0, false, 1, 1, 1, false, false, 1.0f, 0.0f, false});
  // Past the CPU kernel's 4-row and 256-column tiles, with ragged last tiles.
  specs.push_back({0, false, 7, 5, 300, false, false, 1.0f, 0.0f, false});
  specs.push_back({2, true, 6, 3, 260, true, true, 1.0f, 0.0f, false});
  specs.push_back({0, false, 8, 16, 12, false, true, 1.0f, 0.0f, true});
  specs.push_back({0, false, 4, 6, 5, true, false, 0.5f, -2.0f, false});  // alpha, beta: forward only
  specs.push_back({3, false, 4, 5, 6, false, false, 1.0f, 0.0f, false});
  specs.push_back({2, false, 3, 4, 5, true, true, 1.0f, 0.0f, true});
  specs.push_back({3, true, 4, 5, 6, false, false, 1.0f, 0.0f, false});
  specs.push_back({2, true, 3, 4, 5, true, false, 1.0f, 0.0f, true});
  specs.push_back({2, true, 3, 4, 5, false, true, 1.5f, 1.0f, false});
  // One a for several b (Q, K and V of one input; their weight gradients, a transposed and
  // accumulated).
  specs.push_back({3, false, 4, 5, 6, false, false, 1.0f, 0.0f, false, true});
  specs.push_back({3, false, 4, 5, 6, true, false, 1.0f, 0.0f, true, true});
  specs.push_back({2, false, 3, 4, 5, false, true, 1.0f, 0.0f, true, true});
  specs.push_back({2, false, 7, 3, 260, true, true, 1.0f, 0.0f, false, true});
  specs.push_back({2, false, 3, 4, 5, true, false, 0.5f, 1.0f, false, true});
  for (const MatmulSpec& s : specs) {
    OpCase c;
    c.name =
        fmt::format("matmul/{}{}{}/batch{}/m{}k{}n{}{}{}", s.ta ? 't' : 'n', s.tb ? 't' : 'n',
                    s.b_shared ? "/shared_b" : (s.a_shared ? "/shared_a" : ""), s.batch, s.m, s.k, s.n,
                    s.beta != 0.0f || s.alpha != 1.0f ? fmt::format("/alpha{}beta{}", s.alpha, s.beta) : "",
                    s.accumulate_grads ? "/accumulate" : "");
    c.ops = {"matmul"};
    const Shape a_shape = s.ta ? Shape{s.k, s.m} : Shape{s.m, s.k};
    const Shape b_shape = s.tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
    auto batched = [&](Shape sh, bool batch) {
      if (batch) sh.insert(sh.begin(), s.batch);
      return sh;
    };
    const Shape as = batched(a_shape, s.batch > 0 && !s.a_shared);
    const Shape bs = batched(b_shape, s.batch > 0 && !s.b_shared);
    const Shape os = batched({s.m, s.n}, s.batch > 0);
    c.inputs = {rng.uniform(as), rng.uniform(bs), rng.uniform(os)};
    c.forward = [s, os](TestDevice& dev, const Tensors& in) {
      Tensor out = s.beta != 0.0f ? dev.upload(dev.download(in[2])) : dev.poisoned(os);
      matmul(dev.exec(), in[0], in[1], out, s.ta, s.tb, s.alpha, s.beta);
      return HostTensors{dev.download(out)};
    };
    c.reference = [s](const HostTensors& in) {
      return HostTensors{reference_matmul(in[0], in[1], s.beta != 0.0f ? &in[2] : nullptr, s)};
    };
    c.atol = 1e-5;
    c.rtol = 1e-5;
    if (s.alpha == 1.0f && s.beta == 0.0f) {
      c.ops.push_back("matmul_backward");
      c.grad_inputs = {0, 1};
      c.loss_outputs = {0};
      if (s.accumulate_grads) c.grad_init = {rng.uniform(as), rng.uniform(bs)};
      const HostTensors init = c.grad_init;
      c.backward = [s, as, bs, init](TestDevice& dev, const Tensors& in, const Tensors& douts) {
        Tensor da = s.accumulate_grads ? dev.upload(init[0]) : dev.poisoned(as);
        Tensor db = s.accumulate_grads ? dev.upload(init[1]) : dev.poisoned(bs);
        matmul_backward(dev.exec(), in[0], in[1], douts[0], &da, &db, s.ta, s.tb, s.accumulate_grads);
        return HostTensors{dev.download(da), dev.download(db)};
      };
    }
    cases.push_back(std::move(c));
  }
}

// ---- grouped matmul ----------------------------------------------------------------------

void add_grouped_matmul_cases(std::vector<OpCase>& cases, Rng& rng) {
  struct Spec {
    std::vector<int64_t> counts;
    int64_t k, n;
    bool trans_w, accumulate_dw;
  };
  const std::vector<Spec> specs = {
      {{3, 0, 6, 2}, 5, 4, false, false},    // ragged, one empty expert
      {{0, 5, 0, 4, 0}, 3, 6, true, false},  // empty first and last experts
      {{4, 1, 0, 3}, 6, 5, false, true},     // dw accumulates
      {{2, 2, 2}, 4, 4, true, true},
      {{0, 0, 0}, 4, 3, false, false},    // no tokens at all: dw must come out zero
      {{5, 0, 9}, 3, 260, false, false},  // past the CPU kernel's row and column tiles
  };
  for (const Spec& s : specs) {
    int64_t tokens = 0;
    for (int64_t c : s.counts) tokens += c;
    const int64_t experts = static_cast<int64_t>(s.counts.size());
    const Shape ws = s.trans_w ? Shape{experts, s.n, s.k} : Shape{experts, s.k, s.n};
    OpCase c;
    std::string counts;
    for (int64_t n : s.counts) counts += (counts.empty() ? "" : "-") + std::to_string(n);
    c.name = fmt::format("grouped_matmul/{}/counts{}/k{}n{}{}", s.trans_w ? "trans_w" : "w", counts, s.k, s.n,
                         s.accumulate_dw ? "/accumulate_dw" : "");
    c.ops = {"grouped_matmul", "grouped_matmul_backward"};
    c.inputs = {rng.uniform({tokens, s.k}), rng.uniform(ws), offsets_of(s.counts)};
    c.forward = [s, tokens](TestDevice& dev, const Tensors& in) {
      Tensor out = dev.poisoned({tokens, s.n});
      grouped_matmul(dev.exec(), in[0], in[1], in[2], out, s.trans_w);
      return HostTensors{dev.download(out)};
    };
    c.reference = [s, tokens, experts](const HostTensors& in) {
      HostTensor out = HostTensor::zeros({tokens, s.n});
      for (int64_t e = 0; e < experts; ++e) {
        for (int64_t r = static_cast<int64_t>(in[2][e]); r < static_cast<int64_t>(in[2][e + 1]); ++r) {
          for (int64_t j = 0; j < s.n; ++j) {
            double acc = 0.0;
            for (int64_t kk = 0; kk < s.k; ++kk) {
              const double w = s.trans_w ? in[1][(e * s.n + j) * s.k + kk] : in[1][(e * s.k + kk) * s.n + j];
              acc += in[0][r * s.k + kk] * w;
            }
            out[r * s.n + j] = acc;
          }
        }
      }
      return HostTensors{out};
    };
    c.grad_inputs = {0, 1};
    c.loss_outputs = {0};
    c.grad_init = {HostTensor{}, s.accumulate_dw ? rng.uniform(ws) : HostTensor{}};
    const HostTensor dw_init = c.grad_init[1];
    c.backward = [s, tokens, ws, dw_init](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor dx = dev.poisoned({tokens, s.k});
      Tensor dw = s.accumulate_dw ? dev.upload(dw_init) : dev.poisoned(ws);
      grouped_matmul_backward(dev.exec(), in[0], in[1], in[2], douts[0], &dx, &dw, s.trans_w,
                              s.accumulate_dw);
      return HostTensors{dev.download(dx), dev.download(dw)};
    };
    cases.push_back(std::move(c));
  }
}

// ---- embedding, RMSNorm, RoPE, softmax, SwiGLU -----------------------------------------

void add_embedding_cases(std::vector<OpCase>& cases, Rng& rng) {
  const int64_t vocab = 5, dim = 6;
  for (int64_t tokens : {9, 1}) {
    OpCase c;
    c.name = fmt::format("embedding/t{}v{}d{}", tokens, vocab, dim);
    c.ops = {"embedding_forward", "embedding_backward"};
    c.inputs = {rng.ints({tokens}, 0, vocab), rng.uniform({vocab, dim})};
    c.forward = [tokens](TestDevice& dev, const Tensors& in) {
      Tensor out = dev.poisoned({tokens, dim});
      embedding_forward(dev.exec(), in[0], in[1], out);
      return HostTensors{dev.download(out)};
    };
    c.reference = [tokens](const HostTensors& in) {
      HostTensor out = HostTensor::zeros({tokens, dim});
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t d = 0; d < dim; ++d) out[t * dim + d] = in[1][static_cast<int64_t>(in[0][t]) * dim + d];
      return HostTensors{out};
    };
    c.grad_inputs = {1};
    c.loss_outputs = {0};
    c.grad_init = {rng.uniform({vocab, dim})};  // embedding_backward always accumulates
    const HostTensor init = c.grad_init[0];
    c.backward = [init](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor dtable = dev.upload(init);
      embedding_backward(dev.exec(), in[0], douts[0], dtable);
      return HostTensors{dev.download(dtable)};
    };
    cases.push_back(std::move(c));
  }
}

// y, rstd of rmsnorm_forward for x [t, d], w [d], in double.
HostTensors rmsnorm_reference(const HostTensor& x, const HostTensor& w, double eps) {
  const int64_t t = x.shape[0], d = x.shape[1];
  HostTensor y = HostTensor::zeros({t, d}), rstd = HostTensor::zeros({t});
  for (int64_t i = 0; i < t; ++i) {
    double ss = 0.0;
    for (int64_t j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    rstd[i] = r;
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = x[i * d + j] * r * w[j];
  }
  return {y, rstd};
}

void add_rmsnorm_cases(std::vector<OpCase>& cases, Rng& rng) {
  const float eps = 1e-5f;
  for (auto [rows, dim, accumulate] :
       {std::tuple{6, 16, false}, std::tuple{3, 7, true}, std::tuple{1, 1, false}, std::tuple{5, 1024, false},
        std::tuple{3, 2048, true}, std::tuple{2501, 1024, true}}) {
    // (the last three: CUDA's register kernels, one and two chunks; 2501 rows give a
    // backward block more than one row, the next one loaded ahead, and the forward's
    // two-row blocks an odd tail)
    OpCase c;
    c.name = fmt::format("rmsnorm/t{}d{}{}", rows, dim, accumulate ? "/accumulate_dw" : "");
    c.ops = {"rmsnorm_forward", "rmsnorm_backward"};
    const int64_t t = rows, d = dim;
    c.inputs = {rng.uniform({t, d}, -2.0, 2.0), rng.uniform({d}, 0.5, 1.5)};
    c.forward = [t, d, eps](TestDevice& dev, const Tensors& in) {
      Tensor y = dev.poisoned({t, d}), rstd = dev.poisoned({t}, DType::kF32);
      rmsnorm_forward(dev.exec(), in[0], in[1], eps, y, rstd);
      return HostTensors{dev.download(y), dev.download(rstd)};
    };
    c.reference = [eps](const HostTensors& in) { return rmsnorm_reference(in[0], in[1], eps); };
    c.grad_inputs = {0, 1};
    c.loss_outputs = {0};
    c.grad_init = {HostTensor{}, accumulate ? rng.uniform({d}) : HostTensor{}};
    const HostTensor dw_init = c.grad_init[1];
    c.backward = [t, d, eps, accumulate, dw_init](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor y = dev.poisoned({t, d}), rstd = dev.poisoned({t}, DType::kF32);
      rmsnorm_forward(dev.exec(), in[0], in[1], eps, y, rstd);
      Tensor dx = dev.poisoned({t, d});
      Tensor dw = accumulate ? dev.upload(dw_init) : dev.poisoned({d});
      rmsnorm_backward(dev.exec(), douts[0], in[0], in[1], rstd, dx, dw, accumulate);
      return HostTensors{dev.download(dx), dev.download(dw)};
    };
    c.cpu_finite_differences = rows < 1000;
    c.cuda_bf16_storage = true;
    cases.push_back(std::move(c));
  }
}

// The spacing of bf16 values around |x| (8 significant bits), the smallest normal's below it.
double bf16_ulp(double x) {
  int e = 0;
  std::frexp(std::max(std::fabs(x), std::ldexp(1.0, -126)), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 8);
}

// 1 where got and want differ by more than tol (or either is NaN), else 0: i32, so that the
// harnesses compare it exactly whatever the storage's tolerances.
HostTensor flag_differences(const HostTensor& got, const HostTensor& want, const std::vector<double>& tol) {
  HostTensor f = HostTensor::zeros(want.shape, DType::kI32);
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double bound = tol.empty() ? 0.0 : tol[static_cast<size_t>(i)];
    f[i] = std::fabs(got[i] - want[i]) <= bound ? 0.0 : 1.0;  // NaN is flagged
  }
  return f;
}

// A pre-norm block's residual adds fused into its norms: rmsnorm_add_forward (h = x + r,
// then the norm of h) and rmsnorm_backward's dres (the residual branch's gradient added to
// dx). The loss L = dot(dh, h) + dot(dy, y) with h = x + r, y = rmsnorm(h) makes
// dL/dx = dL/dr = dh + norm'(dy): a fusion that drops the residual, in either direction,
// fails the reference or the finite differences. w stays f32 under bf16 storage, as the
// model's master weights do. Shapes: rows of 16 and 1032 take the CUDA kernels' 8-wide packs
// (1032 = 129 packs, more than a 128-thread block's one round), 7 and 263 the scalar path
// (263 > 256 threads); in_place writes h over x and dx over dres.
//
// Each shape also has a "/vs_unfused" case comparing the fused ops with the pairs they
// replace (add then rmsnorm_forward; rmsnorm_backward then add) on the same device: h, y
// and rstd must be equal bit for bit. So must dx with f32 storage; with bf16 storage the
// unfused pair rounds the norm's gradient g to bf16 before adding dres and rounds again,
// the fused op rounds g + dres once, so they may differ by that first rounding (half a
// bf16 ulp of g) plus half an ulp of each result (their own final roundings), plus f32
// roundings of the sums (2^-22 of |g| + |dres| covers them). Where g + dres cancels, the
// difference comes close to that bound: the fused result is the more accurate one.
void add_rmsnorm_add_cases(std::vector<OpCase>& cases, Rng& rng) {
  const float eps = 1e-5f;
  // (1024 and 2048 columns: CUDA's register kernels; 1201 rows: more than one a backward block)
  for (auto [rows, dim, in_place] :
       {std::tuple{6, 16, false}, std::tuple{3, 7, false}, std::tuple{2, 1032, true},
        std::tuple{2, 263, true}, std::tuple{1201, 1024, true}, std::tuple{3, 2048, false}}) {
    const int64_t t = rows, d = dim;
    const bool alias = in_place;
    const HostTensors inputs = {rng.uniform({t, d}, -2.0, 2.0), rng.uniform({t, d}, -2.0, 2.0),
                                rng.uniform({d}, 0.5, 1.5)};
    // The fused forward on `dev`: h, y, rstd (h written over a copy of x when in place).
    auto fused_forward = [t, d, eps, alias](TestDevice& dev, const Tensors& in) {
      Tensor h = alias ? dev.upload(dev.download(in[0])) : dev.poisoned({t, d});
      Tensor y = dev.poisoned({t, d}), rstd = dev.poisoned({t}, DType::kF32);
      rmsnorm_add_forward(dev.exec(), alias ? h : in[0], in[1], in[2], eps, h, y, rstd);
      return Tensors{h, y, rstd};
    };
    // The fused backward: dx = norm'(dy) + dres, over a copy of dres when in place.
    auto fused_backward = [t, d, alias](TestDevice& dev, const Tensor& dy, const Tensor& dres,
                                        const Tensor& h, const Tensor& w, const Tensor& rstd, Tensor& dx,
                                        Tensor& dw) {
      dx = alias ? dev.upload(dev.download(dres)) : dev.poisoned({t, d});
      dw = dev.poisoned({d}, DType::kF32);
      rmsnorm_backward(dev.exec(), dy, h, w, rstd, dx, dw, false, alias ? &dx : &dres);
    };
    const std::string tag = fmt::format("rmsnorm_add/t{}d{}{}", rows, dim, in_place ? "/in_place" : "");
    {
      OpCase c;
      c.name = tag;
      c.ops = {"rmsnorm_forward", "rmsnorm_backward"};  // rmsnorm_add_forward runs on the first
      c.inputs = inputs;
      c.f32_inputs = {2};
      c.forward = [fused_forward](TestDevice& dev, const Tensors& in) {
        const Tensors out = fused_forward(dev, in);
        return HostTensors{dev.download(out[0]), dev.download(out[1]), dev.download(out[2])};
      };
      c.reference = [eps](const HostTensors& in) {
        HostTensor h = in[0];
        for (int64_t i = 0; i < h.numel(); ++i) h[i] += in[1][i];
        HostTensors yr = rmsnorm_reference(h, in[2], eps);
        return HostTensors{h, yr[0], yr[1]};
      };
      c.grad_inputs = {0, 1, 2};
      c.loss_outputs = {0, 1};
      c.backward = [fused_forward, fused_backward](TestDevice& dev, const Tensors& in, const Tensors& douts) {
        const Tensors f = fused_forward(dev, in);
        Tensor dx, dw;
        fused_backward(dev, douts[1], douts[0], f[0], in[2], f[2], dx, dw);
        const HostTensor dxh = dev.download(dx);
        return HostTensors{dxh, dxh, dev.download(dw)};
      };
      c.cpu_finite_differences = rows < 1000;
      c.cuda_bf16_storage = true;
      cases.push_back(std::move(c));
    }
    {
      OpCase c;
      c.name = tag + "/vs_unfused";
      c.ops = {"rmsnorm_forward", "rmsnorm_backward", "add"};
      c.inputs = inputs;
      c.inputs.push_back(rng.uniform({t, d}));  // dy (the norm's upstream gradient)
      c.inputs.push_back(rng.uniform({t, d}));  // dres
      c.f32_inputs = {2};
      // Outputs: where the fused h, y, rstd, dx and dw differ from the unfused ones.
      c.forward = [t, d, eps, fused_forward, fused_backward](TestDevice& dev, const Tensors& in) {
        const Tensors f = fused_forward(dev, in);
        Tensor h = dev.poisoned({t, d}), y = dev.poisoned({t, d}), rstd = dev.poisoned({t}, DType::kF32);
        add(dev.exec(), in[0], in[1], h);
        rmsnorm_forward(dev.exec(), h, in[2], eps, y, rstd);
        Tensor dx, dw;
        fused_backward(dev, in[3], in[4], h, in[2], rstd, dx, dw);
        Tensor g = dev.poisoned({t, d}), dw_u = dev.poisoned({d}, DType::kF32);
        rmsnorm_backward(dev.exec(), in[3], h, in[2], rstd, g, dw_u);
        const HostTensor gh = dev.download(g);  // the norm's gradient as the unfused pair stores it
        Tensor dx_u = dev.poisoned({t, d});
        add(dev.exec(), g, in[4], dx_u);
        const HostTensor fused = dev.download(dx), unfused = dev.download(dx_u), dres = dev.download(in[4]);
        std::vector<double> tol(static_cast<size_t>(t * d), 0.0);
        if (dev.float_storage() == DType::kBF16) {
          for (int64_t i = 0; i < t * d; ++i) {
            tol[static_cast<size_t>(i)] =
                0.5 * (bf16_ulp(gh[i]) + bf16_ulp(fused[i]) + bf16_ulp(unfused[i])) +
                std::ldexp(std::fabs(gh[i]) + std::fabs(dres[i]), -22);
          }
        }
        return HostTensors{flag_differences(dev.download(f[0]), dev.download(h), {}),
                           flag_differences(dev.download(f[1]), dev.download(y), {}),
                           flag_differences(dev.download(f[2]), dev.download(rstd), {}),
                           flag_differences(fused, unfused, tol),
                           flag_differences(dev.download(dw), dev.download(dw_u), {})};
      };
      c.reference = [t, d](const HostTensors&) {
        const HostTensor same = HostTensor::zeros({t, d}, DType::kI32);
        return HostTensors{same, same, HostTensor::zeros({t}, DType::kI32), same,
                           HostTensor::zeros({d}, DType::kI32)};
      };
      c.cuda_bf16_storage = true;
      cases.push_back(std::move(c));
    }
  }
}

void add_rope_cases(std::vector<OpCase>& cases, Rng& rng) {
  const float theta = 10000.0f;
  // CUDA, f32: head dims 8 and 16 take the 16-byte kernel (half a multiple of 4; 8 tokens a
  // block: 9 and 70 leave a partial block), 12 the paired one (kRopeTokens tokens a block),
  // 2 and 6 the per-element one. The bf16 test covers the 16-byte kernel at head dim 64.
  for (auto [tokens, heads, dh, in_place] :
       {std::tuple{5, 3, 8, false}, std::tuple{4, 2, 2, true}, std::tuple{9, 3, 16, true},
        std::tuple{9, 2, 12, false}, std::tuple{3, 2, 6, false}, std::tuple{70, 2, 8, true}}) {
    const Shape s{tokens, heads, dh};
    OpCase c;
    c.name = fmt::format("rope/{}{}", shape_tag(s), in_place ? "/in_place" : "");
    c.ops = {"rope_forward", "rope_backward"};
    c.inputs = {rng.uniform(s), rng.ints({tokens}, 0, 200)};
    const bool alias = in_place;
    c.forward = [s, theta, alias](TestDevice& dev, const Tensors& in) {
      Tensor x = dev.upload(dev.download(in[0]));
      Tensor out = alias ? x : dev.poisoned(s);
      rope_forward(dev.exec(), x, in[1], theta, out);
      return HostTensors{dev.download(out)};
    };
    c.reference = [s, theta](const HostTensors& in) {
      HostTensor out = HostTensor::zeros(s);
      const int64_t half = s[2] / 2;
      for (int64_t t = 0; t < s[0]; ++t) {
        for (int64_t h = 0; h < s[1]; ++h) {
          const int64_t base = (t * s[1] + h) * s[2];
          for (int64_t i = 0; i < half; ++i) {
            const double angle =
                in[1][t] * std::pow(static_cast<double>(theta),
                                    -2.0 * static_cast<double>(i) / static_cast<double>(s[2]));
            const double x0 = in[0][base + i], x1 = in[0][base + i + half];
            out[base + i] = x0 * std::cos(angle) - x1 * std::sin(angle);
            out[base + i + half] = x0 * std::sin(angle) + x1 * std::cos(angle);
          }
        }
      }
      return HostTensors{out};
    };
    c.grad_inputs = {0};
    c.loss_outputs = {0};
    c.backward = [s, theta, alias](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor d = dev.upload(dev.download(douts[0]));
      Tensor dx = alias ? d : dev.poisoned(s);
      rope_backward(dev.exec(), d, in[1], theta, dx);
      return HostTensors{dev.download(dx)};
    };
    cases.push_back(std::move(c));
  }
}

void add_softmax_cases(std::vector<OpCase>& cases, Rng& rng) {
  for (const Shape& s : {Shape{4, 9}, Shape{1, 1}, Shape{3, 64}}) {
    OpCase c;
    c.name = "softmax/" + shape_tag(s);
    c.ops = {"softmax_forward", "softmax_backward"};
    c.inputs = {rng.uniform(s, -4.0, 4.0)};
    c.forward = [s](TestDevice& dev, const Tensors& in) {
      Tensor y = dev.poisoned(s);
      softmax_forward(dev.exec(), in[0], y);
      return HostTensors{dev.download(y)};
    };
    c.reference = [s](const HostTensors& in) {
      HostTensor y = HostTensor::zeros(s);
      for (int64_t r = 0; r < s[0]; ++r) {
        double mx = -std::numeric_limits<double>::infinity(), z = 0.0;
        for (int64_t j = 0; j < s[1]; ++j) mx = std::max(mx, in[0][r * s[1] + j]);
        for (int64_t j = 0; j < s[1]; ++j) z += std::exp(in[0][r * s[1] + j] - mx);
        for (int64_t j = 0; j < s[1]; ++j) y[r * s[1] + j] = std::exp(in[0][r * s[1] + j] - mx) / z;
      }
      return HostTensors{y};
    };
    c.grad_inputs = {0};
    c.loss_outputs = {0};
    c.backward = [s](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor y = dev.poisoned(s), dx = dev.poisoned(s);
      softmax_forward(dev.exec(), in[0], y);
      softmax_backward(dev.exec(), y, douts[0], dx);
      return HostTensors{dev.download(dx)};
    };
    cases.push_back(std::move(c));
  }
}

void add_swiglu_cases(std::vector<OpCase>& cases, Rng& rng) {
  for (const Shape& s : {Shape{5, 12}, Shape{1, 2}}) {
    const int64_t t = s[0], f = s[1] / 2;
    OpCase c;
    c.name = "swiglu/" + shape_tag(s);
    c.ops = {"swiglu_forward", "swiglu_backward"};
    c.inputs = {rng.uniform(s, -3.0, 3.0)};
    c.forward = [t, f](TestDevice& dev, const Tensors& in) {
      Tensor out = dev.poisoned({t, f});
      swiglu_forward(dev.exec(), in[0], out);
      return HostTensors{dev.download(out)};
    };
    c.reference = [t, f](const HostTensors& in) {
      HostTensor out = HostTensor::zeros({t, f});
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t j = 0; j < f; ++j) {
          const double g = in[0][i * 2 * f + j], u = in[0][i * 2 * f + f + j];
          out[i * f + j] = g / (1.0 + std::exp(-g)) * u;
        }
      }
      return HostTensors{out};
    };
    c.grad_inputs = {0};
    c.loss_outputs = {0};
    c.backward = [s](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor dh = dev.poisoned(s);
      swiglu_backward(dev.exec(), in[0], douts[0], dh);
      return HostTensors{dev.download(dh)};
    };
    cases.push_back(std::move(c));
  }
}

// ---- attention -------------------------------------------------------------------------

struct AttentionSpec {
  int64_t b, s, hq, hkv, dh;
};

// The double-precision causal attention of q [B,S,Hq,Dh], k, v [B,S,Hkv,Dh]: out and lse.
HostTensors reference_attention(const AttentionSpec& sp, const Shape& qs, const Shape& ls, double scale,
                                const std::array<const HostTensor*, 3>& qkv) {
  const HostTensors in = {*qkv[0], *qkv[1], *qkv[2]};
  HostTensor out = HostTensor::zeros(qs), lse = HostTensor::zeros(ls);
  const int64_t group = sp.hq / sp.hkv;
  std::vector<double> p(static_cast<size_t>(sp.s));
  for (int64_t b = 0; b < sp.b; ++b) {
    for (int64_t h = 0; h < sp.hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < sp.s; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < sp.dh; ++d)
            dot += in[0][((b * sp.s + i) * sp.hq + h) * sp.dh + d] *
                   in[1][((b * sp.s + j) * sp.hkv + hk) * sp.dh + d];
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        double z = 0.0;
        for (int64_t j = 0; j <= i; ++j) z += std::exp(p[j] - mx);
        lse[(b * sp.hq + h) * sp.s + i] = mx + std::log(z);
        for (int64_t d = 0; d < sp.dh; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j <= i; ++j)
            acc += std::exp(p[j] - mx) / z * in[2][((b * sp.s + j) * sp.hkv + hk) * sp.dh + d];
          out[((b * sp.s + i) * sp.hq + h) * sp.dh + d] = acc;
        }
      }
    }
  }
  return HostTensors{out, lse};
}

// rope_forward of x [T, H, Dh] at positions pos [T], in double precision.
HostTensor reference_rope(const HostTensor& x, const HostTensor& pos, double theta) {
  HostTensor out = HostTensor::zeros(x.shape);
  const int64_t heads = x.shape[1], dh = x.shape[2], half = dh / 2;
  for (int64_t t = 0; t < x.shape[0]; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * dh;
      for (int64_t i = 0; i < half; ++i) {
        const double angle =
            pos[t] * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dh));
        const double x0 = x[base + i], x1 = x[base + i + half];
        out[base + i] = x0 * std::cos(angle) - x1 * std::sin(angle);
        out[base + i + half] = x0 * std::sin(angle) + x1 * std::cos(angle);
      }
    }
  }
  return out;
}

void add_attention_cases(std::vector<OpCase>& cases, Rng& rng) {
  using Spec = AttentionSpec;
  for (Spec sp : {Spec{2, 5, 4, 2, 8}, Spec{1, 7, 2, 2, 4}, Spec{1, 6, 3, 1, 4}, Spec{1, 1, 1, 1, 2}}) {
    const Shape qs{sp.b, sp.s, sp.hq, sp.dh}, ks{sp.b, sp.s, sp.hkv, sp.dh}, ls{sp.b, sp.hq, sp.s};
    const float scale = 1.0f / std::sqrt(static_cast<float>(sp.dh));
    OpCase c;
    c.name = fmt::format("attention/b{}s{}hq{}hkv{}dh{}", sp.b, sp.s, sp.hq, sp.hkv, sp.dh);
    c.ops = {"attention_forward", "attention_backward"};
    c.inputs = {rng.uniform(qs, -2.0, 2.0), rng.uniform(ks, -2.0, 2.0), rng.uniform(ks)};
    c.forward = [qs, ls, scale](TestDevice& dev, const Tensors& in) {
      Tensor out = dev.poisoned(qs), lse = dev.poisoned(ls, DType::kF32);
      attention_forward(dev.exec(), in[0], in[1], in[2], scale, out, lse);
      return HostTensors{dev.download(out), dev.download(lse)};
    };
    c.reference = [sp, qs, ls, scale](const HostTensors& in) {
      return reference_attention(sp, qs, ls, scale, {&in[0], &in[1], &in[2]});
    };
    c.grad_inputs = {0, 1, 2};
    c.loss_outputs = {0};
    c.backward = [qs, ks, ls, scale](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor out = dev.poisoned(qs), lse = dev.poisoned(ls, DType::kF32);
      attention_forward(dev.exec(), in[0], in[1], in[2], scale, out, lse);
      Tensor dq = dev.poisoned(qs), dk = dev.poisoned(ks), dv = dev.poisoned(ks);
      attention_backward(dev.exec(), in[0], in[1], in[2], out, lse, douts[0], scale, dq, dk, dv);
      return HostTensors{dev.download(dq), dev.download(dk), dev.download(dv)};
    };
    cases.push_back(std::move(c));
  }  // attention_backward with the RoPE that made q and k (RopeArgs): the gradients of the
  // unrotated q and k, against finite differences of rope_forward -> attention_forward.
  // Positions not in order and past the sequence (a shard's), theta not the default.
  for (Spec sp : {Spec{2, 5, 4, 2, 8}, Spec{1, 6, 3, 1, 4}}) {
    const Shape qs{sp.b, sp.s, sp.hq, sp.dh}, ks{sp.b, sp.s, sp.hkv, sp.dh}, ls{sp.b, sp.hq, sp.s};
    const float scale = 1.0f / std::sqrt(static_cast<float>(sp.dh)), theta = 500.0f;
    const int64_t tokens = sp.b * sp.s;
    OpCase c;
    c.name = fmt::format("attention_rope/b{}s{}hq{}hkv{}dh{}", sp.b, sp.s, sp.hq, sp.hkv, sp.dh);
    c.ops = {"attention_backward"};
    c.inputs = {rng.uniform(qs, -2.0, 2.0), rng.uniform(ks, -2.0, 2.0), rng.uniform(ks),
                rng.ints({tokens}, 0, 3000)};
    const auto rotated = [sp, tokens, theta](TestDevice& dev, const Tensors& in, Tensor& q, Tensor& k) {
      q = dev.poisoned({sp.b, sp.s, sp.hq, sp.dh});
      k = dev.poisoned({sp.b, sp.s, sp.hkv, sp.dh});
      Tensor q3 = q.view({tokens, sp.hq, sp.dh}), k3 = k.view({tokens, sp.hkv, sp.dh});
      rope_forward(dev.exec(), in[0].view({tokens, sp.hq, sp.dh}), in[3], theta, q3);
      rope_forward(dev.exec(), in[1].view({tokens, sp.hkv, sp.dh}), in[3], theta, k3);
    };
    c.forward = [qs, ls, scale, rotated](TestDevice& dev, const Tensors& in) {
      Tensor q, k, out = dev.poisoned(qs), lse = dev.poisoned(ls, DType::kF32);
      rotated(dev, in, q, k);
      attention_forward(dev.exec(), q, k, in[2], scale, out, lse);
      return HostTensors{dev.download(out), dev.download(lse)};
    };
    c.reference = [sp, qs, ls, scale, theta, tokens](const HostTensors& in) {
      HostTensor q = in[0], k = in[1];
      q.shape = {tokens, sp.hq, sp.dh};
      k.shape = {tokens, sp.hkv, sp.dh};
      HostTensor qr = reference_rope(q, in[3], theta), kr = reference_rope(k, in[3], theta);
      return reference_attention(sp, qs, ls, scale, {&qr, &kr, &in[2]});
    };
    c.grad_inputs = {0, 1, 2};
    c.loss_outputs = {0};
    c.backward = [qs, ks, ls, scale, theta, rotated](TestDevice& dev, const Tensors& in,
                                                     const Tensors& douts) {
      Tensor q, k, out = dev.poisoned(qs), lse = dev.poisoned(ls, DType::kF32);
      rotated(dev, in, q, k);
      attention_forward(dev.exec(), q, k, in[2], scale, out, lse);
      Tensor dq = dev.poisoned(qs), dk = dev.poisoned(ks), dv = dev.poisoned(ks);
      const RopeArgs rope{&in[3], theta};
      attention_backward(dev.exec(), q, k, in[2], out, lse, douts[0], scale, dq, dk, dv, &rope);
      return HostTensors{dev.download(dq), dev.download(dk), dev.download(dv)};
    };
    cases.push_back(std::move(c));
  }
}

// ---- router ------------------------------------------------------------------------------

HostTensors reference_router(const HostTensor& logits, const HostTensor* bias, const RouterConfig& cfg) {
  const int64_t t_n = logits.shape[0], e_n = logits.shape[1], k = cfg.top_k;
  HostTensor scores = HostTensor::zeros({t_n, e_n}), idx = HostTensor::zeros({t_n, k}, DType::kI32),
             gates = HostTensor::zeros({t_n, k});
  for (int64_t t = 0; t < t_n; ++t) {
    if (cfg.score == RouterScore::kSoftmax) {
      double mx = -std::numeric_limits<double>::infinity(), z = 0.0;
      for (int64_t e = 0; e < e_n; ++e) mx = std::max(mx, logits[t * e_n + e]);
      for (int64_t e = 0; e < e_n; ++e) z += std::exp(logits[t * e_n + e] - mx);
      for (int64_t e = 0; e < e_n; ++e) scores[t * e_n + e] = std::exp(logits[t * e_n + e] - mx) / z;
    } else {
      for (int64_t e = 0; e < e_n; ++e) scores[t * e_n + e] = 1.0 / (1.0 + std::exp(-logits[t * e_n + e]));
    }
    // Stable sort by descending rank keeps the lower index first among equals.
    std::vector<int64_t> order(static_cast<size_t>(e_n));
    for (int64_t e = 0; e < e_n; ++e) order[e] = e;
    auto rank = [&](int64_t e) { return scores[t * e_n + e] + (bias ? (*bias)[e] : 0.0); };
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rank(a) > rank(b); });
    double gsum = 0.0;
    for (int64_t j = 0; j < k; ++j) gsum += scores[t * e_n + order[j]];
    const bool renorm = cfg.normalize || cfg.score == RouterScore::kSigmoid;
    for (int64_t j = 0; j < k; ++j) {
      idx[t * k + j] = static_cast<double>(order[j]);
      gates[t * k + j] = scores[t * e_n + order[j]] / (renorm ? gsum : 1.0);
    }
  }
  return {scores, idx, gates};
}

// The router's forward case for one shape: random logits, and a bias large enough to change
// which experts win, so selection-only use of it shows.
struct RouterSpec {
  std::string tag;
  int64_t tokens, experts;
  RouterConfig cfg;
  bool bias, dscores;
};
OpCase router_forward_case(const RouterSpec& sp, Rng& rng) {
  OpCase c;
  c.name = "router/" + sp.tag;
  c.ops = {"router_forward"};
  c.inputs = {rng.uniform({sp.tokens, sp.experts}, -2.0, 2.0), rng.uniform({sp.experts}, -0.3, 0.3)};
  c.f32_inputs = {1};
  const RouterConfig cfg = sp.cfg;
  const bool use_bias = sp.bias;
  const int64_t t = sp.tokens, e = sp.experts, k = cfg.top_k;
  c.forward = [cfg, use_bias, t, e, k](TestDevice& dev, const Tensors& in) {
    Tensor scores = dev.poisoned({t, e}, DType::kF32), idx = dev.poisoned({t, k}, DType::kI32),
           gates = dev.poisoned({t, k}, DType::kF32);
    router_forward(dev.exec(), in[0], use_bias ? &in[1] : nullptr, cfg, scores, idx, gates);
    return HostTensors{dev.download(scores), dev.download(idx), dev.download(gates)};
  };
  c.reference = [cfg, use_bias](const HostTensors& in) {
    return reference_router(in[0], use_bias ? &in[1] : nullptr, cfg);
  };
  return c;
}

// Row log-sum-exp (the router z-loss): 16 experts (a warp's lanes half empty), 40, and
// 300 (several columns a lane); the backward accumulates.
void add_logsumexp_cases(std::vector<OpCase>& cases, Rng& rng) {
  for (const auto& [t, e] : std::vector<std::pair<int64_t, int64_t>>{{6, 16}, {9, 40}, {3, 300}}) {
    OpCase c;
    c.name = fmt::format("logsumexp/t{}e{}", t, e);
    c.ops = {"logsumexp_forward", "logsumexp_backward"};
    c.inputs = {rng.uniform({t, e}, -4.0, 4.0)};
    c.f32_inputs = {0};
    c.bf16_storage = false;
    c.forward = [t](TestDevice& dev, const Tensors& in) {
      Tensor lse = dev.poisoned({t}, DType::kF32);
      logsumexp_forward(dev.exec(), in[0], lse);
      return HostTensors{dev.download(lse)};
    };
    c.reference = [t, e](const HostTensors& in) {
      HostTensor lse = HostTensor::zeros({t});
      for (int64_t i = 0; i < t; ++i) {
        double m = -1e300, s = 0;
        for (int64_t j = 0; j < e; ++j) m = std::max(m, in[0][i * e + j]);
        for (int64_t j = 0; j < e; ++j) s += std::exp(in[0][i * e + j] - m);
        lse[i] = m + std::log(s);
      }
      return HostTensors{lse};
    };
    c.grad_inputs = {0};
    c.loss_outputs = {0};
    c.grad_init = {rng.uniform({t, e})};
    const HostTensor init = c.grad_init[0];
    c.backward = [t, init](TestDevice& dev, const Tensors& in, const Tensors& douts) {
      Tensor lse = dev.poisoned({t}, DType::kF32);
      logsumexp_forward(dev.exec(), in[0], lse);
      Tensor dx = dev.upload(init);
      logsumexp_backward(dev.exec(), in[0], lse, douts[0], 1.0f, dx);
      return HostTensors{dev.download(dx)};
    };
    cases.push_back(std::move(c));
  }
}

void add_router_cases(std::vector<OpCase>& cases, Rng& rng) {
  const std::vector<RouterSpec> specs = {
      {"softmax/top2/norm", 6, 8, {2, RouterScore::kSoftmax, true}, false, true},
      {"softmax/top1/raw", 5, 4, {1, RouterScore::kSoftmax, false}, false, false},
      {"softmax/top3/raw/bias", 4, 6, {3, RouterScore::kSoftmax, false}, true, true},
      {"sigmoid/top2/bias", 7, 8, {2, RouterScore::kSigmoid, true}, true, true},
      {"sigmoid/top4of4", 3, 4, {4, RouterScore::kSigmoid, true}, false, false},
  };
  for (const RouterSpec& sp : specs) {
    OpCase c = router_forward_case(sp, rng);
    c.ops = {"router_forward", "router_backward"};
    const RouterConfig cfg = sp.cfg;
    const bool use_bias = sp.bias;
    const int64_t t = sp.tokens, e = sp.experts, k = cfg.top_k;
    c.grad_inputs = {0};
    c.loss_outputs = sp.dscores ? std::vector<int>{0, 2} : std::vector<int>{2};
    const bool with_dscores = sp.dscores;
    c.backward = [cfg, use_bias, with_dscores, t, e, k](TestDevice& dev, const Tensors& in,
                                                        const Tensors& douts) {
      Tensor scores = dev.poisoned({t, e}, DType::kF32), idx = dev.poisoned({t, k}, DType::kI32),
             gates = dev.poisoned({t, k}, DType::kF32);
      router_forward(dev.exec(), in[0], use_bias ? &in[1] : nullptr, cfg, scores, idx, gates);
      Tensor dlogits = dev.poisoned({t, e});
      const Tensor& dgates = with_dscores ? douts[1] : douts[0];
      router_backward(dev.exec(), scores, idx, dgates, with_dscores ? &douts[0] : nullptr, cfg, dlogits);
      return HostTensors{dev.download(dlogits)};
    };
    cases.push_back(std::move(c));
  }
  // The CUDA router takes a warp per token up to 256 experts (1, 2, 4 or 8 a lane, the last
  // lanes partly empty) and a thread per token beyond: forward cases on each.
  const std::vector<RouterSpec> wide = {
      {"softmax/top8of40/norm/bias", 9, 40, {8, RouterScore::kSoftmax, true}, true, false},
      {"sigmoid/top8of64/bias", 6, 64, {8, RouterScore::kSigmoid, true}, true, false},
      {"softmax/top16of100/raw", 5, 100, {16, RouterScore::kSoftmax, false}, false, false},
      {"softmax/top6of256/norm", 4, 256, {6, RouterScore::kSoftmax, true}, false, false},
      {"softmax/top2of300/norm/bias", 4, 300, {2, RouterScore::kSoftmax, true}, true, false},
  };
  for (const RouterSpec& sp : wide) cases.push_back(router_forward_case(sp, rng));
  // The load statistics of the same pass (RouterStats) and the backward that reads them:
  // counts, score column sums, acc += [counts | aux_scale * counts . sums]; the aux term's
  // gradient is aux_scale * counts[e] for every token, one [E] row scaled as the layer
  // scales it (here by the upstream gradient of acc[E]). 300 experts take the CUDA
  // backend's serial statistics kernel; 16 and 40 its warp kernel (with 700 tokens, 22
  // blocks of partial sums); the backward likewise takes a warp per token up to 256
  // experts and a thread per token beyond.
  struct StatsSpec {
    std::string tag;
    int64_t tokens, experts;
    RouterConfig cfg;
    bool bias, backward;
  };
  const std::vector<StatsSpec> stats_specs = {
      {"softmax/top2of16", 700, 16, {2, RouterScore::kSoftmax, true}, false, false},
      {"softmax/top2of16/small", 37, 16, {2, RouterScore::kSoftmax, true}, false, true},
      {"sigmoid/top8of40/bias", 29, 40, {8, RouterScore::kSigmoid, true}, true, true},
      {"softmax/top3of300", 21, 300, {3, RouterScore::kSoftmax, false}, false, true},
  };
  for (const StatsSpec& sp : stats_specs) {
    OpCase c;
    c.name = "router/stats/" + sp.tag;
    c.ops = sp.backward ? std::vector<std::string>{"router_forward", "router_backward"}
                        : std::vector<std::string>{"router_forward"};
    const int64_t t = sp.tokens, e = sp.experts, k = sp.cfg.top_k;
    c.inputs = {rng.uniform({t, e}, -2.0, 2.0), rng.uniform({e + 1}, 0.0, 3.0), rng.uniform({e}, -0.3, 0.3)};
    c.f32_inputs = {1, 2};
    const RouterConfig cfg = sp.cfg;
    const bool use_bias = sp.bias;
    const float aux_scale = 0.37f;
    const HostTensor acc0 = c.inputs[1];
    const auto run = [cfg, use_bias, t, e, k, aux_scale, acc0](TestDevice& dev, const Tensors& in,
                                                               Tensor& scores, Tensor& idx, Tensor& gates,
                                                               Tensor& counts, Tensor& sums, Tensor& acc) {
      scores = dev.poisoned({t, e}, DType::kF32);
      idx = dev.poisoned({t, k}, DType::kI32);
      gates = dev.poisoned({t, k}, DType::kF32);
      counts = dev.poisoned({e}, DType::kF32);
      sums = dev.poisoned({e}, DType::kF32);
      acc = dev.upload(acc0, DType::kF32);  // a fresh copy: the op adds into it
      RouterStats st{&counts, &sums, &acc, aux_scale};
      router_forward(dev.exec(), in[0], use_bias ? &in[2] : nullptr, cfg, scores, idx, gates, &st);
    };
    c.forward = [run](TestDevice& dev, const Tensors& in) {
      Tensor scores, idx, gates, counts, sums, acc;
      run(dev, in, scores, idx, gates, counts, sums, acc);
      return HostTensors{dev.download(scores), dev.download(idx),  dev.download(gates),
                         dev.download(counts), dev.download(sums), dev.download(acc)};
    };
    c.reference = [cfg, use_bias, t, e, k, aux_scale](const HostTensors& in) {
      HostTensors out = reference_router(in[0], use_bias ? &in[2] : nullptr, cfg);
      HostTensor counts = HostTensor::zeros({e}), sums = HostTensor::zeros({e}), acc = in[1];
      for (int64_t i = 0; i < t * k; ++i) counts[static_cast<int64_t>(out[1][i])] += 1.0;
      for (int64_t r = 0; r < t; ++r)
        for (int64_t j = 0; j < e; ++j) sums[j] += out[0][r * e + j];
      double dot = 0.0;
      for (int64_t j = 0; j < e; ++j) {
        acc[j] += counts[j];
        dot += counts[j] * sums[j];
      }
      acc[e] += static_cast<double>(aux_scale) * dot;
      out.push_back(counts);
      out.push_back(sums);
      out.push_back(acc);
      return out;
    };
    if (sp.backward) {
      c.grad_inputs = {0};
      c.loss_outputs = {2, 5};  // gates, acc
      // 6300 logits are slow to probe; the smaller cases check the same CPU arithmetic.
      c.cpu_finite_differences = e <= 64;
      c.backward = [run, cfg, t, e, aux_scale](TestDevice& dev, const Tensors& in, const Tensors& douts) {
        Tensor scores, idx, gates, counts, sums, acc;
        run(dev, in, scores, idx, gates, counts, sums, acc);
        const double dacc = dev.download(douts[1])[e];  // upstream gradient of acc[E]
        Tensor dlogits = dev.poisoned({t, e});
        router_backward(dev.exec(), scores, idx, douts[0], &counts, cfg, dlogits,
                        static_cast<float>(aux_scale * dacc));
        return HostTensors{dev.download(dlogits)};
      };
    }
    cases.push_back(std::move(c));
  }
  {
    // Exact ties (equal logits give equal scores) must go to the lower expert index.
    OpCase c;
    c.name = "router/ties";
    c.ops = {"router_forward"};
    HostTensor logits = HostTensor::zeros({4, 6});
    const double rows[4][6] = {
        {1, 1, 1, 1, 1, 1}, {0.5, 2, 0.5, 2, 2, 0.5}, {-1, 3, 3, -1, 3, 3}, {2, 1, 2, 1, 2, 1}};
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 6; ++j) logits[i * 6 + j] = rows[i][j];
    c.inputs = {logits};
    const RouterConfig cfg{3, RouterScore::kSoftmax, true};
    c.forward = [cfg](TestDevice& dev, const Tensors& in) {
      Tensor scores = dev.poisoned({4, 6}, DType::kF32), idx = dev.poisoned({4, 3}, DType::kI32),
             gates = dev.poisoned({4, 3}, DType::kF32);
      router_forward(dev.exec(), in[0], nullptr, cfg, scores, idx, gates);
      return HostTensors{dev.download(scores), dev.download(idx), dev.download(gates)};
    };
    c.reference = [cfg](const HostTensors& in) { return reference_router(in[0], nullptr, cfg); };
    cases.push_back(std::move(c));
  }
}

// ---- dispatch plan, permute, unpermute -----------------------------------------------------

void add_moe_cases(std::vector<OpCase>& cases, Rng& rng) {
  struct Spec {
    int64_t tokens, k, experts, used, capacity;
  };
  // `used` < experts leaves the last experts empty; capacity >= 0 drops copies.
  const std::vector<Spec> specs = {{7, 2, 4, 4, -1}, {9, 2, 5, 3, 2}, {6, 3, 6, 6, 1}, {1, 1, 3, 1, -1}};
  // Plans only (no permutation cases: their finite differences would take long): several
  // 2048-copy chunks of the CUDA plan (and, within one, rounds and warps); the last with
  // more experts than its parallel numbering takes.
  const std::vector<Spec> plan_specs = {
      {3000, 2, 16, 16, -1}, {1500, 4, 40, 33, 120}, {700, 3, 300, 290, -1}};
  // The plan case of a spec and its top-k choices.
  auto plan_case = [](const Spec& sp, const HostTensor& topk) {
    const int64_t k = sp.k, t = sp.tokens, experts = sp.experts, capacity = sp.capacity;
    OpCase c;
    c.name = fmt::format("moe_dispatch_plan/t{}k{}e{}used{}cap{}", sp.tokens, sp.k, sp.experts, sp.used,
                         sp.capacity);
    c.ops = {"moe_dispatch_plan"};
    c.inputs = {topk};
    c.forward = [t, k, experts, capacity](TestDevice& dev, const Tensors& in) {
      Tensor row_map = dev.poisoned({t * k}, DType::kI32), counts = dev.poisoned({experts}, DType::kI32),
             offsets = dev.poisoned({experts + 1}, DType::kI32);
      moe_dispatch_plan(dev.exec(), in[0], experts, capacity, row_map, counts, offsets);
      return HostTensors{dev.download(row_map), dev.download(counts), dev.download(offsets)};
    };
    c.reference = [experts, capacity](const HostTensors& in) {
      return reference_plan(in[0], experts, capacity);
    };
    return c;
  };
  for (const Spec& sp : plan_specs)
    cases.push_back(plan_case(sp, random_topk(rng, sp.tokens, sp.k, sp.used)));
  for (const Spec& sp : specs) {
    const HostTensor topk = random_topk(rng, sp.tokens, sp.k, sp.used);
    const HostTensors plan = reference_plan(topk, sp.experts, sp.capacity);
    const int64_t rows = static_cast<int64_t>(plan[2][sp.experts]);
    const std::string tag =
        fmt::format("t{}k{}e{}used{}cap{}", sp.tokens, sp.k, sp.experts, sp.used, sp.capacity);
    const int64_t dim = 5, k = sp.k, t = sp.tokens;
    cases.push_back(plan_case(sp, topk));
    {
      OpCase c;
      c.name = "moe_permute/" + tag;
      c.ops = {"moe_permute", "moe_permute_backward"};
      c.inputs = {rng.uniform({t, dim}), plan[0]};
      c.forward = [t, k, rows](TestDevice& dev, const Tensors& in) {
        Tensor xp = dev.poisoned({rows, dim});
        moe_permute(dev.exec(), in[0], in[1], k, xp);
        return HostTensors{dev.download(xp)};
      };
      c.reference = [t, k, rows](const HostTensors& in) {
        HostTensor xp = HostTensor::zeros({rows, dim});
        for (int64_t cp = 0; cp < t * k; ++cp) {
          const int64_t r = static_cast<int64_t>(in[1][cp]);
          if (r < 0) continue;
          for (int64_t d = 0; d < dim; ++d) xp[r * dim + d] = in[0][(cp / k) * dim + d];
        }
        return HostTensors{xp};
      };
      c.grad_inputs = {0};
      c.loss_outputs = {0};
      c.backward = [t, k](TestDevice& dev, const Tensors& in, const Tensors& douts) {
        Tensor dx = dev.poisoned({t, dim});
        moe_permute_backward(dev.exec(), douts[0], in[1], k, dx);
        return HostTensors{dev.download(dx)};
      };
      cases.push_back(std::move(c));
    }
    {
      OpCase c;
      c.name = "moe_unpermute/" + tag;
      c.ops = {"moe_unpermute", "moe_unpermute_backward"};
      c.inputs = {rng.uniform({rows, dim}), plan[0], rng.uniform({t, k}, 0.1, 1.0)};
      c.forward = [t](TestDevice& dev, const Tensors& in) {
        Tensor y = dev.poisoned({t, dim});
        moe_unpermute(dev.exec(), in[0], in[1], in[2], y);
        return HostTensors{dev.download(y)};
      };
      c.reference = [t, k](const HostTensors& in) {
        HostTensor y = HostTensor::zeros({t, dim});
        for (int64_t cp = 0; cp < t * k; ++cp) {
          const int64_t r = static_cast<int64_t>(in[1][cp]);
          if (r < 0) continue;
          for (int64_t d = 0; d < dim; ++d) y[(cp / k) * dim + d] += in[2][cp] * in[0][r * dim + d];
        }
        return HostTensors{y};
      };
      c.grad_inputs = {0, 2};
      c.loss_outputs = {0};
      c.backward = [t, k, rows](TestDevice& dev, const Tensors& in, const Tensors& douts) {
        Tensor dyp = dev.poisoned({rows, dim}), dgates = dev.poisoned({t, k});
        moe_unpermute_backward(dev.exec(), douts[0], in[0], in[1], in[2], dyp, dgates);
        return HostTensors{dev.download(dyp), dev.download(dgates)};
      };
      cases.push_back(std::move(c));
    }
    // With the block's residual stream added in the combine (LocalExpertDispatch::forward_add);
    // 16 columns take the CUDA kernel's 8-element packs, 5 its scalar path.
    for (const int64_t rd : {int64_t{5}, int64_t{16}}) {
      OpCase c;
      c.name = fmt::format("moe_unpermute/residual/d{}/{}", rd, tag);
      c.ops = {"moe_unpermute"};
      c.inputs = {rng.uniform({rows, rd}), plan[0], rng.uniform({t, k}, 0.1, 1.0), rng.uniform({t, rd})};
      c.forward = [t, rd](TestDevice& dev, const Tensors& in) {
        Tensor y = dev.poisoned({t, rd});
        moe_unpermute(dev.exec(), in[0], in[1], in[2], y, &in[3]);
        return HostTensors{dev.download(y)};
      };
      c.reference = [t, k, rd](const HostTensors& in) {
        HostTensor y = HostTensor::zeros({t, rd});
        for (int64_t cp = 0; cp < t * k; ++cp) {
          const int64_t r = static_cast<int64_t>(in[1][cp]);
          if (r < 0) continue;
          for (int64_t d = 0; d < rd; ++d) y[(cp / k) * rd + d] += in[2][cp] * in[0][r * rd + d];
        }
        for (int64_t i = 0; i < t * rd; ++i) y[i] += in[3][i];
        return HostTensors{y};
      };
      cases.push_back(std::move(c));
    }
  }
}

// ---- cross-entropy -----------------------------------------------------------------------

// Per-row losses (0 for ignored targets) and log-sum-exps of logits [t, v], in double.
HostTensors reference_cross_entropy(const HostTensor& logits, const HostTensor& targets, int64_t t,
                                    int64_t v) {
  HostTensor losses = HostTensor::zeros({t}), lse = HostTensor::zeros({t});
  for (int64_t i = 0; i < t; ++i) {
    double mx = -std::numeric_limits<double>::infinity(), z = 0.0;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, logits[i * v + j]);
    for (int64_t j = 0; j < v; ++j) z += std::exp(logits[i * v + j] - mx);
    lse[i] = mx + std::log(z);
    const int64_t target = static_cast<int64_t>(targets[i]);
    losses[i] = target < 0 ? 0.0 : lse[i] - logits[i * v + target];
  }
  return HostTensors{losses, lse};
}

void add_cross_entropy_cases(std::vector<OpCase>& cases, Rng& rng) {
  for (auto [tokens, vocab, in_place] :
       {std::tuple{6, 11, false}, std::tuple{5, 32, true}, std::tuple{1, 2, false}}) {
    const int64_t t = tokens, v = vocab;
    HostTensor targets = rng.ints({t}, 0, v);
    if (t > 2) targets[1] = -1;  // ignored rows: loss 0, gradient 0
    if (t > 4) targets[4] = -1;
    OpCase c;
    c.name = fmt::format("cross_entropy/t{}v{}{}", t, v, in_place ? "/dlogits=logits" : "");
    c.ops = {"cross_entropy_forward", "cross_entropy_backward"};
    c.inputs = {rng.uniform({t, v}, -3.0, 3.0), targets};
    c.forward = [t](TestDevice& dev, const Tensors& in) {
      Tensor losses = dev.poisoned({t}, DType::kF32), lse = dev.poisoned({t}, DType::kF32);
      cross_entropy_forward(dev.exec(), in[0], in[1], losses, lse);
      return HostTensors{dev.download(losses), dev.download(lse)};
    };
    c.reference = [t, v](const HostTensors& in) { return reference_cross_entropy(in[0], in[1], t, v); };
    c.grad_inputs = {0};
    c.loss_outputs = {0};
    c.uniform_dout = 0.5;  // the backward's grad_scale (e.g. 1 / number of tokens)
    const bool alias = in_place;
    c.backward = [t, v, alias](TestDevice& dev, const Tensors& in, const Tensors&) {
      Tensor logits = dev.upload(dev.download(in[0]));
      Tensor losses = dev.poisoned({t}, DType::kF32), lse = dev.poisoned({t}, DType::kF32);
      cross_entropy_forward(dev.exec(), logits, in[1], losses, lse);
      Tensor dlogits = alias ? logits : dev.poisoned({t, v});
      cross_entropy_backward(dev.exec(), logits, in[1], lse, 0.5f, dlogits);
      return HostTensors{dev.download(dlogits)};
    };
    cases.push_back(std::move(c));
  }
}

// The fused pass: losses, lse and dlogits = (softmax - onehot) * grad_scale (0 for ignored
// rows) against the exact reference, in place and not; vocabularies below, at and above a
// block's 512 x 8 elements per sweep, odd (the scalar path) and multiples of 8 (vectors).
void add_cross_entropy_fused_cases(std::vector<OpCase>& cases, Rng& rng) {
  // (20488 = 8 * 2561: CUDA's 512 threads take groups of two 8-wide vectors, then a tail)
  for (auto [tokens, vocab, in_place] :
       {std::tuple{6, 11, false}, std::tuple{5, 32, true}, std::tuple{3, 4104, true},
        std::tuple{4, 9001, false}, std::tuple{3, 20488, false}}) {
    const int64_t t = tokens, v = vocab;
    HostTensor targets = rng.ints({t}, 0, v);
    if (t > 2) targets[1] = -1;
    if (t > 3) targets[3] = static_cast<double>(v - 1);  // the last column
    OpCase c;
    c.name = fmt::format("cross_entropy_forward_backward/t{}v{}{}", t, v, in_place ? "/dlogits=logits" : "");
    c.ops = {"cross_entropy_forward_backward"};
    c.inputs = {rng.uniform({t, v}, -3.0, 3.0), targets};
    const bool alias = in_place;
    c.forward = [t, v, alias](TestDevice& dev, const Tensors& in) {
      Tensor logits = dev.upload(dev.download(in[0]));
      Tensor losses = dev.poisoned({t}, DType::kF32), lse = dev.poisoned({t}, DType::kF32);
      Tensor dlogits = alias ? logits : dev.poisoned({t, v});
      cross_entropy_forward_backward(dev.exec(), logits, in[1], 0.25f, losses, lse, dlogits);
      return HostTensors{dev.download(losses), dev.download(lse), dev.download(dlogits)};
    };
    c.reference = [t, v](const HostTensors& in) {
      HostTensors out = reference_cross_entropy(in[0], in[1], t, v);  // losses, lse
      HostTensor d = HostTensor::zeros({t, v});
      for (int64_t i = 0; i < t; ++i) {
        const int64_t target = static_cast<int64_t>(in[1][i]);
        if (target < 0) continue;
        for (int64_t j = 0; j < v; ++j)
          d[i * v + j] = (std::exp(in[0][i * v + j] - out[1][i]) - (j == target ? 1.0 : 0.0)) * 0.25;
      }
      out.push_back(d);
      return out;
    };
    cases.push_back(std::move(c));
  }
}

// ---- AdamW ---------------------------------------------------------------------------------

// The double-precision AdamW update of one tensor (torch.optim.AdamW's arithmetic), in
// place on p, m and v: the gradient times grad_scale, decoupled weight decay `decay`.
void adamw_reference(const AdamWConfig& cfg, double grad_scale, double decay, const HostTensor& grad,
                     HostTensor& p, HostTensor& m, HostTensor& v) {
  const double b1 = cfg.beta1, b2 = cfg.beta2, step = static_cast<double>(cfg.step);
  for (int64_t i = 0; i < p.numel(); ++i) {
    const double g = grad[i] * grad_scale;
    m[i] = b1 * m[i] + (1 - b1) * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    const double mhat = m[i] / (1 - std::pow(b1, step)), vhat = v[i] / (1 - std::pow(b2, step));
    p[i] = p[i] - cfg.lr * decay * p[i] - cfg.lr * mhat / (std::sqrt(vhat) + cfg.eps);
  }
}

void add_adamw_cases(std::vector<OpCase>& cases, Rng& rng) {
  for (DType grad_type : {DType::kF32, DType::kBF16}) {
    const Shape s{7, 9};
    AdamWConfig cfg;
    cfg.lr = 0.01f;
    cfg.beta1 = 0.9f;
    cfg.beta2 = 0.95f;
    cfg.eps = 1e-8f;
    cfg.weight_decay = 0.1f;
    cfg.step = grad_type == DType::kF32 ? 3 : 1;
    cfg.grad_scale = 0.5f;
    HostTensor grad = rng.uniform(s);
    if (grad_type == DType::kBF16)
      for (double& g : grad.v) g = as_bf16(g);
    OpCase c;
    c.name = fmt::format("adamw_step/grad_{}/step{}", dtype_name(grad_type), cfg.step);
    c.ops = {"adamw_step"};
    c.bf16_storage = false;  // the dtypes are the subject of the case
    c.inputs = {rng.uniform(s), grad, rng.uniform(s, -0.1, 0.1), rng.uniform(s, 0.001, 0.01)};
    c.forward = [cfg, grad_type](TestDevice& dev, const Tensors& in) {
      Tensor param = dev.upload(dev.download(in[0]), DType::kF32);
      Tensor grad = dev.upload(dev.download(in[1]), grad_type);
      Tensor m = dev.upload(dev.download(in[2]), DType::kF32);
      Tensor v = dev.upload(dev.download(in[3]), DType::kF32);
      adamw_step(dev.exec(), param, grad, m, v, cfg);
      return HostTensors{dev.download(param), dev.download(m), dev.download(v)};
    };
    c.reference = [cfg](const HostTensors& in) {
      HostTensor p = in[0], m = in[2], v = in[3];
      adamw_reference(cfg, cfg.grad_scale, cfg.weight_decay, in[1], p, m, v);
      return HostTensors{p, m, v};
    };
    c.atol = 1e-6;
    c.rtol = 1e-5;
    cases.push_back(std::move(c));
  }
}

// Multi-tensor AdamW and sum of squares over a list of tensors: sizes that are and are not
// multiples of the 4-element vector groups, f32 and bf16 gradients, one weight decay each.
void add_multi_tensor_cases(std::vector<OpCase>& cases, Rng& rng) {
  const std::vector<Shape> shapes = {{7, 9}, {16, 8}, {130}, {3}, {4, 33}};
  const std::vector<DType> grad_types = {DType::kF32, DType::kBF16, DType::kF32, DType::kBF16, DType::kBF16};
  const std::vector<float> decays = {0.1f, 0.0f, 0.05f, 0.1f, 0.0f};
  const size_t n = shapes.size();
  std::vector<HostTensor> grads;
  for (size_t i = 0; i < n; ++i) {
    HostTensor g = rng.uniform(shapes[i]);
    if (grad_types[i] == DType::kBF16)
      for (double& x : g.v) x = as_bf16(x);
    grads.push_back(std::move(g));
  }
  AdamWConfig cfg;
  cfg.lr = 0.02f;
  cfg.beta1 = 0.9f;
  cfg.beta2 = 0.95f;
  cfg.eps = 1e-8f;
  cfg.step = 2;
  cfg.grad_scale = 0.3f;  // a clip factor
  // Without and with working copies written in the same pass (f32 for even tensors, bf16
  // for odd ones: the updated param rounded to bf16, within one bf16 ulp of the reference).
  for (bool with_work : {false, true}) {
    OpCase c;
    c.name = with_work ? "adamw_step_multi/5_tensors_working_copies" : "adamw_step_multi/5_tensors";
    c.ops = {"adamw_step_multi"};
    c.bf16_storage = false;
    for (size_t i = 0; i < n; ++i) {  // per tensor: param, grad, m, v
      c.inputs.push_back(rng.uniform(shapes[i]));
      c.inputs.push_back(grads[i]);
      c.inputs.push_back(rng.uniform(shapes[i], -0.1, 0.1));
      c.inputs.push_back(rng.uniform(shapes[i], 0.001, 0.01));
    }
    c.forward = [cfg, grad_types, decays, n, with_work](TestDevice& dev, const Tensors& in) {
      std::vector<Tensor> t;
      for (size_t i = 0; i < n; ++i) {
        t.push_back(dev.upload(dev.download(in[4 * i]), DType::kF32));
        t.push_back(dev.upload(dev.download(in[4 * i + 1]), grad_types[i]));
        t.push_back(dev.upload(dev.download(in[4 * i + 2]), DType::kF32));
        t.push_back(dev.upload(dev.download(in[4 * i + 3]), DType::kF32));
      }
      std::vector<Tensor> work;
      for (size_t i = 0; i < n; ++i) {
        HostTensor poison = HostTensor::zeros(t[4 * i].shape());
        for (double& x : poison.v) x = 1e4;  // every element must be overwritten
        work.push_back(dev.upload(poison, i % 2 == 0 ? DType::kF32 : DType::kBF16));
      }
      std::vector<AdamWTensor> list;
      for (size_t i = 0; i < n; ++i) {
        list.push_back({&t[4 * i], &t[4 * i + 1], &t[4 * i + 2], &t[4 * i + 3], decays[i],
                        with_work ? &work[i] : nullptr});
      }
      adamw_step_multi(dev.exec(), list, cfg);
      HostTensors out;
      for (size_t i = 0; i < n; ++i) {
        out.push_back(dev.download(t[4 * i]));
        out.push_back(dev.download(t[4 * i + 2]));
        out.push_back(dev.download(t[4 * i + 3]));
        if (with_work) out.push_back(dev.download(work[i]));
      }
      return out;
    };
    c.reference = [cfg, decays, n, with_work](const HostTensors& in) {
      HostTensors out;
      for (size_t t = 0; t < n; ++t) {
        HostTensor p = in[4 * t], m = in[4 * t + 2], v = in[4 * t + 3];
        adamw_reference(cfg, cfg.grad_scale, decays[t], in[4 * t + 1], p, m, v);
        out.push_back(p);
        out.push_back(m);
        out.push_back(v);
        if (with_work) {
          HostTensor w = p;
          if (t % 2 == 1)
            for (double& x : w.v) x = as_bf16(x);
          out.push_back(w);
        }
      }
      return out;
    };
    c.atol = 1e-6;
    c.rtol = with_work ? 8e-3 : 1e-5;  // bf16: one ulp (at most 2^-7 relative) where the f32 and
                                       // double updates round to neighbouring values
    cases.push_back(std::move(c));
  }
  // master_split / master_join alone, bit for bit: values whose low 16 bits are exactly half
  // (ties: away from zero), just under and over half, zeros of both signs, infinities, the
  // largest float (rounds to infinity, as the bf16 cast does) and random values; 37 of
  // them, so that the vector kernels' scalar tail runs too.
  {
    OpCase c;
    c.name = "master_split_join/edges";
    c.ops = {"master_split", "master_join"};
    c.bf16_storage = false;
    const auto from_bits = [](uint32_t b) {
      float f;
      std::memcpy(&f, &b, 4);
      return static_cast<double>(f);
    };
    HostTensor x = rng.uniform({37}, -3.0, 3.0);
    const uint32_t edges[] = {0x3F808000u, 0xBF808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u,
                              0xC2FF8000u, 0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u,
                              0x7F7FFFFFu, 0x3F7FFFFFu, 0x00800000u};
    for (size_t i = 0; i < std::size(edges); ++i) x[static_cast<int64_t>(i)] = from_bits(edges[i]);
    c.inputs = {x};
    c.forward = [](TestDevice& dev, const Tensors& in) {
      Tensor value = dev.upload(dev.download(in[0]), DType::kF32);
      Tensor hi = dev.poisoned(value.shape(), DType::kBF16), lo = dev.poisoned(value.shape(), DType::kI16);
      Tensor back = dev.poisoned(value.shape(), DType::kF32);
      master_split(dev.exec(), value, hi, lo);
      master_join(dev.exec(), hi, lo, back);
      return HostTensors{dev.download(hi), dev.download(lo), dev.download(back)};
    };
    c.reference = [](const HostTensors& in) {
      HostTensor hi = in[0], lo = in[0];
      for (int64_t i = 0; i < hi.numel(); ++i) {
        const float f = static_cast<float>(in[0][i]);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        lo[i] = static_cast<int16_t>(static_cast<uint16_t>(b & 0xFFFFu));
        // Round to 8 significant bits, ties away from zero, in double (independent of the
        // kernels' bit arithmetic); beyond the largest bf16 the cast gives infinity.
        const double a = std::fabs(in[0][i]);
        double r = a;
        if (a != 0.0 && std::isfinite(a)) {
          const double ulp = std::ldexp(1.0, std::ilogb(a) - 7);
          r = std::floor(a / ulp + 0.5) * ulp;
          if (r > 3.3895313892515355e38) r = HUGE_VAL;  // above bf16's largest finite value
        }
        hi[i] = std::signbit(in[0][i]) ? -r : r;
      }
      return HostTensors{hi, lo, in[0]};
    };
    c.atol = 0.0;
    c.rtol = 0.0;
    c.cross_atol = 0.0;
    c.cross_rtol = 0.0;
    cases.push_back(std::move(c));
  }
  // The split master (train.master_weights = "split"): every tensor's master as a bf16 work
  // and an i16 low half, made by master_split, updated in place, read back by master_join.
  // The master must match the f32 update's reference as closely as the unsplit step does,
  // and param must be left alone (poisoned after the split).
  {
    OpCase c;
    c.name = "adamw_step_multi/5_tensors_split_master";
    c.ops = {"adamw_step_multi", "master_split", "master_join"};
    c.bf16_storage = false;
    for (size_t i = 0; i < n; ++i) {
      c.inputs.push_back(rng.uniform(shapes[i]));
      c.inputs.push_back(grads[i]);
      c.inputs.push_back(rng.uniform(shapes[i], -0.1, 0.1));
      c.inputs.push_back(rng.uniform(shapes[i], 0.001, 0.01));
    }
    c.forward = [cfg, grad_types, decays, n](TestDevice& dev, const Tensors& in) {
      std::vector<Tensor> t, hi, lo;
      for (size_t i = 0; i < n; ++i) {
        t.push_back(dev.upload(dev.download(in[4 * i]), DType::kF32));
        t.push_back(dev.upload(dev.download(in[4 * i + 1]), grad_types[i]));
        t.push_back(dev.upload(dev.download(in[4 * i + 2]), DType::kF32));
        t.push_back(dev.upload(dev.download(in[4 * i + 3]), DType::kF32));
        hi.push_back(dev.poisoned(t[4 * i].shape(), DType::kBF16));
        lo.push_back(dev.poisoned(t[4 * i].shape(), DType::kI16));
        master_split(dev.exec(), t[4 * i], hi[i], lo[i]);
        fill(dev.exec(), t[4 * i], 1e4f);  // the step must not read or write param
      }
      std::vector<AdamWTensor> list;
      for (size_t i = 0; i < n; ++i) {
        list.push_back({&t[4 * i], &t[4 * i + 1], &t[4 * i + 2], &t[4 * i + 3], decays[i], &hi[i], &lo[i]});
      }
      adamw_step_multi(dev.exec(), list, cfg);
      HostTensors out;
      for (size_t i = 0; i < n; ++i) {
        Tensor master = dev.poisoned(t[4 * i].shape(), DType::kF32);
        master_join(dev.exec(), hi[i], lo[i], master);
        out.push_back(dev.download(master));
        out.push_back(dev.download(t[4 * i + 2]));
        out.push_back(dev.download(t[4 * i + 3]));
        out.push_back(dev.download(hi[i]));
        out.push_back(dev.download(t[4 * i]));
      }
      return out;
    };
    c.reference = [cfg, decays, n](const HostTensors& in) {
      HostTensors out;
      for (size_t t = 0; t < n; ++t) {
        HostTensor p = in[4 * t], m = in[4 * t + 2], v = in[4 * t + 3];
        adamw_reference(cfg, cfg.grad_scale, decays[t], in[4 * t + 1], p, m, v);
        HostTensor w = p, poison = p;
        for (double& x : w.v) x = as_bf16(x);
        for (double& x : poison.v) x = 1e4;
        out.push_back(p);
        out.push_back(m);
        out.push_back(v);
        out.push_back(w);
        out.push_back(poison);
      }
      return out;
    };
    c.atol = 1e-6;
    c.rtol = 8e-3;  // the work: one bf16 ulp, as above; the master itself as the f32 step's
    cases.push_back(std::move(c));
  }
  {
    OpCase c;
    c.name = "sum_squares_multi/5_tensors";
    c.ops = {"sum_squares_multi"};
    c.bf16_storage = false;
    c.inputs = grads;
    c.forward = [grad_types, n](TestDevice& dev, const Tensors& in) {
      std::vector<Tensor> t;
      for (size_t i = 0; i < n; ++i) t.push_back(dev.upload(dev.download(in[i]), grad_types[i]));
      std::vector<const Tensor*> list;
      for (const Tensor& x : t) list.push_back(&x);
      return HostTensors{HostTensor::scalar(sum_squares_multi(dev.exec(), list))};
    };
    c.reference = [n](const HostTensors& in) {
      double s = 0.0;
      for (size_t t = 0; t < n; ++t)
        for (double x : in[t].v) s += x * x;
      return HostTensors{HostTensor::scalar(s)};
    };
    c.atol = 1e-6;
    c.rtol = 1e-6;
    cases.push_back(std::move(c));
  }
}

// ---- device-resident step statistics ---------------------------------------------

// sum_squares_into (written and accumulated) and adamw_step_multi clipped by a device-held
// norm (clipping and not clipping).
void add_step_stats_cases(std::vector<OpCase>& cases, Rng& rng) {
  const std::vector<Shape> shapes = {{7, 9}, {130}, {4, 33}};
  const std::vector<DType> types = {DType::kF32, DType::kBF16, DType::kF32};
  const size_t n = shapes.size();
  HostTensors xs;
  double sumsq = 0;
  for (size_t i = 0; i < n; ++i) {
    HostTensor g = rng.uniform(shapes[i]);
    if (types[i] == DType::kBF16)
      for (double& x : g.v) x = as_bf16(x);
    for (double x : g.v) sumsq += x * x;
    xs.push_back(std::move(g));
  }
  for (bool acc : {false, true}) {
    OpCase c;
    c.name = std::string("sum_squares_into/") + (acc ? "accumulate" : "write");
    c.ops = {"sum_squares_into"};
    c.bf16_storage = false;
    c.inputs = xs;
    c.inputs.push_back(HostTensor::scalar(as_f32(1.25)));
    c.inputs.back().shape = {1};
    c.forward = [types, n, acc](TestDevice& dev, const Tensors& in) {
      std::vector<Tensor> t;
      for (size_t i = 0; i < n; ++i) t.push_back(dev.upload(dev.download(in[i]), types[i]));
      std::vector<const Tensor*> list;
      for (const Tensor& x : t) list.push_back(&x);
      Tensor out = acc ? dev.upload(dev.download(in[n]), DType::kF32) : dev.poisoned({1}, DType::kF32);
      sum_squares_into(dev.exec(), list, out, acc);
      return HostTensors{dev.download(out)};
    };
    c.reference = [n, acc](const HostTensors& in) {
      double s = acc ? in[n][0] : 0.0;
      for (size_t t = 0; t < n; ++t)
        for (double x : in[t].v) s += x * x;
      HostTensor out = HostTensor::zeros({1});
      out[0] = s;
      return HostTensors{out};
    };
    c.atol = 1e-6;
    c.rtol = 1e-6;
    cases.push_back(std::move(c));
  }
  // AdamW clipped by the norm the device holds: max below the norm (clips) and above it.
  const double norm = std::sqrt(static_cast<double>(static_cast<float>(sumsq)));
  // The third: lr and the bias corrections from a device schedule (CUDA graphs of the step),
  // the launch's own lr and step set to other values that must not be used.
  for (auto [max_norm, schedule] : {std::pair{0.5 * norm, false}, {2.0 * norm, false}, {0.5 * norm, true}}) {
    AdamWConfig cfg;
    cfg.lr = 0.02f;
    cfg.step = 3;
    cfg.grad_scale = 0.8f;
    cfg.clip_max_norm = static_cast<float>(max_norm);
    OpCase c;
    c.name = std::string("adamw_step_multi/device_clip_") + (max_norm < norm ? "clips" : "no_clip") +
             (schedule ? "_device_schedule" : "");
    c.ops = {"adamw_step_multi", "sum_squares_into"};
    c.bf16_storage = false;
    for (size_t i = 0; i < n; ++i) {  // per tensor: param, grad, m, v
      c.inputs.push_back(rng.uniform(shapes[i]));
      c.inputs.push_back(xs[i]);
      c.inputs.push_back(rng.uniform(shapes[i], -0.1, 0.1));
      c.inputs.push_back(rng.uniform(shapes[i], 0.001, 0.01));
    }
    c.forward = [cfg, types, n, schedule](TestDevice& dev, const Tensors& in) {
      std::vector<Tensor> t;
      for (size_t i = 0; i < n; ++i) {
        t.push_back(dev.upload(dev.download(in[4 * i]), DType::kF32));
        t.push_back(dev.upload(dev.download(in[4 * i + 1]), types[i]));
        t.push_back(dev.upload(dev.download(in[4 * i + 2]), DType::kF32));
        t.push_back(dev.upload(dev.download(in[4 * i + 3]), DType::kF32));
      }
      std::vector<const Tensor*> grads;
      std::vector<AdamWTensor> list;
      for (size_t i = 0; i < n; ++i) {
        grads.push_back(&t[4 * i + 1]);
        list.push_back({&t[4 * i], &t[4 * i + 1], &t[4 * i + 2], &t[4 * i + 3], 0.1f});
      }
      Tensor sq = dev.poisoned({1}, DType::kF32);
      sum_squares_into(dev.exec(), grads, sq);  // the norm stays on the device
      AdamWConfig dc = cfg;
      dc.clip_sum_squares = &sq;
      Tensor sched;
      if (schedule) {
        const std::array<float, 3> v = adamw_schedule(cfg);
        sched =
            dev.upload(HostTensor{{3}, DType::kF32, std::vector<double>(v.begin(), v.end())}, DType::kF32);
        dc.device_schedule = &sched;
        dc.lr = 7.0f;  // neither may be read
        dc.step = 1;
      }
      adamw_step_multi(dev.exec(), list, dc);
      HostTensors out;
      for (size_t i = 0; i < n; ++i) {
        out.push_back(dev.download(t[4 * i]));
        out.push_back(dev.download(t[4 * i + 2]));
        out.push_back(dev.download(t[4 * i + 3]));
      }
      return out;
    };
    c.reference = [cfg, n, norm](const HostTensors& in) {
      HostTensors out;
      const double clip = norm > cfg.clip_max_norm ? cfg.clip_max_norm / norm : 1.0;
      for (size_t t = 0; t < n; ++t) {
        HostTensor p = in[4 * t], m = in[4 * t + 2], v = in[4 * t + 3];
        adamw_reference(cfg, cfg.grad_scale * clip, 0.1, in[4 * t + 1], p, m, v);
        out.push_back(p);
        out.push_back(m);
        out.push_back(v);
      }
      return out;
    };
    c.atol = 1e-6;
    c.rtol = 1e-5;
    cases.push_back(std::move(c));
  }
}

// ---- fp8 quantization ----------------------------------------------------------------------

void add_quant_cases(std::vector<OpCase>& cases, Rng& rng) {
  struct Spec {
    DType fp8;
    int64_t rows, cols, block;
  };
  for (Spec sp : {Spec{DType::kF8E4M3, 4, 300, 0}, Spec{DType::kF8E4M3, 3, 300, 128},
                  Spec{DType::kF8E5M2, 3, 200, 128}, Spec{DType::kF8E5M2, 2, 17, 0}}) {
    const int64_t nb = sp.block == 0 ? 1 : (sp.cols + sp.block - 1) / sp.block;
    const double qmax = sp.fp8 == DType::kF8E4M3 ? kFp8E4M3Max : kFp8E5M2Max;
    // fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: half a step is 2^-4 or 2^-3 relative;
    // below the normal range the step is absolute (2^-9 or 2^-16 in q units).
    const double q_rtol = sp.fp8 == DType::kF8E4M3 ? 1.0 / 16 : 1.0 / 8;
    const double q_atol = sp.fp8 == DType::kF8E4M3 ? 1.0 / 512 : 1.0 / 65536;
    const std::string tag = fmt::format("{}/{}x{}/block{}", dtype_name(sp.fp8), sp.rows, sp.cols, sp.block);
    {
      HostTensor x = rng.uniform({sp.rows, sp.cols});
      for (int64_t r = 0; r < sp.rows; ++r)  // rows of very different magnitudes
        for (int64_t j = 0; j < sp.cols; ++j)
          x[r * sp.cols + j] = as_f32(x[r * sp.cols + j] * std::pow(10.0, r - 1.0));
      if (sp.rows > 2)
        for (int64_t j = 0; j < sp.cols; ++j) x[2 * sp.cols + j] = 0.0;  // all-zero row: scale 1
      OpCase c;
      c.name = "quantize_fp8/" + tag;
      c.ops = {"quantize_fp8"};
      c.inputs = {x};
      c.forward = [sp, nb](TestDevice& dev, const Tensors& in) {
        Tensor q = dev.poisoned({sp.rows, sp.cols}, sp.fp8),
               scales = dev.poisoned({sp.rows, nb}, DType::kF32);
        quantize_fp8(dev.exec(), in[0], sp.block, q, scales);
        return HostTensors{dev.download(q), dev.download(scales)};
      };
      // Reference: the exact scaled values x / scale, which q must round to within half
      // an fp8 step; the scales themselves to f32 precision.
      c.reference = [sp, nb, qmax](const HostTensors& in) {
        HostTensor q = HostTensor::zeros({sp.rows, sp.cols}), scales = HostTensor::zeros({sp.rows, nb});
        const int64_t block = sp.block == 0 ? sp.cols : sp.block;
        for (int64_t r = 0; r < sp.rows; ++r) {
          for (int64_t b = 0; b < nb; ++b) {
            double amax = 0.0;
            for (int64_t j = b * block; j < std::min(sp.cols, (b + 1) * block); ++j)
              amax = std::max(amax, std::fabs(in[0][r * sp.cols + j]));
            const double s = amax > 0.0 ? amax / qmax : 1.0;
            scales[r * nb + b] = s;
            for (int64_t j = b * block; j < std::min(sp.cols, (b + 1) * block); ++j)
              q[r * sp.cols + j] = std::clamp(in[0][r * sp.cols + j] / s, -qmax, qmax);
          }
        }
        return HostTensors{q, scales};
      };
      c.atol = q_atol;
      c.rtol = q_rtol;
      cases.push_back(std::move(c));
    }
    for (DType out_type : {DType::kF32, DType::kBF16}) {
      // Codes exactly representable in the fp8 format, and positive scales.
      HostTensor q = rng.uniform({sp.rows, sp.cols}, -qmax, qmax);
      for (double& v : q.v) {
        float f = static_cast<float>(v), back;
        uint8_t bits = sp.fp8 == DType::kF8E4M3 ? float_to_fp8e4m3_bits(f) : float_to_fp8e5m2_bits(f);
        back = sp.fp8 == DType::kF8E4M3 ? fp8e4m3_bits_to_float(bits) : fp8e5m2_bits_to_float(bits);
        v = back;
      }
      OpCase c;
      c.name = fmt::format("dequantize_fp8/{}/out_{}", tag, dtype_name(out_type));
      c.ops = {"dequantize_fp8"};
      c.inputs = {q, rng.uniform({sp.rows, nb}, 1e-4, 1e-2)};
      c.f32_inputs = {1};
      c.forward = [sp, out_type](TestDevice& dev, const Tensors& in) {
        Tensor qd = dev.upload(dev.download(in[0]), sp.fp8);
        Tensor out = dev.poisoned({sp.rows, sp.cols}, out_type);
        dequantize_fp8(dev.exec(), qd, in[1], sp.block, out);
        return HostTensors{dev.download(out)};
      };
      c.reference = [sp, nb](const HostTensors& in) {
        HostTensor out = HostTensor::zeros({sp.rows, sp.cols});
        const int64_t block = sp.block == 0 ? sp.cols : sp.block;
        for (int64_t r = 0; r < sp.rows; ++r)
          for (int64_t j = 0; j < sp.cols; ++j)
            out[r * sp.cols + j] = in[0][r * sp.cols + j] * in[1][r * nb + j / block];
        return HostTensors{out};
      };
      c.atol = 0.0;
      c.rtol = out_type == DType::kF32 ? 1e-6 : 1.0 / 256;
      cases.push_back(std::move(c));
    }
  }
}

// ---- communication codecs -------------------------------------------------------
// moe_permute_fp8 (the fused permute + per-row e4m3 quantisation of the expert dispatch)
// and sum_chunks (the fp32 local sum of a bf16 reduce-scatter). Their CPU versions equal
// comm/compression.h's codecs bit for bit (tests/comm/comm_compression_test.cc); the
// CUDA test holds the CUDA versions to the CPU ones.
void add_codec_cases(std::vector<OpCase>& cases, Rng& rng) {
  const double qmax = kFp8E4M3Max;
  for (const auto& [t, dim, k] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{9, 40, 2}, {5, 300, 1}}) {
    const int64_t rows = t * k + 3;  // 3 rows no copy maps to: zero codes, scale 1
    HostTensor x = rng.uniform({t, dim});
    for (int64_t i = 0; i < t; ++i)  // rows of very different magnitudes
      for (int64_t j = 0; j < dim; ++j) x[i * dim + j] = as_f32(x[i * dim + j] * std::pow(10.0, i % 4 - 2.0));
    for (int64_t j = 0; j < dim; ++j) x[1 * dim + j] = 0.0;  // an all-zero token
    std::vector<int64_t> order(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) order[static_cast<size_t>(i)] = i;
    std::shuffle(order.begin(), order.end(), rng.gen());
    HostTensor row_map = HostTensor::zeros({t * k}, DType::kI32);
    for (int64_t i = 0; i < t * k; ++i) row_map[i] = static_cast<double>(order[static_cast<size_t>(i)]);
    OpCase c;
    c.name = fmt::format("moe_permute_fp8/{}x{}/k{}", t, dim, k);
    c.ops = {"moe_permute_fp8"};
    c.inputs = {x, row_map};
    c.forward = [rows, dim](TestDevice& dev, const Tensors& in) {
      Tensor q = dev.poisoned({rows, dim}, DType::kF8E4M3), scales = dev.poisoned({rows}, DType::kF32);
      moe_permute_fp8(dev.exec(), in[0], in[1], in[1].numel() / in[0].size(0), q, scales);
      return HostTensors{dev.download(q), dev.download(scales)};
    };
    // Reference: each copy's row as x / (amax / 448), which the codes must round to within
    // half an e4m3 step; unmapped rows zero with scale 1.
    c.reference = [t, k, rows, dim, qmax](const HostTensors& in) {
      HostTensor q = HostTensor::zeros({rows, dim}), scales = HostTensor::zeros({rows});
      for (int64_t r = 0; r < rows; ++r) scales[r] = 1.0;
      for (int64_t cp = 0; cp < t * k; ++cp) {
        const int64_t r = static_cast<int64_t>(in[1][cp]), tok = cp / k;
        double amax = 0.0;
        for (int64_t j = 0; j < dim; ++j) amax = std::max(amax, std::fabs(in[0][tok * dim + j]));
        const double s = amax > 0.0 ? amax / qmax : 1.0;
        scales[r] = s;
        for (int64_t j = 0; j < dim; ++j) q[r * dim + j] = std::clamp(in[0][tok * dim + j] / s, -qmax, qmax);
      }
      return HostTensors{q, scales};
    };
    c.atol = 1.0 / 512;
    c.rtol = 1.0 / 16;
    cases.push_back(std::move(c));
  }
  for (DType in_type : {DType::kF32, DType::kBF16}) {
    const int64_t n = 4, m = 777;
    OpCase c;
    c.name = fmt::format("sum_chunks/{}/{}x{}", dtype_name(in_type), n, m);
    c.ops = {"sum_chunks"};
    c.inputs = {rng.uniform({n, m})};
    c.bf16_storage = false;
    c.forward = [in_type, m](TestDevice& dev, const Tensors& in) {
      Tensor x = dev.upload(dev.download(in[0]), in_type);
      Tensor out = dev.poisoned({m}, DType::kF32);
      sum_chunks(dev.exec(), x, out);
      return HostTensors{dev.download(out)};
    };
    c.reference = [in_type, n, m](const HostTensors& in) {
      HostTensor out = HostTensor::zeros({m});
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < n; ++r) {
          const double v = in[0][r * m + i];
          out[i] += in_type == DType::kBF16 ? as_bf16(v) : v;
        }
      return HostTensors{out};
    };
    c.atol = 1e-6;
    c.rtol = 1e-6;
    cases.push_back(std::move(c));
  }
}

}  // namespace

std::vector<OpCase> all_op_cases(uint64_t seed) {
  Rng rng(seed);
  std::vector<OpCase> cases;
  add_elementwise_cases(cases, rng);
  add_matmul_cases(cases, rng);
  add_grouped_matmul_cases(cases, rng);
  add_embedding_cases(cases, rng);
  add_rmsnorm_cases(cases, rng);
  add_rmsnorm_add_cases(cases, rng);
  add_rope_cases(cases, rng);
  add_attention_cases(cases, rng);
  add_softmax_cases(cases, rng);
  add_router_cases(cases, rng);
  add_logsumexp_cases(cases, rng);
  add_moe_cases(cases, rng);
  add_swiglu_cases(cases, rng);
  add_cross_entropy_cases(cases, rng);
  add_cross_entropy_fused_cases(cases, rng);
  add_adamw_cases(cases, rng);
  add_multi_tensor_cases(cases, rng);
  add_quant_cases(cases, rng);
  add_step_stats_cases(cases, rng);
  add_codec_cases(cases, rng);
  return cases;
}

void PrintTo(const OpRun& r, std::ostream* os) {
  *os << r.case_name << " with " << dtype_name(r.storage) << " storage";
}

std::vector<OpRun> op_runs(const std::vector<OpCase>& table, bool backward,
                           const std::function<bool(const OpCase&)>& with_bf16) {
  std::vector<OpRun> r;
  for (DType storage : {DType::kF32, DType::kBF16}) {
    for (size_t i = 0; i < table.size(); ++i) {
      const OpCase& c = table[i];
      if (backward && !c.backward) continue;
      if (storage == DType::kBF16 && !(c.bf16_storage && with_bf16(c))) continue;
      r.push_back({i, storage, c.name});
    }
  }
  return r;
}

std::string op_run_name(const OpRun& r) {
  std::string s = r.case_name;
  if (r.storage != DType::kF32) s += "/" + std::string(dtype_name(r.storage));
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

}  // namespace troupe::kernels::testing
