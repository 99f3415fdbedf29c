// test_model.cpp: swarm::StageModel: nanoGPT names, shapes and init; partition independence of
// init and forward; causality; loss at init; gradients against finite differences; PyTorch's
// numbers for a tiny nanoGPT with these weights.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "stages/model.h"

namespace swarm {
namespace {

ModelSpec tiny(int layers = 2) {
  ModelSpec m;
  m.vocab_size = 256;
  m.d_model = 32;
  m.n_head = 4;
  m.n_layer = layers;
  m.seq_len = 16;
  m.max_seq_len = 0;
  return m;
}

std::vector<std::string> block_names(int l, bool bias) {
  const std::string h = "transformer.h." + std::to_string(l) + ".";
  std::vector<std::string> out;
  for (const char* n : {"ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"}) {
    out.push_back(h + n + ".weight");
    if (bias) out.push_back(h + n + ".bias");
  }
  return out;
}

std::vector<std::string> names_of(const StageModel& m) {
  std::vector<std::string> out;
  for (const auto& np : m.named_parameters()) out.push_back(np.first);
  return out;
}

// Builds stages of `layers_per_stage` and chains them.
torch::Tensor chained_logits(const ModelSpec& spec, const std::vector<int>& layers_per_stage, uint64_t seed,
                             const torch::Tensor& tokens) {
  int first = 0;
  torch::Tensor x = tokens;
  const int S = static_cast<int>(layers_per_stage.size());
  for (int s = 0; s < S; ++s) {
    StageModel m(spec, s, S, first, layers_per_stage[s], seed);
    x = m.forward(x);
    first += layers_per_stage[s];
  }
  return x;
}

TEST(StageModel, OneStageNamesAndShapesAreNanoGPTs) {
  ModelSpec spec = tiny(2);
  StageModel m(spec, 0, 1, 0, 2, 1);
  std::vector<std::string> want = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int l = 0; l < 2; ++l)
    for (const auto& n : block_names(l, true)) want.push_back(n);
  for (const char* n : {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}) want.push_back(n);
  EXPECT_EQ(names_of(m), want);

  const int64_t C = 32, V = 256;
  std::map<std::string, std::vector<int64_t>> shapes = {
      {"transformer.wte.weight", {V, C}}, {"transformer.wpe.weight", {16, C}},
      {"transformer.h.1.ln_1.weight", {C}}, {"transformer.h.1.ln_1.bias", {C}},
      {"transformer.h.1.attn.c_attn.weight", {3 * C, C}}, {"transformer.h.1.attn.c_attn.bias", {3 * C}},
      {"transformer.h.1.attn.c_proj.weight", {C, C}}, {"transformer.h.1.attn.c_proj.bias", {C}},
      {"transformer.h.1.mlp.c_fc.weight", {4 * C, C}}, {"transformer.h.1.mlp.c_fc.bias", {4 * C}},
      {"transformer.h.1.mlp.c_proj.weight", {C, 4 * C}}, {"transformer.h.1.mlp.c_proj.bias", {C}},
      {"transformer.ln_f.weight", {C}}, {"lm_head.weight", {V, C}}};
  int64_t total = 0;
  for (const auto& np : m.named_parameters()) {
    total += np.second.numel();
    EXPECT_TRUE(np.second.is_leaf()) << np.first;
    EXPECT_TRUE(np.second.requires_grad()) << np.first;
    EXPECT_EQ(np.second.scalar_type(), torch::kFloat32) << np.first;
    auto it = shapes.find(np.first);
    if (it != shapes.end()) {
      EXPECT_EQ(np.second.sizes().vec(), it->second) << np.first;
    }
  }
  // nanoGPT's count (untied head): 2 V C + T C + L (12 C^2 + 13 C) + 2 C.
  EXPECT_EQ(total, 2 * V * C + 16 * C + 2 * (12 * C * C + 13 * C) + 2 * C);
  EXPECT_EQ(m.num_parameters(), total);
  EXPECT_EQ(m.parameters().size(), m.named_parameters().size());
}

TEST(StageModel, TwoStageSplitUsesGlobalLayerIndices) {
  ModelSpec spec = tiny(3);
  StageModel whole(spec, 0, 1, 0, 3, 1);
  StageModel s0(spec, 0, 2, 0, 1, 1);
  StageModel s1(spec, 1, 2, 1, 2, 1);
  EXPECT_TRUE(s0.is_first());
  EXPECT_FALSE(s0.is_last());
  EXPECT_TRUE(s1.is_last());
  std::vector<std::string> want0 = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (const auto& n : block_names(0, true)) want0.push_back(n);
  EXPECT_EQ(names_of(s0), want0);
  std::vector<std::string> want1 = block_names(1, true);
  for (const auto& n : block_names(2, true)) want1.push_back(n);
  for (const char* n : {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}) want1.push_back(n);
  EXPECT_EQ(names_of(s1), want1);
  std::vector<std::string> joined = want0;
  joined.insert(joined.end(), want1.begin(), want1.end());
  EXPECT_EQ(names_of(whole), joined);
  EXPECT_EQ(s0.num_parameters() + s1.num_parameters(), whole.num_parameters());
}

TEST(StageModel, NoBiasDropsEveryBias) {
  ModelSpec spec = tiny(2);
  spec.bias = false;
  spec.max_seq_len = 32;
  StageModel m(spec, 0, 1, 0, 2, 1);
  std::vector<std::string> want = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int l = 0; l < 2; ++l)
    for (const auto& n : block_names(l, false)) want.push_back(n);
  want.push_back("transformer.ln_f.weight");
  want.push_back("lm_head.weight");
  EXPECT_EQ(names_of(m), want);
  EXPECT_EQ(m.named_parameters()[1].second.size(0), 32);  // wpe has max_seq_len rows
  torch::Tensor logits = m.forward(torch::randint(0, 256, {2, 20}, torch::kLong));
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{2, 20, 256}));
}

