// costs.h: what each piece of a job's work costs a simulated peer, from the job spec and a
// device profile: compute time per request, bytes per message.
//
// Defines swarm::sim::Profile (a device: its effective FLOP/s, memory bandwidth, memory, kind
// and precision, and how much its timings jitter), `builtin_profile` (a100, v100, t4, cpu,
// cpu-slow), JobCosts (per-stage forward FLOPs of one microbatch and parameter counts, from
// the model's shape: a GPT block does 24 d^2 + 4 T d FLOPs per token forward, the LM head
// 2 d V) and `request_seconds` (the time a request takes a peer of a profile: hops in the
// router's work units of forward FLOPs, optimizer steps and round arithmetic at memory speed,
// a stage load at a fixed cost plus one timed step), and `message_bytes` (what a message costs
// on a link: envelope and body plus every inline tensor's encoded bytes).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/job_spec.h"
#include "runtime/wire.h"

namespace swarm::sim {

struct Profile {
  std::string name;
  double flops = 0;            // effective FLOP/s of a stage's forward and backward (not the peak)
  double mem_bytes_per_s = 0;  // effective memory bandwidth for optimizer steps and round arithmetic
  int64_t memory_bytes = -1;   // device memory free at HELLO [bytes]; -1: not said
  bool cuda = false;           // a GPU: HELLO says device cuda:0
  std::string precision = "fp32";
  double jitter = 0.05;        // coefficient of variation of each compute time (log-normal)
  double overhead_ms = 0.2;    // per request: decoding, encoding, dispatch [ms]
  double load_s = 2.0;         // building a stage's modules on LOAD_STAGE, before the timed step [s]
  // A profile measured on one stage of one job: a forward of one microbatch there took this many
  // ms (the router's ms per unit). flops then follows from that stage's FLOPs (JobCosts::calibrate).
  double ms_per_unit = 0;
  int on_stage = -1;           // the stage ms_per_unit was measured on; -1: a stage of mean cost
};

// The built-in profiles, or nullopt. a100, v100, t4: GPUs whose effective speeds keep the ratios
// of `swarm-stage --emulate` (4 : 2 : 1) at plausible fractions of their peaks; cpu: this
// project's 2-core test machine on the bundled example; cpu-slow: 8x slower than a100, as
// --emulate cpu-slow.
std::optional<Profile> builtin_profile(const std::string& name);
std::vector<std::string> builtin_profile_names();

struct JobCosts {
  int stages = 1;
  int64_t B = 1, T = 1, d_model = 1;
  std::vector<double> fwd_flops;   // [S] one microbatch's forward on stage s [FLOP]
  std::vector<int64_t> params;     // [S] parameters (stage_parameter_counts)
  double fwd_flops_sum = 0, mean_fwd_flops = 0;   // over the stages [FLOP]
  // The profile with flops filled in from ms_per_unit, when it was given that way.
  Profile calibrate(Profile p) const;
};
JobCosts job_costs(const JobSpec& spec);

// Seconds a request of type `t` takes a peer of profile `p` serving `stage` (before jitter and
// slow-down faults): hops by work units (sim/stage_replies.h work_units; `cached`: a backward
// finds its forward's graph); STEP an AdamW pass over the stage (28 bytes per parameter);
// ROUND_BEGIN the outer gradient of `values` parameters, ROUND_REDUCE the mean of `members`
// parts of `values`, ROUND_APPLY and STATE_LOAD the outer step over `values`, STATE_REQUEST a
// copy of `values` x tensors; LOAD_STAGE load_s plus one forward and backward.
double request_seconds(const Profile& p, const JobCosts& c, wire::MsgType t, int stage, bool cached, int64_t values, int members);

// Bytes a message puts on a link: envelope and body, the descriptions, and each inline tensor's
// payload (its encoded bytes; zstd's gain on real data is not modelled: zeros would flatter it).
uint64_t message_bytes(const wire::Message& m);

}  // namespace swarm::sim
