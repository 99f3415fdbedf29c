// model.cpp: swarm::StageModel, one stage of the GPT-2 (nanoGPT) decoder on plain tensors.
//
// Parameters are plain leaf tensors (no torch::nn::Module), so the code is the same on
// libtorch 1.13 and 2.x. Initial values come from a counter-based generator (splitmix64 keyed
// by the seed and the parameter's full name, Box-Muller to normals) computed on the CPU in
// double, so they do not depend on the libtorch version, the device or the partition.
#include "stages/model.h"

#include <cmath>

#include "runtime/errors.h"
#include "runtime/random.h"

namespace swarm {
namespace {

// Order of a block's parameters in blocks_[i] (and, with the ".weight"/".bias" names, in the
// state dict).
enum BlockParam {
  kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB,
  kLn2W, kLn2B, kFcW, kFcB, kMlpProjW, kMlpProjB, kNumBlockParams
};

constexpr double kInitStd = 0.02;
constexpr double kLayerNormEps = 1e-5;  // torch.nn.LayerNorm's default, as nanoGPT

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

// Uniform in (0, 1]: 53 random bits, never 0 so that log() is finite.
double uniform_open0(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<float> StageModel::init_values(const ModelSpec& model, const std::string& name,
                                           const std::vector<int64_t>& shape, uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n), 0.0f);
  if (ends_with(name, ".bias")) return out;  // Linear and LayerNorm biases
  if (ends_with(name, "ln_1.weight") || ends_with(name, "ln_2.weight") || ends_with(name, "ln_f.weight")) {
    std::fill(out.begin(), out.end(), 1.0f);
    return out;
  }
  double std = kInitStd;
  if (ends_with(name, "c_proj.weight")) std = kInitStd / std::sqrt(2.0 * model.n_layer);
  // Element i's pair of uniforms comes from counters 2*(i/2), 2*(i/2)+1 of the stream keyed by
  // (seed, name): element values depend only on (seed, name, i).
  const uint64_t key = splitmix64(seed ^ splitmix64(fnv1a64(name)));
  const double two_pi = 6.283185307179586476925;
  for (int64_t i = 0; i < n; i += 2) {
    const uint64_t c = static_cast<uint64_t>(i);
    const double u1 = uniform_open0(splitmix64(key + c));
    const double u2 = uniform_open0(splitmix64(key + c + 1));
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(std * r * std::cos(two_pi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(std * r * std::sin(two_pi * u2));
  }
  return out;
}

int StageModel::add_param(const std::string& name, std::vector<int64_t> shape, uint64_t seed) {
  std::vector<float> values = init_values(spec_, name, shape, seed);
  torch::Tensor t = torch::from_blob(values.data(), shape, torch::kFloat32).clone().to(device_);
  t.set_requires_grad(true);
  params_.emplace_back(name, t);
  return static_cast<int>(params_.size()) - 1;
}

const torch::Tensor& StageModel::p(int index) const {
  static const torch::Tensor kAbsent;
  return index < 0 ? kAbsent : params_[static_cast<size_t>(index)].second;
}

StageModel::StageModel(const ModelSpec& model, int stage, int num_stages, int first_layer,
                       int num_layers, uint64_t seed, torch::Device device, torch::ScalarType compute,
                       AttentionImpl attention)
    : spec_(model), stage_(stage), num_stages_(num_stages), first_layer_(first_layer),
      num_layers_(num_layers), device_(device), compute_(compute), attention_(resolve_attention(attention)) {
  SWARM_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, "stage index out of range");
  SWARM_CHECK(first_layer >= 0 && num_layers >= 0 && first_layer + num_layers <= model.n_layer,
              "blocks [" + std::to_string(first_layer) + ", " + std::to_string(first_layer + num_layers) +
                  ") outside the model's " + std::to_string(model.n_layer) + " layers");
  SWARM_CHECK(model.n_head >= 1 && model.d_model % model.n_head == 0, "d_model must divide by n_head");
  if (spec_.max_seq_len <= 0) spec_.max_seq_len = spec_.seq_len;
  const int64_t C = spec_.d_model, V = spec_.vocab_size;
  const bool bias = spec_.bias;

  if (is_first()) {
    wte_ = add_param("transformer.wte.weight", {V, C}, seed);
    wpe_ = add_param("transformer.wpe.weight", {spec_.max_seq_len, C}, seed);
  }
  for (int l = first_layer; l < first_layer + num_layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    std::vector<int> b(kNumBlockParams, -1);
    b[kLn1W] = add_param(h + "ln_1.weight", {C}, seed);
    if (bias) b[kLn1B] = add_param(h + "ln_1.bias", {C}, seed);
    b[kAttnW] = add_param(h + "attn.c_attn.weight", {3 * C, C}, seed);
    if (bias) b[kAttnB] = add_param(h + "attn.c_attn.bias", {3 * C}, seed);
    b[kAttnProjW] = add_param(h + "attn.c_proj.weight", {C, C}, seed);
    if (bias) b[kAttnProjB] = add_param(h + "attn.c_proj.bias", {C}, seed);
    b[kLn2W] = add_param(h + "ln_2.weight", {C}, seed);
    if (bias) b[kLn2B] = add_param(h + "ln_2.bias", {C}, seed);
    b[kFcW] = add_param(h + "mlp.c_fc.weight", {4 * C, C}, seed);
    if (bias) b[kFcB] = add_param(h + "mlp.c_fc.bias", {4 * C}, seed);
    b[kMlpProjW] = add_param(h + "mlp.c_proj.weight", {C, 4 * C}, seed);
    if (bias) b[kMlpProjB] = add_param(h + "mlp.c_proj.bias", {C}, seed);
    blocks_.push_back(std::move(b));
  }
  if (is_last()) {
    ln_f_w_ = add_param("transformer.ln_f.weight", {C}, seed);
    if (bias) ln_f_b_ = add_param("transformer.ln_f.bias", {C}, seed);
    lm_head_ = add_param("lm_head.weight", {V, C}, seed);
  }
}

torch::Tensor StageModel::linear(const torch::Tensor& x, int weight, int bias) const {
  const torch::Tensor& b = p(bias);
  return torch::linear(x.to(compute_), p(weight).to(compute_), b.defined() ? b.to(compute_) : b);
}

torch::Tensor StageModel::block_forward(const std::vector<int>& b, const torch::Tensor& x,
                                        const torch::Tensor& future) const {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const int64_t nh = spec_.n_head, hd = C / nh;
  const torch::ScalarType residual = x.scalar_type();  // fp32 (double in gradient checks)

  // Attention: [B, T, C] -> q, k, v [B, nh, T, hd]; causal softmax(q k^T / sqrt(hd)) v.
  torch::Tensor h = torch::layer_norm(x, {C}, p(b[kLn1W]), p(b[kLn1B]), kLayerNormEps);
  torch::Tensor qkv = linear(h, b[kAttnW], b[kAttnB]);  // [B, T, 3C]
  std::vector<torch::Tensor> parts = qkv.split(C, /*dim=*/2);
  torch::Tensor q = parts[0].view({B, T, nh, hd}).transpose(1, 2);
  torch::Tensor k = parts[1].view({B, T, nh, hd}).transpose(1, 2);
  torch::Tensor v = parts[2].view({B, T, nh, hd}).transpose(1, 2);
  torch::Tensor y = causal_attention(q, k, v, future, attention_).transpose(1, 2).contiguous().view({B, T, C});
  torch::Tensor out = x + linear(y, b[kAttnProjW], b[kAttnProjB]).to(residual);

  // MLP: C -> 4C -> GELU (tanh approximation, as GPT-2) -> C.
  h = torch::layer_norm(out, {C}, p(b[kLn2W]), p(b[kLn2B]), kLayerNormEps);
  h = at::gelu(linear(h, b[kFcW], b[kFcB]), "tanh");
  return out + linear(h, b[kMlpProjW], b[kMlpProjB]).to(residual);
}

torch::Tensor StageModel::forward(const torch::Tensor& input) {
  torch::Tensor x;
  if (is_first()) {
    SWARM_CHECK(input.dim() == 2, "stage 0 takes tokens [B, T]");
    const int64_t T = input.size(1);
    SWARM_CHECK(T <= spec_.max_seq_len, "sequence of " + std::to_string(T) + " tokens over max_seq_len " +
                                            std::to_string(spec_.max_seq_len));
    torch::Tensor idx = input.to(device_, torch::kLong);
    x = torch::embedding(p(wte_), idx) + p(wpe_).slice(0, 0, T);  // [B, T, C]
  } else {
    SWARM_CHECK(input.dim() == 3 && input.size(2) == spec_.d_model, "a later stage takes activations [B, T, C]");
    x = input.device() == device_ ? input : input.to(device_);
  }
  if (!blocks_.empty()) {
    const int64_t T = x.size(1);
    // [T, T], true above the diagonal: the future positions a query must not see.
    const torch::Tensor future =
        torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    for (const std::vector<int>& b : blocks_) x = block_forward(b, x, future);
  }
  if (is_last()) {
    x = torch::layer_norm(x, {spec_.d_model}, p(ln_f_w_), p(ln_f_b_), kLayerNormEps);
    x = linear(x, lm_head_, -1).to(x.scalar_type());  // [B, T, V], fp32 for the loss
  }
  return x;
}

torch::Tensor StageModel::loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  const int64_t V = logits.size(-1);
  torch::Tensor flat = logits.reshape({-1, V});
  torch::Tensor t = targets.to(logits.device(), torch::kLong).reshape({-1});
  return torch::nll_loss(torch::log_softmax(flat, -1), t);
}

std::vector<torch::Tensor> StageModel::parameters() const {
  std::vector<torch::Tensor> out;
  out.reserve(params_.size());
  for (const auto& np : params_) out.push_back(np.second);
  return out;
}

int64_t StageModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& np : params_) n += np.second.numel();
  return n;
}

void StageModel::swap_weights(std::vector<torch::Tensor>& data) {
  SWARM_CHECK(data.size() == params_.size(), "swap_weights needs one tensor per parameter");
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor held = params_[i].second.detach();
    params_[i].second.set_data(data[i]);
    data[i] = held;
  }
}

void StageModel::to_dtype(torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  compute_ = dtype;
  for (auto& np : params_) {
    torch::Tensor t = np.second.detach().to(dtype).clone();
    t.set_requires_grad(true);
    np.second = t;
  }
}

}  // namespace swarm
