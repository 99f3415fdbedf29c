// test_optim.cpp: swarm::AdamW and lr_at against torch.optim.AdamW's numbers and the schedule's
// endpoints; graphs built before a step still run backward after it, and on a swapped-in
// snapshot give that snapshot's gradients; optimizer state round
// trip; swarm::train_reference learns a tiny text, identically for any partition.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/data.h"
#include "runtime/errors.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/reference.h"

namespace swarm {
namespace {

OptimizerSpec adam_spec() {
  OptimizerSpec o;
  o.lr = 0.01;
  o.min_lr = 0.0;
  o.warmup_steps = 0;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.grad_clip = 1.0;
  return o;
}

// Two blocks of width 16 over 32 tokens: stages small enough to check by hand.
ModelSpec two_block_model() {
  ModelSpec spec;
  spec.vocab_size = 32;
  spec.d_model = 16;
  spec.n_head = 2;
  spec.n_layer = 2;
  spec.seq_len = 8;
  return spec;
}

void expect_near(const torch::Tensor& t, const std::vector<double>& want, double tol) {
  torch::Tensor flat = t.detach().reshape({-1}).to(torch::kFloat64);
  ASSERT_EQ(flat.numel(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(flat[i].item<double>(), want[i], tol) << i;
}

// Expected values from torch.optim.AdamW (PyTorch 1.13) with clip_grad_norm_(1.0) on the mean
// gradients, weight_decay 0.1 on the matrix and 0 on the vector, lr 0.01 then 0.005.
TEST(AdamW, MatchesTorchAdamWWithClippingAndDecay) {
  torch::Tensor p = torch::tensor({{1.0, -2.0}, {0.5, 3.0}}).requires_grad_(true);
  torch::Tensor b = torch::tensor({0.1, -0.2}).requires_grad_(true);
  // total_steps 3: step 0 at lr, step 1 halfway down the cosine to min_lr 0, i.e. 0.005.
  AdamW opt({{"w", p}, {"b", b}}, adam_spec(), 3);
  EXPECT_DOUBLE_EQ(opt.next_lr(), 0.01);

  // Gradients arrive as sums over 2 samples.
  p.mutable_grad() = 2 * torch::tensor({{0.2, -0.4}, {1.0, 0.0}});
  b.mutable_grad() = 2 * torch::tensor({0.6, -0.2});
  EXPECT_NEAR(opt.step(2), 1.2649110555648804, 1e-6);
  EXPECT_FALSE(p.grad().defined());
  EXPECT_EQ(opt.steps_taken(), 1);
  // By hand, Adam's first step is lr * sign(g) after the decay p *= 1 - lr * wd (matrix only).
  expect_near(p, {1.0 * 0.999 - 0.01, -2.0 * 0.999 + 0.01, 0.5 * 0.999 - 0.01, 3.0 * 0.999}, 1e-6);
  expect_near(b, {0.1 - 0.01, -0.2 + 0.01}, 1e-6);
  expect_near(p, {0.9890000224113464, -1.9880000352859497, 0.4895000159740448, 2.996999979019165}, 1e-6);
  expect_near(b, {0.09000000357627869, -0.1899999976158142}, 1e-6);

  EXPECT_DOUBLE_EQ(opt.next_lr(), 0.005);
  p.mutable_grad() = 2 * torch::tensor({{-0.1, 0.3}, {0.5, 2.0}});
  b.mutable_grad() = 2 * torch::tensor({0.0, 0.8});
  EXPECT_NEAR(opt.step(2), 2.233830690383911, 1e-6);
  expect_near(p, {0.9862720370292664, -1.9853631258010864, 0.4849716126918793, 2.9918267726898193}, 1e-6);
  expect_near(b, {0.08660676330327988, -0.1920342594385147}, 1e-6);
  EXPECT_TRUE(p.is_leaf());
  EXPECT_TRUE(p.requires_grad());
}

// The async schedule's step: the learning rate of the job's step (lr_step), not of this
// optimizer's own count, times the staleness factor; bias correction still counts its own steps.
TEST(AdamW, LrStepAndFactorChooseTheLearningRate) {
  OptimizerSpec o = adam_spec();
  o.weight_decay = 0;
  o.grad_clip = 0;
  torch::Tensor p = torch::zeros({1}).requires_grad_(true);
  AdamW opt({{"b", p}}, o, 3);  // lr 0.01 at step 0, 0.005 at step 1
  p.mutable_grad() = torch::ones({1});
  opt.step(1, 1.0, /*lr_step=*/1, /*lr_factor=*/0.5);
  // Adam's first step is lr * sign(g): 0.005 x 0.5.
  EXPECT_NEAR(p.item<double>(), -0.0025, 1e-7);
  EXPECT_EQ(opt.steps_taken(), 1);
  p.mutable_grad() = torch::ones({1});
  opt.step(1, 1.0, /*lr_step=*/0);  // a constant gradient: the bias-corrected step is lr again
  EXPECT_NEAR(p.item<double>(), -0.0025 - 0.01, 1e-6);
}

TEST(AdamW, ParametersWithoutGradientAreUntouched) {
  torch::Tensor p = torch::ones({2, 2}).requires_grad_(true);
  torch::Tensor q = torch::ones({2, 2}).requires_grad_(true);
  AdamW opt({{"p", p}, {"q", q}}, adam_spec(), 10);
  p.mutable_grad() = torch::ones({2, 2});
  opt.step(1);
  EXPECT_TRUE(torch::equal(q, torch::ones({2, 2})));
  EXPECT_FALSE(torch::equal(p, torch::ones({2, 2})));
}

TEST(LrAt, WarmupThenCosineEndpoints) {
  OptimizerSpec o;
  o.lr = 1e-3;
  o.min_lr = 1e-4;
  o.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(lr_at(o, 0, 111), 1e-4);
  EXPECT_DOUBLE_EQ(lr_at(o, 4, 111), 5e-4);
  EXPECT_DOUBLE_EQ(lr_at(o, 9, 111), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(o, 10, 111), 1e-3);
  EXPECT_NEAR(lr_at(o, 60, 111), 0.55e-3, 1e-15);  // halfway: (lr + min_lr) / 2
  EXPECT_DOUBLE_EQ(lr_at(o, 110, 111), 1e-4);      // the last step
  EXPECT_DOUBLE_EQ(lr_at(o, 500, 111), 1e-4);
  for (int s = 11; s < 111; ++s) EXPECT_LT(lr_at(o, s, 111), lr_at(o, s - 1, 111)) << s;
  o.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(lr_at(o, 0, 50), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(o, 0, 1), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(o, 49, 50), 1e-4);
}

// The stage server's affinity cache keeps a forward's graph across optimizer steps.
TEST(AdamW, GraphBuiltBeforeAStepStillRunsBackward) {
  const ModelSpec spec = two_block_model();
  StageModel first(spec, 0, 2, 0, 1, 1);
  StageModel last(spec, 1, 2, 1, 1, 1);
  AdamW opt(first.named_parameters(), adam_spec(), 10);
  torch::manual_seed(0);
  torch::Tensor x1 = torch::randint(0, 32, {2, 8}, torch::kLong);
  torch::Tensor x2 = torch::randint(0, 32, {2, 8}, torch::kLong);
  torch::Tensor kept = first.forward(x2);  // graph kept alive
  torch::Tensor out = first.forward(x1);
  out.pow(2).sum().backward();
  torch::Tensor before = first.named_parameters()[2].second.detach().clone();
  opt.step(2);
  EXPECT_FALSE(torch::equal(before, first.named_parameters()[2].second));
  ASSERT_NO_THROW(kept.backward(torch::ones_like(kept)));
  for (const auto& np : first.named_parameters()) {
    ASSERT_TRUE(np.second.grad().defined()) << np.first;
    EXPECT_TRUE(torch::isfinite(np.second.grad()).all().item<bool>()) << np.first;
  }
  // The last stage's loss backward through a kept graph too.
  AdamW opt_last(last.named_parameters(), adam_spec(), 10);
  torch::Tensor a = torch::randn({2, 8, 16}).requires_grad_(true);
  torch::Tensor loss_kept = StageModel::loss(last.forward(a), x1);
  StageModel::loss(last.forward(a.detach()), x2).backward();
  opt_last.step(2);
  ASSERT_NO_THROW(loss_kept.backward());
  EXPECT_TRUE(a.grad().defined());
}

// Weight versions (the async schedule): a graph recorded on a snapshot of the weights, swapped
// in for the forward and again for the backward, computes exactly the gradients of the snapshot
// after an optimizer step wrote into the live weights in place: the same as a model that holds
// the snapshot's weights computes afresh. A libtorch that saved parameters by value, or a step
// that reached the snapshot, would fail here.
TEST(AdamW, AGraphOnASwappedInSnapshotGivesTheSnapshotsGradientsAfterAStep) {
  const ModelSpec spec = two_block_model();
  StageModel live(spec, 1, 3, 1, 1, 1);  // a middle stage: activations in, activations out
  AdamW opt(live.named_parameters(), adam_spec(), 10);
  torch::manual_seed(0);
  torch::Tensor x = torch::randn({2, 8, 16}).requires_grad_(true);
  torch::Tensor g = torch::randn({2, 8, 16});
  std::vector<torch::Tensor> snapshot;
  for (const auto& np : live.named_parameters()) snapshot.push_back(np.second.detach().clone().add_(0.01));
  // The forward on the snapshot, then the live weights back.
  std::vector<torch::Tensor> swap = snapshot;
  live.swap_weights(swap);
  torch::Tensor out = live.forward(x);
  live.swap_weights(swap);
  // A step in place on the live weights (another microbatch's gradients).
  live.forward(torch::randn({2, 8, 16})).pow(2).sum().backward();
  opt.step(2);
  opt.zero_grad();
  // The backward with the snapshot swapped in again.
  swap = snapshot;
  live.swap_weights(swap);
  out.backward(g);
  live.swap_weights(swap);
  // Afresh: a model holding the snapshot's weights.
  StageModel fresh(spec, 1, 3, 1, 1, 1);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < snapshot.size(); ++i) fresh.named_parameters()[i].second.copy_(snapshot[i]);
  }
  torch::Tensor x2 = x.detach().clone().requires_grad_(true);
  fresh.forward(x2).backward(g);
  EXPECT_TRUE(torch::allclose(x.grad(), x2.grad(), 1e-5, 1e-6));
  for (size_t i = 0; i < snapshot.size(); ++i) {
    const auto& [name, p] = live.named_parameters()[i];
    EXPECT_TRUE(torch::allclose(p.grad(), fresh.named_parameters()[i].second.grad(), 1e-5, 1e-6)) << name;
    EXPECT_FALSE(torch::equal(p.detach(), snapshot[i])) << name << ": the live weights are the live ones again";
  }
}

TEST(AdamW, StateRoundTripContinuesIdentically) {
  auto make = [] {
    return std::vector<std::pair<std::string, torch::Tensor>>{
        {"w", torch::tensor({{1.0, -2.0}, {0.5, 3.0}}).requires_grad_(true)},
        {"b", torch::tensor({0.1, -0.2}).requires_grad_(true)}};
  };
  auto grads = [](const std::vector<std::pair<std::string, torch::Tensor>>& ps, double k) {
    ps[0].second.mutable_grad() = torch::tensor({{0.2, -0.4}, {1.0, 0.0}}) * k;
    ps[1].second.mutable_grad() = torch::tensor({0.6, -0.2}) * k;
  };
  auto pa = make(), pb = make();
  AdamW a(pa, adam_spec(), 10), b(pb, adam_spec(), 10);
  grads(pa, 1.0);
  a.step(1);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < pa.size(); ++i) pb[i].second.data().copy_(pa[i].second);
  }
  auto st = a.state();
  ASSERT_EQ(st.size(), 5u);
  EXPECT_EQ(st[0].first, "w.exp_avg");
  EXPECT_EQ(st[1].first, "w.exp_avg_sq");
  EXPECT_EQ(st[4].first, "step");
  b.load_state(st);
  EXPECT_EQ(b.steps_taken(), 1);
  grads(pa, -3.0);
  grads(pb, -3.0);
  a.step(1);
  b.step(1);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second));

  auto bad = st;
  bad.erase(bad.begin());
  EXPECT_THROW(b.load_state(bad), InputError);
  bad = st;
  bad[1].second = torch::zeros({3});
  EXPECT_THROW(b.load_state(bad), InputError);
  EXPECT_EQ(b.steps_taken(), 2);  // unchanged by the failed loads
}

class ReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = std::filesystem::temp_directory_path() /
            ("swarm_reference_" + std::to_string(::getpid()) + ".txt");
    std::ofstream f(path_);
    for (int i = 0; i < 60; ++i) f << "The quick brown fox jumps over the lazy dog. ";
  }
  void TearDown() override { std::filesystem::remove(path_); }

  JobSpec spec(std::vector<int> layers) const {
    JobSpec s;
    s.seed = 1;
    s.steps = 30;
    s.model.vocab_size = 256;
    s.model.d_model = 32;
    s.model.n_head = 4;
    s.model.n_layer = 2;
    s.model.seq_len = 16;
    s.partition.stages = static_cast<int>(layers.size());
    s.partition.layers_per_stage = layers;
    s.data.paths = {path_.string()};
    s.batch.batch_size = 8;
    s.batch.microbatch_size = 4;
    s.optimizer.lr = 3e-3;
    s.optimizer.min_lr = 3e-4;
    s.optimizer.warmup_steps = 3;
    s.eval.batches = 2;
    return s;
  }

  std::filesystem::path path_;
};

TEST_F(ReferenceTest, LossFallsOnATinyText) {
  JobSpec s = spec({1, 1});
  TokenData data = TokenData::load(s.data, s.model.seq_len, s.model.vocab_size);
  int calls = 0;
  ReferenceResult r = train_reference(s, data, 0, [&](int step, double loss) {
    EXPECT_EQ(step, calls);
    ++calls;
  });
  EXPECT_EQ(calls, 30);
  ASSERT_EQ(r.losses.size(), 30u);
  EXPECT_NEAR(r.losses[0], std::log(256.0), 0.1);
  double tail = 0;
  for (int i = 25; i < 30; ++i) tail += r.losses[i] / 5;
  EXPECT_LT(tail, r.losses[0] - 2.0) << "first " << r.losses[0] << " last five " << tail;
  EXPECT_LT(r.val_loss, r.losses[0] - 2.0);
  EXPECT_GT(r.tokens_per_s, 0);

  // The partition does not change training (same init, same data, per-stage clipping aside:
  // clip off so that the whole-model and per-stage norms agree).
  s.optimizer.grad_clip = 0;
  JobSpec one = s;
  one.partition.stages = 1;
  one.partition.layers_per_stage = {2};
  one.steps = 5;
  s.steps = 5;
  ReferenceResult a = train_reference(one, data, 0), b = train_reference(s, data, 0);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5) << i;
  EXPECT_NEAR(a.val_loss, b.val_loss, 1e-5);
}

}  // namespace
}  // namespace swarm
