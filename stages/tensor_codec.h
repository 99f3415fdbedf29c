// tensor_codec.h: between torch tensors and wire tensor frames.
//
// Defines `to_wire` (a float tensor encoded by a codec, or an integer tensor raw, sealed with
// its checksum) and `from_wire` (a validated frame decoded into a tensor). The frame layout
// and the codecs are in runtime/wire.h and compression/codec.h.
#pragma once

#include <torch/torch.h>

#include "runtime/wire.h"

namespace swarm {

// Float tensors go through `codec`; int32/int64 tensors travel raw as i32.
wire::Tensor to_wire(const torch::Tensor& t, const compression::CodecSpec& codec);

// f32 -> float tensor of the frame's shape; i32/u16 -> int64 tensor (token ids).
// `expect_rank` (when >= 0) and `expect_last_dim` (when > 0) are checked; throws WireError.
torch::Tensor from_wire(const wire::Tensor& t, int expect_rank = -1, int64_t expect_last_dim = 0);

// A frame's shape as torch takes sizes (a view of it: the shape must outlive the call).
inline c10::IntArrayRef sizes_of(const wire::Shape& s) { return c10::IntArrayRef(s.data(), s.size()); }

// The shape checks of from_wire alone (throws WireError).
void check_frame_shape(const wire::Tensor& t, int expect_rank, int64_t expect_last_dim);

}  // namespace swarm
