// test_attention.cpp: the two attention implementations (stages/attention.h) against a plain
// reference written with loops in double, forward and gradients; scaled-dot-product attention
// against the math form where the build has it (libtorch 2.x), skipped otherwise; a model built
// with either gives the same logits.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/errors.h"
#include "stages/attention.h"
#include "stages/model.h"

namespace swarm {
namespace {

torch::Tensor future_mask(int64_t T) { return torch::ones({T, T}, torch::kBool).triu(1); }

// softmax over s <= t of q_t . k_s / sqrt(hd), times v_s: one query at a time, in double.
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  auto qa = q.to(torch::kDouble).contiguous(), ka = k.to(torch::kDouble).contiguous(), va = v.to(torch::kDouble).contiguous();
  torch::Tensor out = torch::zeros({B, H, T, D}, torch::kDouble);
  auto Q = qa.accessor<double, 4>(), K = ka.accessor<double, 4>(), V = va.accessor<double, 4>();
  auto O = out.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> w(size_t(t + 1));
        double m = -std::numeric_limits<double>::infinity(), z = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i) d += Q[b][h][t][i] * K[b][h][s][i];
          w[size_t(s)] = d / std::sqrt(double(D));
          m = std::max(m, w[size_t(s)]);
        }
        for (double& x : w) z += (x = std::exp(x - m));
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t i = 0; i < D; ++i) O[b][h][t][i] += w[size_t(s)] / z * V[b][h][s][i];
      }
  return out;
}

struct Qkv {
  torch::Tensor q, k, v;
};
Qkv random_qkv(int64_t B, int64_t H, int64_t T, int64_t D, torch::ScalarType dtype = torch::kFloat32) {
  torch::manual_seed(11);
  const auto o = torch::TensorOptions().dtype(dtype);
  return {torch::randn({B, H, T, D}, o).requires_grad_(true), torch::randn({B, H, T, D}, o).requires_grad_(true),
          torch::randn({B, H, T, D}, o).requires_grad_(true)};
}

TEST(Attention, MathMatchesTheReference) {
  Qkv a = random_qkv(2, 3, 9, 8);
  torch::Tensor y = causal_attention(a.q, a.k, a.v, future_mask(9), AttentionImpl::kMath);
  EXPECT_EQ(y.scalar_type(), torch::kFloat32);
  EXPECT_LE((y.to(torch::kDouble) - reference_attention(a.q, a.k, a.v)).abs().max().item<double>(), 1e-5);
}

TEST(Attention, MathGradientsMatchTheReferenceInDouble) {
  Qkv a = random_qkv(1, 2, 6, 4, torch::kDouble);
  torch::Tensor w = torch::randn({1, 2, 6, 4}, torch::kDouble);
  (causal_attention(a.q, a.k, a.v, future_mask(6), AttentionImpl::kMath) * w).sum().backward();
  const torch::Tensor gq = a.q.grad().clone(), gk = a.k.grad().clone(), gv = a.v.grad().clone();
  for (torch::Tensor* t : {&a.q, &a.k, &a.v}) t->mutable_grad() = torch::Tensor();
  // The reference through autograd (torch ops in double, no mask tricks): same gradients.
  torch::Tensor s = torch::matmul(a.q, a.k.transpose(-2, -1)) / 2.0;
  s = s.masked_fill(future_mask(6), -std::numeric_limits<double>::infinity());
  (torch::matmul(torch::softmax(s, -1), a.v) * w).sum().backward();
  EXPECT_LE((gq - a.q.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LE((gk - a.k.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LE((gv - a.v.grad()).abs().max().item<double>(), 1e-12);
}

TEST(Attention, Bf16StaysCloseWhereSupported) {
  Qkv a = random_qkv(2, 2, 16, 8);
  torch::Tensor ref = reference_attention(a.q, a.k, a.v);
  torch::Tensor y;
  try {
    y = causal_attention(a.q.to(torch::kBFloat16), a.k.to(torch::kBFloat16), a.v.to(torch::kBFloat16), future_mask(16),
                         AttentionImpl::kMath);
  } catch (const c10::Error&) {
    GTEST_SKIP() << "this libtorch has no bf16 matmul on the CPU";
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_LE((y.to(torch::kDouble) - ref).abs().max().item<double>(), 0.05);
}

TEST(Attention, SdpaIsTheAutoChoiceOnlyWhereItExists) {
  EXPECT_EQ(resolve_attention(AttentionImpl::kAuto), sdpa_available() ? AttentionImpl::kSdpa : AttentionImpl::kMath);
  if (!sdpa_available()) {
    EXPECT_THROW(resolve_attention(AttentionImpl::kSdpa), InputError);
    EXPECT_STREQ(attention_name(AttentionImpl::kAuto), "math");
  }
}

// libtorch 2.x: scaled-dot-product attention against the math form, forward and gradients.
TEST(Attention, SdpaMatchesMath) {
  if (!sdpa_available()) GTEST_SKIP() << "built against libtorch " TORCH_VERSION ": no scaled_dot_product_attention";
  Qkv a = random_qkv(2, 4, 33, 16), b = random_qkv(2, 4, 33, 16);
  torch::Tensor w = torch::randn({2, 4, 33, 16});
  torch::Tensor ya = causal_attention(a.q, a.k, a.v, future_mask(33), AttentionImpl::kSdpa);
  torch::Tensor yb = causal_attention(b.q, b.k, b.v, future_mask(33), AttentionImpl::kMath);
  EXPECT_LE((ya - yb).abs().max().item<double>(), 1e-5);
  (ya * w).sum().backward();
  (yb * w).sum().backward();
  EXPECT_LE((a.q.grad() - b.q.grad()).abs().max().item<double>(), 1e-4);
  EXPECT_LE((a.k.grad() - b.k.grad()).abs().max().item<double>(), 1e-4);
  EXPECT_LE((a.v.grad() - b.v.grad()).abs().max().item<double>(), 1e-4);
}

TEST(Attention, ModelLogitsAgreeAcrossImplementations) {
  if (!sdpa_available()) GTEST_SKIP() << "built against libtorch " TORCH_VERSION ": one implementation only";
  ModelSpec spec;
  spec.d_model = 32;
  spec.n_head = 4;
  spec.n_layer = 2;
  spec.seq_len = 16;
  StageModel math(spec, 0, 1, 0, 2, 7, torch::kCPU, torch::kFloat32, AttentionImpl::kMath);
  StageModel sdpa(spec, 0, 1, 0, 2, 7, torch::kCPU, torch::kFloat32, AttentionImpl::kSdpa);
  torch::manual_seed(3);
  torch::Tensor x = torch::randint(0, 256, {2, 16}, torch::kLong);
  torch::NoGradGuard ng;
  EXPECT_LE((math.forward(x) - sdpa.forward(x)).abs().max().item<double>(), 1e-4);
}

}  // namespace
}  // namespace swarm
