// optim.h: the inner optimizer of a stage: AdamW with linear warmup then cosine decay.
//
// Defines swarm::AdamW over a stage's parameters, `lr_at`, and ParamConstraint (a linear
// constraint a step keeps, e.g. stages/subspace.h's). Written out by hand (not
// torch::optim) so its state is plain named tensors for checkpoints and the same on every
// libtorch version. Gradients arrive as sums over samples; `step(samples)` divides by the
// sample count, clips the stage's gradient to grad_clip (L2 norm over this stage's parameters:
// a pipeline cannot see the whole model's norm without another round trip), updates, and
// zeroes the gradients.
//
// The update is torch.optim.AdamW's (bias-corrected moments; decoupled weight decay
// p *= 1 - lr * weight_decay on tensors with dim >= 2 only, as nanoGPT's groups), and clipping
// is torch.nn.utils.clip_grad_norm_'s (scale by grad_clip / (norm + 1e-6) when below 1).
// With optimizer.name "sgd" the same class takes plain SGD steps (p -= lr * g, same schedule,
// clipping and decay; the moments stay zero): the inner optimizer of the closed-form tests.
// Parameters are updated in place through their `.data()` alias under NoGradGuard, so their
// autograd version counters do not move: a graph built before a step (the stage server's
// affinity cache) still runs backward after it, with the updated values.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "runtime/job_spec.h"

namespace swarm {

// Learning rate of optimizer step `step` (0-based) of a job of `total_steps`:
// lr * (step + 1) / warmup_steps for step < warmup_steps, then a cosine from lr (at step
// warmup_steps) down to min_lr (at step total_steps - 1, and after).
double lr_at(const OptimizerSpec& opt, int64_t step, int64_t total_steps);

// A constraint on a stage's parameters that every AdamW step keeps: the gradients are projected
// onto its tangent space before the step (so clipping and the moments see the constrained
// model's gradient) and the parameters back onto the constraint set after the update.
class ParamConstraint {
 public:
  virtual ~ParamConstraint() = default;
  // Both take the stage's named parameters; they skip what they do not constrain (and, for the
  // gradients, parameters without one).
  virtual void project_grads(const std::vector<std::pair<std::string, torch::Tensor>>& params) const = 0;
  virtual void project_params(const std::vector<std::pair<std::string, torch::Tensor>>& params) const = 0;
};

class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, OptimizerSpec opt,
        int64_t total_steps);

  // One update with the gradients accumulated in the parameters' .grad(), which hold sums
  // over `samples` samples, multiplied by `grad_scale` (a loss scale; a power of two, so the
  // one division by samples x grad_scale rounds exactly as dividing by samples alone would).
  // Returns the gradient norm before clipping (of the mean gradient). Parameters without a
  // gradient are left alone (no decay either), as torch does. `lr_step` >= 0: the learning rate
  // of that (0-based) step of the schedule instead of this optimizer's own count (the async
  // schedule: a peer steps at the job's step, not at its own); bias correction counts its own.
  // `lr_factor` multiplies the schedule's learning rate (async: the gradients' staleness).
  double step(int64_t samples, double grad_scale = 1.0, int64_t lr_step = -1, double lr_factor = 1.0);
  // Drops the gradients (sets them undefined, as torch 2.x's zero_grad).
  void zero_grad();
  // Keeps `c` (not owned; it outlives this optimizer) from the next step on; null for none.
  void set_constraint(const ParamConstraint* c) { constraint_ = c; }
  int64_t steps_taken() const { return t_; }
  // The learning rate the next step() will use.
  double next_lr() const { return lr_at(opt_, t_, total_steps_); }

  // State for checkpoints and donors: "<param>.exp_avg", "<param>.exp_avg_sq" (copies, on the
  // parameters' device), and "step" (int64 scalar on the CPU). load_state takes the same
  // names (any device) and throws InputError when a name is missing or a shape differs.
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state);

 private:
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<torch::Tensor> m_, v_;
  std::vector<bool> decay_;
  OptimizerSpec opt_;
  int64_t total_steps_;
  int64_t t_ = 0;
  const ParamConstraint* constraint_ = nullptr;
};

}  // namespace swarm
