// precision.cpp: precision names, resolve_precision and LossScaler (see precision.h).
#include "runtime/precision.h"

#include <algorithm>
#include <cmath>

#include "runtime/errors.h"
#include "runtime/text.h"

namespace swarm {
namespace {

bool power_of_two(double v) {
  int exp = 0;
  return std::isfinite(v) && v > 0 && std::frexp(v, &exp) == 0.5;
}

std::string device_text(const DeviceCaps& caps) {
  if (!caps.cuda) return caps.name.empty() ? "the CPU" : caps.name;
  std::string s = caps.name.empty() ? "this CUDA device" : caps.name;
  if (caps.cc_major > 0) s += " (compute capability " + std::to_string(caps.cc_major) + "." + std::to_string(caps.cc_minor) + ")";
  return s;
}

bool supports(const DeviceCaps& caps, Precision p) {
  switch (p) {
    case Precision::kFp32: return true;
    case Precision::kBf16: return caps.bf16;
    case Precision::kFp16: return caps.fp16;
    case Precision::kAuto: return true;
  }
  return false;
}

}  // namespace

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kAuto: return "auto";
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

Precision parse_precision(const std::string& text) {
  for (Precision p : {Precision::kAuto, Precision::kFp32, Precision::kBf16, Precision::kFp16})
    if (text == precision_name(p)) return p;
  throw InputError("precision \"" + text + "\" is not one of auto, fp32, bf16, fp16");
}

size_t compute_bytes(Precision p) {
  switch (p) {
    case Precision::kFp32: return 4;
    case Precision::kBf16: case Precision::kFp16: return 2;
    case Precision::kAuto: return 0;
  }
  return 0;
}

Precision auto_precision(const DeviceCaps& caps) {
  if (!caps.cuda || caps.cc_major <= 0) return Precision::kFp32;
  if (caps.cc_major >= 8 && caps.bf16) return Precision::kBf16;
  return caps.fp16 ? Precision::kFp16 : Precision::kFp32;
}

PrecisionChoice resolve_precision(Precision job, Precision flag, const DeviceCaps& caps) {
  PrecisionChoice out;
  const bool pinned = job != Precision::kAuto;
  const Precision asked = pinned ? job : flag;
  const std::string who = pinned ? "the job's model.precision" : "--precision";
  if (asked == Precision::kAuto) {
    out.precision = auto_precision(caps);
    if (!caps.cuda) out.reason = "auto: fp32 on " + device_text(caps);
    else if (caps.cc_major <= 0)
      out.reason = "auto: fp32, the compute capability of " + device_text(caps) +
                   " is unknown (a build without -DSWARM_CUDA=ON); pass --precision bf16 or fp16 to use the tensor cores";
    else
      out.reason = std::string("auto: ") + precision_name(out.precision) + " on " + device_text(caps);
    return out;
  }
  if (!supports(caps, asked)) {
    std::string hint = std::string("use ") + precision_name(auto_precision(caps)) + " (what auto picks here)";
    throw InputError(who + " asks for " + precision_name(asked) + ", but this libtorch cannot compute in " +
                     precision_name(asked) + " on " + device_text(caps) + "; " + hint);
  }
  out.precision = asked;
  out.reason = std::string(precision_name(asked)) + ", as " + who + " says";
  return out;
}

LossScaler::LossScaler(LossScaleOptions opt) : opt_(opt), scale_(opt.init) {
  SWARM_CHECK(power_of_two(opt.init) && power_of_two(opt.min_scale) && power_of_two(opt.max_scale) &&
                  opt.min_scale <= opt.init && opt.init <= opt.max_scale,
              "loss scales are powers of two with min <= init <= max");
  SWARM_CHECK(opt.growth == 2.0 && opt.backoff == 0.5, "scale steps of 2 keep the scale a power of two");
  SWARM_CHECK(opt.growth_interval >= 1, "growth_interval >= 1");
}

void LossScaler::update(bool overflow) {
  if (overflow) {
    ++overflows_;
    good_ = 0;
    scale_ = std::max(opt_.min_scale, scale_ * opt_.backoff);
    return;
  }
  if (++good_ >= opt_.growth_interval) {
    good_ = 0;
    scale_ = std::min(opt_.max_scale, scale_ * opt_.growth);
  }
}

void LossScaler::restore(double scale, int64_t good_steps) {
  if (!power_of_two(scale) || scale < opt_.min_scale || scale > opt_.max_scale)
    throw InputError("loss scale " + shortest_number(scale) + " is not a power of two in [" + shortest_number(opt_.min_scale) + ", " +
                     shortest_number(opt_.max_scale) + "]");
  if (good_steps < 0 || good_steps >= opt_.growth_interval)
    throw InputError("loss scale good-step count " + std::to_string(good_steps) + " is outside [0, " +
                     std::to_string(opt_.growth_interval) + ")");
  scale_ = scale;
  good_ = good_steps;
}

}  // namespace swarm
