// subspace.cpp: swarm::Subspace (see subspace.h): which parameters the constraint holds, the
// embedding's fixed part, and the subspace codec on torch tensors.
#include "stages/subspace.h"

#include "runtime/errors.h"
#include "stages/model.h"

namespace swarm {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Runs f(values) on t's float32 values: in place when t is a contiguous float32 CPU tensor,
// else on a CPU copy written back. Either way through `.data()` / the raw pointer, so autograd's
// version counters do not move (a cached graph still runs backward, as after AdamW's updates).
template <typename F>
void on_cpu_values(const torch::Tensor& t, F f) {
  if (t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous()) {
    f(t.data_ptr<float>());
    return;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous().clone();
  f(c.data_ptr<float>());
  t.data().copy_(c);
}

WireError bad_tensor(const std::string& what) { return WireError(WireErrc::kBadTensor, what); }

}  // namespace

std::unique_ptr<Subspace> Subspace::for_stage(const JobSpec& spec, int stage) {
  std::optional<compression::SubspaceJob> job =
      compression::subspace_job(spec.compression.activations, spec.compression.gradients, spec.compression.outer,
                                spec.model.d_model, spec.model.vocab_size);
  if (!job) return nullptr;
  SWARM_CHECK(stage >= 0 && stage < spec.partition.stages, "stage out of range");
  return std::unique_ptr<Subspace>(new Subspace(spec, stage, std::move(*job)));
}

Subspace::Subspace(const JobSpec& spec, int stage, compression::SubspaceJob job)
    : job_(std::move(job)), k_(job_.k), C_(spec.model.d_model), V_(spec.model.vocab_size),
      max_T_(spec.model.max_seq_len > 0 ? spec.model.max_seq_len : spec.model.seq_len),
      last_(stage == spec.partition.stages - 1) {
  u_ = compression::subspace_basis(C_, k_, spec.seed);
  U_ = torch::from_blob(u_.data(), {C_, k_}, torch::kFloat32).clone();
  // E's parts: the embeddings' initial rows minus their component in span(U), computed by the
  // same deterministic loop as every projection, so stage 0's constraint and every decoder
  // agree. So the first weights are the unconstrained model's, but for the output projections.
  auto fixed = [&](const std::string& name, int rows) {
    std::vector<float> init = StageModel::init_values(spec.model, name, {rows, C_}, spec.seed);
    std::vector<float> in_span = init;
    compression::project_rows(u_.data(), C_, k_, in_span.data(), rows, nullptr);
    for (size_t i = 0; i < init.size(); ++i) init[i] -= in_span[i];
    return init;
  };
  fixed_tok_ = fixed("transformer.wte.weight", V_);
  fixed_pos_ = fixed("transformer.wpe.weight", max_T_);
  fixed_tok_t_ = torch::from_blob(fixed_tok_.data(), {V_, C_}, torch::kFloat32);
  fixed_pos_t_ = torch::from_blob(fixed_pos_.data(), {max_T_, C_}, torch::kFloat32);
}

Subspace::Kind Subspace::kind_of(const std::string& name) const {
  if (last_) return Kind::kNone;
  if (name == "transformer.wte.weight") return Kind::kTokenRows;
  if (name == "transformer.wpe.weight") return Kind::kPositionRows;
  for (const char* s : {".attn.c_proj.weight", ".attn.c_proj.bias", ".mlp.c_proj.weight", ".mlp.c_proj.bias"})
    if (ends_with(name, s)) return Kind::kColumns;
  return Kind::kNone;
}

void Subspace::project(Kind kind, float* values, int64_t numel, bool tangent) const {
  SWARM_CHECK(numel % C_ == 0, "a constrained parameter is not a multiple of d_model");
  switch (kind) {
    case Kind::kNone: return;
    case Kind::kColumns: compression::project_columns(u_.data(), C_, k_, values, numel / C_); return;
    case Kind::kTokenRows:
    case Kind::kPositionRows: {
      const bool tok = kind == Kind::kTokenRows;
      SWARM_CHECK(numel == int64_t(C_) * (tok ? V_ : max_T_), "embedding shape");
      // The tangent space of {W : W (I - P) = E} is {D : D (I - P) = 0}: rows projected, no offset.
      const float* offset = tangent ? nullptr : (tok ? fixed_tok_ : fixed_pos_).data();
      compression::project_rows(u_.data(), C_, k_, values, numel / C_, offset);
      return;
    }
  }
}

void Subspace::project_grads(const NamedParams& params) const {
  for (const auto& [name, p] : params) {
    const Kind kind = kind_of(name);
    if (kind == Kind::kNone || !p.grad().defined()) continue;
    on_cpu_values(p.grad(), [&](float* v) { project(kind, v, p.numel(), /*tangent=*/true); });
  }
}

void Subspace::project_params(const NamedParams& params) const {
  for (const auto& [name, p] : params) {
    const Kind kind = kind_of(name);
    if (kind != Kind::kNone) on_cpu_values(p, [&](float* v) { project(kind, v, p.numel(), /*tangent=*/false); });
  }
}

void Subspace::project_flat(const NamedParams& params, std::vector<float>& flat) const {
  size_t off = 0;
  for (const auto& [name, p] : params) {
    const auto n = size_t(p.numel());
    SWARM_CHECK(off + n <= flat.size(), "flat parameter vector too short");
    project(kind_of(name), flat.data() + off, int64_t(n), /*tangent=*/false);
    off += n;
  }
  SWARM_CHECK(off == flat.size(), "flat parameter vector size");
}

wire::Tensor Subspace::encode_activation(const torch::Tensor& x, const torch::Tensor& ids) const {
  SWARM_CHECK(job_.activations.has_value(), "this job's activations do not use the subspace codec");
  SWARM_CHECK(x.dim() == 3 && x.size(2) == C_ && ids.dim() == 2 && ids.size(0) == x.size(0) && ids.size(1) == x.size(1),
              "subspace activations are [B, T, d_model] with token ids [B, T]");
  const compression::CodecSpec& spec = *job_.activations;
  torch::NoGradGuard no_grad;
  // z = U^T x per token: U^T E = 0, so the coefficients hold all of x but E.
  torch::Tensor c = torch::matmul(x.detach().to(torch::kFloat32), U_.to(x.device())).to(torch::kCPU).contiguous();
  torch::Tensor id = ids.detach().to(torch::kCPU, torch::kLong).contiguous();
  const int64_t n = x.numel();
  wire::Tensor w = wire::make_tensor(wire::DType::kF32, {x.size(0), x.size(1), C_}, spec, compression::encoded_bytes(spec, n));
  compression::encode_subspace(spec, c.data_ptr<float>(), id.data_ptr<int64_t>(), n, static_cast<uint8_t*>(w.data.data()));
  wire::seal(w);
  return w;
}

wire::Tensor Subspace::encode_gradient(const torch::Tensor& g) const {
  SWARM_CHECK(job_.gradients.has_value(), "this job's gradients do not use the subspace codec");
  SWARM_CHECK(g.dim() == 3 && g.size(2) == C_, "subspace gradients are [B, T, d_model]");
  const compression::CodecSpec& spec = *job_.gradients;
  torch::NoGradGuard no_grad;
  torch::Tensor c = torch::matmul(g.detach().to(torch::kFloat32), U_.to(g.device())).to(torch::kCPU).contiguous();
  const int64_t n = g.numel();
  wire::Tensor w = wire::make_tensor(wire::DType::kF32, {g.size(0), g.size(1), C_}, spec, compression::encoded_bytes(spec, n));
  compression::encode_subspace(spec, c.data_ptr<float>(), nullptr, n, static_cast<uint8_t*>(w.data.data()));
  wire::seal(w);
  return w;
}

torch::Tensor Subspace::coefficients(const wire::Tensor& t, torch::Tensor* ids) const {
  const wire::TensorDesc& d = t.desc;
  if (d.dtype != wire::DType::kF32 || d.codec.codec != compression::Codec::kSubspace)
    throw bad_tensor("expected a subspace-coded tensor, got codec " + d.codec.name());
  if (d.codec.k != k_ || d.codec.dim != C_)
    throw bad_tensor("a subspace frame of k=" + std::to_string(d.codec.k) + ", dim=" + std::to_string(d.codec.dim) +
                     " but this job's subspace has k=" + std::to_string(k_) + " of d_model " + std::to_string(C_));
  if (d.shape.size() != 3 || d.shape[2] != C_) throw bad_tensor("expected a subspace-coded tensor of shape [B, T, d_model]");
  if (d.shape[1] > max_T_) throw bad_tensor("sequence longer than the model's maximum");
  if (ids && d.codec.id_bytes == 0) throw bad_tensor("a subspace-coded activation without token ids");
  torch::Tensor c = torch::empty({d.shape[0], d.shape[1], k_}, torch::kFloat32);
  torch::Tensor id = ids ? torch::empty({d.shape[0], d.shape[1]}, torch::kLong) : torch::Tensor();
  try {
    compression::decode_subspace(d.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), d.numel(),
                                 c.data_ptr<float>(), ids ? id.data_ptr<int64_t>() : nullptr);
  } catch (const CodecError& e) {
    throw bad_tensor(e.what());
  }
  if (ids) {
    if (id.numel() && id.max().item<int64_t>() >= V_) throw bad_tensor("token id outside the vocabulary");
    *ids = id;
  }
  return c;
}

torch::Tensor Subspace::decode_activation(const wire::Tensor& t, torch::Tensor* ids) const {
  SWARM_CHECK(ids != nullptr, "decode_activation returns the token ids");
  torch::NoGradGuard no_grad;
  torch::Tensor c = coefficients(t, ids);
  const int64_t T = c.size(1);
  // x = E(tok, pos) + U z
  return torch::embedding(fixed_tok_t_, *ids) + fixed_pos_t_.slice(0, 0, T) + torch::matmul(c, U_.t());
}

torch::Tensor Subspace::decode_gradient(const wire::Tensor& t) const {
  torch::NoGradGuard no_grad;
  return torch::matmul(coefficients(t, nullptr), U_.t());
}

}  // namespace swarm
