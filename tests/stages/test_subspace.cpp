// test_subspace.cpp: swarm::Subspace on the real model. The constraint holds from the first
// weights on and through constrained AdamW steps (and not without them); real stage outputs of
// trained, constrained stages come out of the codec (through a real wire frame) equal to what
// went in, up to float rounding, and unconstrained ones do not; the gradient that crosses a
// boundary (k coefficients) gives every earlier stage exactly the parameter gradients of the
// constrained model trained in one piece; frames of another subspace are refused.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstring>
#include <memory>
#include <vector>

#include "runtime/wire.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/subspace.h"

using namespace swarm;

namespace {

constexpr int kB = 4, kT = 16;

JobSpec job(const std::string& codec = "subspace:k=8") {
  JobSpec s;
  s.seed = 5;
  s.steps = 100;
  s.model.vocab_size = 256;
  s.model.d_model = 32;
  s.model.n_head = 4;
  s.model.n_layer = 3;
  s.model.seq_len = kT;
  s.partition.stages = 3;
  s.partition.layers_per_stage = {1, 1, 1};
  s.compression.activations = codec;
  s.compression.gradients = codec;
  s.optimizer.lr = 0.01;
  s.optimizer.warmup_steps = 0;
  return s;
}

// A 3-stage model with its optimizers and, when `constrained`, the subspace constraint.
struct Pipeline {
  Pipeline(const JobSpec& spec, bool constrained) {
    for (int s = 0; s < 3; ++s) {
      stages.push_back(std::make_unique<StageModel>(spec.model, s, 3, s, 1, spec.seed));
      optims.push_back(std::make_unique<AdamW>(stages[s]->named_parameters(), spec.optimizer, spec.steps));
      subs.push_back(Subspace::for_stage(spec, s));
      if (constrained) {
        subs[s]->project_params(stages[s]->named_parameters());
        optims[s]->set_constraint(subs[s].get());
      }
    }
  }
  // Trains `steps` steps of one batch each on random tokens.
  void train(int steps) {
    torch::manual_seed(17);
    for (int i = 0; i < steps; ++i) {
      torch::Tensor x = torch::randint(0, 256, {kB, kT}, torch::kLong);
      torch::Tensor y = torch::randint(0, 256, {kB, kT}, torch::kLong);
      torch::Tensor h = x;
      for (auto& s : stages) h = s->forward(h);
      (StageModel::loss(h, y) * double(kB)).backward();
      for (auto& o : optims) o->step(kB);
    }
  }
  std::vector<std::unique_ptr<StageModel>> stages;
  std::vector<std::unique_ptr<AdamW>> optims;
  std::vector<std::unique_ptr<Subspace>> subs;
};

// Largest change projecting the stage's parameters again makes: 0 up to rounding when the
// constraint holds.
double constraint_residual(const Subspace& sub, const StageModel& m) {
  std::vector<std::pair<std::string, torch::Tensor>> copy;
  for (const auto& [name, p] : m.named_parameters()) copy.emplace_back(name, p.detach().clone());
  sub.project_params(copy);
  double worst = 0;
  for (size_t i = 0; i < copy.size(); ++i)
    worst = std::max(worst, (copy[i].second - m.named_parameters()[i].second.detach()).abs().max().item<double>());
  return worst;
}

// A tensor frame through the real wire: encoded to frames, decoded and checked as a peer would.
wire::Tensor over_the_wire(wire::Tensor t) {
  wire::Message m(wire::MsgType::kResult, 1, 0);
  m.tensors.push_back(std::move(t));
  std::vector<zmq::message_t> frames = wire::encode(m);
  wire::Message back = wire::decode(frames);
  return std::move(back.tensors.at(0));
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

torch::Tensor grad_of(const StageModel& m, const std::string& name) {
  for (const auto& [n, t] : m.named_parameters())
    if (n == name) return t.grad().clone();
  ADD_FAILURE() << "no parameter " << name;
  return torch::Tensor();
}

}  // namespace

TEST(Subspace, ConstraintHoldsFromInitThroughAdamWStepsAndNotWithout) {
  Pipeline p(job(), /*constrained=*/true);
  for (int s = 0; s < 2; ++s) EXPECT_LT(constraint_residual(*p.subs[s], *p.stages[s]), 1e-6) << "stage " << s;
  p.train(5);
  for (int s = 0; s < 2; ++s) EXPECT_LT(constraint_residual(*p.subs[s], *p.stages[s]), 1e-6) << "stage " << s;
  // The last stage writes nothing that crosses a boundary: nothing of it is constrained.
  EXPECT_FALSE(p.subs[2]->constrains());
  // Without the constraint the same training leaves the set: the check can fail.
  Pipeline free(job(), /*constrained=*/false);
  free.train(5);
  EXPECT_GT(constraint_residual(*free.subs[0], *free.stages[0]), 1e-3);
  EXPECT_GT(constraint_residual(*free.subs[1], *free.stages[1]), 1e-3);
}

TEST(Subspace, RealStageOutputsComeOutOfTheCodecAsTheyWentIn) {
  Pipeline p(job(), true), free(job(), false);
  p.train(8);
  free.train(8);
  torch::manual_seed(3);
  torch::Tensor tokens = torch::randint(0, 256, {kB, kT}, torch::kLong);
  torch::NoGradGuard ng;
  torch::Tensor out0 = p.stages[0]->forward(tokens);
  wire::Tensor w0 = over_the_wire(p.subs[0]->encode_activation(out0, tokens));
  // k coefficients (fp32) and one byte of token id per token, for d_model fp32 values.
  EXPECT_EQ(w0.desc.nbytes, uint64_t(kB * kT * (8 * 4 + 1)));
  EXPECT_EQ(w0.desc.shape, (std::vector<int64_t>{kB, kT, 32}));
  torch::Tensor ids;
  torch::Tensor x1 = p.subs[1]->decode_activation(w0, &ids);
  EXPECT_TRUE(torch::equal(ids, tokens));
  EXPECT_LT(max_abs(x1 - out0), 1e-5 * max_abs(out0)) << "scale " << max_abs(out0);
  // The second boundary: stage 1's real output, rebuilt by stage 2 from ids and coefficients.
  torch::Tensor out1 = p.stages[1]->forward(x1);
  torch::Tensor ids2;
  torch::Tensor x2 = p.subs[2]->decode_activation(over_the_wire(p.subs[1]->encode_activation(out1, ids)), &ids2);
  EXPECT_LT(max_abs(x2 - out1), 1e-5 * max_abs(out1)) << "scale " << max_abs(out1);
  // The same codec on an unconstrained model's output loses most of it.
  torch::Tensor f0 = free.stages[0]->forward(tokens);
  torch::Tensor fx = free.subs[1]->decode_activation(over_the_wire(free.subs[0]->encode_activation(f0, tokens)), &ids);
  EXPECT_GT(max_abs(fx - f0), 0.1 * max_abs(f0));
}

TEST(Subspace, BoundaryGradientGivesTheConstrainedModelsExactGradients) {
  Pipeline p(job(), true);
  p.train(6);
  torch::manual_seed(4);
  torch::Tensor tokens = torch::randint(0, 256, {kB, kT}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {kB, kT}, torch::kLong);
  auto grads_of = [](StageModel& m) {
    std::vector<torch::Tensor> g;
    for (const auto& [name, t] : m.named_parameters()) g.push_back(t.grad().clone());
    return g;
  };
  auto clear = [&] {
    for (auto& o : p.optims) o->zero_grad();
  };

  // The constrained model in one piece: one graph, the full gradient everywhere.
  clear();
  {
    torch::Tensor h = tokens;
    for (auto& s : p.stages) h = s->forward(h);
    (StageModel::loss(h, targets) * double(kB)).backward();
  }
  std::vector<std::vector<torch::Tensor>> want;
  for (int s = 0; s < 3; ++s) {
    p.subs[s]->project_grads(p.stages[s]->named_parameters());  // what AdamW::step sees
    want.push_back(grads_of(*p.stages[s]));
  }

  // The pipeline: every boundary crossed by the codec both ways, k coefficients per token.
  clear();
  torch::Tensor out0 = p.stages[0]->forward(tokens), ids;
  torch::Tensor x1 = p.subs[1]->decode_activation(over_the_wire(p.subs[0]->encode_activation(out0, tokens)), &ids);
  x1.requires_grad_(true);
  torch::Tensor out1 = p.stages[1]->forward(x1), ids2;
  torch::Tensor x2 = p.subs[2]->decode_activation(over_the_wire(p.subs[1]->encode_activation(out1, ids)), &ids2);
  x2.requires_grad_(true);
  (StageModel::loss(p.stages[2]->forward(x2), targets) * double(kB)).backward();
  wire::Tensor g2 = over_the_wire(p.subs[2]->encode_gradient(x2.grad()));
  EXPECT_EQ(g2.desc.nbytes, uint64_t(kB * kT * 8 * 4));  // k coefficients per token, no ids
  // The coefficients sent are dL/dz, the gradient with respect to the boundary's k numbers per
  // token: U^T dL/dx, as the chain rule through x = E + U z gives.
  torch::Tensor z_grad = torch::matmul(x2.grad(), p.subs[2]->basis());
  torch::Tensor sent = torch::matmul(p.subs[1]->decode_gradient(g2), p.subs[1]->basis());
  EXPECT_LT(max_abs(sent - z_grad), 1e-6 * max_abs(z_grad));
  out1.backward(p.subs[1]->decode_gradient(g2));
  out0.backward(p.subs[0]->decode_gradient(over_the_wire(p.subs[1]->encode_gradient(x1.grad()))));
  for (int s = 0; s < 3; ++s) {
    p.subs[s]->project_grads(p.stages[s]->named_parameters());
    const auto got = grads_of(*p.stages[s]);
    const auto& params = p.stages[s]->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      const double scale = max_abs(want[s][i]) + 1e-12;
      EXPECT_LT(max_abs(got[i] - want[s][i]), 1e-5 * scale + 1e-9) << params[i].first << " of stage " << s;
    }
  }

