// test_precision.cpp: the stage's side of mixed precision (stages/precision.h) on the CPU: bf16
// compute keeps fp32 master weights and gradients and stays close to fp32; loss scaling in fp32
// changes no bit of a training step (the scale is a power of two); an injected overflow is
// caught, zeroes the gradient that would leave, skips the step and halves the scale; the router's
// skip leaves the scale alone; the scale travels through state() and restore().
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/errors.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/precision.h"

namespace swarm {
namespace {

ModelSpec tiny(const std::string& loss_scale = "auto", const std::string& precision = "auto") {
  ModelSpec m;
  m.d_model = 32;
  m.n_head = 4;
  m.n_layer = 2;
  m.seq_len = 16;
  m.loss_scale = loss_scale;
  m.precision = precision;
  return m;
}

DeviceCaps cpu_caps() {
  DeviceInfo info;
  info.name = "cpu";
  return device_caps(torch::kCPU, info);
}

struct Batch {
  torch::Tensor x, y;
};
Batch batch(int seed) {
  torch::manual_seed(seed);
  return {torch::randint(0, 256, {4, 16}, torch::kLong), torch::randint(0, 256, {4, 16}, torch::kLong)};
}

TEST(StagePrecision, CpuDefaultsToFp32WithoutScaling) {
  const StagePrecision p(tiny(), Precision::kAuto, cpu_caps());
  EXPECT_EQ(p.precision(), Precision::kFp32);
  EXPECT_EQ(p.type(), torch::kFloat32);
  EXPECT_FALSE(p.scaling());
  EXPECT_EQ(p.scale(), 1.0);
  EXPECT_EQ(p.state().loss_scale, 0.0);
}

TEST(StagePrecision, Bf16OnTheCpuKeepsFp32MasterWeightsAndStaysClose) {
  const DeviceCaps caps = cpu_caps();
  if (!caps.bf16) GTEST_SKIP() << "this libtorch cannot compute bf16 on the CPU";
  const StagePrecision p(tiny(), Precision::kBf16, caps);
  ASSERT_EQ(p.type(), torch::kBFloat16);
  StageModel f32(tiny(), 0, 1, 0, 2, 5), b16(tiny(), 0, 1, 0, 2, 5, torch::kCPU, p.type());
  const Batch b = batch(1);
  torch::Tensor l32 = StageModel::loss(f32.forward(b.x), b.y), l16 = StageModel::loss(b16.forward(b.x), b.y);
  EXPECT_EQ(l16.scalar_type(), torch::kFloat32);  // logits and loss in fp32
  EXPECT_NEAR(l16.item<double>(), l32.item<double>(), 0.01 * l32.item<double>());
  l32.backward();
  l16.backward();
  for (size_t i = 0; i < f32.named_parameters().size(); ++i) {
    const auto& [name, p32] = f32.named_parameters()[i];
    const torch::Tensor& p16 = b16.named_parameters()[i].second;
    EXPECT_EQ(p16.scalar_type(), torch::kFloat32) << name;
    ASSERT_TRUE(p16.grad().defined()) << name;
    EXPECT_EQ(p16.grad().scalar_type(), torch::kFloat32) << name;
    const double cos = torch::cosine_similarity(p16.grad().flatten(), p32.grad().flatten(), 0).item<double>();
    EXPECT_GT(cos, 0.98) << name;
  }
}

// One training step of a 2-stage model (backward across the cut as the stage servers run it),
// with or without loss scaling: returns the weights after the step.
std::vector<torch::Tensor> one_step(const std::string& loss_scale, double* sent_grad_sum = nullptr) {
  const ModelSpec spec = tiny(loss_scale);
  StagePrecision p0(spec, Precision::kAuto, cpu_caps()), p1(spec, Precision::kAuto, cpu_caps());
  StageModel s0(spec, 0, 2, 0, 1, 3), s1(spec, 1, 2, 1, 1, 3);
  OptimizerSpec o;
  AdamW a0(s0.named_parameters(), o, 10), a1(s1.named_parameters(), o, 10);
  const Batch b = batch(2);
  torch::Tensor act = s0.forward(b.x);
  torch::Tensor x1 = act.detach().requires_grad_(true);
  torch::Tensor loss = StageModel::loss(s1.forward(x1), b.y);
  bool overflow = true;
  p1.backward(loss, torch::full({}, 4.0), false);
  torch::Tensor g = p1.finish(x1.grad(), s1.parameters(), &overflow);
  EXPECT_FALSE(overflow);
  if (sent_grad_sum) *sent_grad_sum = g.abs().sum().item<double>();
  p0.backward(act, g, false);
  p0.finish(torch::Tensor(), s0.parameters(), &overflow);
  EXPECT_FALSE(overflow);
  const double scale0 = p0.scale(), scale1 = p1.scale();
  EXPECT_FALSE(p0.skip_step(false));
  EXPECT_FALSE(p1.skip_step(false));
  a0.step(4, scale0);
  a1.step(4, scale1);
  std::vector<torch::Tensor> out;
  for (StageModel* m : {&s0, &s1})
    for (const auto& np : m->named_parameters()) out.push_back(np.second.detach().clone());
  return out;
}

TEST(StagePrecision, ScalingInFp32ChangesNoBit) {
  double sent_plain = 0, sent_scaled = 0;
  const std::vector<torch::Tensor> plain = one_step("none", &sent_plain), scaled = one_step("dynamic", &sent_scaled);
  EXPECT_EQ(sent_plain, sent_scaled);  // the gradient between stages is unscaled
  ASSERT_EQ(plain.size(), scaled.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], scaled[i])) << i;
}

