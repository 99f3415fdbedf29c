// codec.cpp: implements compression/codec.h: encode/decode for fp32, fp16, bf16, int8, int4
// and topk, and ErrorFeedback, on the grammar and sizes of runtime/codec_spec.h. Byte layouts, error bounds and NaN/Inf rules: docs/compression.md.
//
// Speed: the hot loops are written so GCC vectorises them for baseline x86-64 (SSE2) with the
// per-file options set in compression/CMakeLists.txt (-O3, no FP contraction; the FP results
// must be bit-identical to the CUDA kernels in compression/cuda/). Where the CPU has AVX2 the
// same loops are cloned for it (target_clones, picked once at load time by the dynamic linker).
#include "compression/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "runtime/errors.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__ELF__) && \
    !defined(SWARM_NO_CLONES)
#define SWARM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SWARM_CLONES
#endif

namespace swarm::compression {
namespace {

// Outside [kTinyScale, kHugeScale] a stored scale is (de)quantised in double ("exact path"), so
// that 127/scale cannot overflow, the step stays a normal float and q*step cannot round past
// FLT_MAX. Part of the format: the CUDA kernels make the same choice.
constexpr float kTinyScale = 0x1p-96f;
constexpr float kHugeScale = 0x1p100f;
inline bool exact_path(float s) { return s < kTinyScale || s > kHugeScale; }
// int4 is quantised into int8 scratch a chunk at a time (an even number of blocks, so every
// chunk but the last starts and ends on a byte boundary), then packed.
constexpr int kInt4Chunk = 16384;

[[noreturn]] void fail(const std::string& what) { throw CodecError(what); }

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- half and bfloat16 conversions (branch-free so the loops vectorise) --------------------

// cond ? a : b as bit arithmetic: GCC keeps it branch-free, where a ?: over values computed
// with floating point becomes a branch and stops the vectoriser.
inline uint32_t select(bool cond, uint32_t a, uint32_t b) {
  return b ^ ((a ^ b) & (0u - uint32_t(cond)));
}

// fp32 -> IEEE half, round to nearest even; overflow -> Inf; NaN -> quiet NaN (sign kept).
inline uint16_t f32_to_f16(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal half: rebias the exponent and round the 13 dropped bits to nearest even.
  const uint32_t normal = (a - 0x37fff001u + ((a >> 13) & 1u)) >> 13;
  // Subnormal half: adding 0.5f makes the FPU round at the half's subnormal unit (2^-24).
  const uint32_t sub = f2u(u2f(a) + 0.5f) - 0x3f000000u;
  const uint32_t special = 0x7c00u | (uint32_t(a > 0x7f800000u) << 9);
  const uint32_t r = select(a >= 0x47800000u, special, select(a < 0x38800000u, sub, normal));
  return uint16_t(r | sign);
}

// IEEE half -> fp32 (exact; NaN payload kept).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t normal = (em << 13) + 0x38000000u;
  const uint32_t sub = f2u(float(int32_t(em)) * 0x1p-24f);
  const uint32_t special = (em << 13) | 0x7f800000u;
  const uint32_t r = select(em >= 0x7c00u, special, select(em >= 0x0400u, normal, sub));
  return u2f(r | sign);
}

// fp32 -> bfloat16, round to nearest even; NaN -> quiet NaN (sign and top payload kept).
inline uint16_t f32_to_bf16(float x) {
  const uint32_t u = f2u(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// Smallest half >= a (a >= 0, finite or +Inf): fp16 scales round up so that the stored scale
// covers the block's absmax and no value needs clamping. Above 65504 this gives +Inf.
inline uint16_t f16_ceil(float a) {
  uint16_t h = f32_to_f16(a);
  if (f16_to_f32(h) < a) ++h;
  return h;
}

// ---- raw, fp16, bf16 -------------------------------------------------------------------------

SWARM_CLONES void encode_f16(const float* __restrict src, int64_t n, uint16_t* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
SWARM_CLONES void decode_f16(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
SWARM_CLONES void encode_bf16(const float* __restrict src, int64_t n, uint16_t* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
SWARM_CLONES void decode_bf16(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = u2f(uint32_t(src[i]) << 16);
}

// The wire is little-endian; so is every machine we build for. Buffers of uint8_t are not
// aligned for uint16_t/float, so the float codecs go through aligned scratch when they are not.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire format is little-endian");

template <typename T>
bool aligned_for(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0;
}

// Runs fn(src_chunk, count, dst_chunk) over n elements, bouncing through aligned scratch
// where src or dst is not aligned for its type (rare: tensor frames are aligned in practice).
template <typename In, typename Out, typename Fn>
void convert(const void* src, int64_t n, void* dst, Fn fn) {
  if (aligned_for<In>(src) && aligned_for<Out>(dst)) {
    fn(static_cast<const In*>(src), n, static_cast<Out*>(dst));
    return;
  }
  constexpr int64_t kChunk = 4096;
  In in[kChunk];
  Out out[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    std::memcpy(in, static_cast<const uint8_t*>(src) + i * sizeof(In), m * sizeof(In));
    fn(in, m, out);
    std::memcpy(static_cast<uint8_t*>(dst) + i * sizeof(Out), out, m * sizeof(Out));
  }
}

// ---- int8 / int4 blockwise absmax --------------------------------------------------------

// Largest |x| of the block as fp32 bits (0x7f800000 and above: Inf or NaN present). Comparing
// the bits of |x| as integers orders finite values like floats, and puts NaN above Inf.
SWARM_CLONES uint32_t absmax_bits(const float* __restrict x, int len) {
  uint32_t m = 0;
  for (int i = 0; i < len; ++i) {
    const uint32_t a = f2u(x[i]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m;
}

// q = clamp(round_half_even(x * inv), -L, L). The magic add rounds to an integer for
// |y| < 2^22, and |y| <= L * (1 + 2^-23) here.
template <int L>
SWARM_CLONES void quantize(const float* __restrict x, int len, float inv, int8_t* __restrict q) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  for (int i = 0; i < len; ++i) {
    float r = (x[i] * inv + kMagic) - kMagic;
    r = r < -float(L) ? -float(L) : r;
    r = r > float(L) ? float(L) : r;
    q[i] = int8_t(int32_t(r));
  }
}

template <int L>
void quantize_exact(const float* x, int len, float s, int8_t* q) {
  for (int i = 0; i < len; ++i) {
    double r = std::nearbyint(double(x[i]) * double(L) / double(s));
    r = std::min(std::max(r, -double(L)), double(L));
    q[i] = int8_t(r);
  }
}

SWARM_CLONES void dequantize(const int8_t* __restrict q, int len, float step,
                             float* __restrict out) {
  for (int i = 0; i < len; ++i) out[i] = float(q[i]) * step;
}

template <int L>
void dequantize_exact(const int8_t* q, int len, float s, float* out) {
  for (int i = 0; i < len; ++i) out[i] = float(double(q[i]) * double(s) / double(L));
}

// Quantises one block to levels -L..L and returns its stored scale bits (fp32, or fp16 in the
// low 16 bits). Blocks holding NaN/Inf store a NaN scale and zeros: they decode to all NaN.
template <int L>
uint32_t quantize_block(const float* x, int len, bool fp16_scale, int8_t* q) {
  const uint32_t mbits = absmax_bits(x, len);
  float s;
  uint32_t stored;
  if (mbits >= 0x7f800000u) {
    std::memset(q, 0, len);
    return fp16_scale ? 0x7e00u : 0x7fc00000u;
  }
  if (fp16_scale) {
    stored = f16_ceil(u2f(mbits));
    s = f16_to_f32(uint16_t(stored));
    if (stored == 0x7c00u) {  // absmax above 65504: not representable with an fp16 scale
      std::memset(q, 0, len);
      return stored;
    }
  } else {
    stored = mbits;
    s = u2f(mbits);
  }
  if (s == 0.0f) {
    std::memset(q, 0, len);
  } else if (exact_path(s)) {
    quantize_exact<L>(x, len, s, q);
  } else {
    quantize<L>(x, len, float(L) / s, q);
  }
  return stored;
}

// Stored scale of block b as float; throws on a negative one (no encoder writes it).
inline float load_scale(const uint8_t* scales, int64_t b, bool fp16_scale) {
  uint32_t bits;
  if (fp16_scale) {
    uint16_t h;
    std::memcpy(&h, scales + 2 * b, 2);
    if (h & 0x8000u) fail("malformed int8/int4 encoding: block " + std::to_string(b) +
                          " has a negative scale (sign bit set)");
    return f16_to_f32(h);
  }
  std::memcpy(&bits, scales + 4 * b, 4);
  if (bits & 0x80000000u) fail("malformed int8/int4 encoding: block " + std::to_string(b) +
                               " has a negative scale (sign bit set)");
  return u2f(bits);
}

template <int L>
void dequantize_block(const int8_t* q, int len, float s, float* out) {
  if (!(s <= std::numeric_limits<float>::max())) {  // NaN or +Inf scale
    std::fill(out, out + len, std::numeric_limits<float>::quiet_NaN());
  } else if (exact_path(s)) {
    dequantize_exact<L>(q, len, s, out);
  } else {
    dequantize(q, len, s / float(L), out);
  }
}

inline void store_scale(uint8_t* scales, int64_t b, bool fp16_scale, uint32_t bits) {
  if (fp16_scale) {
    const uint16_t h = uint16_t(bits);
    std::memcpy(scales + 2 * b, &h, 2);
  } else {
    std::memcpy(scales + 4 * b, &bits, 4);
  }
}


void encode_int8(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  const int64_t nb = layout::blocks(n, spec.block);
  int8_t* q = reinterpret_cast<int8_t*>(dst + nb * layout::scale_bytes(spec));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = b * spec.block;
    const int len = int(std::min<int64_t>(spec.block, n - at));
    store_scale(dst, b, spec.fp16_scales, quantize_block<127>(src + at, len, spec.fp16_scales, q + at));
  }
}

SWARM_CLONES bool any_int8_min(const int8_t* __restrict q, int64_t n) {
  uint8_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= uint8_t(q[i] == -128);
  return bad != 0;
}

void decode_int8(const CodecSpec& spec, const uint8_t* src, int64_t n, float* dst) {
  const int64_t nb = layout::blocks(n, spec.block);
  const int8_t* q = reinterpret_cast<const int8_t*>(src + nb * layout::scale_bytes(spec));
  if (any_int8_min(q, n)) fail("malformed int8 encoding: a value byte is -128 (levels are -127..127)");
  for (int64_t b = 0; b < nb; ++b) load_scale(src, b, spec.fp16_scales);  // validate first
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = b * spec.block;
    const int len = int(std::min<int64_t>(spec.block, n - at));
    dequantize_block<127>(q + at, len, load_scale(src, b, spec.fp16_scales), dst + at);
  }
}

// Element i of the int4 stream lives in byte i/2: low nibble for even i, high for odd, as a
// 4-bit two's complement value in -7..7.
SWARM_CLONES void pack_nibbles(const int8_t* __restrict q, int64_t pairs, uint8_t* __restrict out) {
  for (int64_t j = 0; j < pairs; ++j)
    out[j] = uint8_t((uint8_t(q[2 * j]) & 0x0fu) | (uint8_t(q[2 * j + 1]) << 4));
}
SWARM_CLONES bool unpack_nibbles(const uint8_t* __restrict in, int64_t pairs, int8_t* __restrict q) {
  uint8_t bad = 0;
  for (int64_t j = 0; j < pairs; ++j) {
    const uint8_t b = in[j];
    bad |= uint8_t((b & 0x0fu) == 0x08u) | uint8_t((b & 0xf0u) == 0x80u);
    q[2 * j] = int8_t(uint8_t(b << 4)) >> 4;
    q[2 * j + 1] = int8_t(b) >> 4;
  }
  return bad != 0;
}

int int4_chunk_blocks(int block) { return std::max(2, (kInt4Chunk / block) & ~1); }

void encode_int4(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  const int64_t nb = layout::blocks(n, spec.block);
  uint8_t* packed = dst + nb * layout::scale_bytes(spec);
  const int cb = int4_chunk_blocks(spec.block);
  int8_t q[kInt4Chunk];
  for (int64_t b0 = 0; b0 < nb; b0 += cb) {
    const int64_t at0 = b0 * spec.block;
    const int64_t b1 = std::min<int64_t>(nb, b0 + cb);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t at = b * spec.block;
      const int len = int(std::min<int64_t>(spec.block, n - at));
      store_scale(dst, b, spec.fp16_scales,
                  quantize_block<7>(src + at, len, spec.fp16_scales, q + (at - at0)));
    }
    const int64_t m = std::min<int64_t>(n, b1 * spec.block) - at0;  // even unless last chunk
    pack_nibbles(q, m / 2, packed + at0 / 2);
    if (m % 2) packed[(at0 + m) / 2] = uint8_t(q[m - 1]) & 0x0fu;
  }
}

void decode_int4(const CodecSpec& spec, const uint8_t* src, int64_t n, float* dst) {
  const int64_t nb = layout::blocks(n, spec.block);
  const uint8_t* packed = src + nb * layout::scale_bytes(spec);
  for (int64_t b = 0; b < nb; ++b) load_scale(src, b, spec.fp16_scales);  // validate first
  if (n % 2) {
    const uint8_t last = packed[n / 2];
    if (last & 0xf0u) fail("malformed int4 encoding: the padding nibble after the last value is not 0");
  }
  const int cb = int4_chunk_blocks(spec.block);
  int8_t q[kInt4Chunk];
  for (int64_t b0 = 0; b0 < nb; b0 += cb) {
    const int64_t at0 = b0 * spec.block;
    const int64_t b1 = std::min<int64_t>(nb, b0 + cb);
    const int64_t m = std::min<int64_t>(n, b1 * spec.block) - at0;
    bool bad = unpack_nibbles(packed + at0 / 2, m / 2, q);
    if (m % 2) {
      const uint8_t lo = packed[(at0 + m) / 2] & 0x0fu;
      bad |= lo == 0x08u;
      q[m - 1] = int8_t(uint8_t(lo << 4)) >> 4;
    }
    if (bad) fail("malformed int4 encoding: a value nibble is -8 (levels are -7..7)");
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t at = b * spec.block;
      const int len = int(std::min<int64_t>(spec.block, n - at));
      dequantize_block<7>(q + (at - at0), len, load_scale(src, b, spec.fp16_scales), dst + at);
    }
  }
}

// ---- topk ---------------------------------------------------------------------------------

void encode_topk(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  const int64_t total = layout::topk_total(spec, n);
  uint8_t* idx_out = dst;                // [total] uint16 index within block
  uint8_t* val_out = dst + 2 * total;    // [total] fp32 value
  std::vector<uint64_t> keys(spec.block);
  std::vector<uint16_t> idx(spec.block);
  int64_t at_k = 0;
  for (int64_t at = 0; at < n; at += spec.block) {
    const int len = int(std::min<int64_t>(spec.block, n - at));
    const int k = layout::topk_keep(spec.fraction, len);
    // Larger key = larger |x| (NaN > Inf > finite), then lower index.
    for (int i = 0; i < len; ++i)
      keys[i] = (uint64_t(f2u(src[at + i]) & 0x7fffffffu) << 32) | uint32_t(0xffffffffu - i);
    if (k < len)
      std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.begin() + len,
                       std::greater<uint64_t>());
    for (int j = 0; j < k; ++j) idx[j] = uint16_t(0xffffffffu - uint32_t(keys[j]));
    std::sort(idx.begin(), idx.begin() + k);
    for (int j = 0; j < k; ++j) {
      std::memcpy(idx_out + 2 * (at_k + j), &idx[j], 2);
      std::memcpy(val_out + 4 * (at_k + j), &src[at + idx[j]], 4);
    }
    at_k += k;
  }
}

void decode_topk(const CodecSpec& spec, const uint8_t* src, int64_t n, float* dst) {
  const int64_t total = layout::topk_total(spec, n);
  const uint8_t* idx_in = src;
  const uint8_t* val_in = src + 2 * total;
  // Validate every index before writing anything.
  int64_t at_k = 0;
  for (int64_t at = 0; at < n; at += spec.block) {
    const int len = int(std::min<int64_t>(spec.block, n - at));
    const int k = layout::topk_keep(spec.fraction, len);
    int prev = -1;
    for (int j = 0; j < k; ++j) {
      uint16_t i;
      std::memcpy(&i, idx_in + 2 * (at_k + j), 2);
      if (int(i) >= len || int(i) <= prev)
        fail("malformed topk encoding: block " + std::to_string(at / spec.block) + " index " +
             std::to_string(i) + (int(i) >= len ? " is out of range (block has " + std::to_string(len) + " values)"
                                                : " is not above the previous one (indices must be strictly increasing)"));
      prev = i;
    }
    at_k += k;
  }
  std::fill(dst, dst + n, 0.0f);
  at_k = 0;
  for (int64_t at = 0; at < n; at += spec.block) {
    const int k = layout::topk_keep(spec.fraction, int(std::min<int64_t>(spec.block, n - at)));
    for (int j = 0; j < k; ++j) {
      uint16_t i;
      std::memcpy(&i, idx_in + 2 * (at_k + j), 2);
      std::memcpy(&dst[at + i], val_in + 4 * (at_k + j), 4);
    }
    at_k += k;
  }
}

}  // namespace

// ---- public API -----------------------------------------------------------------------------

namespace {
[[noreturn]] void not_for_subspace(const CodecSpec& spec) {
  fail("codec " + spec.name() + ": a subspace payload holds coefficients in the model's basis; "
       "encode_subspace/decode_subspace (compression/subspace.h) write and read it");
}
}  // namespace

void encode(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  validate(spec);
  layout::check_count(n);
  if (n == 0) return;
  switch (spec.codec) {
    case Codec::kFp32: std::memcpy(dst, src, 4 * size_t(n)); return;
    case Codec::kFp16: convert<float, uint16_t>(src, n, dst, encode_f16); return;
    case Codec::kBf16: convert<float, uint16_t>(src, n, dst, encode_bf16); return;
    case Codec::kInt8: encode_int8(spec, src, n, dst); return;
    case Codec::kInt4: encode_int4(spec, src, n, dst); return;
    case Codec::kTopk: encode_topk(spec, src, n, dst); return;
    case Codec::kSubspace: not_for_subspace(spec);
  }
}

void decode(const CodecSpec& spec, const uint8_t* src, size_t nbytes, int64_t n, float* dst) {
  const size_t want = encoded_bytes(spec, n);
  if (nbytes != want)
    fail("codec " + spec.name() + ": " + std::to_string(n) + " values need " + std::to_string(want) +
         " encoded bytes, got " + std::to_string(nbytes));
  if (n == 0) return;
  switch (spec.codec) {
    case Codec::kFp32: std::memcpy(dst, src, 4 * size_t(n)); return;
    case Codec::kFp16: convert<uint16_t, float>(src, n, dst, decode_f16); return;
    case Codec::kBf16: convert<uint16_t, float>(src, n, dst, decode_bf16); return;
    case Codec::kInt8: decode_int8(spec, src, n, dst); return;
    case Codec::kInt4: decode_int4(spec, src, n, dst); return;
    case Codec::kTopk: decode_topk(spec, src, n, dst); return;
    case Codec::kSubspace: not_for_subspace(spec);
  }
}

// ---- ErrorFeedback --------------------------------------------------------------------------

void ErrorFeedback::encode(const std::string& key, const CodecSpec& spec, const float* src,
                           int64_t n, uint8_t* dst) {
  encode_parts(key, spec, src, n, {0, n}, {dst});
}

void ErrorFeedback::encode_parts(const std::string& key, const CodecSpec& spec, const float* src, int64_t n,
                                 const std::vector<int64_t>& bounds, const std::vector<uint8_t*>& dst) {
  layout::check_count(n);
  if (bounds.size() != dst.size() + 1 || bounds.front() != 0 || bounds.back() != n)
    fail("error feedback: parts must cover the tensor, with one destination each");
  for (size_t i = 0; i + 1 < bounds.size(); ++i)
    if (bounds[i] > bounds[i + 1]) fail("error feedback: part bounds must not decrease");
  std::vector<float>& res = residual_[key];
  if (res.empty() && n > 0) res.assign(size_t(n), 0.0f);
  if (int64_t(res.size()) != n)
    fail("error feedback: key \"" + key + "\" carries a residual of " +
         std::to_string(res.size()) + " values but this tensor has " + std::to_string(n) +
         "; call reset(key) when a tensor's size changes");
  sum_.resize(size_t(n));
  decoded_.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) sum_[i] = src[i] + res[i];
  for (size_t k = 0; k < dst.size(); ++k) {
    const int64_t lo = bounds[k], len = bounds[k + 1] - bounds[k];
    swarm::compression::encode(spec, sum_.data() + lo, len, dst[k]);
    decode(spec, dst[k], encoded_bytes(spec, len), len, decoded_.data() + lo);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float r = sum_[i] - decoded_[i];
    res[i] = (f2u(r) & 0x7fffffffu) < 0x7f800000u ? r : 0.0f;
  }
}

const std::vector<float>* ErrorFeedback::residual(const std::string& key) const {
  const auto it = residual_.find(key);
  return it == residual_.end() ? nullptr : &it->second;
}

void ErrorFeedback::reset() { residual_.clear(); }
void ErrorFeedback::reset(const std::string& key) { residual_.erase(key); }

}  // namespace swarm::compression
