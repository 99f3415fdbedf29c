// precision.h: a stage server's side of mixed precision: its compute type and its loss scale.
//
// Defines `compute_type` (Precision -> torch dtype), `dtype_works` (does this libtorch compute
// in a dtype on a device), `device_caps` (DeviceCaps for resolve_precision) and
// swarm::StagePrecision. Each peer scales its own backward: the seed of every backward
// (loss x samples at the last stage, the incoming output gradient elsewhere) is multiplied by
// the peer's loss scale, and the stage-input gradient it returns is divided by it again, so the
// gradients between stages are never scaled and peers of any precision mix freely. With the
// scale a power of two this is exact in fp32: scaled and unscaled runs give the same bits.
// docs/gpu.md has the whole story.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "runtime/job_spec.h"
#include "runtime/precision.h"
#include "stages/device_info.h"

namespace swarm {

torch::ScalarType compute_type(Precision p);  // kFloat32, kBFloat16, kHalf; p resolved
// One small linear layer, layer norm, GELU and softmax, forward and backward, in `dtype` on
// `device`: false when this libtorch has no kernel for it (fp16 on 1.13's CPU, ...).
bool dtype_works(const torch::Device& device, torch::ScalarType dtype);
// The capabilities resolve_precision needs: compute capability from `info`, bf16/fp16 probed.
DeviceCaps device_caps(const torch::Device& device, const DeviceInfo& info);

class StagePrecision {
 public:
  StagePrecision() = default;
  // The job's model.precision and model.loss_scale, this peer's --precision, its device.
  // Throws InputError when the precision asked for does not work on the device.
  StagePrecision(const ModelSpec& model, Precision flag, const DeviceCaps& caps);

  Precision precision() const { return precision_; }
  torch::ScalarType type() const { return compute_type(precision_); }
  const std::string& reason() const { return reason_; }
  bool scaling() const { return scaling_; }
  double scale() const { return scaling_ ? scaler_.scale() : 1.0; }
  int64_t overflows() const { return scaler_.overflows(); }

  // out.backward(seed x scale); with `inject_overflow` the seed is +inf instead (an injected
  // `overflow` fault: what an fp16 overflow does to the gradients).
  void backward(const torch::Tensor& out, const torch::Tensor& seed, bool inject_overflow) const;
  // After a backward with scaling on: whether it overflowed (the stage-input gradient or any
  // parameter gradient is not finite); remembered until the next step. Returns the stage-input
  // gradient to send, unscaled, or zeros when it overflowed (the receiver must not see NaN/Inf).
  // Without scaling: `input_grad` as is, no check.
  torch::Tensor finish(const torch::Tensor& input_grad, const std::vector<torch::Tensor>& params, bool* overflow);
  bool overflow_pending() const { return overflow_pending_; }
  // The gradients an overflow concerned were dropped (a state load): forget it, scale unchanged.
  void drop_pending() { overflow_pending_ = false; }

  // The optimizer step: true when it must be skipped (an overflow since the last step, or the
  // router's `skip`). Either way the pending overflow is cleared; the scale falls only when this
  // peer overflowed, and grows after growth_interval good steps.
  bool skip_step(bool told_to_skip);

  // The loss scale and its good steps for STATE_REPLY and checkpoints (scale 0: no scaling),
  // and restoring them from STATE_LOAD (scale 0: keep). Throws InputError on a bad scale.
  struct ScaleState {
    double loss_scale = 0;
    int64_t good_steps = 0;
  };
  ScaleState state() const;
  void restore(const ScaleState& s);

 private:
  Precision precision_ = Precision::kFp32;
  std::string reason_;
  bool scaling_ = false;
  LossScaler scaler_;
  bool overflow_pending_ = false;
};

}  // namespace swarm
