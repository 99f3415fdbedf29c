// conformance_detail.h: the pieces of tools/conformance.cpp that are not the script: the test
// job, deterministic inputs, tensor frames, and how replies are compared (Tol, differ).
//
// Defines, in swarm::conformance_detail: Tol and the tolerances kClose, kExact, kAfterStep,
// kOutputAfterStep; the test job's constants and test_spec; values, f32, i32, floats_of, fmt,
// max_diff, differ. Included by conformance.cpp only.
#pragma once

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "runtime/job_spec.h"
#include "runtime/random.h"
#include "runtime/wire.h"

namespace swarm::conformance_detail {

using nlohmann::json;
using wire::Message;

// How far a value may be from the reference's: |got - want| <= abs + rel * |want|, or the same bits.
struct Tol {
  double abs = 0, rel = 0;
  bool exact = false;
};
// fp32 on two libraries (another summation order): tight enough that the exact GELU in place of
// the tanh approximation (up to 4e-4 per value) is caught.
constexpr Tol kClose{1e-5, 1e-5, false};
constexpr Tol kExact{0, 0, true};
// After an AdamW step a weight moves by up to lr (1e-4 at the test job's first step) along its
// gradient's sign; where a gradient is within rounding of zero two libraries may step opposite
// ways: 2 lr apart. Weights, deltas and moments after a step, and outputs computed from them.
constexpr Tol kAfterStep{2.5e-4, 1e-5, false};
constexpr Tol kOutputAfterStep{1e-3, 1e-4, false};
constexpr int kHeartbeatMs = 200, kLiveness = 25;  // peers reconnect after 5 s of silence
constexpr int64_t kB = 2, kT = 8, kC = 16, kV = 32;

// The job: the vectors' model (docs/model.md), three stages, fp32 on every link, hub hops.
inline JobSpec test_spec() {
  const json j{{"name", "conformance"}, {"seed", 1234}, {"steps", 20}, {"schedule", "sync"},
               {"model", {{"vocab_size", kV}, {"d_model", kC}, {"n_head", 2}, {"n_layer", 3}, {"seq_len", kT}, {"bias", true}, {"precision", "fp32"}}},
               {"partition", {{"stages", 3}}},
               {"batch", {{"batch_size", kB}, {"microbatch_size", kB}}},
               {"optimizer", {{"lr", 1e-3}, {"min_lr", 1e-4}, {"warmup_steps", 10}, {"weight_decay", 0.1}, {"grad_clip", 1.0}}},
               {"diloco", {{"inner_steps", 2}}},
               {"routing", {{"hops", "hub"}, {"rebalance", false}}},
               {"data", {{"format", "bin"}, {"path", "conformance.bin"}}}};
  return parse_job_spec(j, false);
}

// Deterministic values: normal-ish floats in [-scale, scale) from splitmix64.
inline std::vector<float> values(uint64_t seed, size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * (float(splitmix64(seed + i) >> 40) / float(1 << 24) * 2.f - 1.f);
  return v;
}

inline wire::Tensor f32(const std::vector<float>& v, std::vector<int64_t> shape) {
  wire::Tensor t = wire::make_tensor(wire::DType::kF32, std::move(shape), compression::CodecSpec{}, v.size() * 4);
  std::memcpy(t.data.data(), v.data(), v.size() * 4);
  wire::seal(t);
  return t;
}
inline wire::Tensor i32(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  wire::Tensor t = wire::make_tensor(wire::DType::kI32, std::move(shape), compression::CodecSpec{}, v.size() * 4);
  std::memcpy(t.data.data(), v.data(), v.size() * 4);
  wire::seal(t);
  return t;
}

// An fp32 tensor of a reply as floats; nullopt (and why) when it is not one of `n` values.
inline std::optional<std::vector<float>> floats_of(const Message& m, size_t i, size_t n, std::string& why) {
  if (i >= m.tensors.size()) {
    why = wire::msg_type_name(m.type) + std::string(" carries ") + std::to_string(m.tensors.size()) + " tensor(s), expected at least " + std::to_string(i + 1);
    return std::nullopt;
  }
  const wire::Tensor& t = m.tensors[i];
  if (t.desc.dtype != wire::DType::kF32 || t.desc.codec.name() != "fp32" || size_t(t.desc.numel()) != n) {
    why = "tensor " + std::to_string(i) + " is not f32 in codec fp32 with " + std::to_string(n) + " values (dtype " +
          wire::dtype_name(t.desc.dtype) + ", codec " + t.desc.codec.name() + ", " + std::to_string(t.desc.numel()) + " values)";
    return std::nullopt;
  }
  std::vector<float> v(n);
  std::memcpy(v.data(), t.data.data(), n * 4);
  return v;
}

// "" when `got` is within tolerance of `want` (exact when tol is false), else where it is not.
inline std::string fmt(double v) {
  char b[48];
  std::snprintf(b, sizeof(b), "%.9g", v);
  return b;
}

inline double max_diff(const std::vector<float>& want, const std::vector<float>& got) {
  double m = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) m = std::max(m, std::fabs(double(want[i]) - double(got[i])));
  return m;
}

inline std::string differ(const std::vector<float>& want, const std::vector<float>& got, const Tol& tol) {
  if (want.size() != got.size()) return std::to_string(got.size()) + " values, expected " + std::to_string(want.size());
  size_t worst = 0;
  double excess = -1, diff_at_worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(want[i]) - double(got[i]));
    const double e = !tol.exact ? d - (tol.abs + tol.rel * std::fabs(double(want[i]))) : (std::memcmp(&want[i], &got[i], 4) ? 1.0 : -1.0);
    if (std::isnan(got[i]) || e > excess) {
      excess = std::isnan(got[i]) ? 1e30 : e;
      worst = i;
      diff_at_worst = d;
    }
  }
  if (excess <= 0) return "";
  return "value " + std::to_string(worst) + " is " + std::to_string(got[worst]) + ", the reference's " + std::to_string(want[worst]) +
         " (off by " + std::to_string(diff_at_worst) + (!tol.exact ? ", tolerance " + fmt(tol.abs) + " + " + fmt(tol.rel) + " x |reference|)" : "; must be bit-identical)");
}

}  // namespace swarm::conformance_detail
