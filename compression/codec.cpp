// codec.cpp: implements compression/codec.h: the codec text form (parse_codec, name), the
// exact encoded sizes, and encode/decode for fp32, fp16, bf16, int8, int4 and topk, plus
// ErrorFeedback. The subspace codec's grammar and sizes are here; its payload is
// compression/subspace.cpp's. Byte layouts, error bounds and NaN/Inf rules: docs/compression.md.
//
// Speed: the hot loops are written so GCC vectorises them for baseline x86-64 (SSE2) with the
// per-file options set in compression/CMakeLists.txt (-O3, no FP contraction; the FP results
// must be bit-identical to the CUDA kernels in compression/cuda/). Where the CPU has AVX2 the
// same loops are cloned for it (target_clones, picked once at load time by the dynamic linker).
#include "compression/codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <system_error>
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

constexpr int kMinBlock = 64;
constexpr int kMaxBlock = 4096;
constexpr int kDefaultBlock = 64;
constexpr int kDefaultTopkBlock = 1024;
constexpr double kDefaultTopkFraction = 0.01;
// n above this is surely a bug or an attack (2^48 floats is 1 PiB); keeps size math in range.
constexpr int64_t kMaxElements = int64_t(1) << 48;
// Outside [kTinyScale, kHugeScale] a stored scale is (de)quantised in double ("exact path"), so
// that 127/scale cannot overflow, the step stays a normal float and q*step cannot round past
// FLT_MAX. Part of the format: the CUDA kernels make the same choice.
constexpr float kTinyScale = 0x1p-96f;
constexpr float kHugeScale = 0x1p100f;
inline bool exact_path(float s) { return s < kTinyScale || s > kHugeScale; }
// int4 is quantised into int8 scratch a chunk at a time (an even number of blocks, so every
// chunk but the last starts and ends on a byte boundary), then packed.
constexpr int kInt4Chunk = 16384;

const char* const kAccepted =
    "accepted: fp32, fp16, bf16, int8[:block=B][,scale=fp32|fp16], "
    "int4[:block=B][,scale=fp32|fp16], topk[:block=B][,fraction=F] with B an integer in "
    "64..4096 (default 64; topk 1024) and 0 < F <= 1 (default 0.01), "
    "subspace:k=K[,coef=fp32|fp16|bf16|int8|int4][,block=B][,scale=fp16] with K coefficients per "
    "token below d_model (activations and their gradients only), any of them with "
    "entropy=zstd (the codes zstd-compressed on the wire); e.g. "
    "\"int8:block=256,scale=fp16\", \"topk:block=1024,fraction=0.01\", \"int8:block=1024,entropy=zstd\", "
    "\"subspace:k=16,coef=int8\"";
// Largest d_model (and so k) the subspace codec takes; a token's coefficients fit one block row.
constexpr int kMaxSubspaceDim = 65536;

[[noreturn]] void fail(const std::string& what) { throw CodecError(what); }

// Text from the network, made safe to put in an error message.
std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 64; ++i) {
    char c = s[i];
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  if (s.size() > 64) out += "...";
  return out;
}

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

int64_t num_blocks(int64_t n, int block) { return (n + block - 1) / block; }
size_t scale_bytes(const CodecSpec& s) { return s.fp16_scales ? 2 : 4; }

