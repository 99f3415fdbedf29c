// test_vectors.cpp: the C++ peer against the test vectors of docs/model.md (docs/vectors/*.json).
//
// Each vector file is computed here from the code a stage server runs (StageModel, AdamW,
// lr_at, diloco::, the state hash) and compared with the committed file: integers, hashes
// and strings exactly, floats within the file's tolerance ("tolerance": {"abs", "rel"}; 0
// means bit-identical, compared as float32). Run with SWARM_WRITE_VECTORS=1 to rewrite the
// files after a deliberate change (then say why in the commit). A peer in another language
// checks itself against the same files (examples/python_peer/check_vectors.py).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/diloco.h"
#include "runtime/job_spec.h"
#include "runtime/memory_estimate.h"
#include "runtime/random.h"
#include "runtime/wire.h"
#include "stages/model.h"
#include "stages/optim.h"

namespace swarm {
namespace {

using nlohmann::json;

std::string hex64(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "0x%016llx", static_cast<unsigned long long>(v));
  return b;
}

// float32 values as JSON numbers that read back to the same float (9 significant digits).
json floats(const float* p, size_t n) {
  json a = json::array();
  for (size_t i = 0; i < n; ++i) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.9g", double(p[i]));
    a.push_back(json::parse(b));
  }
  return a;
}
json floats(const torch::Tensor& t) {
  torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  return floats(c.data_ptr<float>(), size_t(c.numel()));
}
double sum_of(const torch::Tensor& t) { return t.detach().to(torch::kFloat64).sum().item<double>(); }
double norm_of(const torch::Tensor& t) { return t.detach().to(torch::kFloat64).norm().item<double>(); }

// The model of every vector: small enough to print, with every part of a block (3 stages of 1
// block, biases, 2 heads).
json tiny_spec_json() {
  return json{{"name", "vectors"}, {"seed", 1234}, {"steps", 10}, {"schedule", "sync"},
              {"model", {{"vocab_size", 32}, {"d_model", 16}, {"n_head", 2}, {"n_layer", 3}, {"seq_len", 8}, {"bias", true}}},
              {"partition", {{"stages", 3}}},
              {"batch", {{"batch_size", 2}, {"microbatch_size", 2}}},
              {"optimizer", {{"lr", 1e-3}, {"min_lr", 1e-4}, {"warmup_steps", 3}, {"weight_decay", 0.1}, {"grad_clip", 1.0}}},
              {"data", {{"format", "bin"}, {"path", "unused.bin"}}}};
}

// Tokens and targets of the model vectors: token (b, t) = (7 b + 3 t + 1) mod 32, target the next.
torch::Tensor tiny_tokens(int64_t shift) {
  torch::Tensor x = torch::empty({2, 8}, torch::kLong);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 8; ++t) x[b][t] = (7 * b + 3 * (t + shift) + 1) % 32;
  return x;
}

json init_vectors() {
  json out;
  out["about"] = "docs/model.md#initialisation: splitmix64, fnv1a64 and every initial parameter of the vectors' model";
  out["tolerance"] = {{"abs", 0}, {"rel", 0}};
  json sm = json::array();
  for (uint64_t x : {uint64_t(0), uint64_t(1), uint64_t(1234), uint64_t(0xFFFFFFFFFFFFFFFFull)})
    sm.push_back({{"in", hex64(x)}, {"out", hex64(splitmix64(x))}});
  out["splitmix64"] = sm;
  const JobSpec spec = parse_job_spec(tiny_spec_json(), false);
  out["spec"] = tiny_spec_json();
  json params = json::array();
  for (int s = 0; s < spec.partition.stages; ++s) {
    StageModel m(spec.model, s, spec.partition.stages, spec.first_layer(s), spec.partition.layers_per_stage[size_t(s)], spec.seed);
    for (const auto& [name, t] : m.named_parameters()) {
      torch::Tensor c = t.detach().contiguous();
      json shape = json::array();
      for (int64_t d : c.sizes()) shape.push_back(d);
      params.push_back({{"stage", s}, {"name", name}, {"shape", shape}, {"first", floats(c.data_ptr<float>(), std::min<size_t>(6, size_t(c.numel())))},
                        {"xxh3", hex64(wire::checksum(c.data_ptr<float>(), size_t(c.numel()) * 4))}});
    }
  }
  out["params"] = params;
  return out;
}

