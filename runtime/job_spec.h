// job_spec.h: the job a user submits (JSON), parsed and validated.
//
// Defines swarm::JobSpec and its parts, `parse_job_spec` (JSON text or object -> JobSpec,
// throwing SpecError with a message that says what to change) and `to_json` (JobSpec ->
// canonical JSON with every default filled in; the router sends that to peers).
// Every field, its default and its rules are in docs/job-spec.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/precision.h"

namespace swarm {

// The decisions a job spec names as strings, parsed once (to_json writes the same strings).
// "async": no flush between steps; each peer takes one step per job step on the microbatches of
// that step it served, at the job step's learning rate (docs/schedules.md). "sync": flush at
// every step (exact). "async_local": no flush; each peer steps on its own after inner_batch
// samples, at its own count's learning rate (the first asynchronous schedule, kept to compare).
enum class Schedule { kAsync, kSync, kAsyncLocal };
enum class DilocoSync { kRounds, kEveryStep };  // "rounds": DiLoCo; "every_step": the data-parallel reference
// When a DiLoCo round runs under async and async_local: "alongside" training (the pipeline is
// not drained for it), "at_barrier" (drained, as under sync), or "auto": alongside when more
// than one job step of microbatches is in flight (max_inflight > microbatches per step), where
// a drain costs the most.
enum class RoundTiming { kAuto, kAlongside, kAtBarrier };
enum class RoutingMode { kSwarm, kStatic };   // "swarm": least expected completion; "static": fixed pipelines
enum class Hops { kP2p, kHub };               // "p2p": tensors go peer to peer; "hub": through the router
const char* schedule_name(Schedule s);
const char* diloco_sync_name(DilocoSync s);
const char* round_timing_name(RoundTiming t);
const char* routing_mode_name(RoutingMode m);
const char* hops_name(Hops h);

struct ModelSpec {
  int vocab_size = 256;      // 256 for text read as bytes
  int d_model = 128;
  int n_head = 4;
  int n_layer = 4;
  int seq_len = 128;         // tokens per sample during training
  int max_seq_len = 0;       // positions in wpe; 0 -> seq_len. seq_len must be <= max_seq_len
  bool bias = true;          // biases in Linear and LayerNorm, as nanoGPT's default
  // Compute precision: "auto" leaves it to each peer (`swarm-stage --precision`, whose own auto
  // picks by device); "fp32", "bf16" or "fp16" pins every peer. Weights and optimizer state are
  // fp32 regardless (docs/gpu.md).
  std::string precision = "auto";
  // Dynamic loss scaling: "auto" on peers that compute in fp16, "dynamic" on every peer (exact
  // in fp32 and bf16: the scale is a power of two), "none" nowhere.
  std::string loss_scale = "auto";

