// attention.cpp: causal_attention, the math form and libtorch 2.x's scaled-dot-product attention
// (see attention.h).
#include "stages/attention.h"

#include <cmath>
#include <limits>

#include "runtime/errors.h"

namespace swarm {

bool sdpa_available() {
#ifdef SWARM_TORCH_2
  return true;
#else
  return false;
#endif
}

AttentionImpl resolve_attention(AttentionImpl impl) {
  if (impl == AttentionImpl::kAuto) return sdpa_available() ? AttentionImpl::kSdpa : AttentionImpl::kMath;
  if (impl == AttentionImpl::kSdpa && !sdpa_available())
    throw InputError("scaled-dot-product attention needs a build against libtorch 2.x; this one has libtorch " TORCH_VERSION);
  return impl;
}

const char* attention_name(AttentionImpl impl) {
  switch (resolve_attention(impl)) {
    case AttentionImpl::kSdpa: return "sdpa";
    default: return "math";
  }
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& future, AttentionImpl impl) {
  SWARM_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v are [B, H, T, hd]");
  if (resolve_attention(impl) == AttentionImpl::kSdpa) {
#ifdef SWARM_TORCH_2
    // 2.0's signature (2.1 added `scale`; its default is the 1 / sqrt(hd) used below).
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#endif
  }
  const int64_t hd = q.size(-1);
  torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  // The softmax in fp32 (as autocast runs it; double stays double), back to the compute type
  // for the product with v. In fp32 both casts are no-ops: the same graph as before casts.
  const torch::ScalarType acc = at::promote_types(q.scalar_type(), torch::kFloat32);
  att = torch::softmax(att.to(acc).masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
  return torch::matmul(att.to(q.scalar_type()), v);
}

}  // namespace swarm
