// codec.h: the codecs that compress tensors on the wire, on contiguous fp32 buffers.
//
// Defines the encode/decode pair and ErrorFeedback (residual carry-over for lossy codecs, e.g.
// topk on outer gradients), built on the codec grammar of runtime/codec_spec.h (CodecSpec,
// parse_codec, encoded_bytes), which the wire layer owns. The subspace codec's payload
// (coefficients in the job's basis plus token ids) is written and read by compression/subspace.h. Plain C++ with no libtorch. Byte
// layouts and error bounds: docs/compression.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/codec_spec.h"

namespace swarm::compression {

// src: n contiguous floats; dst: encoded_bytes(spec, n) bytes. Not for subspace (a CodecError:
// its payload is coefficients, written by compression/subspace.h's encode_subspace).
void encode(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst);

// Validates nbytes == encoded_bytes(spec, n) and the content (e.g. topk indices in range)
// before writing n floats to dst; throws swarm::CodecError otherwise (and for subspace, whose
// payload decode_subspace reads: rebuilding the n values needs the model's basis).
void decode(const CodecSpec& spec, const uint8_t* src, size_t nbytes, int64_t n, float* dst);

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
  // The same with src[0, n) cut into parts [bounds[i], bounds[i+1]) (bounds from 0 to n), each
  // encoded on its own into dst[i] (encoded_bytes(spec, its length) bytes): one residual for the
  // whole whatever the cut, so a different cut next time keeps what was not sent.
  void encode_parts(const std::string& key, const CodecSpec& spec, const float* src, int64_t n,
                    const std::vector<int64_t>& bounds, const std::vector<uint8_t*>& dst);
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
