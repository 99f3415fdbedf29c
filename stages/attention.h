// attention.h: causal multi-head attention for the GPT stage, two implementations.
//
// Defines swarm::AttentionImpl, `sdpa_available` and `causal_attention`. `kSdpa` is libtorch
// 2.x's at::scaled_dot_product_attention (flash or memory-efficient kernels on GPUs: no [T, T]
// matrix is stored); `kMath` writes softmax(q k^T / sqrt(hd)) v out, with the softmax in fp32
// whatever the compute type. The build defines SWARM_TORCH_2 against libtorch 2.x; against 1.13
// only kMath exists. Both give the same function up to rounding (tests/stages/test_attention.cpp).
#pragma once

#include <torch/torch.h>

namespace swarm {

enum class AttentionImpl { kAuto, kMath, kSdpa };

// True when this build has scaled-dot-product attention (libtorch 2.x).
bool sdpa_available();
// kAuto -> kSdpa when available, else kMath. Asking for kSdpa without it: InputError.
AttentionImpl resolve_attention(AttentionImpl impl);
const char* attention_name(AttentionImpl impl);  // "sdpa", "math"

// q, k, v [B, H, T, hd] in the compute type -> [B, H, T, hd] in the same type. `future`
// [T, T] bool, true above the diagonal (the positions a query must not see); kMath uses it,
// kSdpa ignores it (is_causal).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& future, AttentionImpl impl = AttentionImpl::kAuto);

}  // namespace swarm