TEST(StageModel, InitIsAPureFunctionOfSeedAndName) {
  ModelSpec spec = tiny(4);
  StageModel whole(spec, 0, 1, 0, 4, 5);
  StageModel mid(spec, 1, 3, 1, 2, 5);  // blocks 1, 2 of a 3-stage split
  StageModel other_seed(spec, 0, 1, 0, 4, 6);
  std::map<std::string, torch::Tensor> w, o;
  for (const auto& np : whole.named_parameters()) w[np.first] = np.second;
  for (const auto& np : other_seed.named_parameters()) o[np.first] = np.second;
  for (const auto& np : mid.named_parameters()) EXPECT_TRUE(torch::equal(np.second, w.at(np.first))) << np.first;
  EXPECT_FALSE(torch::equal(w.at("transformer.h.1.attn.c_attn.weight"), o.at("transformer.h.1.attn.c_attn.weight")));
  EXPECT_FALSE(torch::equal(w.at("transformer.wte.weight"), o.at("transformer.wte.weight")));
  // Different names draw different values.
  EXPECT_FALSE(torch::equal(w.at("transformer.h.1.mlp.c_fc.weight"), w.at("transformer.h.2.mlp.c_fc.weight")));

  // nanoGPT's distributions.
  auto stdev = [](const torch::Tensor& t) { return t.std().item<double>(); };
  EXPECT_NEAR(stdev(w.at("transformer.wte.weight")), 0.02, 0.001);
  EXPECT_NEAR(w.at("transformer.wte.weight").mean().item<double>(), 0.0, 0.001);
  EXPECT_NEAR(stdev(w.at("transformer.h.0.mlp.c_fc.weight")), 0.02, 0.001);
  EXPECT_NEAR(stdev(w.at("transformer.h.3.mlp.c_proj.weight")), 0.02 / std::sqrt(8.0), 0.0005);
  EXPECT_NEAR(stdev(w.at("transformer.h.3.attn.c_proj.weight")), 0.02 / std::sqrt(8.0), 0.0008);
  EXPECT_NEAR(stdev(w.at("lm_head.weight")), 0.02, 0.001);
  EXPECT_TRUE(torch::equal(w.at("transformer.h.2.ln_1.weight"), torch::ones({32})));
  EXPECT_TRUE(torch::equal(w.at("transformer.h.2.ln_2.bias"), torch::zeros({32})));
  EXPECT_TRUE(torch::equal(w.at("transformer.h.2.mlp.c_fc.bias"), torch::zeros({128})));
  EXPECT_TRUE(torch::equal(w.at("transformer.ln_f.weight"), torch::ones({32})));

  // The values the constructor uses.
  std::vector<float> v = StageModel::init_values(spec, "transformer.wte.weight", {256, 32}, 5);
  torch::Tensor t = w.at("transformer.wte.weight").flatten();
  ASSERT_EQ(static_cast<int64_t>(v.size()), t.numel());
  for (int i : {0, 1, 2, 777, 8191}) EXPECT_EQ(v[i], t[i].item<float>());
}

