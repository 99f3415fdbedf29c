// costs.cpp: implements sim/costs.h.
#include "sim/costs.h"

#include <algorithm>

#include "runtime/errors.h"
#include "runtime/memory_estimate.h"
#include "sim/stage_replies.h"

namespace swarm::sim {

namespace {

constexpr double kGiB = double(1ull << 30);

Profile gpu(const char* name, double tflops, double mem_tb_s, double memory_gib, const char* precision) {
  Profile p;
  p.name = name;
  p.flops = tflops * 1e12;
  p.mem_bytes_per_s = mem_tb_s * 1e12;
  p.memory_bytes = int64_t(memory_gib * kGiB);
  p.cuda = true;
  p.precision = precision;
  p.overhead_ms = 0.5;   // a host round trip, a kernel launch or two, the codec
  p.load_s = 5.0;        // CUDA context, modules, the first timed step
  return p;
}

}  // namespace

std::optional<Profile> builtin_profile(const std::string& name) {
  // Effective rates: about a third of each GPU's dense bf16/fp16 peak (312, 125, 65 TFLOP/s),
  // rounded to keep --emulate's 4 : 2 : 1; memory bandwidth about 80% of the datasheet's.
  if (name == "a100") return gpu("a100", 100, 1.5, 80, "bf16");
  if (name == "v100") return gpu("v100", 50, 0.7, 32, "fp16");
  if (name == "t4") return gpu("t4", 25, 0.25, 16, "fp16");
  if (name == "cpu") {
    // Measured: a one-thread stage of the bundled example on this project's 2-core machine
    // (`swarm bench sim` measures it again in every run, for sim_vs_real).
    Profile p;
    p.name = "cpu";
    p.flops = 40e9;
    p.mem_bytes_per_s = 5e9;
    p.memory_bytes = int64_t(8 * kGiB);
    p.precision = "fp32";
    p.overhead_ms = 0.2;
    p.load_s = 1.0;
    return p;
  }
  return std::nullopt;
}

std::vector<std::string> builtin_profile_names() { return {"a100", "v100", "t4", "cpu"}; }

JobCosts job_costs(const JobSpec& spec) {
  JobCosts c;
  c.stages = spec.partition.stages;
  c.B = spec.batch.microbatch_size;
  c.T = spec.model.seq_len;
  c.d_model = spec.model.d_model;
  c.params = stage_parameter_counts(spec);
  const double d = double(spec.model.d_model), T = double(spec.model.seq_len), V = double(spec.model.vocab_size);
  const double tokens = double(c.B) * T;
  // Per token, forward: a block's four matmuls (qkv 3d^2, projection d^2, MLP 8d^2) at 2 FLOPs
  // per multiply-add, and attention's scores and weighted values (2 T d each); the LM head 2 d V.
  const double block = 24 * d * d + 4 * T * d;
  for (int s = 0; s < c.stages; ++s) {
    double f = block * double(spec.partition.layers_per_stage[size_t(s)]);
    if (s == c.stages - 1) f += 2 * d * V;
    c.fwd_flops.push_back(f * tokens);
  }
  for (double f : c.fwd_flops) c.fwd_flops_sum += f;
  c.mean_fwd_flops = c.fwd_flops_sum / double(c.stages);
  return c;
}

Profile JobCosts::calibrate(Profile p) const {
  if (!(p.ms_per_unit > 0)) return p;
  SWARM_CHECK(p.on_stage < stages, "profile measured on a stage outside the job");
  const double f = p.on_stage >= 0 ? fwd_flops[size_t(p.on_stage)] : mean_fwd_flops;
  p.flops = f / (p.ms_per_unit / 1000.0);
  return p;
}

double request_seconds(const Profile& p, const JobCosts& c, wire::MsgType t, int stage, bool cached, int64_t values, int members) {
  using wire::MsgType;
  const double over = p.overhead_ms / 1000.0;
  const double fwd = stage >= 0 && stage < c.stages ? c.fwd_flops[size_t(stage)] / p.flops : 0.0;
  const double mem = 1.0 / p.mem_bytes_per_s;
  switch (t) {
    case MsgType::kForward: case MsgType::kForwardLoss: case MsgType::kBackward: case MsgType::kEval:
      return over + work_units(t, cached) * fwd;
    case MsgType::kStep:
      return over + 28.0 * double(stage >= 0 ? c.params[size_t(stage)] : 0) * mem;
    case MsgType::kRoundBegin:   // theta_g - theta, encoded
      return over + 12.0 * double(values) * mem;
    case MsgType::kRoundReduce:  // members' parts decoded and averaged, the mean encoded
      return over + 8.0 * double(values) * double(std::max(1, members)) * mem;
    case MsgType::kRoundApply: case MsgType::kStateLoad:  // the outer step, or copying a state in
      return over + 24.0 * double(values) * mem;
    case MsgType::kStateRequest:
      return over + 4.0 * double(values) * mem;
    case MsgType::kLoadStage:
      return p.load_s + 3 * fwd;
    default:
      return over;
  }
}

uint64_t message_bytes(const wire::Message& m) {
  uint64_t n = 64 + m.body.size() + 96 * (m.tensors.size() + m.refs.size());   // envelope, body, descriptions
  for (const wire::Tensor& t : m.tensors) n += t.desc.nbytes;
  return n;
}

}  // namespace swarm::sim