json model_vectors() {
  json out;
  out["about"] = "docs/model.md#the-forward-and-backward: one microbatch through the 3 stages of the vectors' model, in fp32";
  out["tolerance"] = {{"abs", 2e-5}, {"rel", 1e-4}};
  out["spec"] = tiny_spec_json();
  const JobSpec spec = parse_job_spec(tiny_spec_json(), false);
  std::vector<std::unique_ptr<StageModel>> st;
  for (int s = 0; s < 3; ++s)
    st.push_back(std::make_unique<StageModel>(spec.model, s, 3, spec.first_layer(s), spec.partition.layers_per_stage[size_t(s)], spec.seed));
  const torch::Tensor x = tiny_tokens(0), y = tiny_tokens(1);
  out["tokens"] = json(std::vector<int64_t>(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + 16));
  out["targets"] = json(std::vector<int64_t>(y.data_ptr<int64_t>(), y.data_ptr<int64_t>() + 16));
  // FORWARD at stages 0 and 1 (inputs detached, as they arrive from the wire).
  const torch::Tensor a1 = st[0]->forward(x).detach();
  const torch::Tensor a2 = st[1]->forward(a1).detach();
  out["a1"] = floats(a1);
  out["a2"] = floats(a2);
  // FORWARD_LOSS at stage 2: (loss x B).backward(); grad_input = d(loss x B)/d a2.
  torch::Tensor in2 = a2.clone().requires_grad_(true);
  torch::Tensor loss = StageModel::loss(st[2]->forward(in2), y);
  (loss * 2.0).backward();
  out["loss"] = loss.item<double>();
  out["g2"] = floats(in2.grad());
  // BACKWARD at stage 1 (recomputed forward; out.backward(g2)), then at stage 0.
  torch::Tensor in1 = a1.clone().requires_grad_(true);
  st[1]->forward(in1).backward(in2.grad());
  out["g1"] = floats(in1.grad());
  st[0]->forward(x).backward(in1.grad());
  json grads = json::array();
  for (int s = 0; s < 3; ++s)
    for (const auto& [name, t] : st[size_t(s)]->named_parameters())
      grads.push_back({{"stage", s}, {"name", name}, {"sum", sum_of(t.grad())}, {"norm", norm_of(t.grad())}});
  out["grad_sums"] = grads;
  // The inner step of every stage over those gradients (2 samples), at step 0 of 10.
  json after = json::array();
  for (int s = 0; s < 3; ++s) {
    AdamW opt(st[size_t(s)]->named_parameters(), spec.optimizer, spec.steps);
    const double gnorm = opt.step(2);
    json ps = json::array();
    for (const auto& [name, t] : st[size_t(s)]->named_parameters())
      ps.push_back({{"name", name}, {"sum", sum_of(t)}, {"norm", norm_of(t)}});
    after.push_back({{"stage", s}, {"grad_norm", gnorm}, {"params", ps}});
  }
  out["after_step"] = after;
  return out;
}

