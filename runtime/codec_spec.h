// codec_spec.h: the codec grammar of the wire: which codec a tensor frame uses, its canonical
// text, and the exact number of bytes it encodes to.
//
// Defines swarm::compression::Codec, CodecSpec, `parse_codec` (text from a job spec or a tensor
// description -> CodecSpec, throwing CodecError), `validate`, `encoded_bytes` (a pure function of
// (spec, element count) that a decoder checks before it reads anything) and the layout facts the
// byte formats are built from (namespace layout). The codecs themselves (encode, decode, error
// feedback) live in compression/ on top of this; the wire needs only the grammar, so the router
// never links a codec. Byte layouts: docs/compression.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace swarm::compression {


enum class Codec : uint8_t {
  kFp32 = 0,  // raw little-endian float32
  kFp16 = 1,  // IEEE half, round to nearest even
  kBf16 = 2,  // bfloat16, round to nearest even, NaN and Inf preserved
  kInt8 = 3,  // blockwise absmax int8
  kInt4 = 4,  // blockwise absmax int4, two values per byte
  kTopk = 5,  // largest-magnitude fraction per block, with indices
  kSubspace = 6,  // k coefficients per token in the job's shared basis, plus token ids (compression/subspace.h)
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

// Longest codec text parse_codec accepts (it arrives from the network).
constexpr size_t kMaxCodecTextBytes = 128;

// Throws swarm::CodecError if `spec` is not one parse_codec could return (block out of
// 64..4096, fraction outside (0, 1], k not below dim, parameters on a codec that takes none). encode,
// decode and encoded_bytes call it; callers building a CodecSpec by hand may call it early.
void validate(const CodecSpec& spec);

// What a job's codecs ask of the subspace codec.
struct SubspaceJob {
  int k = 0;
  // The wire codecs bound to the model (dim = d_model; activations carry ids of the narrowest
  // width that holds the vocabulary); unset where that direction uses another codec.
  std::optional<CodecSpec> activations, gradients;
};

// From a job's codec texts (as parse_codec reads them); nullopt when neither direction uses
// the subspace codec. Throws CodecError saying what to fix: outer gradients cannot use it (the
// constraint confines what crosses a stage boundary, not the weights), k must be below d_model
// and the same both ways (one basis per job), dim when given must be d_model, and ids are the
// stage's choice.
std::optional<SubspaceJob> subspace_job(const std::string& activations, const std::string& gradients,
                                        const std::string& outer, int d_model, int vocab_size);

namespace layout {
// Blocks of `block` values covering n values (the last one may be short).
inline int64_t blocks(int64_t n, int block) { return (n + block - 1) / block; }
// Bytes per stored int8/int4 block scale.
inline size_t scale_bytes(const CodecSpec& s) { return s.fp16_scales ? 2 : 4; }
// Values topk keeps from a block of len values: ceil(fraction * len) in IEEE double, in [1, len].
int topk_keep(double fraction, int len);
// Values topk keeps over n values.
int64_t topk_total(const CodecSpec& spec, int64_t n);
// Throws CodecError when n is negative or above 2^48 (surely a bug or an attack; keeps size math in range).
void check_count(int64_t n);
}  // namespace layout

}  // namespace swarm::compression
