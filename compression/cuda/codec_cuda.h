// codec_cuda.h: int8 and int4 blockwise codecs on an NVIDIA GPU (built with -DSWARM_CUDA=ON).
//
// Defines swarm::compression::cuda::{device_available, encode, decode}. Same byte format as the
// CPU codec in compression/codec.h, bit for bit (tests/compression_cuda checks it): a tensor
// encoded on the GPU decodes on a CPU-only router or peer, and the reverse. Pointers are device
// pointers; `stream` is a cudaStream_t (nullptr: the legacy default stream), kept as void* so this
// header needs no CUDA headers. Other codecs (fp16, bf16, topk) are not here: throw CodecError.
#pragma once

#include <cstddef>
#include <cstdint>

#include "compression/codec.h"

namespace swarm::compression::cuda {

// True if the CUDA runtime sees at least one device.
bool device_available();

// d_src: n floats; d_dst: encoded_bytes(spec, n) bytes. Asynchronous on `stream`.
// Throws swarm::CodecError for a codec other than int8/int4, std::runtime_error on a CUDA error.
void encode(const CodecSpec& spec, const float* d_src, int64_t n, uint8_t* d_dst,
            void* stream = nullptr);

// d_src: nbytes encoded bytes (checked against encoded_bytes first); d_dst: n floats.
// Validates the content like the CPU decoder (negative scale, value -128 / nibble -8, int4
// padding) and throws swarm::CodecError; for that it synchronises `stream` once per call.
void decode(const CodecSpec& spec, const uint8_t* d_src, size_t nbytes, int64_t n, float* d_dst,
            void* stream = nullptr);

}  // namespace swarm::compression::cuda
