// memory_estimate.cpp: estimate_stage_memory (see memory_estimate.h).
//
// Saved activations per microbatch of N = B·T tokens, d_model C, heads H, compute bytes e, as
// stages/model.cpp computes (residual stream, LayerNorms and softmax in fp32, matrix products in
// the compute type):
//   per block: ln_1 input 4NC, its output in e (c_attn's input) eNC, q/k/v 3eNC, attention output
//   eNC, ln_2 input 4NC, its output eNC, c_fc output 4eNC (GELU's input), GELU output 4eNC
//   (c_proj's input): (8 + 14e)·N·C; plus the attention matrix B·H·T² in fp32 (and its copy in
//   e for the product with v when e < 4), or, with flash attention, only the log-sum-exp 4·B·H·T.
//   stage 0: the token ids, 8N. Last stage: ln_f input 4NC and output eNC, log_softmax output 4NV.
#include "runtime/memory_estimate.h"

#include <algorithm>
#include <cstdio>

#include "runtime/errors.h"

namespace swarm {

std::vector<int64_t> stage_parameter_counts(const JobSpec& spec) {
  const ModelSpec& m = spec.model;
  const int64_t C = m.d_model, V = m.vocab_size, T = m.max_seq_len > 0 ? m.max_seq_len : m.seq_len, b = m.bias ? 1 : 0;
  // ln_1, c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weights, then biases when bias is on).
  const int64_t block = (C + 3 * C * C + C * C + C + 4 * C * C + 4 * C * C) + b * (C + 3 * C + C + C + 4 * C + C);
  std::vector<int64_t> out;
  const int S = spec.partition.stages;
  for (int s = 0; s < S; ++s) {
    int64_t n = block * spec.partition.layers_per_stage[size_t(s)];
    if (s == 0) n += V * C + T * C;
    if (s == S - 1) n += C + b * C + V * C;
    out.push_back(n);
  }
  return out;
}
namespace {

constexpr int64_t kMiB = int64_t(1) << 20;
constexpr int64_t kCudaRuntimeBytes = 600 * kMiB;  // context, cuBLAS/cuDNN workspaces, kernels

std::string gib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", double(b) / double(int64_t(1) << 30));
  return buf;
}

}  // namespace

int64_t StageMemory::device_bytes() const {
  const int64_t sum = weights + grads + adam + graphs + versions + transient;
  return sum + sum / 10 + runtime;
}

int64_t StageMemory::need_bytes(bool cuda_peer) const { return cuda_peer ? device_bytes() : device_bytes() + host; }

std::string StageMemory::describe(bool cuda_peer) const {
  std::string s = human_bytes(need_bytes(cuda_peer)) + " at " + precision_name(precision) + " (weights " + gib(weights) +
                  ", grads " + gib(grads) + ", AdamW " + gib(adam) + ", " + std::to_string(inflight) + " graph(s) " + gib(graphs) +
                  ", temporaries " + gib(transient);
  if (versions) s += ", weight versions " + gib(versions);
  if (runtime) s += ", CUDA runtime " + gib(runtime);
  s += ", 10% margin";
  s += cuda_peer ? "; host RAM " + gib(host) + " GiB besides)" : ", θ_g and momentum " + gib(host) + " GiB)";
  return s;
}

int64_t stage_parameters(const JobSpec& spec, int stage) {
  const ModelSpec& m = spec.model;
  const int S = spec.partition.stages;
  SWARM_CHECK(stage >= 0 && stage < S && int(spec.partition.layers_per_stage.size()) == S, "stage index / partition");
  const int64_t C = m.d_model, V = m.vocab_size, L = spec.partition.layers_per_stage[size_t(stage)];
  const int64_t max_T = m.max_seq_len > 0 ? m.max_seq_len : m.seq_len;
  const int64_t b = m.bias ? 1 : 0;
  // ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj: weights and (with bias) biases.
  const int64_t block = C + 3 * C * C + C * C + C + 4 * C * C + 4 * C * C + b * (C + 3 * C + C + C + 4 * C + C);
  int64_t p = L * block;
  if (stage == 0) p += V * C + max_T * C;
  if (stage == S - 1) p += C + b * C + V * C;
  return p;
}

StageMemory estimate_stage_memory(const JobSpec& spec, int stage, Precision precision, bool flash_attention, bool cuda,
                                  int cache_entries) {
  SWARM_CHECK(precision != Precision::kAuto, "estimate at a resolved precision");
  const ModelSpec& m = spec.model;
  const int S = spec.partition.stages;
  const bool first = stage == 0, last = stage == S - 1;
  const int64_t e = int64_t(compute_bytes(precision));
  const int64_t B = spec.batch.microbatch_size, T = m.seq_len, N = B * T, C = m.d_model, H = m.n_head, V = m.vocab_size;
  const int64_t L = spec.partition.layers_per_stage[size_t(stage)];

  StageMemory out;
  out.precision = precision;
  out.params = stage_parameters(spec, stage);
  out.weights = 4 * out.params;
  out.grads = 4 * out.params;
  out.adam = 8 * out.params;
  out.host = 12 * out.params;
  out.runtime = cuda ? kCudaRuntimeBytes : 0;

  const int64_t attention = flash_attention ? 4 * B * H * T : B * H * T * T * (4 + (e < 4 ? e : 0));
  int64_t graph = L * ((8 + 14 * e) * N * C + attention);
  if (first) graph += 8 * N;
  if (last) graph += 4 * N * C + e * N * C + 4 * N * V;
  if (e < 4) graph += e * out.params;  // each forward's compute-type copy of the weights
  out.inflight = last ? 1 : std::min(std::max(1, spec.max_inflight), std::max(0, cache_entries) + 1);
  out.graphs = int64_t(out.inflight) * graph;
  if (spec.schedule == Schedule::kAsync && !last) {
    const int per_step = std::max(1, spec.microbatches_per_step());
    const int64_t steps_in_flight = (std::max(1, spec.max_inflight) + per_step - 1) / per_step;
    // A snapshot lives while a cached graph ran on it: no more than the graphs kept.
    out.versions = (std::min(steps_in_flight, int64_t(out.inflight)) + 3) * 4 * out.params;
  }

  int64_t largest = L > 0 ? 4 * C * C : 0;
  if (first || last) largest = std::max(largest, V * C);
  out.transient = 8 * largest + 2 * 4 * e * N * C + (last ? (8 + 2 * e) * N * V : 0);
  return out;
}

int cache_entries_that_fit(const JobSpec& spec, int stage, Precision precision, bool flash_attention, bool cuda, int64_t free_bytes) {
  // The need grows with the entries by whole graphs; the largest that fits, found from the top.
  for (int e = int(kGraphCacheEntries); e >= 0; --e)
    if (estimate_stage_memory(spec, stage, precision, flash_attention, cuda, e).need_bytes(cuda) <= free_bytes) return e;
  return -1;
}

size_t graph_cache_entries(const JobSpec& spec, int stage, Precision precision, bool flash_attention, bool cuda, int64_t free_bytes,
                           size_t bound) {
  if (free_bytes < 0) return bound;
  return std::min(bound, size_t(std::max(0, cache_entries_that_fit(spec, stage, precision, flash_attention, cuda, free_bytes))));
}

std::string human_bytes(int64_t bytes) {
  char buf[48];
  const double b = double(bytes);
  if (bytes >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(int64_t(1) << 30));
  else if (bytes >= kMiB) std::snprintf(buf, sizeof buf, "%.0f MiB", b / double(kMiB));
  else std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  return buf;
}

}  // namespace swarm
