// test_precision.cpp: precision names, resolve_precision's decisions (job pin, peer flag, device),
// and LossScaler's dynamics (backoff on overflow, growth after a run of good steps, limits,
// restore checks).
#include <cmath>

#include <gtest/gtest.h>

#include "runtime/errors.h"
#include "runtime/precision.h"

namespace swarm {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE(std::string(msg).find(part), std::string::npos) << "message: " << (msg)

DeviceCaps cpu(bool bf16 = true, bool fp16 = false) {
  DeviceCaps c;
  c.bf16 = bf16;
  c.fp16 = fp16;
  return c;
}

DeviceCaps gpu(const char* name, int major, int minor) {
  DeviceCaps c;
  c.name = name;
  c.cuda = true;
  c.cc_major = major;
  c.cc_minor = minor;
  c.fp16 = true;
  c.bf16 = major >= 8;
  return c;
}

TEST(Precision, NamesRoundTripAndBadNamesSayWhatIsAccepted) {
  for (Precision p : {Precision::kAuto, Precision::kFp32, Precision::kBf16, Precision::kFp16})
    EXPECT_EQ(parse_precision(precision_name(p)), p);
  try {
    parse_precision("half");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "auto, fp32, bf16, fp16");
  }
  EXPECT_EQ(compute_bytes(Precision::kFp32), 4u);
  EXPECT_EQ(compute_bytes(Precision::kBf16), 2u);
  EXPECT_EQ(compute_bytes(Precision::kFp16), 2u);
}

TEST(Precision, AutoPicksBf16FromAmpereFp16BeforeFp32OnCpu) {
  EXPECT_EQ(auto_precision(gpu("NVIDIA A100-SXM4-80GB", 8, 0)), Precision::kBf16);
  EXPECT_EQ(auto_precision(gpu("NVIDIA H200", 9, 0)), Precision::kBf16);
  EXPECT_EQ(auto_precision(gpu("Tesla T4", 7, 5)), Precision::kFp16);
  EXPECT_EQ(auto_precision(gpu("Tesla V100-SXM2-16GB", 7, 0)), Precision::kFp16);
  EXPECT_EQ(auto_precision(cpu()), Precision::kFp32);
  DeviceCaps unknown = gpu("cuda:0", 0, 0);  // a build that cannot read the capability
  EXPECT_EQ(auto_precision(unknown), Precision::kFp32);
  const PrecisionChoice c = resolve_precision(Precision::kAuto, Precision::kAuto, unknown);
  EXPECT_EQ(c.precision, Precision::kFp32);
  EXPECT_HAS(c.reason, "-DSWARM_CUDA=ON");
}

TEST(Precision, JobPinBeatsTheFlagAndTheFlagBeatsAuto) {
  const DeviceCaps a100 = gpu("NVIDIA A100", 8, 0);
  EXPECT_EQ(resolve_precision(Precision::kFp32, Precision::kBf16, a100).precision, Precision::kFp32);
  EXPECT_EQ(resolve_precision(Precision::kFp16, Precision::kAuto, a100).precision, Precision::kFp16);
  EXPECT_EQ(resolve_precision(Precision::kAuto, Precision::kFp16, a100).precision, Precision::kFp16);
  EXPECT_EQ(resolve_precision(Precision::kAuto, Precision::kAuto, a100).precision, Precision::kBf16);
  EXPECT_HAS(resolve_precision(Precision::kBf16, Precision::kAuto, a100).reason, "model.precision");
  EXPECT_EQ(resolve_precision(Precision::kAuto, Precision::kBf16, cpu()).precision, Precision::kBf16);
}

TEST(Precision, UnsupportedTypeNamesDeviceTypeAndAlternative) {
  try {
    resolve_precision(Precision::kBf16, Precision::kAuto, gpu("Tesla T4", 7, 5));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "model.precision asks for bf16");
    EXPECT_HAS(e.what(), "Tesla T4 (compute capability 7.5)");
    EXPECT_HAS(e.what(), "use fp16");
  }
  try {
    resolve_precision(Precision::kAuto, Precision::kFp16, cpu(true, false));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "--precision asks for fp16");
    EXPECT_HAS(e.what(), "use fp32");
  }
}

TEST(LossScaler, OverflowHalvesGoodRunDoubles) {
  LossScaleOptions o;
  o.growth_interval = 3;
  LossScaler s(o);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_EQ(s.overflows(), 1);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_EQ(s.good_steps(), 2);
  s.update(true);  // an overflow resets the run
  EXPECT_EQ(s.scale(), 16384.0);
  EXPECT_EQ(s.good_steps(), 0);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(LossScaler, StaysWithinItsLimits) {
  LossScaleOptions o;
  o.init = 4;
  o.min_scale = 1;
  o.max_scale = 8;
  o.growth_interval = 1;
  LossScaler s(o);
  for (int i = 0; i < 5; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 1.0);
  for (int i = 0; i < 5; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 8.0);
}

TEST(LossScaler, RestoreChecksWhatItIsGiven) {
  LossScaler s;
  s.restore(1024.0, 5);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.good_steps(), 5);
  EXPECT_THROW(s.restore(1000.0, 0), InputError);  // not a power of two: unscaling would round
  EXPECT_THROW(s.restore(0.5, 0), InputError);     // under min_scale
  EXPECT_THROW(s.restore(std::ldexp(1.0, 30), 0), InputError);
  EXPECT_THROW(s.restore(1024.0, -1), InputError);
  EXPECT_THROW(s.restore(1024.0, 2000), InputError);
  EXPECT_EQ(s.scale(), 1024.0);  // a refused restore changes nothing
}

}  // namespace
}  // namespace swarm
