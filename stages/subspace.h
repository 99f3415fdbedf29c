// subspace.h: the model side of the subspace codec (Protocol Models): the constraint that keeps
// what crosses a stage boundary inside the job's shared subspace, and the codec that sends it as
// k coefficients per token plus the token ids.
//
// Defines swarm::Subspace. In a job whose activation or gradient codec is "subspace:k=K", with
// U [C, K] the basis the job's seed gives (compression/subspace.h), every stage but the last
// keeps
//   - its blocks' output projections (attn.c_proj and mlp.c_proj, weight [C, in] and bias [C])
//     with columns in span(U), and
//   - on stage 0, the token and position embeddings equal to their initial values outside
//     span(U): wte (I - U U^T) = wte0 (I - U U^T), the same for wpe. Only their part inside
//     span(U) trains.
// So the residual stream leaving every stage but the last is x = E(tok, pos) + U z, with
// E(tok, pos) = (wte0[tok] + wpe0[pos]) (I - U U^T) a pure function of the seed and the token
// ids: z = U^T x (k numbers per token) and the ids describe x exactly, and the next stage
// rebuilds E from the ids. Any gradient the stage before needs is U^T g: it depends on the
// boundary only through z. The last stage's blocks write nothing that crosses a boundary and
// stay free. The constraint lives in the weights, so `swarm export` writes a plain nanoGPT
// state dict. Method, byte layout, what was left out: docs/compression.md.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "compression/subspace.h"
#include "runtime/job_spec.h"
#include "runtime/wire.h"
#include "stages/optim.h"

namespace swarm {

class Subspace : public ParamConstraint {
 public:
  using NamedParams = std::vector<std::pair<std::string, torch::Tensor>>;

  // Stage `stage`'s side of the job's subspace codec; null when neither codec of the job is a
  // subspace codec. Throws CodecError (an InputError) saying what to fix in the codecs.
  static std::unique_ptr<Subspace> for_stage(const JobSpec& spec, int stage);
  Subspace(const Subspace&) = delete;  // its tensors view its own vectors
  Subspace& operator=(const Subspace&) = delete;

  int k() const { return k_; }
  // Whether the stage's parameters are constrained (every stage but the last).
  bool constrains() const { return !last_; }
  bool codes_activations() const { return bool(job_.activations); }
  bool codes_gradients() const { return bool(job_.gradients); }
  // U [C, k] float32 on the CPU.
  const torch::Tensor& basis() const { return U_; }

  // ParamConstraint. Every projection runs compression/subspace.h's deterministic loops on the
  // CPU (a copy for parameters on another device), so peers that must hold the same bits do.
  // Writes go around autograd's version counters, as AdamW's updates do.
  void project_grads(const NamedParams& params) const override;
  void project_params(const NamedParams& params) const override;
  // The same on a flat fp32 vector of the stage's parameters in `params`' order (the global
  // weights of a DiLoCo group, after an outer step).
  void project_flat(const NamedParams& params, std::vector<float>& flat) const;

  // x, g: [B, T, C] stage outputs and input gradients, any device; ids: the tokens [B, T].
  wire::Tensor encode_activation(const torch::Tensor& x, const torch::Tensor& ids) const;
  wire::Tensor encode_gradient(const torch::Tensor& g) const;
  // A subspace-coded frame -> [B, T, C] float32 on the CPU (and the token ids, int64 [B, T]).
  // Throws WireError (kBadTensor) for a frame of another k, width or shape, ids outside the
  // vocabulary, or undecodable coefficients.
  torch::Tensor decode_activation(const wire::Tensor& t, torch::Tensor* ids) const;
  torch::Tensor decode_gradient(const wire::Tensor& t) const;

 private:
  Subspace(const JobSpec& spec, int stage, compression::SubspaceJob job);
  enum class Kind { kNone, kColumns, kTokenRows, kPositionRows };
  Kind kind_of(const std::string& name) const;
  // Projects one tensor's values (rows or columns of an [n, C] or [C, n] matrix) in place.
  void project(Kind kind, float* values, int64_t numel, bool tangent) const;
  torch::Tensor coefficients(const wire::Tensor& t, torch::Tensor* ids) const;  // [B, T, k]

  compression::SubspaceJob job_;
  int k_, C_, V_, max_T_;
  bool last_;
  std::vector<float> u_;                 // [C, k] row-major
  torch::Tensor U_;                      // the same, as a tensor
  std::vector<float> fixed_tok_, fixed_pos_;  // [V, C], [max_T, C]: E's parts, row-major
  torch::Tensor fixed_tok_t_, fixed_pos_t_;   // the same, as tensors
};

}  // namespace swarm