  Precision precision_pin() const { return parse_precision(precision); }  // kAuto: not pinned
};

struct PartitionSpec {
  int stages = 1;                        // S
  std::vector<int> layers_per_stage;     // size S, sums to n_layer, each >= 1; filled by parse
};

struct DataSpec {
  std::string format = "text";           // "text" (bytes, vocab 256) or "bin" (uint16 tokens)
  std::vector<std::string> paths;        // "path": a string or a list (at most 256); read in order, concatenated
  double val_fraction = 0.1;             // the last fraction of the tokens is the validation split
};

struct BatchSpec {
  int batch_size = 32;       // samples per optimizer step of the job
  int microbatch_size = 8;   // samples per microbatch (one pipeline hop); divides batch_size
  int inner_batch = 0;       // async: samples a peer accumulates before its optimizer step; 0 -> batch_size
};

struct OptimizerSpec {     // inner optimizer with linear warmup then cosine decay to min_lr
  std::string name = "adamw";  // "adamw", or "sgd" (no moments: p -= lr * mean gradient)
  double lr = 1e-3;
  double min_lr = 1e-4;
  int warmup_steps = 10;
  double weight_decay = 0.1;  // on matrices (dim >= 2) only, as nanoGPT
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;     // max L2 norm of the stage's gradient; 0 disables
};

// The within-stage round: every `inner_steps` job steps each stage group averages its peers'
// outer gradients (theta_global - theta_local), weighted by samples, and applies one outer SGD
// step. With outer_lr 1 and outer_momentum 0 that is a plain sample-weighted average.
struct DilocoSpec {
  int inner_steps = 10;        // H
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  bool nesterov = true;
  double deadline_s = 30.0;    // a round ignores contributions that arrive later
  // "rounds": DiLoCo (an outer step every inner_steps). "every_step": the data-parallel
  // reference, the group averages its gradients at every inner step and takes one AdamW step.
  DilocoSync sync = DilocoSync::kRounds;
  // "rounds": the first warm_start_steps steps sync every step as "every_step" does, then the
  // rounds begin from that one shared state (post-local SGD; the DiLoCo paper starts from a
  // pretrained model). Peers drift most early in training, when the loss moves fastest.
  // -1 ("auto") -> derived: kAutoWarmStartFraction of the job's steps under "rounds", 0 under
  // "every_step". Any schedule: during the warm start the router flushes the pipeline at every step.
  int warm_start_steps = -1;
  int fragments = 1;           // streaming: the parameters split in F fragments, one synced every H/F steps
  int overlap_steps = 0;       // streaming: inner steps a fragment's exchange overlaps before it is applied
  RoundTiming rounds = RoundTiming::kAuto;
};

// The share of a job's steps that the derived warm start covers (docs/schedules.md has the
// measurements behind it).
constexpr double kAutoWarmStartFraction = 1.0 / 3.0;

struct CompressionSpec {       // codec names as compression/codec.h parses them ("fp32", "bf16", "int8:block=64", ...)
  std::string activations = "fp32";
  std::string gradients = "fp32";
  std::string outer = "fp32";
};

struct EvalSpec {
  int every_steps = 0;       // 0 -> only at the end
  int batches = 8;           // validation microbatches per evaluation
};

struct TimeoutSpec {
  // A hop's deadline is 4x the time its peer should need (queue + this hop, from the peer's
  // measured speed) + 1 s, at least 2 s, and at most these.
  double forward_s = 30.0;   // FORWARD and EVAL hops
  double backward_s = 60.0;  // BACKWARD and FORWARD_LOSS hops, and a sync-schedule STEP
  int max_attempts = 8;      // attempts per hop before the job fails
};

// Durability: stage snapshots kept by the router, checkpoints written to disk.
struct CheckpointSpec {
  std::string dir;             // "" -> <router --state-dir>/jobs/<id>/checkpoints, or none without a state dir
  int every_steps = 0;         // 0 -> only at the end (when a dir is known)
  int keep = 3;                // newest complete checkpoints kept
  int snapshot_every_steps = 0;  // stage snapshots held by the router; 0 -> after every round
};

// How hops find peers, and whether the router moves peers between stages.
struct RoutingSpec {
  RoutingMode mode = RoutingMode::kSwarm;
  Hops hops = Hops::kP2p;      // where activations, gradients and outer gradients travel
  bool rebalance = true;       // move peers to the bottleneck stage
  double rebalance_period_s = 180;  // mean period (randomised +-25%)
  double min_gain = 0.10;      // a move must raise the minimum stage throughput by this fraction
  double cooldown_s = 300;     // no move of the same peer, and no move at all, within this
  int start_peers = 1;         // ready peers per stage the first step waits for ...
  double start_wait_s = 60;    // ... at most this long after the job could have started
  // The most work the dispatcher queues at one peer: this many seconds at its measured speed,
  // at least 4 units (router/dispatch.h); the rest waits at the router for a peer with room. 0: no bound.
  double max_queued_s = 1.0;
};

struct JobSpec {
  std::string name = "job";
  uint64_t seed = 1;
  int steps = 100;                 // optimizer steps of the job (each batch_size samples)
  Schedule schedule = Schedule::kAsync;
  int max_inflight = 0;            // microbatches in flight at once; 0 -> one job step's microbatches, at least partition.stages; at most limits::kMaxInflight
  ModelSpec model;
  PartitionSpec partition;
  DataSpec data;
  BatchSpec batch;
  OptimizerSpec optimizer;
  DilocoSpec diloco;
  CompressionSpec compression;
  EvalSpec eval;
  TimeoutSpec timeouts;
  CheckpointSpec checkpoint;
  RoutingSpec routing;

  // Derived helpers.
  int microbatches_per_step() const { return batch.batch_size / batch.microbatch_size; }
  int first_layer(int stage) const;   // index of the stage's first transformer block
};

// Parses and validates (codec texts included). Throws SpecError naming the field and what to
// change. Checks that data.paths are readable regular files when `check_files` is true.
JobSpec parse_job_spec(const nlohmann::json& j, bool check_files = true);
JobSpec parse_job_spec_text(const std::string& text, bool check_files = true);
nlohmann::json to_json(const JobSpec& spec);

// Whether job step `step` (1-based) is dense: the stage group sums its gradients and every peer
// takes the same step (diloco.sync "every_step", and the warm start of "rounds"). The pipeline
// flushes before such a step under every schedule.
bool dense_step(const JobSpec& spec, int step);
// Whether the job's DiLoCo rounds run alongside training (diloco.rounds resolved): never under sync.
bool rounds_alongside(const JobSpec& spec);

// Field-by-field equality (through the canonical JSON), e.g. to check that peers run the same job.
bool operator==(const JobSpec& a, const JobSpec& b);
inline bool operator!=(const JobSpec& a, const JobSpec& b) { return !(a == b); }

}  // namespace swarm
