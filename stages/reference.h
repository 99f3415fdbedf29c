// reference.h: the single-process trainer that the swarm is checked against.
//
// Defines swarm::train_reference: the whole model, built from the same StageModel pieces as
// the stage servers, trained in one process on the same microbatches (sample_microbatch with
// the job's seed, indices step * M .. step * M + M - 1), with the same accumulation (each
// microbatch's backward is of loss * samples), the same per-stage clipping and AdamW. It is
// what the `sync` schedule with one peer per stage must equal, and the `single` side of
// `swarm bench pipeline`. A job with the subspace codec trains the constrained model
// (stages/subspace.h) without any codec: what its swarm must equal with fp32 coefficients.
#pragma once

#include <functional>
#include <vector>

#include <string>

#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "runtime/precision.h"

namespace swarm {

struct ReferenceResult {
  std::vector<double> losses;   // train loss per step: mean of the step's microbatch losses
  double val_loss = 0;          // after the last step, over spec.eval.batches val microbatches
  double tokens_per_s = 0;      // training tokens / wall seconds (evaluation excluded)
};

struct ReferenceOptions {
  int threads = 0;                          // torch intra-op threads (0 leaves libtorch's default)
  std::string device = "cpu";               // "cpu", "cuda", "cuda:N"
  Precision precision = Precision::kAuto;   // as swarm-stage --precision (the job's pin wins)
  int max_steps = 0;                        // train only the job's first max_steps steps (0: all); same lr schedule
};

// progress(step, loss) is called after every step. With loss scaling (model.loss_scale, or fp16)
// one scale covers the whole model: an overflow anywhere skips the step everywhere, the rule
// the swarm's stages follow when the router relays their overflows. Throws InputError for a
// device or precision this build cannot use.
ReferenceResult train_reference(const JobSpec& spec, const TokenData& data, const ReferenceOptions& opt,
                                const std::function<void(int, double)>& progress = {});
// The CPU in the precision `auto` picks there (fp32).
ReferenceResult train_reference(const JobSpec& spec, const TokenData& data, int threads,
                                const std::function<void(int, double)>& progress = {});

}  // namespace swarm