json optim_vectors() {
  json out;
  out["about"] = "docs/model.md#the-inner-optimizer: the schedule, and AdamW on two tensors by hand";
  out["tolerance"] = {{"abs", 1e-7}, {"rel", 1e-6}};
  OptimizerSpec o;
  o.lr = 1e-3;
  o.min_lr = 1e-4;
  o.warmup_steps = 3;
  out["schedule"] = {{"lr", o.lr}, {"min_lr", o.min_lr}, {"warmup_steps", o.warmup_steps}, {"total_steps", 10}};
  std::vector<double> lrs;
  for (int s = 0; s < 12; ++s) lrs.push_back(lr_at(o, s, 10));
  out["lr_at"] = lrs;
  // Two parameters: a matrix (decayed) and a vector (not), gradient sums over 2 samples, three
  // steps of a 3-step job with lr 0.01 -> 0 and no warm-up; the second step's gradient is clipped.
  OptimizerSpec a;
  a.lr = 0.01;
  a.min_lr = 0.0;
  a.warmup_steps = 0;
  a.weight_decay = 0.1;
  a.grad_clip = 1.0;
  out["adamw"] = {{"lr", a.lr}, {"min_lr", a.min_lr}, {"warmup_steps", 0}, {"weight_decay", a.weight_decay}, {"beta1", a.beta1},
                  {"beta2", a.beta2}, {"eps", a.eps}, {"grad_clip", a.grad_clip}, {"total_steps", 3}, {"samples", 2}};
  torch::Tensor w = torch::tensor({{1.0f, -2.0f}, {0.5f, 3.0f}}).requires_grad_(true);
  torch::Tensor b = torch::tensor({0.1f, -0.2f}).requires_grad_(true);
  out["w0"] = floats(w);
  out["b0"] = floats(b);
  AdamW opt({{"w", w}, {"b", b}}, a, 3);
  const std::vector<std::vector<float>> gw{{0.4f, -0.8f, 2.0f, 0.0f}, {3.0f, 1.0f, -2.0f, 0.5f}, {0.01f, 0.02f, -0.03f, 0.04f}};
  const std::vector<std::vector<float>> gb{{1.2f, -0.4f}, {-0.6f, 4.0f}, {0.0f, 0.1f}};
  json steps = json::array();
  for (size_t i = 0; i < gw.size(); ++i) {
    w.mutable_grad() = torch::tensor(gw[i]).reshape({2, 2});
    b.mutable_grad() = torch::tensor(gb[i]);
    const double lr = opt.next_lr();
    const double norm = opt.step(2);
    steps.push_back({{"grad_sum_w", gw[i]}, {"grad_sum_b", gb[i]}, {"lr", lr}, {"grad_norm", norm}, {"w", floats(w)}, {"b", floats(b)}});
  }
  out["steps"] = steps;
  return out;
}

json round_vectors() {
  json out;
  out["about"] = "docs/model.md#rounds-fragments-and-hashes: fragment layout, fragment schedule, outer step, reduce, state hash";
  out["tolerance"] = {{"abs", 0}, {"rel", 0}};
  json fr = json::array();
  for (size_t P : {size_t(10), size_t(7), size_t(1000003)})
    for (int F : {1, 3, 4}) {
      json r = json::array();
      for (int f = 0; f < F; ++f) {
        const auto [lo, hi] = diloco::fragment_range(P, F, f);
        r.push_back({lo, hi});
      }
      fr.push_back({{"P", P}, {"F", F}, {"ranges", r}});
    }
  out["fragment_range"] = fr;
  json due = json::array();
  for (auto [H, F] : {std::pair<int, int>{6, 4}, {10, 1}, {5, 2}}) {
    std::vector<int> d;
    for (int s = 0; s <= 20; ++s) d.push_back(diloco::fragment_due(s, H, F));
    due.push_back({{"H", H}, {"F", F}, {"steps_0_to_20", d}});
  }
  out["fragment_due"] = due;
  // ROUND_REDUCE "delta": sum(w_i d_i) / sum(w_i) accumulated in fp32 in the order given.
  const std::vector<float> d0{0.5f, -1.0f, 0.25f, 3.0f}, d1{1.5f, 2.0f, -0.75f, 0.1f};
  std::vector<float> sum(4, 0.0f);
  diloco::accumulate(sum, d0.data(), 4, 3.0f);
  diloco::accumulate(sum, d1.data(), 4, 1.0f);
  for (float& v : sum) v *= float(1.0 / 4.0);  // the reducer multiplies by float(1 / sum of weights)
  out["reduce"] = {{"deltas", {d0, d1}}, {"weights", {3, 1}}, {"mean", floats(sum.data(), 4)}};
  // ROUND_APPLY "delta": outer SGD with Nesterov on theta_g and the momentum.
  std::vector<float> tg{1.0f, 2.0f, -3.0f, 0.5f}, m{0.1f, 0.0f, -0.2f, 0.3f};
  out["outer_step"] = {{"lr", 0.7}, {"momentum", 0.9}, {"nesterov", true}, {"theta_g", floats(tg.data(), 4)}, {"m", floats(m.data(), 4)},
                       {"d", floats(sum.data(), 4)}};
  diloco::outer_step(tg.data(), m.data(), sum.data(), 4, 0.7f, 0.9f, true);
  out["outer_step"]["theta_g_after"] = floats(tg.data(), 4);
  out["outer_step"]["m_after"] = floats(m.data(), 4);
  // The state hash of those: XXH3-64 of each vector's little-endian fp32 bytes.
  const uint64_t a = wire::checksum(tg.data(), 16), bh = wire::checksum(m.data(), 16);
  out["state_hash"] = {{"xxh3_theta_g", hex64(a)}, {"xxh3_m", hex64(bh)}, {"hash", hex64(a ^ (bh * 0x9E3779B97F4A7C15ull))},
                       {"hash_decimal", std::to_string(a ^ (bh * 0x9E3779B97F4A7C15ull))}};
  const JobSpec spec = parse_job_spec(tiny_spec_json(), false);
  out["stage_parameter_counts"] = stage_parameter_counts(spec);
  return out;
}

