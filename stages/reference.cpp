// reference.cpp: swarm::train_reference, the single-process trainer the swarm must equal.
#include "stages/reference.h"

#include <chrono>
#include <memory>

#include "runtime/errors.h"
#include "stages/compute_threads.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/subspace.h"

namespace swarm {
namespace {

// int32 [samples, seq_len] row-major -> int64 tensor.
torch::Tensor tokens(const std::vector<int32_t>& v, int samples, int seq_len) {
  SWARM_CHECK(v.size() == static_cast<size_t>(samples) * static_cast<size_t>(seq_len),
              "microbatch size does not match samples * seq_len");
  return torch::from_blob(const_cast<int32_t*>(v.data()), {samples, seq_len}, torch::kInt32)
      .to(torch::kLong);
}

torch::Tensor forward_all(std::vector<std::unique_ptr<StageModel>>& stages, torch::Tensor x) {
  for (auto& s : stages) x = s->forward(x);
  return x;
}

}  // namespace

ReferenceResult train_reference(const JobSpec& spec, const TokenData& data, int threads,
                                const std::function<void(int, double)>& progress) {
  set_compute_threads(threads);
  const int S = spec.partition.stages;
  std::vector<int> layers = spec.partition.layers_per_stage;
  if (layers.empty() && S == 1) layers.push_back(spec.model.n_layer);
  SWARM_CHECK(static_cast<int>(layers.size()) == S, "partition.layers_per_stage must have one entry per stage");

  std::vector<std::unique_ptr<StageModel>> stages;
  std::vector<std::unique_ptr<AdamW>> optims;
  std::vector<std::unique_ptr<Subspace>> subspaces;  // the subspace codec's constraint, per stage
  int first = 0;  // the prefix sum JobSpec::first_layer computes
  for (int s = 0; s < S; ++s) {
    stages.push_back(std::make_unique<StageModel>(spec.model, s, S, first, layers[s], spec.seed));
    optims.push_back(std::make_unique<AdamW>(stages.back()->named_parameters(), spec.optimizer, spec.steps));
    subspaces.push_back(Subspace::for_stage(spec, s));
    if (subspaces.back()) {
      subspaces.back()->project_params(stages.back()->named_parameters());
      optims.back()->set_constraint(subspaces.back().get());
    }
    first += layers[s];
  }
  SWARM_CHECK(first == spec.model.n_layer, "partition.layers_per_stage must sum to n_layer");

  const int M = spec.microbatches_per_step();
  const int mb = spec.batch.microbatch_size;
  const int T = spec.model.seq_len;
  SWARM_CHECK(M >= 1, "batch_size must be a multiple of microbatch_size");
  const int64_t batch = static_cast<int64_t>(M) * mb;

  ReferenceResult result;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < spec.steps; ++step) {
    double sum = 0;
    for (int m = 0; m < M; ++m) {
      const uint64_t index = static_cast<uint64_t>(step) * M + m;
      Microbatch b = sample_microbatch(data, Split::kTrain, spec.seed, index, mb, T);
      torch::Tensor logits = forward_all(stages, tokens(b.x, mb, T));
      torch::Tensor loss = StageModel::loss(logits, tokens(b.y, mb, T));
      (loss * static_cast<double>(mb)).backward();
      sum += loss.item<double>();
    }
    for (auto& o : optims) o->step(batch);
    result.losses.push_back(sum / M);
    if (progress) progress(step, result.losses.back());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (spec.steps > 0 && seconds > 0)
    result.tokens_per_s = static_cast<double>(spec.steps) * batch * T / seconds;

  torch::NoGradGuard no_grad;
  double sum = 0;
  for (int i = 0; i < spec.eval.batches; ++i) {
    Microbatch b = sample_microbatch(data, Split::kVal, spec.seed, static_cast<uint64_t>(i), mb, T);
    sum += StageModel::loss(forward_all(stages, tokens(b.x, mb, T)), tokens(b.y, mb, T)).item<double>();
  }
  if (spec.eval.batches > 0) result.val_loss = sum / spec.eval.batches;
  return result;
}

}  // namespace swarm