void encode_int8(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  const int64_t nb = num_blocks(n, spec.block);
  int8_t* q = reinterpret_cast<int8_t*>(dst + nb * scale_bytes(spec));
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
  const int64_t nb = num_blocks(n, spec.block);
  const int8_t* q = reinterpret_cast<const int8_t*>(src + nb * scale_bytes(spec));
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
  const int64_t nb = num_blocks(n, spec.block);
  uint8_t* packed = dst + nb * scale_bytes(spec);
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
  const int64_t nb = num_blocks(n, spec.block);
  const uint8_t* packed = src + nb * scale_bytes(spec);
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

// Values kept from a block of len values: ceil(fraction * len) in IEEE double, in [1, len].
int topk_k(double fraction, int len) {
  const double k = std::ceil(fraction * double(len));
  return int(std::min<double>(len, std::max(1.0, k)));
}

int64_t topk_total(const CodecSpec& spec, int64_t n) {
  const int64_t full = n / spec.block;
  const int tail = int(n % spec.block);
  return full * topk_k(spec.fraction, spec.block) + (tail ? topk_k(spec.fraction, tail) : 0);
}

void encode_topk(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  const int64_t total = topk_total(spec, n);
  uint8_t* idx_out = dst;                // [total] uint16 index within block
  uint8_t* val_out = dst + 2 * total;    // [total] fp32 value
  std::vector<uint64_t> keys(spec.block);
  std::vector<uint16_t> idx(spec.block);
  int64_t at_k = 0;
  for (int64_t at = 0; at < n; at += spec.block) {
    const int len = int(std::min<int64_t>(spec.block, n - at));
    const int k = topk_k(spec.fraction, len);
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
  const int64_t total = topk_total(spec, n);
  const uint8_t* idx_in = src;
  const uint8_t* val_in = src + 2 * total;
  // Validate every index before writing anything.
  int64_t at_k = 0;
  for (int64_t at = 0; at < n; at += spec.block) {
    const int len = int(std::min<int64_t>(spec.block, n - at));
    const int k = topk_k(spec.fraction, len);
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
    const int k = topk_k(spec.fraction, int(std::min<int64_t>(spec.block, n - at)));
    for (int j = 0; j < k; ++j) {
      uint16_t i;
      std::memcpy(&i, idx_in + 2 * (at_k + j), 2);
      std::memcpy(&dst[at + i], val_in + 4 * (at_k + j), 4);
    }
    at_k += k;
  }
}

void check_n(int64_t n) {
  if (n < 0) fail("codec: element count " + std::to_string(n) + " is negative");
  if (n > kMaxElements)
    fail("codec: element count " + std::to_string(n) + " is above the limit 2^48");
}

// ---- text form ------------------------------------------------------------------------------

bool parse_int(const std::string& v, int* out) {
  if (v.empty() || v.size() > 6) return false;
  for (char c : v)
    if (c < '0' || c > '9') return false;
  *out = std::stoi(v);
  return true;
}

const char* coef_name(Codec c) {
  switch (c) {
    case Codec::kFp32: return "fp32";
    case Codec::kFp16: return "fp16";
    case Codec::kBf16: return "bf16";
    case Codec::kInt8: return "int8";
    case Codec::kInt4: return "int4";
    default: return nullptr;  // not a coefficient codec
  }
}

bool quantized(Codec c) { return c == Codec::kInt8 || c == Codec::kInt4; }

std::string format_double(double d) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest text that round-trips
  return std::string(buf, r.ptr);
}

}  // namespace

// ---- public API -----------------------------------------------------------------------------

bool CodecSpec::operator==(const CodecSpec& o) const {
  return codec == o.codec && block == o.block && fp16_scales == o.fp16_scales &&
         fraction == o.fraction && zstd == o.zstd && k == o.k && dim == o.dim && coef == o.coef &&
         id_bytes == o.id_bytes;
}

CodecSpec CodecSpec::coefficients() const {
  CodecSpec c;
  c.codec = coef;
  c.block = block;
  c.fp16_scales = fp16_scales;
  return c;
}

std::string CodecSpec::name() const {
  std::string text;
  switch (codec) {
    case Codec::kFp32: text = "fp32"; break;
    case Codec::kFp16: text = "fp16"; break;
    case Codec::kBf16: text = "bf16"; break;
    case Codec::kInt8:
    case Codec::kInt4:
      text = std::string(codec == Codec::kInt8 ? "int8" : "int4") + ":block=" + std::to_string(block) +
             (fp16_scales ? ",scale=fp16" : "");
      break;
    case Codec::kTopk: text = "topk:block=" + std::to_string(block) + ",fraction=" + format_double(fraction); break;
    case Codec::kSubspace: {
      const char* c = coef_name(coef);
      text = "subspace:k=" + std::to_string(k) + ",coef=" + (c ? c : "?");
      if (quantized(coef)) text += ",block=" + std::to_string(block) + (fp16_scales ? ",scale=fp16" : "");
      if (dim) text += ",dim=" + std::to_string(dim);
      if (id_bytes) text += ",ids=u" + std::to_string(8 * id_bytes);
      break;
    }
  }
  if (text.empty()) return "codec(" + std::to_string(int(codec)) + ")";
  if (zstd) text += (text.find(':') == std::string::npos ? ":" : ",") + std::string("entropy=zstd");
  return text;
}