// Walks `want` and `got` together; floats within the tolerance, everything else exactly.
void compare(const json& want, const json& got, double abs_tol, double rel_tol, const std::string& path) {
  if (want.is_number_float() || (want.is_number() && got.is_number_float())) {
    ASSERT_TRUE(got.is_number()) << path;
    const double w = want.get<double>(), g = got.get<double>();
    if (abs_tol == 0 && rel_tol == 0) {
      EXPECT_EQ(float(w), float(g)) << path;
    } else {
      EXPECT_LE(std::fabs(w - g), abs_tol + rel_tol * std::fabs(w)) << path << ": want " << w << ", got " << g;
    }
    return;
  }
  if (want.is_number_integer() && got.is_number_integer()) {  // signed or unsigned: the value counts
    EXPECT_EQ(want.get<int64_t>(), got.get<int64_t>()) << path;
    return;
  }
  ASSERT_EQ(want.type(), got.type()) << path;
  if (want.is_array()) {
    ASSERT_EQ(want.size(), got.size()) << path;
    for (size_t i = 0; i < want.size(); ++i) compare(want[i], got[i], abs_tol, rel_tol, path + "[" + std::to_string(i) + "]");
  } else if (want.is_object()) {
    for (auto it = want.begin(); it != want.end(); ++it) {
      ASSERT_TRUE(got.contains(it.key())) << path << "." << it.key();
      compare(it.value(), got[it.key()], abs_tol, rel_tol, path + "." + it.key());
    }
  } else {
    EXPECT_EQ(want, got) << path;
  }
}

void check_file(const std::string& name, const json& got) {
  const std::string path = std::string(SWARM_SOURCE_DIR) + "/docs/vectors/" + name + ".json";
  if (std::getenv("SWARM_WRITE_VECTORS")) {
    std::ofstream(path) << got.dump(1) << "\n";
    GTEST_SKIP() << "wrote " << path;
  }
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path << " is missing (SWARM_WRITE_VECTORS=1 writes it)";
  const json want = json::parse(f);
  compare(want, got, want["tolerance"]["abs"].get<double>(), want["tolerance"]["rel"].get<double>(), name);
}

TEST(Vectors, Initialisation) { check_file("init", init_vectors()); }
TEST(Vectors, ForwardBackwardAndStep) { check_file("model", model_vectors()); }
TEST(Vectors, InnerOptimizer) { check_file("optim", optim_vectors()); }
TEST(Vectors, RoundsFragmentsAndHashes) { check_file("rounds", round_vectors()); }

// The comparison can fail: a vector off by more than its tolerance is caught.
TEST(Vectors, TheComparisonCatchesADifference) {
  json want = optim_vectors(), got = want;
  got["steps"][1]["w"][0] = got["steps"][1]["w"][0].get<double>() + 1e-3;
  EXPECT_NONFATAL_FAILURE(compare(want, got, 1e-7, 1e-6, "optim"), "optim.steps[1].w[0]");
}

}  // namespace
}  // namespace swarm