TEST(StagePrecision, InjectedOverflowZeroesTheGradientSkipsAndHalves) {
  StagePrecision p(tiny("dynamic"), Precision::kAuto, cpu_caps());
  ASSERT_TRUE(p.scaling());
  EXPECT_EQ(p.scale(), 65536.0);
  StageModel s1(tiny(), 1, 2, 1, 1, 3);
  const Batch b = batch(3);
  torch::Tensor x = torch::randn({4, 16, 32}).requires_grad_(true);
  torch::Tensor loss = StageModel::loss(s1.forward(x), b.y);
  p.backward(loss, torch::full({}, 4.0), /*inject_overflow=*/true);
  bool overflow = false;
  torch::Tensor g = p.finish(x.grad(), s1.parameters(), &overflow);
  EXPECT_TRUE(overflow);
  EXPECT_TRUE(p.overflow_pending());
  EXPECT_TRUE(torch::equal(g, torch::zeros_like(g)));  // nothing non-finite leaves the stage
  EXPECT_TRUE(p.skip_step(false));
  EXPECT_EQ(p.scale(), 32768.0);
  EXPECT_EQ(p.overflows(), 1);
  EXPECT_FALSE(p.overflow_pending());
  // A clean step counts toward growth; the router's skip (another stage overflowed) changes nothing.
  EXPECT_FALSE(p.skip_step(false));
  EXPECT_EQ(p.state().good_steps, 1);
  EXPECT_TRUE(p.skip_step(true));
  EXPECT_EQ(p.scale(), 32768.0);
  EXPECT_EQ(p.state().good_steps, 1);
}

TEST(StagePrecision, ScaleTravelsThroughStateAndRestore) {
  StagePrecision a(tiny("dynamic"), Precision::kAuto, cpu_caps()), b(tiny("dynamic"), Precision::kAuto, cpu_caps());
  a.restore({1024.0, 7});
  b.restore(a.state());
  EXPECT_EQ(b.scale(), 1024.0);
  EXPECT_EQ(b.state().good_steps, 7);
  EXPECT_THROW(b.restore({1000.0, 0}), InputError);
  b.restore({});  // a donor without scaling: keep ours
  EXPECT_EQ(b.scale(), 1024.0);
  StagePrecision off(tiny("none"), Precision::kAuto, cpu_caps());
  off.restore(a.state());  // scaling off here: nothing to restore into
  EXPECT_EQ(off.scale(), 1.0);
}

TEST(StagePrecision, PinnedTypeTheCpuLacksIsAClearError) {
  DeviceCaps caps = cpu_caps();
  caps.fp16 = false;  // as Debian's libtorch 1.13, whatever this one does
  try {
    StagePrecision(tiny("auto", "fp16"), Precision::kAuto, caps);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model.precision asks for fp16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace swarm