TEST(StageModel, SplitForwardEqualsOneStage) {
  ModelSpec spec = tiny(4);
  torch::manual_seed(0);
  torch::Tensor tokens = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::NoGradGuard no_grad;
  torch::Tensor one = chained_logits(spec, {4}, 3, tokens);
  torch::Tensor two = chained_logits(spec, {2, 2}, 3, tokens);
  torch::Tensor four = chained_logits(spec, {1, 1, 1, 1}, 3, tokens);
  torch::Tensor uneven = chained_logits(spec, {1, 3}, 3, tokens);
  EXPECT_EQ(one.sizes().vec(), (std::vector<int64_t>{3, 16, 256}));
  EXPECT_LE((one - two).abs().max().item<double>(), 1e-6);
  EXPECT_LE((one - four).abs().max().item<double>(), 1e-6);
  EXPECT_LE((one - uneven).abs().max().item<double>(), 1e-6);
  // A middle stage maps [B, T, C] to [B, T, C].
  StageModel mid(spec, 1, 3, 1, 2, 3);
  EXPECT_EQ(mid.forward(torch::randn({3, 16, 32})).sizes().vec(), (std::vector<int64_t>{3, 16, 32}));
}

TEST(StageModel, AttentionIsCausal) {
  ModelSpec spec = tiny(2);
  StageModel m(spec, 0, 1, 0, 2, 9);
  torch::manual_seed(1);
  torch::Tensor a = torch::randint(0, 256, {2, 12}, torch::kLong);
  torch::Tensor b = a.clone();
  b.index_put_({torch::indexing::Slice(), 7}, (a.index({torch::indexing::Slice(), 7}) + 1) % 256);
  torch::NoGradGuard no_grad;
  torch::Tensor la = m.forward(a), lb = m.forward(b);
  using torch::indexing::Slice;
  EXPECT_LE((la.index({Slice(), Slice(0, 7)}) - lb.index({Slice(), Slice(0, 7)})).abs().max().item<double>(), 1e-6);
  for (int t = 7; t < 12; ++t)
    EXPECT_GT((la.index({Slice(), t}) - lb.index({Slice(), t})).abs().max().item<double>(), 1e-6) << t;
}

TEST(StageModel, LossAtInitIsAboutLogV) {
  ModelSpec spec = tiny(2);
  StageModel m(spec, 0, 1, 0, 2, 1);
  torch::manual_seed(2);
  torch::Tensor x = torch::randint(0, 256, {4, 16}, torch::kLong);
  torch::Tensor y = torch::randint(0, 256, {4, 16}, torch::kLong);
  const double loss = StageModel::loss(m.forward(x), y).item<double>();
  EXPECT_NEAR(loss, std::log(256.0), 0.05);
  // Int32 tokens and targets work too (the data sampler's type).
  EXPECT_NEAR(StageModel::loss(m.forward(x.to(torch::kInt32)), y.to(torch::kInt32)).item<double>(), loss, 1e-6);
}

