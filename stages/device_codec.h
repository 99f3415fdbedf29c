// device_codec.h: encoding a stage's outputs and decoding its inputs where the tensors live.
//
// Defines `encode_output`, `decode_input` and `device_codecs_available`. For a tensor on a CUDA
// device with an int8 or int4 codec, in a build with -DSWARM_CUDA=ON, the codec runs on the
// device (compression/cuda/): only the encoded bytes (about a quarter of fp32's for int8) cross
// PCIe, through pinned host buffers, on a stream of their own that waits for the compute stream
// with an event. The bytes are those the CPU codec writes (tests/compression_cuda checks the
// kernels bit for bit). Every other case goes through the CPU (stages/tensor_codec.h).
#pragma once

#include <torch/torch.h>

#include "runtime/wire.h"

namespace swarm {

// True in a -DSWARM_CUDA=ON build (the device path exists; a CUDA device is still needed).
bool device_codecs_available();

// A float tensor (any device) encoded by `codec` into a sealed wire tensor.
wire::Tensor encode_output(const torch::Tensor& t, const compression::CodecSpec& codec);

// A float tensor frame decoded onto `device`, its rank and last dimension checked as
// from_wire checks them (throws WireError).
torch::Tensor decode_input(const wire::Tensor& w, int expect_rank, int64_t expect_last_dim, const torch::Device& device);

}  // namespace swarm
