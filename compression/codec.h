// codec.h: the codecs that compress tensors on the wire.
//
// Defines swarm::compression::CodecSpec (a codec and its parameters), `parse_codec` (the
// canonical text form, e.g. "int8:block=64", used in job specs and on the wire), the
// encode/decode pair over contiguous fp32 buffers, and ErrorFeedback (residual carry-over for
// lossy codecs, e.g. topk on outer gradients). Byte layouts and error bounds: docs/compression.md.
// The subspace codec's payload (coefficients in the job's basis plus token ids) is written and
// read by compression/subspace.h; its sizes are here like every other codec's. Plain C++ with no
// libtorch, so the router can link it (it forwards activations untouched, but averages outer
// gradients).
//
// Encoded sizes are a pure function of (spec, element count): a decoder checks the byte count
// it was given against `encoded_bytes` before it reads anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace swarm::compression {

enum class Codec : uint8_t {
  kFp32 = 0,  // raw little-endian float32
  kFp16 = 1,  // IEEE half, round to nearest even
  kBf16 = 2,  // bfloat16, round to nearest even, NaN and Inf preserved
  kInt8 = 3,  // blockwise absmax int8
  kInt4 = 4,  // blockwise absmax int4, two values per byte
  kTopk = 5,  // largest-magnitude fraction per block, with indices
  kSubspace = 6,  // k coefficients per token in the job's shared basis, plus token ids (subspace.h)
};

struct CodecSpec {
  Codec codec = Codec::kFp32;
  int block = 0;            // int8/int4/topk: values per block (64..4096); 0 for float codecs
  bool fp16_scales = false; // int8/int4: scales stored as fp16 instead of fp32
  double fraction = 0.0;    // topk: fraction of each block kept (0 < fraction <= 1)
  // Any codec: the encoded bytes travel zstd-compressed (lossless; the wire layer packs and
  // unpacks them, encode/decode and encoded_bytes here are unchanged). Quantized codes of
  // smooth data are far from uniform: int8 deltas shrink to about 0.8 of their size.
  bool zstd = false;
  // subspace only. k: coefficients per token (1 <= k < dim). dim: values per token of the
  // [..., dim] tensor the payload stands for (d_model); 0 in a job spec, set by the stage that
  // binds the codec to its model. coef: how the coefficients are coded (fp32, fp16, bf16, int8,
  // int4; `block` and `fp16_scales` apply to int8/int4). id_bytes: bytes of each token id sent
  // before the coefficients (0: none, as for gradients; 1, 2 or 4).
  int k = 0;
  int dim = 0;
  Codec coef = Codec::kFp32;
  int id_bytes = 0;

  // Canonical text, e.g. "fp32", "bf16", "int8:block=64", "int8:block=256,scale=fp16",
  // "topk:block=1024,fraction=0.01", "int8:block=1024,entropy=zstd",
  // "subspace:k=16,coef=int8,block=64,dim=128,ids=u8". parse_codec(c.name()) == c.
  std::string name() const;
  bool lossless() const { return codec == Codec::kFp32; }
  bool operator==(const CodecSpec& o) const;
  // subspace: the codec the coefficients go through (coef, block, fp16_scales).
  CodecSpec coefficients() const;
};

// Throws swarm::CodecError (an InputError) naming what is wrong and what is accepted.
CodecSpec parse_codec(const std::string& text);

// Exact number of bytes `encode` writes for n values.
size_t encoded_bytes(const CodecSpec& spec, int64_t n);

// src: n contiguous floats; dst: encoded_bytes(spec, n) bytes. Not for subspace (a CodecError:
// its payload is coefficients, written by compression/subspace.h's encode_subspace).
void encode(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst);

// Validates nbytes == encoded_bytes(spec, n) and the content (e.g. topk indices in range)
// before writing n floats to dst; throws swarm::CodecError otherwise (and for subspace, whose
// payload decode_subspace reads: rebuilding the n values needs the model's basis).
void decode(const CodecSpec& spec, const uint8_t* src, size_t nbytes, int64_t n, float* dst);

// Longest codec text parse_codec accepts (it arrives from the network).
constexpr size_t kMaxCodecTextBytes = 128;

// Throws swarm::CodecError if `spec` is not one parse_codec could return (block out of
// 64..4096, fraction outside (0, 1], k not below dim, parameters on a codec that takes none). encode,
// decode and encoded_bytes call it; callers building a CodecSpec by hand may call it early.
void validate(const CodecSpec& spec);

// Error feedback: what a lossy codec did not send is added to the next round's input, per key
// (e.g. a parameter name). For each call, with t = src + residual (fp32 adds, residual zero the
// first time), dst receives encode(t) and the new residual is t - decode(dst); so, elementwise in
// fp32, decoded + new residual == t exactly ("mass conservation"). A non-finite residual element
// (the input held NaN/Inf) is reset to 0 so one bad round does not poison later ones.
// Not thread-safe; use one instance per thread or lock around it.
class ErrorFeedback {
 public:
  // dst: encoded_bytes(spec, n) bytes. Throws CodecError if the key's residual holds a
  // different element count (call reset(key) when a tensor's shape changes).
  void encode(const std::string& key, const CodecSpec& spec, const float* src, int64_t n,
              uint8_t* dst);
  // The residual carried for `key` (n floats), or nullptr if none yet.
  const std::vector<float>* residual(const std::string& key) const;
  void reset();                        // forget every residual
  void reset(const std::string& key);  // forget one
  size_t size() const { return residual_.size(); }

 private:
  std::unordered_map<std::string, std::vector<float>> residual_;
  std::vector<float> sum_;      // [n] src + residual, scratch
  std::vector<float> decoded_;  // [n] decode(dst), scratch
};

}  // namespace swarm::compression