void validate(const CodecSpec& s) {
  const std::string what = "codec spec " + s.name() + ": ";
  if (s.codec != Codec::kSubspace && (s.k != 0 || s.dim != 0 || s.coef != Codec::kFp32 || s.id_bytes != 0))
    fail(what + "k, dim, coef and ids apply to subspace only");
  switch (s.codec) {
    case Codec::kSubspace:
      if (!coef_name(s.coef)) fail(what + "coef must be fp32, fp16, bf16, int8 or int4");
      if (quantized(s.coef) ? (s.block < kMinBlock || s.block > kMaxBlock) : (s.block != 0 || s.fp16_scales))
        fail(what + (quantized(s.coef) ? "block " + std::to_string(s.block) + " is outside 64..4096"
                                       : std::string("block and scale apply to int8/int4 coefficients only")));
      if (s.fraction != 0.0) fail(what + "fraction applies to topk only");
      if (s.dim < 0 || s.dim > kMaxSubspaceDim) fail(what + "dim " + std::to_string(s.dim) + " is outside 1..65536");
      if (s.k < 1 || (s.dim > 0 && s.k >= s.dim) || s.k > kMaxSubspaceDim)
        fail(what + "k " + std::to_string(s.k) + " must be at least 1 and below d_model" +
             (s.dim > 0 ? " (" + std::to_string(s.dim) + ")" : ""));
      if (s.id_bytes != 0 && s.id_bytes != 1 && s.id_bytes != 2 && s.id_bytes != 4)
        fail(what + "ids must take 1, 2 or 4 bytes (u8, u16, u32)");
      return;
    case Codec::kFp32:
    case Codec::kFp16:
    case Codec::kBf16:
      if (s.block != 0 || s.fp16_scales || s.fraction != 0.0)
        fail(what + "float codecs take no block, scale or fraction (leave them 0/false)");
      return;
    case Codec::kInt8:
    case Codec::kInt4:
    case Codec::kTopk:
      if (s.block < kMinBlock || s.block > kMaxBlock)
        fail(what + "block " + std::to_string(s.block) + " is outside 64..4096");
      if (s.codec == Codec::kTopk) {
        if (s.fp16_scales) fail(what + "topk stores fp32 values; scale=fp16 does not apply");
        if (!(s.fraction > 0.0 && s.fraction <= 1.0))
          fail(what + "fraction " + format_double(s.fraction) + " is outside (0, 1]");
      } else if (s.fraction != 0.0) {
        fail(what + "fraction applies to topk only");
      }
      return;
  }
  fail("codec spec: unknown codec id " + std::to_string(int(s.codec)) + "; " + kAccepted);
}

CodecSpec parse_codec(const std::string& text) {
  if (text.size() > kMaxCodecTextBytes)
    fail("codec text is " + std::to_string(text.size()) + " bytes, over the limit of " +
         std::to_string(kMaxCodecTextBytes) + " (\"" + printable(text) + "\"); " + kAccepted);
  const std::string bad = "bad codec \"" + printable(text) + "\": ";
  const size_t colon = text.find(':');
  const std::string base = text.substr(0, colon);
  CodecSpec s;
  if (base == "fp32") s.codec = Codec::kFp32;
  else if (base == "fp16") s.codec = Codec::kFp16;
  else if (base == "bf16") s.codec = Codec::kBf16;
  else if (base == "int8") s.codec = Codec::kInt8;
  else if (base == "int4") s.codec = Codec::kInt4;
  else if (base == "topk") s.codec = Codec::kTopk;
  else if (base == "subspace") s.codec = Codec::kSubspace;
  else fail(bad + "unknown codec \"" + printable(base) + "\"; " + kAccepted);

  const bool quant = s.codec == Codec::kInt8 || s.codec == Codec::kInt4;
  const bool topk = s.codec == Codec::kTopk;
  const bool sub = s.codec == Codec::kSubspace;
  if (quant) s.block = kDefaultBlock;
  if (topk) {
    s.block = kDefaultTopkBlock;
    s.fraction = kDefaultTopkFraction;
  }
  if (sub && colon == std::string::npos) fail(bad + "subspace needs k, the coefficients per token, e.g. \"subspace:k=16\"");
  if (colon == std::string::npos) return s;

  bool seen_block = false, seen_scale = false, seen_fraction = false, seen_entropy = false;
  bool seen_k = false, seen_coef = false, seen_dim = false, seen_ids = false;
  size_t at = colon + 1;
  while (true) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      fail(bad + "parameter \"" + printable(item) + "\" is not key=value; " + kAccepted);
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "entropy") {
      if (seen_entropy) fail(bad + "entropy given twice");
      seen_entropy = true;
      if (value == "zstd") s.zstd = true;
      else if (value != "none") fail(bad + "entropy must be zstd or none, not \"" + printable(value) + "\"");
    } else if (!quant && !topk && !sub) {
      fail(bad + base + " takes no parameters but entropy; " + kAccepted);
    } else if (sub && (key == "k" || key == "dim")) {
      bool& seen = key == "k" ? seen_k : seen_dim;
      if (seen) fail(bad + key + " given twice");
      seen = true;
      int v = 0;
      if (!parse_int(value, &v) || v < 1 || v > kMaxSubspaceDim)
        fail(bad + key + " \"" + printable(value) + "\" is not an integer in 1..65536");
      (key == "k" ? s.k : s.dim) = v;
    } else if (sub && key == "coef") {
      if (seen_coef) fail(bad + "coef given twice");
      seen_coef = true;
      if (value == "fp32") s.coef = Codec::kFp32;
      else if (value == "fp16") s.coef = Codec::kFp16;
      else if (value == "bf16") s.coef = Codec::kBf16;
      else if (value == "int8") s.coef = Codec::kInt8;
      else if (value == "int4") s.coef = Codec::kInt4;
      else fail(bad + "coef must be fp32, fp16, bf16, int8 or int4, not \"" + printable(value) + "\"");
    } else if (sub && key == "ids") {
      if (seen_ids) fail(bad + "ids given twice");
      seen_ids = true;
      if (value == "u8") s.id_bytes = 1;
      else if (value == "u16") s.id_bytes = 2;
      else if (value == "u32") s.id_bytes = 4;
      else fail(bad + "ids must be u8, u16 or u32, not \"" + printable(value) + "\"");
    } else if (key == "block") {
      if (seen_block) fail(bad + "block given twice");
      seen_block = true;
      int b = 0;
      if (!parse_int(value, &b) || b < kMinBlock || b > kMaxBlock)
        fail(bad + "block \"" + printable(value) + "\" is not an integer in 64..4096");
      s.block = b;
    } else if (key == "scale" && (quant || sub)) {
      if (seen_scale) fail(bad + "scale given twice");
      seen_scale = true;
      if (value == "fp16") s.fp16_scales = true;
      else if (value != "fp32") fail(bad + "scale must be fp32 or fp16, not \"" + printable(value) + "\"");
    } else if (key == "fraction" && topk) {
      if (seen_fraction) fail(bad + "fraction given twice");
      seen_fraction = true;
      double f = 0;
      const auto r = std::from_chars(value.data(), value.data() + value.size(), f);
      if (r.ec != std::errc() || r.ptr != value.data() + value.size() || !(f > 0.0 && f <= 1.0))
        fail(bad + "fraction \"" + printable(value) + "\" is not a number in (0, 1]");
      s.fraction = f;
    } else {
      fail(bad + "unknown parameter \"" + printable(key) + "\" for " + base + "; " + kAccepted);
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (sub) {
    if (!seen_k) fail(bad + "subspace needs k, the coefficients per token, e.g. \"subspace:k=16\"");
    if (quantized(s.coef)) {
      if (!seen_block) s.block = kDefaultBlock;
    } else if (seen_block || seen_scale) {
      fail(bad + "block and scale apply to int8/int4 coefficients (coef=int8 or coef=int4)");
    }
    if (s.dim > 0 && s.k >= s.dim) fail(bad + "k " + std::to_string(s.k) + " must be below dim " + std::to_string(s.dim));
  }
  return s;
}

