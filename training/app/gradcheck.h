// training/app/gradcheck.h — defines gradcheck: every parameter gradient of a stage
// program (stage_program.h) against central finite differences of its loss, on the CPU
// at layout 1x1x1 (`<app> --config ... --gradcheck`, run_app).
//
// One micro-batch of seeded random tokens (no data needed) goes through the program as
// the Stage runs it — embed, every block's forward, the head's loss and gradient, the
// blocks' backward, the embedding's backward — giving the analytic gradient g of the
// summed token loss L. Then, per parameter w and per direction u (a random +-1 vector,
// and g's own direction scaled to max |u_i| = 1), the directional derivative of the
// evaluation forward's loss (head_loss_sum, accumulated in double) — central differences
// at h and h/2 extrapolated (Richardson), which cancels the third-derivative term — is
// compared with <g, u>, relative to the larger of the two or, for the random direction,
// to |g| (the scale of <g, u> however much its terms cancel). A directional check sees
// every element at once, so a gradient wrong anywhere shows. The CPU kernels store f32
// (they have no f64 path): the step and the tolerance are sized for that (dense_lm and
// parallel_lm: worst errors 7e-4 to 8e-3 over their configs, tolerance 2e-2); a wrong gradient is off by far
// more.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "training/run_config.h"
#include "training/stage/stage_program.h"

namespace troupe::training {

struct GradcheckOptions {
  int64_t batch = 2;  // sequences (at most train.micro_batch_size)
  int64_t seq = 16;   // tokens per sequence (at most train.seq_len)
  // The step h per element, per parameter: move_target / |grad|, within [min_step,
  // max_step]. Along a direction the loss then moves by about move_target: large against
  // the f32 rounding of the summed loss, small against its curvature.
  double move_target = 0.004;
  float min_step = 1e-3f, max_step = 0.1f;
  double tolerance = 2e-2;
};

struct GradcheckResult {
  struct Param {
    std::string name;
    int64_t elements = 0;
    double grad_norm = 0;
    double worst = 0;  // the larger relative error of its two directions
  };
  std::vector<Param> params;
  double loss = 0;  // L, summed over the micro-batch's tokens
  double worst = 0;
  std::string worst_param;
  int64_t batch = 0, seq = 0;
};

// Builds `program` for `tc` at 1x1x1 on the CPU and checks every parameter it holds.
Result<GradcheckResult> gradcheck(const ProgramFactory& program, const layers::TrainConfig& tc,
                                  const GradcheckOptions& o = {});

// gradcheck, printed as a table (one line per parameter: elements, gradient norm, worst
// relative error); an error naming the worst parameter when it exceeds the tolerance.
Status run_gradcheck(const std::string& app, const ProgramFactory& program, const layers::TrainConfig& tc,
                     const GradcheckOptions& o = {});

}  // namespace troupe::training