  // Without projecting the output projections' gradients the pipeline's differ: the part of
  // dL/dx outside span(U), which never crosses, is what makes them.
  clear();
  out0 = p.stages[0]->forward(tokens);
  x1 = p.subs[1]->decode_activation(over_the_wire(p.subs[0]->encode_activation(out0, tokens)), &ids).requires_grad_(true);
  (StageModel::loss(p.stages[2]->forward(p.stages[1]->forward(x1)), targets) * double(kB)).backward();
  torch::Tensor full = x1.grad().clone();
  out0.backward(p.subs[0]->decode_gradient(over_the_wire(p.subs[1]->encode_gradient(full))));
  torch::Tensor pipe = grad_of(*p.stages[0], "transformer.h.0.attn.c_proj.weight");
  clear();
  p.stages[0]->forward(tokens).backward(full);
  torch::Tensor mono = grad_of(*p.stages[0], "transformer.h.0.attn.c_proj.weight");
  EXPECT_GT(max_abs(pipe - mono), 0.1 * max_abs(mono));
}

TEST(Subspace, FlatProjectionEqualsTheParametersBitForBit) {
  Pipeline p(job("subspace:k=8,coef=int8"), true);
  p.train(3);
  StageModel& m = *p.stages[0];
  std::vector<float> flat;
  for (const auto& [name, t] : m.named_parameters()) {
    torch::Tensor c = t.detach().contiguous();
    flat.insert(flat.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  // A lossy outer step moves the weights off the constraint; both routes project them back the same.
  torch::manual_seed(9);
  torch::Tensor noise = torch::randn({int64_t(flat.size())}) * 0.01;
  for (size_t i = 0; i < flat.size(); ++i) flat[i] += noise[int64_t(i)].item<float>();
  size_t off = 0;
  {
    torch::NoGradGuard ng;
    for (const auto& [name, t] : m.named_parameters()) {
      t.detach().copy_(torch::from_blob(flat.data() + off, t.sizes(), torch::kFloat32));
      off += size_t(t.numel());
    }
  }
  p.subs[0]->project_flat(m.named_parameters(), flat);
  p.subs[0]->project_params(m.named_parameters());
  off = 0;
  for (const auto& [name, t] : m.named_parameters()) {
    torch::Tensor c = t.detach().contiguous();
    EXPECT_EQ(std::memcmp(c.data_ptr<float>(), flat.data() + off, size_t(c.numel()) * 4), 0) << name;
    off += size_t(t.numel());
  }
  EXPECT_LT(constraint_residual(*p.subs[0], m), 1e-6);
}

TEST(Subspace, FramesOfAnotherSubspaceAreRefused) {
  Pipeline p(job(), true);
  torch::Tensor tokens = torch::randint(0, 256, {kB, kT}, torch::kLong);
  torch::NoGradGuard ng;
  torch::Tensor out0 = p.stages[0]->forward(tokens), ids;
  // Another k.
  Pipeline other(job("subspace:k=4"), true);
  wire::Tensor w = other.subs[0]->encode_activation(out0, tokens);
  EXPECT_THROW(p.subs[1]->decode_activation(w, &ids), WireError);
  // A gradient frame (no ids) where an activation is due; an fp32 frame where a subspace one is.
  EXPECT_THROW(p.subs[1]->decode_activation(p.subs[0]->encode_gradient(out0), &ids), WireError);
  wire::Tensor plain = wire::make_tensor(wire::DType::kF32, {kB, kT, 32}, compression::CodecSpec{}, size_t(kB * kT * 32 * 4));
  EXPECT_THROW(p.subs[1]->decode_gradient(plain), WireError);
  // Token ids beyond the vocabulary (here 100 of a 64-token vocabulary).
  JobSpec small = job();
  small.model.vocab_size = 64;
  auto sub = Subspace::for_stage(small, 1);
  EXPECT_THROW(sub->decode_activation(p.subs[0]->encode_activation(out0, torch::full({kB, kT}, 100, torch::kLong)), &ids),
               WireError);
  // A job whose codecs cannot work is refused with a CodecError (an InputError).
  EXPECT_THROW(Subspace::for_stage(job("subspace:k=32"), 0), InputError);
  EXPECT_EQ(Subspace::for_stage(job("int8"), 0), nullptr);
}
