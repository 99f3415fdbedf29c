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

#include "runtime/data.h"
#include "runtime/job_spec.h"

namespace swarm {

struct ReferenceResult {
  std::vector<double> losses;   // train loss per step: mean of the step's microbatch losses
  double val_loss = 0;          // after the last step, over spec.eval.batches val microbatches
  double tokens_per_s = 0;      // training tokens / wall seconds (evaluation excluded)
};

// threads: torch intra-op threads (0 leaves libtorch's default).
// progress(step, loss) is called after every step.
ReferenceResult train_reference(const JobSpec& spec, const TokenData& data, int threads,
                                const std::function<void(int, double)>& progress = {});

}  // namespace swarm
