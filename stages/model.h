// model.h: one stage of the GPT-2-style decoder, with nanoGPT's parameter names.
//
// Defines swarm::StageModel. Stage 0 holds the token and position embeddings, the last stage
// the final LayerNorm, the (untied) LM head and the cross-entropy; every stage holds its share
// of the transformer blocks. Initialisation is a pure function of (seed, full parameter name),
// so every peer of a stage, and the single-process reference, start from identical weights
// whatever the partition, libtorch version or device. No dropout: a forward is a pure function
// of weights and input.
//
// Architecture (nanoGPT): pre-LayerNorm blocks x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)),
// causal multi-head attention, MLP C -> 4C -> C with tanh-approximated GELU. Linear weights
// are [out, in] as torch.nn.Linear. Init: Linear and Embedding weights N(0, 0.02), the two
// c_proj weights N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weight 1 and bias 0.
//
// Mixed precision by explicit casts, the policy autocast applies: parameters stay fp32 leaves;
// each linear layer casts its input, weight and bias to the compute type (bf16/fp16), so its
// matrix product runs there and its gradient flows back to the fp32 weight; LayerNorms, the
// attention softmax, the residual stream, the logits and the loss stay fp32. Stage inputs and
// outputs are fp32 whatever the compute type. In fp32 every cast is a no-op.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "runtime/job_spec.h"
#include "stages/attention.h"

namespace swarm {

class StageModel {
 public:
  // Stage `stage` of `num_stages`, holding transformer blocks [first_layer, first_layer + num_layers).
  // Block names use the global layer index ("transformer.h.{first_layer + i}...").
  // `compute`: the type of the matrix products (kFloat32, kBFloat16, kHalf); `attention`: which
  // implementation (stages/attention.h; kAuto: scaled-dot-product attention on libtorch 2.x).
  StageModel(const ModelSpec& model, int stage, int num_stages, int first_layer, int num_layers,
             uint64_t seed, torch::Device device = torch::kCPU, torch::ScalarType compute = torch::kFloat32,
             AttentionImpl attention = AttentionImpl::kAuto);

  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == num_stages_ - 1; }
  int stage() const { return stage_; }
  int first_layer() const { return first_layer_; }
  int num_layers() const { return num_layers_; }

  // First stage: int64 tokens [B, T] -> activations [B, T, C]. Middle: [B, T, C] -> [B, T, C].
  // Last stage: ... -> logits [B, T, V] (a one-stage model maps tokens to logits).
  // T may be anything up to max_seq_len; integer token tensors of any integer dtype are accepted.
  torch::Tensor forward(const torch::Tensor& input);

  // Mean cross-entropy over all B*T tokens; targets int64 [B, T].
  static torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets);

  // The stage's parameters in a stable order (the order of nanoGPT's state dict), e.g.
  // "transformer.wte.weight", "transformer.h.3.attn.c_attn.weight", "lm_head.weight".
  // Leaf tensors with requires_grad, on device().
  const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters() const { return params_; }
  std::vector<torch::Tensor> parameters() const;
  int64_t num_parameters() const;
  // Exchanges each parameter's data with data[i] (same shapes, dtypes and devices; set_data, no
  // copy, no autograd version bump). A graph recorded while `data` was swapped in computes its
  // backward on `data` again once it is swapped back in, whatever was written into the
  // parameters' own data in between: the weight versions of the async schedule.
  void swap_weights(std::vector<torch::Tensor>& data);
  torch::Device device() const { return device_; }
  torch::ScalarType compute_type() const { return compute_; }
  AttentionImpl attention() const { return attention_; }

  // The initial value of parameter `name` (a full nanoGPT name) for `seed`, as float32 in
  // row-major order; what the constructor copies into the tensor. Exposed for tests and tools.
  static std::vector<float> init_values(const ModelSpec& model, const std::string& name,
                                        const std::vector<int64_t>& shape, uint64_t seed);

  // Replaces every parameter by a fresh leaf of `dtype` holding the same values (dropping any
  // grad), and computes in `dtype` too. For tests (gradient checks in double); the swarm keeps
  // fp32 parameters.
  void to_dtype(torch::ScalarType dtype);

 private:
  // Index into params_ of a named parameter, or -1 when absent (biases with bias=false).
  int add_param(const std::string& name, std::vector<int64_t> shape, uint64_t seed);
  const torch::Tensor& p(int index) const;
  // torch::linear in the compute type: x [..., in] with weight [out, in] and bias [out] (-1: none).
  torch::Tensor linear(const torch::Tensor& x, int weight, int bias) const;
  // x [B, T, C] -> [B, T, C]; future: [T, T] bool causal mask (true where masked).
  torch::Tensor block_forward(const std::vector<int>& b, const torch::Tensor& x, const torch::Tensor& future) const;

  ModelSpec spec_;
  int stage_, num_stages_, first_layer_, num_layers_;
  torch::Device device_;
  torch::ScalarType compute_;
  AttentionImpl attention_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  // Per block: indexes into params_ in the order of kBlockParams in model.cpp (-1: absent).
  std::vector<std::vector<int>> blocks_;
  int wte_ = -1, wpe_ = -1, ln_f_w_ = -1, ln_f_b_ = -1, lm_head_ = -1;
};

}  // namespace swarm
