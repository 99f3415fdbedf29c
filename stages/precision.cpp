// precision.cpp: compute types, the dtype probe and StagePrecision (see precision.h).
#include "stages/precision.h"

#include <limits>

#include "runtime/errors.h"
#include "stages/attention.h"

namespace swarm {
namespace {

// True when every defined tensor holds only finite values (one device sync for all of them).
bool all_finite(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> flags;
  for (const torch::Tensor& t : ts)
    if (t.defined() && t.numel() > 0) flags.push_back(torch::isfinite(t).all());
  return flags.empty() || torch::stack(flags).all().item<bool>();
}

}  // namespace

torch::ScalarType compute_type(Precision p) {
  switch (p) {
    case Precision::kBf16: return torch::kBFloat16;
    case Precision::kFp16: return torch::kHalf;
    case Precision::kFp32: return torch::kFloat32;
    case Precision::kAuto: break;
  }
  SWARM_CHECK(false, "compute_type of an unresolved precision");
  return torch::kFloat32;
}

bool dtype_works(const torch::Device& device, torch::ScalarType dtype) {
  try {
    const auto f32 = torch::TensorOptions().device(device).dtype(torch::kFloat32);
    torch::Tensor x = torch::randn({1, 4, 8}, f32).requires_grad_(true);
    torch::Tensor w = torch::randn({24, 8}, f32).requires_grad_(true);
    torch::Tensor h = torch::layer_norm(x, {8});
    torch::Tensor qkv = at::gelu(torch::linear(h.to(dtype), w.to(dtype)), "tanh");  // [1, 4, 24]
    std::vector<torch::Tensor> p = qkv.view({1, 4, 3, 1, 8}).unbind(2);                // [1, 4, 1, 8] each
    const torch::Tensor future = torch::ones({4, 4}, torch::TensorOptions().dtype(torch::kBool).device(device)).triu(1);
    torch::Tensor y = causal_attention(p[0].transpose(1, 2), p[1].transpose(1, 2), p[2].transpose(1, 2), future);
    torch::log_softmax(y.to(torch::kFloat32), -1).sum().backward();
    return w.grad().defined() && torch::isfinite(w.grad()).all().item<bool>();
  } catch (const std::exception&) {
    return false;  // no kernel for this dtype on this device
  }
}

DeviceCaps device_caps(const torch::Device& device, const DeviceInfo& info) {
  DeviceCaps caps;
  caps.name = info.name;
  caps.cuda = device.is_cuda();
  caps.cc_major = info.cc_major;
  caps.cc_minor = info.cc_minor;
  caps.bf16 = dtype_works(device, torch::kBFloat16);
  caps.fp16 = dtype_works(device, torch::kHalf);
  return caps;
}

StagePrecision::StagePrecision(const ModelSpec& model, Precision flag, const DeviceCaps& caps) {
  const PrecisionChoice c = resolve_precision(model.precision_pin(), flag, caps);
  precision_ = c.precision;
  reason_ = c.reason;
  scaling_ = model.loss_scale == "dynamic" || (model.loss_scale == "auto" && precision_ == Precision::kFp16);
  if (scaling_) reason_ += ", dynamic loss scaling from " + std::to_string(int64_t(scaler_.scale()));
}

void StagePrecision::backward(const torch::Tensor& out, const torch::Tensor& seed, bool inject_overflow) const {
  const double factor = inject_overflow ? std::numeric_limits<double>::infinity() : scale();
  if (factor == 1.0) {
    out.backward(seed);
  } else {
    out.backward(seed * factor);
  }
}

torch::Tensor StagePrecision::finish(const torch::Tensor& input_grad, const std::vector<torch::Tensor>& params,
                                     bool* overflow) {
  *overflow = false;
  if (!scaling_) return input_grad;
  std::vector<torch::Tensor> check;
  if (!overflow_pending_) {  // after an overflow the sums stay non-finite: nothing new to learn
    for (const torch::Tensor& p : params) check.push_back(p.grad());
  }
  const bool input_ok = !input_grad.defined() || all_finite({input_grad});
  *overflow = !input_ok || !all_finite(check);
  overflow_pending_ = overflow_pending_ || *overflow;
  if (!input_grad.defined()) return input_grad;
  if (!input_ok) return torch::zeros_like(input_grad);
  return input_grad * (1.0 / scaler_.scale());  // a power of two: exact
}

bool StagePrecision::skip_step(bool told_to_skip) {
  const bool overflow = overflow_pending_;
  overflow_pending_ = false;
  if (scaling_ && (overflow || !told_to_skip)) scaler_.update(overflow);
  return overflow || told_to_skip;
}

StagePrecision::ScaleState StagePrecision::state() const {
  return scaling_ ? ScaleState{scaler_.scale(), scaler_.good_steps()} : ScaleState{};
}

void StagePrecision::restore(const ScaleState& s) {
  if (!scaling_ || s.loss_scale == 0) return;
  scaler_.restore(s.loss_scale, s.good_steps);
}

}  // namespace swarm
