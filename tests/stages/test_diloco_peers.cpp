// test_diloco_peers.cpp: peers of one stage group fed identical data, with the real model,
// AdamW and outer step (runtime/diloco.h): they stay bitwise identical round after round, and
// equal one peer alone.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "runtime/diloco.h"
#include "stages/model.h"
#include "stages/optim.h"

using namespace swarm;

namespace {

// One peer: its model, inner optimizer, theta_g and outer momentum.
struct Peer {
  Peer(const ModelSpec& spec, const OptimizerSpec& opt)
      : model(spec, 0, 1, 0, spec.n_layer, 11), adam(model.named_parameters(), opt, 100) {
    theta_g = flat();
    momentum.assign(theta_g.size(), 0.f);
  }
  std::vector<float> flat() const {
    std::vector<float> v;
    for (const auto& [name, p] : model.named_parameters()) {
      torch::Tensor c = p.detach().contiguous();
      v.insert(v.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    return v;
  }
  void load(const std::vector<float>& v) {
    torch::NoGradGuard ng;
    size_t off = 0;
    for (const auto& [name, p] : model.named_parameters()) {
      p.detach().copy_(torch::from_blob(const_cast<float*>(v.data() + off), p.sizes(), torch::kFloat32));
      off += size_t(p.numel());
    }
  }
  void inner_step(const torch::Tensor& x, const torch::Tensor& y) {
    (StageModel::loss(model.forward(x), y) * double(x.size(0))).backward();
    adam.step(x.size(0));
  }
  StageModel model;
  AdamW adam;
  std::vector<float> theta_g, momentum;
};

// One round for a group: sample-weighted mean of theta_g - theta, the outer step, theta <- theta_g.
void round(std::vector<Peer*> group, const DilocoSpec& d) {
  std::vector<float> sum;
  const float w = 8.f;
  for (Peer* p : group) {
    std::vector<float> delta = p->flat();
    for (size_t i = 0; i < delta.size(); ++i) delta[i] = p->theta_g[i] - delta[i];
    diloco::accumulate(sum, delta.data(), delta.size(), w);
  }
  const float inv = 1.f / (w * float(group.size()));
  for (float& v : sum) v *= inv;
  for (Peer* p : group) {
    diloco::outer_step(p->theta_g.data(), p->momentum.data(), sum.data(), sum.size(), float(d.outer_lr),
                       float(d.outer_momentum), d.nesterov);
    p->load(p->theta_g);
  }
}

}  // namespace

TEST(DilocoPeers, IdenticalDataKeepsPeersIdenticalAndEqualToOnePeer) {
  torch::manual_seed(0);
  ModelSpec spec;
  spec.vocab_size = 64;
  spec.d_model = 32;
  spec.n_head = 2;
  spec.n_layer = 2;
  spec.seq_len = 16;
  spec.max_seq_len = 16;
  OptimizerSpec opt;
  opt.lr = 3e-3;
  DilocoSpec d;  // the defaults: outer lr 0.7, momentum 0.9, Nesterov
  Peer a(spec, opt), b(spec, opt), alone(spec, opt);
  const int H = 3;
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < H; ++s) {
      torch::Tensor x = torch::randint(0, spec.vocab_size, {8, spec.seq_len}, torch::kLong);
      torch::Tensor y = torch::randint(0, spec.vocab_size, {8, spec.seq_len}, torch::kLong);
      a.inner_step(x, y);
      b.inner_step(x, y);
      alone.inner_step(x, y);
    }
    round({&a, &b}, d);
    round({&alone}, d);
    ASSERT_EQ(a.theta_g, b.theta_g) << "round " << r;
    ASSERT_EQ(a.momentum, b.momentum) << "round " << r;
    ASSERT_EQ(a.flat(), b.flat()) << "round " << r;
    EXPECT_EQ(a.theta_g, alone.theta_g) << "round " << r;
    EXPECT_EQ(a.momentum, alone.momentum) << "round " << r;
  }
  // And training moved the weights: the test is not comparing three untouched models.
  Peer fresh(spec, opt);
  EXPECT_NE(a.theta_g, fresh.theta_g);
}
