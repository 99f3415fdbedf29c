// memory_estimate.h: how many bytes a peer needs to serve one stage of a job.
//
// Defines swarm::StageMemory and `estimate_stage_memory`, a pure function of the job spec, the
// stage and the compute precision, shared by the router (placement never puts a stage on a peer
// that cannot hold it) and the stage server (it logs the estimate next to what it measured).
// No libtorch. The model follows stages/model.cpp's arithmetic; docs/gpu.md explains each term.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/graph_cache.h"
#include "runtime/job_spec.h"
#include "runtime/precision.h"

namespace swarm {

// Parameters per stage of the GPT the spec describes (stages/model.h builds exactly these):
// token and position embeddings on stage 0, its blocks on every stage, the final norm and the
// LM head on the last. The router takes a stage's size from here, never from a peer.
std::vector<int64_t> stage_parameter_counts(const JobSpec& spec);

struct StageMemory {
  int64_t params = 0;           // parameters of the stage
  // On the device (the CPU's RAM for a CPU peer), in bytes:
  int64_t weights = 0;          // fp32 master weights [params]
  int64_t grads = 0;            // fp32 gradient sums [params]
  int64_t adam = 0;             // AdamW exp_avg and exp_avg_sq, fp32 [2 x params]
  int64_t graphs = 0;           // autograd graphs of the microbatches in flight: saved activations,
                                // plus each forward's compute-type copy of the weights (bf16/fp16)
  int64_t versions = 0;         // async, all but the last stage: the weight versions forwards ran on (one
                                // per job step in flight and the current one), the last update and a
                                // step's copy of the weights, fp32 [params each]
  int64_t transient = 0;        // the largest temporaries of one backward (logits, AdamW's denominator)
  int64_t runtime = 0;          // CUDA context and library workspaces (0 on the CPU)
  // In host RAM whatever the device, in bytes:
  int64_t host = 0;             // θ_g and the outer momentum (fp32), and one flat copy of the weights
  int inflight = 0;             // graphs counted in `graphs` (the cache's entries and the one computing)
  Precision precision = Precision::kFp32;

  // What the device must hold: the sum of the device terms plus a 10% margin for allocator
  // fragmentation.
  int64_t device_bytes() const;
  // What a peer must have free: device_bytes() for a CUDA peer; device_bytes() + host for a CPU
  // peer, whose device is the host.
  int64_t need_bytes(bool cuda_peer) const;
  // "1.93 GiB (weights 0.34, grads 0.34, AdamW 0.69, 8 graphs 0.41, ...)".
  std::string describe(bool cuda_peer) const;
};

// Parameters of stage `stage` of the job (what StageModel holds).
int64_t stage_parameters(const JobSpec& spec, int stage);

// `precision` must be resolved (not kAuto); `flash_attention`: the attention keeps no [T, T]
// matrix (scaled-dot-product attention on a GPU with libtorch 2.x); `cuda`: count the CUDA
// runtime's own share. Graphs: the `cache_entries` the peer's affinity cache keeps plus the one
// it is computing, never more than the job's max_inflight; one on the last stage (it runs each
// backward at once). Placement asks with 0 entries (the least a peer must hold: every backward
// recomputes its forward), a stage server sizes its cache with `cache_entries_that_fit`.
StageMemory estimate_stage_memory(const JobSpec& spec, int stage, Precision precision, bool flash_attention, bool cuda,
                                  int cache_entries = int(kGraphCacheEntries));

// The most graphs, up to kGraphCacheEntries, a peer's affinity cache can keep for `stage` with
// `free_bytes` free (need_bytes(cuda) within it); -1 where the stage does not fit even with none.
int cache_entries_that_fit(const JobSpec& spec, int stage, Precision precision, bool flash_attention, bool cuda, int64_t free_bytes);

// The size of a peer's affinity cache for `stage`: what fits in `free_bytes`, at most `bound`
// (the configured size); `bound` where the free memory is unknown (-1). The stage server and
// the simulator's peers size their caches with it.
size_t graph_cache_entries(const JobSpec& spec, int stage, Precision precision, bool flash_attention, bool cuda, int64_t free_bytes,
                           size_t bound = kGraphCacheEntries);

// "1.5 GiB", "812 MiB": bytes for people.
std::string human_bytes(int64_t bytes);

}  // namespace swarm
