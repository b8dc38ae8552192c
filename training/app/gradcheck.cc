// training/app/gradcheck.cc — finite-difference check of a stage program's gradients.
#include "training/app/gradcheck.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "training/parallel/group_ops.h"

namespace troupe::training {

namespace {

// The program's pass over one micro-batch, as the Stage runs it at 1x1x1.
struct Pass {
  StageProgram& p;
  const layers::Ctx& c;
  Tensor ids, targets;

  // The summed token loss; with `grads`, every parameter's gradient of it is added.
  double run(bool grads) {
    Tensor x = p.embed(c, ids);
    const int64_t n = p.num_blocks();
    std::vector<std::unique_ptr<StageProgram::Saved>> saved(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x = p.block_forward(c, i, x, saved[static_cast<size_t>(i)], grads);
    if (!grads) return p.head_loss_sum(c, x, targets);
    Tensor dx;
    const double loss = p.head_forward_backward(c, x, targets, 1.0f, dx);
    for (int64_t i = n; i-- > 0;) {
      TROUPE_CHECK(saved[static_cast<size_t>(i)] != nullptr, "gradcheck: block {} kept nothing for backward",
                   i);
      dx = p.block_backward(c, i, dx, *saved[static_cast<size_t>(i)]);
      saved[static_cast<size_t>(i)].reset();
    }
    p.embed_backward(c, ids, dx);
    return loss;
  }
};

}  // namespace

Result<GradcheckResult> gradcheck(const ProgramFactory& program, const layers::TrainConfig& tc_in,
                                  const GradcheckOptions& o) {
  layers::TrainConfig tc = tc_in;
  tc.parallel.pp = tc.parallel.dp = tc.parallel.n = 1;
  GradcheckResult res;
  res.batch = std::min(o.batch, tc.train.micro_batch_size);
  res.seq = std::min(o.seq, tc.train.seq_len);
  const layers::Ctx c = layers::Ctx::cpu();
  CommTime time;
  const StageEnv env{tc, ParallelCoord{}, 1, 1, 1, true, true, res.batch, res.seq, 1.0f, c, nullptr, time};
  TROUPE_ASSIGN_OR_RETURN(std::unique_ptr<StageProgram> prog, program(env));
  if (prog == nullptr) return internal_error("gradcheck: the program factory returned nothing");
  const std::vector<ProgramParam> params = prog->parameters();
  if (params.empty()) return invalid_argument("gradcheck: the program holds no parameter");

  // Seeded random tokens and targets: the check needs no data.
  const int64_t t = res.batch * res.seq;
  std::mt19937_64 rng(tc.train.seed);
  std::vector<int32_t> ids(static_cast<size_t>(t)), targets(static_cast<size_t>(t));
  for (auto* v : {&ids, &targets})
    for (int32_t& x : *v) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(tc.model.vocab_size));
  Pass pass{*prog, c, Tensor::from_ints({t}, ids), Tensor::from_ints({t}, targets)};

