// reference.cpp: swarm::train_reference, the single-process trainer the swarm must equal.
#include "stages/reference.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "runtime/errors.h"
#include "stages/compute_threads.h"
#include "stages/device_info.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/precision.h"
#include "stages/subspace.h"

namespace swarm {
namespace {

// int32 [samples, seq_len] row-major -> int64 tensor on `device`.
torch::Tensor tokens(const std::vector<int32_t>& v, int samples, int seq_len, const torch::Device& device) {
  SWARM_CHECK(v.size() == static_cast<size_t>(samples) * static_cast<size_t>(seq_len),
              "microbatch size does not match samples * seq_len");
  return torch::from_blob(const_cast<int32_t*>(v.data()), {samples, seq_len}, torch::kInt32)
      .to(device, torch::kLong);
}

torch::Tensor forward_all(std::vector<std::unique_ptr<StageModel>>& stages, torch::Tensor x) {
  for (auto& s : stages) x = s->forward(x);
  return x;
}

}  // namespace

ReferenceResult train_reference(const JobSpec& spec, const TokenData& data, int threads,
                                const std::function<void(int, double)>& progress) {
  ReferenceOptions opt;
  opt.threads = threads;
  return train_reference(spec, data, opt, progress);
}

ReferenceResult train_reference(const JobSpec& spec, const TokenData& data, const ReferenceOptions& opt,
                                const std::function<void(int, double)>& progress) {
  set_compute_threads(opt.threads);
  const torch::Device device(opt.device == "cuda" ? std::string("cuda:0") : opt.device);
  if (device.is_cuda() && !torch::cuda::is_available())
    throw InputError("--device " + opt.device + ": this libtorch has no CUDA device available (libtorch " TORCH_VERSION ")");
  StagePrecision prec(spec.model, opt.precision, device_caps(device, query_device(opt.device)));
  const int S = spec.partition.stages;
  std::vector<int> layers = spec.partition.layers_per_stage;
  if (layers.empty() && S == 1) layers.push_back(spec.model.n_layer);
  SWARM_CHECK(static_cast<int>(layers.size()) == S, "partition.layers_per_stage must have one entry per stage");

  std::vector<std::unique_ptr<StageModel>> stages;
  std::vector<std::unique_ptr<AdamW>> optims;
  std::vector<std::unique_ptr<Subspace>> subspaces;  // the subspace codec's constraint, per stage
  int first = 0;  // the prefix sum JobSpec::first_layer computes
  for (int s = 0; s < S; ++s) {
    stages.push_back(std::make_unique<StageModel>(spec.model, s, S, first, layers[s], spec.seed, device, prec.type()));
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

  std::vector<torch::Tensor> params;
  for (auto& s : stages)
    for (const torch::Tensor& p : s->parameters()) params.push_back(p);

  if (device.is_cuda()) {
    // One untimed forward and backward first, as a stage server's LOAD_STAGE runs one: CUDA's
    // libraries initialise and pick their kernels outside the measured time. No step: the
    // training is unchanged.
    forward_all(stages, torch::zeros({mb, T}, torch::TensorOptions().dtype(torch::kLong).device(device))).sum().backward();
    for (auto& o : optims) o->zero_grad();
  }

  ReferenceResult result;
  const auto t0 = std::chrono::steady_clock::now();
  const int steps = opt.max_steps > 0 ? std::min(opt.max_steps, spec.steps) : spec.steps;
  for (int step = 0; step < steps; ++step) {
    double sum = 0;
    for (int m = 0; m < M; ++m) {
      const uint64_t index = static_cast<uint64_t>(step) * M + m;
      Microbatch b = sample_microbatch(data, Split::kTrain, spec.seed, index, mb, T);
      torch::Tensor logits = forward_all(stages, tokens(b.x, mb, T, device));
      torch::Tensor loss = StageModel::loss(logits, tokens(b.y, mb, T, device));
      prec.backward(loss, torch::full({}, static_cast<double>(mb), loss.options()), false);  // loss x mb x scale
      bool overflow = false;
      prec.finish(torch::Tensor(), params, &overflow);
      sum += loss.item<double>();
    }
    const double scale = prec.scale();
    if (prec.skip_step(false)) {
      for (auto& o : optims) o->zero_grad();
    } else {
      for (auto& o : optims) o->step(batch, scale);
    }
    result.losses.push_back(sum / M);
    if (progress) progress(step, result.losses.back());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (steps > 0 && seconds > 0)
    result.tokens_per_s = static_cast<double>(steps) * batch * T / seconds;

  torch::NoGradGuard no_grad;
  double sum = 0;
  for (int i = 0; i < spec.eval.batches; ++i) {
    Microbatch b = sample_microbatch(data, Split::kVal, spec.seed, static_cast<uint64_t>(i), mb, T);
    sum += StageModel::loss(forward_all(stages, tokens(b.x, mb, T, device)), tokens(b.y, mb, T, device)).item<double>();
  }
  if (spec.eval.batches > 0) result.val_loss = sum / spec.eval.batches;
  return result;
}

}  // namespace swarm