size_t encoded_bytes(const CodecSpec& spec, int64_t n) {
  validate(spec);
  check_n(n);
  const size_t un = size_t(n);
  switch (spec.codec) {
    case Codec::kFp32: return 4 * un;
    case Codec::kFp16:
    case Codec::kBf16: return 2 * un;
    case Codec::kInt8: return size_t(num_blocks(n, spec.block)) * scale_bytes(spec) + un;
    case Codec::kInt4: return size_t(num_blocks(n, spec.block)) * scale_bytes(spec) + (un + 1) / 2;
    case Codec::kTopk: return 6 * size_t(topk_total(spec, n));
    case Codec::kSubspace: {
      if (spec.dim == 0)
        fail("codec " + spec.name() + ": not bound to a model (dim=d_model unknown); a stage server sets it");
      if (n % spec.dim != 0)
        fail("codec " + spec.name() + ": " + std::to_string(n) + " values are not whole tokens of " +
             std::to_string(spec.dim));
      const int64_t tokens = n / spec.dim;
      return size_t(tokens) * size_t(spec.id_bytes) + encoded_bytes(spec.coefficients(), tokens * spec.k);
    }
  }
  return 0;  // unreachable: validate() rejects unknown codecs
}

namespace {
[[noreturn]] void not_for_subspace(const CodecSpec& spec) {
  fail("codec " + spec.name() + ": a subspace payload holds coefficients in the model's basis; "
       "encode_subspace/decode_subspace (compression/subspace.h) write and read it");
}
}  // namespace

void encode(const CodecSpec& spec, const float* src, int64_t n, uint8_t* dst) {
  validate(spec);
  check_n(n);
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
  check_n(n);
  std::vector<float>& res = residual_[key];
  if (res.empty() && n > 0) res.assign(size_t(n), 0.0f);
  if (int64_t(res.size()) != n)
    fail("error feedback: key \"" + printable(key) + "\" carries a residual of " +
         std::to_string(res.size()) + " values but this tensor has " + std::to_string(n) +
         "; call reset(key) when a tensor's size changes");
  sum_.resize(size_t(n));
  decoded_.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) sum_[i] = src[i] + res[i];
  swarm::compression::encode(spec, sum_.data(), n, dst);
  decode(spec, dst, encoded_bytes(spec, n), n, decoded_.data());
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