  for (const ProgramParam& p : params) {
    p.param->grad.fill(0.0f);
    p.param->grad_stale = false;
  }
  res.loss = pass.run(true);
  for (const ProgramParam& p : params) {
    layers::Parameter& w = *p.param;
    const std::vector<float> g = w.grad.to_floats();
    const int64_t n = w.numel();
    GradcheckResult::Param r{p.name, n, 0, 0};
    double gmax = 0;
    for (float v : g) {
      r.grad_norm += static_cast<double>(v) * v;
      gmax = std::max(gmax, static_cast<double>(std::fabs(v)));
    }
    r.grad_norm = std::sqrt(r.grad_norm);
    // Two directions: random signs (every element), and the gradient's own.
    std::mt19937_64 dr(layers::hash_string(p.name) ^ tc.train.seed);
    std::vector<std::vector<float>> dirs(2, std::vector<float>(static_cast<size_t>(n)));
    for (float& u : dirs[0]) u = (dr() & 1) != 0 ? 1.0f : -1.0f;
    for (int64_t i = 0; i < n; ++i)
      dirs[1][static_cast<size_t>(i)] =
          gmax > 0 ? static_cast<float>(g[static_cast<size_t>(i)] / gmax) : 0.0f;
    const Tensor saved = w.value.clone();
    float* v = w.value.data<float>();
    const float* v0 = saved.data<float>();
    // (L(w + h u) - L(w - h u)) / 2h, at h and h/2, extrapolated (Richardson) so that the
    // loss's third derivative drops out.
    auto derivative = [&](const std::vector<float>& u, float h) {
      for (int64_t i = 0; i < n; ++i) v[i] = v0[i] + h * u[static_cast<size_t>(i)];
      const double plus = pass.run(false);
      for (int64_t i = 0; i < n; ++i) v[i] = v0[i] - h * u[static_cast<size_t>(i)];
      const double minus = pass.run(false);
      w.value.copy_from(saved);
      return (plus - minus) / (2.0 * static_cast<double>(h));
    };
    // The step: along a direction the loss moves by about h |grad| (GradcheckOptions).
    const float h =
        std::clamp(static_cast<float>(o.move_target / std::max(r.grad_norm, 1e-30)), o.min_step, o.max_step);
    for (const std::vector<float>& u : dirs) {
      double analytic = 0, u2 = 0;
      for (int64_t i = 0; i < n; ++i) {
        analytic += static_cast<double>(g[static_cast<size_t>(i)]) * u[static_cast<size_t>(i)];
        u2 += static_cast<double>(u[static_cast<size_t>(i)]) * u[static_cast<size_t>(i)];
      }
      const double numeric = (4.0 * derivative(u, h / 2) - derivative(u, h)) / 3.0;
      // Relative to the derivative's scale: a random-sign direction's <g, u> is of the
      // order of |g| (its standard deviation), however much its terms cancel.
      const double scale = std::max(
          {std::fabs(analytic), std::fabs(numeric), r.grad_norm * std::sqrt(u2 / static_cast<double>(n))});
      const double err = scale > 0 ? std::fabs(analytic - numeric) / scale : 0.0;
      r.worst = std::max(r.worst, err);
    }
    if (r.worst >= res.worst) {
      res.worst = r.worst;
      res.worst_param = r.name;
    }
    res.params.push_back(std::move(r));
  }
  return res;
}

Status run_gradcheck(const std::string& app, const ProgramFactory& program, const layers::TrainConfig& tc,
                     const GradcheckOptions& o) {
  TROUPE_ASSIGN_OR_RETURN(GradcheckResult r, gradcheck(program, tc, o));
  fmt::print(
      "{}: gradcheck on the CPU (f32 kernels), layout 1x1x1, {} x {} random tokens, loss {:.6f} (summed); "
      "per "
      "parameter w the worst relative error of central differences (L(w+hu) - L(w-hu)) / 2h (Richardson, h "
      "= {} / |grad| within [{}, {}]) against <grad, u>, u = random signs and the gradient's direction\n",
      app, r.batch, r.seq, r.loss, o.move_target, o.min_step, o.max_step);
  size_t width = 9;
  for (const auto& p : r.params) width = std::max(width, p.name.size());
  fmt::print("  {:<{}} {:>10} {:>11} {:>10}\n", "parameter", width, "elements", "|grad|", "rel. error");
  for (const auto& p : r.params) {
    fmt::print("  {:<{}} {:>10} {:>11.4e} {:>10.2e}{}\n", p.name, width, p.elements, p.grad_norm, p.worst,
               p.worst > o.tolerance ? "  FAILED" : "");
  }
  fmt::print("{}: gradcheck of {} parameters: worst relative error {:.2e} ({}), tolerance {:.0e}: {}\n", app,
             r.params.size(), r.worst, r.worst_param, o.tolerance, r.worst <= o.tolerance ? "ok" : "FAILED");
  std::fflush(stdout);
  if (r.worst > o.tolerance) {
    return failed_precondition(
        "gradcheck: the gradient of {} is off by {:.2e} (relative) from finite differences of the loss "
        "(tolerance {:.0e}): its backward does not match its forward",
        r.worst_param, r.worst, o.tolerance);
  }
  return ok_status();
}

}  // namespace troupe::training
