// precision.h: which floating-point type a stage computes in, and the fp16 loss scale.
//
// Defines swarm::Precision (`auto`, `fp32`, `bf16`, `fp16`: `swarm-stage --precision` and the
// job's `model.precision`), DeviceCaps (what a device can compute in), `resolve_precision` (the
// pure decision: the job's pin, else the peer's flag, `auto` resolved by the device), and
// LossScaler (dynamic loss scaling: an overflow lowers the scale, a run of good steps raises it).
// No libtorch: the router's memory estimate and the checkpoint code use these too. Master
// weights, θ_g, the outer momentum and AdamW state are fp32 whatever the precision; only the
// forward and backward arithmetic changes (docs/gpu.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace swarm {

enum class Precision { kAuto, kFp32, kBf16, kFp16 };

const char* precision_name(Precision p);   // "auto", "fp32", "bf16", "fp16"
// Throws InputError naming the accepted values.
Precision parse_precision(const std::string& text);
// Bytes per element of the compute type: 4 (fp32), 2 (bf16, fp16). kAuto is not a type: 0.
size_t compute_bytes(Precision p);

// What one device offers. `cuda` with compute capability (cc_major.cc_minor; 0.0: unknown,
// e.g. a build without -DSWARM_CUDA cannot read it); bf16/fp16: this libtorch computes in that
// type on the device (probed by the stage server with one small matmul and layer norm).
struct DeviceCaps {
  std::string name = "cpu";  // for messages: "cpu", "NVIDIA A100-SXM4-80GB", ...
  bool cuda = false;
  int cc_major = 0, cc_minor = 0;
  bool bf16 = false, fp16 = false;
};

struct PrecisionChoice {
  Precision precision = Precision::kFp32;  // never kAuto
  std::string reason;                      // one line for the log
};

// `auto` on this device: bf16 on CUDA devices of compute capability 8.0 and up (A100, H100,
// H200: native bf16 tensor cores), fp16 on older CUDA devices (T4, V100), fp32 on the CPU and
// on a CUDA device whose capability is unknown.
Precision auto_precision(const DeviceCaps& caps);

// The job's model.precision pins every peer unless it is `auto`; then the peer's own
// --precision applies; `auto` resolves by auto_precision. A pinned or asked-for type the device
// cannot compute in throws InputError saying which device, which type and what to use instead.
PrecisionChoice resolve_precision(Precision job, Precision flag, const DeviceCaps& caps);

// Dynamic loss scaling (as torch.cuda.amp.GradScaler): the loss is multiplied by scale() before
// the backward and the gradients divided by it before the optimizer step. An overflow (a
// non-finite gradient) skips the step and multiplies the scale by `backoff`; `growth_interval`
// good steps in a row multiply it by `growth`. Scales stay powers of two inside
// [min_scale, max_scale], so scaling and unscaling are exact in binary floating point.
struct LossScaleOptions {
  double init = 65536.0;       // 2^16, GradScaler's default
  double growth = 2.0;
  double backoff = 0.5;
  int64_t growth_interval = 2000;
  double min_scale = 1.0;      // an fp16 gradient that overflows at scale 1 is a real divergence
  double max_scale = 16777216.0;  // 2^24
};

class LossScaler {
 public:
  explicit LossScaler(LossScaleOptions opt = {});
  double scale() const { return scale_; }
  int64_t good_steps() const { return good_; }   // good steps since the scale last changed
  int64_t overflows() const { return overflows_; }
  // One optimizer step's outcome: `overflow` true when it was skipped for a non-finite gradient.
  void update(bool overflow);
  // Restores a saved (scale, good_steps), e.g. from a checkpoint or a donor. Throws InputError
  // unless scale is a power of two within [min_scale, max_scale] and good_steps is in
  // [0, growth_interval).
  void restore(double scale, int64_t good_steps);
  const LossScaleOptions& options() const { return opt_; }

 private:
  LossScaleOptions opt_;
  double scale_;
  int64_t good_ = 0;
  int64_t overflows_ = 0;
};

}  // namespace swarm