// Central differences in double against autograd, for parameters and for the input of a
// middle stage (the activation gradient a stage server returns).
TEST(StageModel, GradientsMatchFiniteDifferences) {
  ModelSpec spec;
  spec.vocab_size = 11;
  spec.d_model = 8;
  spec.n_head = 2;
  spec.n_layer = 2;
  spec.seq_len = 5;
  StageModel first(spec, 0, 2, 0, 1, 4);
  StageModel last(spec, 1, 2, 1, 1, 4);
  first.to_dtype(torch::kFloat64);
  last.to_dtype(torch::kFloat64);
  {
    // Larger weights than the init so that every term matters.
    torch::NoGradGuard no_grad;
    torch::manual_seed(3);
    for (StageModel* m : {&first, &last})
      for (const auto& np : m->named_parameters())
        np.second.data().add_(torch::randn_like(np.second) * 0.3);
  }
  torch::Tensor x = torch::tensor({{1, 4, 7, 2, 10}, {3, 3, 0, 9, 5}}, torch::kLong);
  torch::Tensor y = torch::tensor({{4, 7, 2, 10, 1}, {3, 0, 9, 5, 6}}, torch::kLong);
  torch::Tensor a1 = first.forward(x).detach().requires_grad_(true);
  EXPECT_EQ(a1.scalar_type(), torch::kFloat64);
  auto f = [&]() { return StageModel::loss(last.forward(first.forward(x)), y); };
  // autograd::grad: the activation gradient without touching the parameters' .grad().
  torch::Tensor ga = torch::autograd::grad({StageModel::loss(last.forward(a1), y)}, {a1})[0].view({-1});
  f().backward();

  const double h = 1e-6;
  int checked = 0;
  for (StageModel* m : {&first, &last}) {
    for (const auto& np : m->named_parameters()) {
      torch::Tensor flat = np.second.data().view({-1});
      torch::Tensor g = np.second.grad().view({-1});
      for (int64_t i : {int64_t(0), flat.numel() / 2, flat.numel() - 1}) {
        const double saved = flat[i].item<double>();
        double lp, lm;
        {
          torch::NoGradGuard no_grad;
          flat[i] = saved + h;
          lp = f().item<double>();
          flat[i] = saved - h;
          lm = f().item<double>();
          flat[i] = saved;
        }
        const double numeric = (lp - lm) / (2 * h);
        EXPECT_NEAR(g[i].item<double>(), numeric, 1e-6 + 1e-5 * std::abs(numeric)) << np.first << "[" << i << "]";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 40);

  // Gradient of the loss with respect to the last stage's input.
  torch::Tensor base = a1.detach().clone();
  for (int64_t i : {int64_t(0), int64_t(17), int64_t(79)}) {
    torch::NoGradGuard no_grad;
    torch::Tensor p = base.clone(), q = base.clone();
    p.view({-1})[i] += h;
    q.view({-1})[i] -= h;
    const double numeric =
        (StageModel::loss(last.forward(p), y).item<double>() - StageModel::loss(last.forward(q), y).item<double>()) /
        (2 * h);
    EXPECT_NEAR(ga[i].item<double>(), numeric, 1e-6 + 1e-5 * std::abs(numeric)) << "input[" << i << "]";
  }
}

// Logits of PyTorch 1.13's nanoGPT modules (nn.Embedding, nn.LayerNorm, nn.Linear, GELU tanh)
// loaded with StageModel's initial weights for seed 7 (computed in Python from the same
// generator), every non-LayerNorm parameter scaled by 20 and every bias (LayerNorm's too) set to
// 0.01 * arange.
TEST(StageModel, MatchesPyTorchNanoGPT) {
  ModelSpec spec;
  spec.vocab_size = 16;
  spec.d_model = 8;
  spec.n_head = 2;
  spec.n_layer = 2;
  spec.seq_len = 6;
  StageModel m(spec, 0, 1, 0, 2, 7);
  {
    torch::NoGradGuard no_grad;
    for (const auto& np : m.named_parameters()) {
      torch::Tensor p = np.second.data();
      if (np.first.find("ln_") == std::string::npos) p.mul_(20.0);
      if (np.first.size() > 5 && np.first.compare(np.first.size() - 5, 5, ".bias") == 0)
        p.add_(0.01 * torch::arange(p.numel(), torch::kFloat32).view(p.sizes()));
    }
  }
  const float wte0[4] = {0.3410738706588745f, -0.12204114347696304f, 0.35465431213378906f, 0.5766698122024536f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(m.named_parameters()[0].second[0][i].item<float>(), wte0[i]);

  torch::Tensor x = torch::tensor({{1, 5, 3, 15, 0, 7}, {2, 2, 9, 4, 11, 6}}, torch::kLong);
  torch::Tensor y = torch::tensor({{5, 3, 15, 0, 7, 2}, {2, 9, 4, 11, 6, 1}}, torch::kLong);
  torch::Tensor logits = m.forward(x);
  const std::vector<double> l00 = {-0.6972662806510925, 0.26958751678466797, 0.5180342793464661, -0.6892744302749634,
                                   -1.2209099531173706, -1.8358999490737915, 0.35296276211738586, 0.7813806533813477,
                                   -1.732666254043579, -0.6176662445068359, 1.0649445056915283, 0.1771652102470398,
                                   -0.05459071695804596, -2.152778148651123, -0.7558199763298035, 0.7429764270782471};
  const std::vector<double> l15 = {0.4656693637371063, 0.8544471263885498, -0.7782589793205261, -1.5793240070343018,
                                   -1.6651042699813843, -1.4442147016525269, -0.017385201528668404, 0.46635356545448303,
                                   -0.9464261531829834, 0.4578742980957031, 0.8059396743774414, 1.0176501274108887,
                                   1.5724751949310303, -1.0454566478729248, -0.64790940284729, 0.6986479163169861};
  for (int v = 0; v < 16; ++v) {
    EXPECT_NEAR(logits[0][0][v].item<double>(), l00[v], 2e-5) << v;
    EXPECT_NEAR(logits[1][5][v].item<double>(), l15[v], 2e-5) << v;
  }
  EXPECT_NEAR(StageModel::loss(logits, y).item<double>(), 3.1759157180786133, 2e-5);
}

}  // namespace
}  // namespace swarm
