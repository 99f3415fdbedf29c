// test_codec.cpp: tests for compression/codec.h: the text form, exact sizes, every codec's
// error bound and special values (zero, tiny, subnormal, huge, NaN/Inf, ragged blocks,
// unaligned and strided input), the wire layouts of docs/compression.md, topk selection,
// ErrorFeedback's mass conservation, and rejection of malformed encodings (fuzzed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "runtime/errors.h"

namespace swarm::compression {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint8_t> enc(const CodecSpec& s, const std::vector<float>& x) {
  std::vector<uint8_t> out(encoded_bytes(s, int64_t(x.size())));
  encode(s, x.data(), int64_t(x.size()), out.data());
  return out;
}
std::vector<float> dec(const CodecSpec& s, const std::vector<uint8_t>& b, size_t n) {
  std::vector<float> out(n);
  decode(s, b.data(), b.size(), int64_t(n), out.data());
  return out;
}
std::vector<float> roundtrip(const CodecSpec& s, const std::vector<float>& x) {
  return dec(s, enc(s, x), x.size());
}

std::vector<float> normal_data(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

// IEEE half -> float, written independently of codec.cpp (via ldexp).
float half_ref(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  if (e == 0x1f) return m ? kNaN : sign * kInf;
  if (e == 0) return sign * std::ldexp(float(m), -24);
  return sign * std::ldexp(float(m + 1024), e - 25);
}

// Stored scale of block b, read from the wire as docs/compression.md describes it.
float wire_scale(const CodecSpec& s, const std::vector<uint8_t>& w, int64_t b) {
  if (s.fp16_scales) {
    uint16_t h;
    std::memcpy(&h, w.data() + 2 * b, 2);
    return half_ref(h);
  }
  float f;
  std::memcpy(&f, w.data() + 4 * b, 4);
  return f;
}

int levels(const CodecSpec& s) { return s.codec == Codec::kInt8 ? 127 : 7; }

// Checks |x - x'| <= step/2 per element (step = stored scale / L), up to fp32 rounding of the
// step and of the output, and that stored scales cover each block's absmax.
void expect_within_half_step(const CodecSpec& s, const std::vector<float>& x) {
  const auto w = enc(s, x);
  const auto y = dec(s, w, x.size());
  const int L = levels(s);
  for (size_t at = 0, b = 0; at < x.size(); at += s.block, ++b) {
    const size_t end = std::min(x.size(), at + s.block);
    float absmax = 0;
    for (size_t i = at; i < end; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    const float scale = wire_scale(s, w, int64_t(b));
    if (s.fp16_scales) {
      ASSERT_GE(scale, absmax) << s.name() << " block " << b;
    } else {
      ASSERT_EQ(scale, absmax) << s.name() << " block " << b;
    }
    const double step = double(scale) / L;
    const double tol = step / 2 * (1 + 1e-5) + 0x1p-149;
    for (size_t i = at; i < end; ++i)
      ASSERT_LE(std::fabs(double(x[i]) - double(y[i])), tol)
          << s.name() << " n=" << x.size() << " i=" << i << " x=" << x[i] << " y=" << y[i];
  }
}

// ---- text form ---------------------------------------------------------------------------

TEST(ParseCodec, CanonicalNamesRoundTrip) {
  for (const char* t : {"fp32", "fp16", "bf16", "int8:block=64", "int8:block=256,scale=fp16",
                        "int4:block=64", "int4:block=4096,scale=fp16", "int8:block=100",
                        "topk:block=1024,fraction=0.01", "topk:block=64,fraction=1",
                        "topk:block=4096,fraction=1e-05", "topk:block=333,fraction=0.123456789",
                        "fp32:entropy=zstd", "int8:block=1024,scale=fp16,entropy=zstd"}) {
    const CodecSpec s = parse_codec(t);
    EXPECT_EQ(s.name(), t);
    EXPECT_EQ(parse_codec(s.name()), s);
  }
}

TEST(ParseCodec, DefaultsAndAliases) {
  EXPECT_EQ(parse_codec("int8").name(), "int8:block=64");
  EXPECT_EQ(parse_codec("int4").name(), "int4:block=64");
  EXPECT_EQ(parse_codec("int8:block=256,scale=fp32").name(), "int8:block=256");
  EXPECT_EQ(parse_codec("int8:scale=fp16,block=128").name(), "int8:block=128,scale=fp16");
  EXPECT_EQ(parse_codec("topk").name(), "topk:block=1024,fraction=0.01");
  EXPECT_EQ(parse_codec("topk:fraction=0.5").name(), "topk:block=1024,fraction=0.5");
  EXPECT_EQ(parse_codec("int8:entropy=none").name(), "int8:block=64");
  EXPECT_EQ(parse_codec("int8:entropy=zstd,block=128").name(), "int8:block=128,entropy=zstd");
  EXPECT_TRUE(parse_codec("int4:entropy=zstd").zstd);
  EXPECT_FALSE(parse_codec("int4:entropy=zstd") == parse_codec("int4"));
  // Same codes either way: zstd is the wire's business.
  EXPECT_EQ(encoded_bytes(parse_codec("int8:entropy=zstd"), 1000), encoded_bytes(parse_codec("int8"), 1000));
  const CodecSpec s = parse_codec("int8:block=256,scale=fp16");
  EXPECT_EQ(s.codec, Codec::kInt8);
  EXPECT_EQ(s.block, 256);
  EXPECT_TRUE(s.fp16_scales);
  EXPECT_TRUE(parse_codec("fp32").lossless());
  EXPECT_FALSE(parse_codec("bf16").lossless());
}

TEST(ParseCodec, RejectsBadTextWithActionableMessage) {
  const std::string nul("int8\0", 5);
  for (const std::string& t :
       {std::string(""), std::string("int9"), std::string("INT8"), std::string(" int8"),
        std::string("int8:"), std::string("int8:,"), std::string("int8:block=64,"),
        std::string("int8:block=63"), std::string("int8:block=4097"), std::string("int8:block=-64"),
        std::string("int8:block=+64"), std::string("int8:block= 64"), std::string("int8:block=6x"),
        std::string("int8:block=99999999999999999999"), std::string("int8:block=64,block=64"),
        std::string("int8:block"), std::string("int8:=64"), std::string("int8:block="),
        std::string("fp32:block=64"), std::string("bf16:scale=fp16"), std::string("int8:scale=fp8"),
        std::string("int8:fraction=0.1"), std::string("topk:scale=fp16"),
        std::string("topk:fraction=0"), std::string("topk:fraction=1.5"),
        std::string("topk:fraction=-0.1"), std::string("topk:fraction=nan"),
        std::string("topk:fraction=inf"), std::string("topk:fraction=0x1p-3"),
        std::string("topk:fraction=0.1x"), std::string("topk:fraction=0.1,fraction=0.2"),
        std::string(1000, 'a'), std::string("int8:block=64") + std::string(200, ' '), nul}) {
    try {
      parse_codec(t);
      ADD_FAILURE() << "accepted \"" << t << "\"";
    } catch (const CodecError& e) {
      EXPECT_GT(std::strlen(e.what()), 20u) << t;
    }
  }
  try {
    parse_codec("int9");
  } catch (const CodecError& e) {
    EXPECT_NE(std::string(e.what()).find("accepted: fp32, fp16, bf16, int8"), std::string::npos)
        << e.what();
  }
}

TEST(ParseCodec, FuzzedTextOnlyEverThrowsCodecError) {
  std::mt19937_64 rng(7);
  const std::string alphabet = "fpbintkoc13268468:=,.e-+blockscalefractionfp16fp3209\x01\xff ";
  const std::vector<std::string> seeds = {"int8:block=256,scale=fp16", "topk:block=1024,fraction=0.01",
                                          "int4:block=64", "bf16"};
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string t = seeds[rng() % seeds.size()];
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = t.empty() ? 0 : rng() % (t.size() + 1);
      const char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0: t.insert(t.begin() + pos, c); break;
        case 1: if (pos < t.size()) t.erase(pos, 1); break;
        default: if (pos < t.size()) t[pos] = c; break;
      }
    }
    try {
      const CodecSpec s = parse_codec(t);
      ++accepted;
      ASSERT_EQ(parse_codec(s.name()), s) << t;
      ASSERT_NO_THROW(validate(s)) << t;
    } catch (const CodecError&) {
    }
  }
  EXPECT_GT(accepted, 0);
}

TEST(Validate, RejectsHandBuiltSpecs) {
  CodecSpec s;
  s.codec = Codec::kInt8;
  s.block = 0;
  EXPECT_THROW(validate(s), CodecError);
  EXPECT_THROW(encoded_bytes(s, 10), CodecError);
  s.block = 64;
  EXPECT_NO_THROW(validate(s));
  s.fraction = 0.5;
  EXPECT_THROW(validate(s), CodecError);
  CodecSpec f;
  f.codec = Codec::kFp16;
  f.block = 64;
  EXPECT_THROW(validate(f), CodecError);
  CodecSpec t;
  t.codec = Codec::kTopk;
  t.block = 128;
  t.fraction = 0.0;
  EXPECT_THROW(validate(t), CodecError);
  CodecSpec u;
  u.codec = Codec(42);
  EXPECT_THROW(validate(u), CodecError);
}

// ---- sizes --------------------------------------------------------------------------------

TEST(EncodedBytes, ExactForEveryCodec) {
  EXPECT_EQ(encoded_bytes(parse_codec("fp32"), 10), 40u);
  EXPECT_EQ(encoded_bytes(parse_codec("fp16"), 10), 20u);
  EXPECT_EQ(encoded_bytes(parse_codec("bf16"), 10), 20u);
  EXPECT_EQ(encoded_bytes(parse_codec("int8:block=64"), 100), 2 * 4 + 100u);
  EXPECT_EQ(encoded_bytes(parse_codec("int8:block=64,scale=fp16"), 128), 2 * 2 + 128u);
  EXPECT_EQ(encoded_bytes(parse_codec("int4:block=64"), 101), 2 * 4 + 51u);
  EXPECT_EQ(encoded_bytes(parse_codec("int4:block=64,scale=fp16"), 1), 2 + 1u);
  // topk: ceil(0.01 * 1024) = 11 per full block, ceil(0.01 * 100) = 1 for the tail.
  EXPECT_EQ(encoded_bytes(parse_codec("topk:block=1024,fraction=0.01"), 2148), 6 * (2 * 11 + 1u));
  for (const char* c : {"fp32", "int8", "int4", "topk"}) {
    EXPECT_EQ(encoded_bytes(parse_codec(c), 0), 0u);
    EXPECT_THROW(encoded_bytes(parse_codec(c), -1), CodecError);
    float x = 0;
    uint8_t b[64];
    EXPECT_THROW(encode(parse_codec(c), &x, -5, b), CodecError);
    EXPECT_THROW(decode(parse_codec(c), b, 0, -5, &x), CodecError);
  }
  EXPECT_THROW(encoded_bytes(parse_codec("fp32"), int64_t(1) << 60), CodecError);
}

// ---- float codecs ---------------------------------------------------------------------------

uint16_t fp16_bits(float x) {
  uint16_t h;
  encode(parse_codec("fp16"), &x, 1, reinterpret_cast<uint8_t*>(&h));
  return h;
}
uint16_t bf16_bits(float x) {
  uint16_t h;
  encode(parse_codec("bf16"), &x, 1, reinterpret_cast<uint8_t*>(&h));
  return h;
}

TEST(Fp16, KnownValues) {
  EXPECT_EQ(fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(fp16_bits(0.0f), 0x0000);
  EXPECT_EQ(fp16_bits(-0.0f), 0x8000);
  EXPECT_EQ(fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(fp16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(fp16_bits(65520.0f), 0x7c00);  // overflow -> Inf
  EXPECT_EQ(fp16_bits(1e30f), 0x7c00);
  EXPECT_EQ(fp16_bits(-kInf), 0xfc00);
  EXPECT_EQ(fp16_bits(0x1p-24f), 0x0001);
  EXPECT_EQ(fp16_bits(0x1p-25f), 0x0000);      // tie -> even (0)
  EXPECT_EQ(fp16_bits(0x1.8p-24f), 0x0002);    // tie -> even (2)
  EXPECT_EQ(fp16_bits(1.0f + 0x1p-11f), 0x3c00);  // tie -> even
  EXPECT_EQ(fp16_bits(1.0f + 0x3p-11f), 0x3c02);  // tie -> even
  EXPECT_EQ(fp16_bits(1e-30f), 0x0000);
  EXPECT_EQ(fp16_bits(0x1p-14f), 0x0400);  // smallest normal
  const uint16_t n = fp16_bits(kNaN);
  EXPECT_EQ(n & 0x7c00, 0x7c00);
  EXPECT_NE(n & 0x03ff, 0);
  EXPECT_NE(n & 0x0200, 0);  // quiet
  EXPECT_NE(fp16_bits(from_bits(0xff800001u)) & 0x0200, 0);  // signalling -> quiet
  EXPECT_NE(fp16_bits(-kNaN) & 0x8000, 0);
}

TEST(Fp16, EveryHalfRoundTripsExactly) {
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), 0);
  const CodecSpec s = parse_codec("fp16");
  std::vector<float> f(65536);
  decode(s, reinterpret_cast<const uint8_t*>(all.data()), 2 * 65536, 65536, f.data());
  std::vector<uint16_t> back(65536);
  encode(s, f.data(), 65536, reinterpret_cast<uint8_t*>(back.data()));
  for (int h = 0; h < 65536; ++h) {
    const float r = half_ref(uint16_t(h));
    if (std::isnan(r)) {
      ASSERT_TRUE(std::isnan(f[h])) << h;
      ASSERT_EQ(back[h] & 0x7c00, 0x7c00);
      ASSERT_NE(back[h] & 0x03ff, 0);
    } else {
      ASSERT_EQ(bits(f[h]), bits(r)) << h;
      ASSERT_EQ(back[h], h);
    }
  }
}

TEST(Fp16, RandomFloatsRoundToNearestEven) {
  std::mt19937 rng(3);
  std::vector<float> x(50000);
  for (auto& v : x) {
    do v = from_bits((uint32_t(rng()) & 0xc7ffffffu) | (uint32_t(rng()) & 0x30000000u));  // |x| < ~2^17
    while (std::isnan(v));
  }
  const CodecSpec s = parse_codec("fp16");
  const auto w = enc(s, x);
  for (size_t i = 0; i < x.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, w.data() + 2 * i, 2);
#ifdef __FLT16_MAX__
    const _Float16 ref = static_cast<_Float16>(x[i]);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    ASSERT_EQ(h, rb) << x[i];
#else
    const double d = half_ref(h);
    if (std::isinf(d)) continue;
    const double ulp = std::fabs(d) < 0x1p-14 ? 0x1p-24 : std::ldexp(1.0, std::ilogb(d) - 10);
    ASSERT_LE(std::fabs(d - x[i]), ulp / 2) << x[i];
#endif
  }
}

TEST(Bf16, KnownValuesAndRounding) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits(1.0f + 0x1p-8f), 0x3f80);   // tie -> even
  EXPECT_EQ(bf16_bits(1.0f + 0x3p-8f), 0x3f82);   // tie -> even
  EXPECT_EQ(bf16_bits(1.0f + 0x1.8p-8f), 0x3f81); // above the tie
  EXPECT_EQ(bf16_bits(kInf), 0x7f80);
  EXPECT_EQ(bf16_bits(-kInf), 0xff80);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds to Inf (IEEE)
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(bf16_bits(from_bits(0x00000001u)), 0x0000);  // smallest subnormal rounds to 0
  EXPECT_EQ(bf16_bits(from_bits(0x00018000u)), 0x0002);  // subnormal tie -> even
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu}) {
    const uint16_t h = bf16_bits(from_bits(nan));
    EXPECT_TRUE(std::isnan(from_bits(uint32_t(h) << 16))) << std::hex << nan;
    EXPECT_NE(h & 0x40, 0) << "quiet";
    EXPECT_EQ(h & 0x8000, (nan >> 16) & 0x8000) << "sign kept";
  }
}

TEST(Bf16, EveryBf16RoundTripsAndRandomIsNearest) {
  std::vector<float> all(65536);
  for (uint32_t h = 0; h < 65536; ++h) all[h] = from_bits(h << 16);
  const auto y = roundtrip(parse_codec("bf16"), all);
  for (uint32_t h = 0; h < 65536; ++h) {
    if (std::isnan(all[h])) {
      ASSERT_TRUE(std::isnan(y[h]));
    } else {
      ASSERT_EQ(bits(y[h]), h << 16);
    }
  }
  std::mt19937 rng(5);
  std::vector<float> x(50000);
  for (auto& v : x) {
    do v = from_bits(uint32_t(rng()));
    while (!std::isfinite(v) || std::fabs(v) > 1e38f);
  }
  const auto z = roundtrip(parse_codec("bf16"), x);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t lo = bits(x[i]) & 0xffff0000u;  // truncation toward zero
    const double a = std::fabs(double(from_bits(lo))), b = std::fabs(double(from_bits(lo + 0x10000u)));
    const double ax = std::fabs(double(x[i])), az = std::fabs(double(z[i]));
    const double want = (ax - a < b - ax) ? a : (ax - a > b - ax) ? b : ((lo >> 16) & 1 ? b : a);
    ASSERT_EQ(az, want) << x[i];
  }
}

TEST(FloatCodecs, UnalignedBuffersGiveTheSameBytes) {
  const auto x = normal_data(10007, 11);
  for (const char* c : {"fp32", "fp16", "bf16"}) {
    const CodecSpec s = parse_codec(c);
    const auto ref = enc(s, x);
    std::vector<uint8_t> buf(ref.size() + 3);
    encode(s, x.data(), int64_t(x.size()), buf.data() + 1);
    ASSERT_EQ(0, std::memcmp(buf.data() + 1, ref.data(), ref.size())) << c;
    std::vector<float> y(x.size() + 1);
    std::vector<uint8_t> fbytes((x.size() + 1) * 4);
    decode(s, buf.data() + 1, ref.size(), int64_t(x.size()), y.data());
    const auto want = dec(s, ref, x.size());
    ASSERT_EQ(0, std::memcmp(y.data(), want.data(), 4 * x.size())) << c;
    // Unaligned float destination.
    float* dst = reinterpret_cast<float*>(fbytes.data() + 2);
    decode(s, ref.data(), ref.size(), int64_t(x.size()), dst);
    ASSERT_EQ(0, std::memcmp(dst, want.data(), 4 * x.size())) << c;
  }
}

TEST(FloatCodecs, Fp32IsExactAndHalfCodecsBoundError) {
  auto x = normal_data(5000, 12);
  x.push_back(1e-30f);
  x.push_back(1e30f);
  x.push_back(from_bits(1));
  const auto y = roundtrip(parse_codec("fp32"), x);
  ASSERT_EQ(0, std::memcmp(x.data(), y.data(), 4 * x.size()));
  const auto b = roundtrip(parse_codec("bf16"), x);
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_LE(std::fabs(x[i] - b[i]), std::fabs(x[i]) * 0x1p-8f + 0x1p-133f) << i;
}

// ---- int8 / int4 --------------------------------------------------------------------------

std::vector<std::string> quant_specs() {
  std::vector<std::string> out;
  for (const char* base : {"int8", "int4"})
    for (int block : {64, 100, 4096})
      for (const char* scale : {"", ",scale=fp16"})
        out.push_back(std::string(base) + ":block=" + std::to_string(block) + scale);
  return out;
}

TEST(Quantized, ErrorAtMostHalfStepRaggedSizes) {
  for (const auto& name : quant_specs()) {
    const CodecSpec s = parse_codec(name);
    const int B = s.block;
    for (int64_t n : {int64_t(1), int64_t(2), int64_t(B - 1), int64_t(B), int64_t(B + 1),
                      int64_t(3 * B + 7)}) {
      auto x = normal_data(size_t(n), uint64_t(n) * 31 + B, 2.0f);
      if (n > 10) x[5] = 40.0f;  // an outlier
      expect_within_half_step(s, x);
    }
  }
}

TEST(Quantized, ExactlyRepresentableValuesRoundTripExactly) {
  for (const auto& name : quant_specs()) {
    const CodecSpec s = parse_codec(name);
    const int L = levels(s);
    for (int e : {-3, 0, 5}) {
      // Scale L * 2^e: the step is 2^e, and q * 2^e is exact in fp32 and in fp16 scales.
      std::vector<float> x(size_t(2 * s.block + 3));
      std::mt19937 rng(uint32_t(e + 100));
      for (size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(float(int(rng() % (2 * L + 1)) - L), e);
      for (size_t at = 0; at < x.size(); at += s.block) x[at] = std::ldexp(float(L), e);  // absmax
      const auto y = roundtrip(s, x);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], y[i]) << name << " e=" << e << " i=" << i;
    }
  }
}

TEST(Quantized, ZeroTinySubnormalAndHugeBlocks) {
  for (const auto& name : quant_specs()) {
    const CodecSpec s = parse_codec(name);
    const size_t n = size_t(3 * s.block + 7);
    // All zero (with a negative zero): exact, no NaN.
    std::vector<float> z(n, 0.0f);
    z[1] = -0.0f;
    const auto zy = roundtrip(s, z);
    for (float v : zy) ASSERT_EQ(v, 0.0f) << name;
    for (float scale : {1e-30f, 1e-38f, 1e-40f, 1e-45f, 1e-20f, 1e30f, 5e37f}) {
      auto x = normal_data(n, 77, 1.0f);
      for (auto& v : x) v *= scale;  // for tiny scales many become subnormal or zero
      x[3] = scale;
      if (s.fp16_scales && scale > 65504.0f) {
        // Documented: a block over 65504 cannot have an fp16 scale; it decodes to NaN.
        const auto y = roundtrip(s, x);
        for (int i = 0; i < s.block; ++i) ASSERT_TRUE(std::isnan(y[i])) << name;
        continue;
      }
      expect_within_half_step(s, x);
    }
    std::vector<float> mx(n, std::numeric_limits<float>::max());
    mx[2] = -std::numeric_limits<float>::max();
    if (!s.fp16_scales) {
      const auto y = roundtrip(s, mx);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(y[i], mx[i]) << name;
    }
  }
}

TEST(Quantized, NonFiniteBlockDecodesAllNaNOthersUntouched) {
  for (const auto& name : quant_specs()) {
    const CodecSpec s = parse_codec(name);
    for (float bad : {kNaN, kInf, -kInf}) {
      auto x = normal_data(size_t(3 * s.block + 7), 5);
      x[size_t(s.block) + 9] = bad;  // block 1
      const auto w = enc(s, x);
      EXPECT_TRUE(std::isnan(wire_scale(s, w, 1))) << name;
      const auto y = dec(s, w, x.size());
      for (int i = 0; i < s.block; ++i) ASSERT_TRUE(std::isnan(y[size_t(s.block + i)])) << name;
      for (int i = 0; i < s.block; ++i) {
        ASSERT_TRUE(std::isfinite(y[size_t(i)]));
        ASSERT_TRUE(std::isfinite(y[size_t(2 * s.block + i)]));
      }
    }
  }
}

TEST(Quantized, StridedInputViaGather) {
  // A non-contiguous view (every other element) is gathered to a contiguous buffer first.
  const auto base = normal_data(2 * 1000 + 1, 9);
  std::vector<float> x;
  for (size_t i = 0; i < base.size(); i += 2) x.push_back(base[i]);
  for (const auto& name : quant_specs()) expect_within_half_step(parse_codec(name), x);
}

TEST(Quantized, ScaleIsFp16RoundedUp) {
  const CodecSpec s = parse_codec("int8:block=64,scale=fp16");
  std::vector<float> x(64, 0.0f);
  x[0] = 1.0f + 0x1p-12f;  // not a half: the scale must round up to 1 + 2^-10
  const auto w = enc(s, x);
  uint16_t h;
  std::memcpy(&h, w.data(), 2);
  EXPECT_EQ(h, 0x3c01);
  x[0] = 1e-9f;  // below the smallest half: the scale is 2^-24
  std::memcpy(&h, enc(s, x).data(), 2);
  EXPECT_EQ(h, 0x0001);
}

TEST(Layout, Int8ScalesThenValues) {
  const CodecSpec s = parse_codec("int8:block=64");
  std::vector<float> x(70, 0.0f);
  x[0] = 127.0f;
  x[1] = -64.0f;
  x[64] = -2.0f;
  x[65] = 1.0f;
  const auto w = enc(s, x);
  ASSERT_EQ(w.size(), 8u + 70u);
  EXPECT_EQ(wire_scale(s, w, 0), 127.0f);
  EXPECT_EQ(wire_scale(s, w, 1), 2.0f);
  EXPECT_EQ(int8_t(w[8]), 127);
  EXPECT_EQ(int8_t(w[9]), -64);
  EXPECT_EQ(int8_t(w[8 + 64]), -127);
  EXPECT_EQ(int8_t(w[8 + 65]), 64);  // 1 * 127/2 = 63.5 -> 64 (half to even)
}

TEST(Layout, Int4NibblesAcrossOddBlocks) {
  const CodecSpec s = parse_codec("int4:block=65,scale=fp16");
  std::vector<float> x(67, 0.0f);
  x[0] = 7.0f;   // q 7 (low nibble of byte 0)
  x[1] = -3.0f;  // q -3 (high nibble of byte 0)
  x[64] = 1.0f;  // q 1, low nibble of byte 32; element 65 (block 1) shares its byte
  x[65] = -7.0f; // block 1 absmax 7: q -7
  x[66] = 7.0f;  // q 7, low nibble of byte 33 (n odd: high nibble is 0 padding)
  const auto w = enc(s, x);
  ASSERT_EQ(w.size(), 2 * 2 + 34u);
  EXPECT_EQ(w[4 + 0], 0xd7);           // 0x7 | (0xd << 4), 0xd = -3
  EXPECT_EQ(w[4 + 32], 0x91);          // 0x1 | (0x9 << 4), 0x9 = -7
  EXPECT_EQ(w[4 + 33], 0x07);
  const auto y = dec(s, w, x.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(x[i], y[i]) << i;
}

TEST(Malformed, QuantizedRejected) {
  for (const auto& name : quant_specs()) {
    const CodecSpec s = parse_codec(name);
    const auto x = normal_data(size_t(2 * s.block + 7), 21);
    auto w = enc(s, x);
    std::vector<float> y(x.size());
    EXPECT_THROW(decode(s, w.data(), w.size() - 1, int64_t(x.size()), y.data()), CodecError);
    EXPECT_THROW(decode(s, w.data(), w.size(), int64_t(x.size()) + 2, y.data()), CodecError);
    const size_t sb = s.fp16_scales ? 2 : 4;
    auto neg = w;
    neg[sb - 1] |= 0x80;  // negative scale in block 0
    EXPECT_THROW(decode(s, neg.data(), neg.size(), int64_t(x.size()), y.data()), CodecError) << name;
    auto lo = w;
    const size_t values = 3 * sb;
    if (s.codec == Codec::kInt8) {
      lo[values + 5] = 0x80;  // -128
    } else {
      lo[values + 5] = 0x18;  // low nibble -8
    }
    EXPECT_THROW(decode(s, lo.data(), lo.size(), int64_t(x.size()), y.data()), CodecError) << name;
    if (s.codec == Codec::kInt4) {
      auto pad = w;
      pad.back() |= 0x10;  // n is odd: the high nibble of the last byte must be 0
      EXPECT_THROW(decode(s, pad.data(), pad.size(), int64_t(x.size()), y.data()), CodecError);
    }
  }
}

// ---- topk ---------------------------------------------------------------------------------

// Reference: indices of the k largest |x| in [at, at+len), ties to the lower index, ascending.
std::vector<int> topk_ref(const std::vector<float>& x, size_t at, int len, int k) {
  std::vector<int> idx(static_cast<size_t>(len));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
    const float fa = std::fabs(x[at + size_t(a)]), fb = std::fabs(x[at + size_t(b)]);
    if (std::isnan(fa) != std::isnan(fb)) return std::isnan(fa);
    return fa > fb;
  });
  idx.resize(size_t(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(Topk, KeepsExactlyTheLargestPerBlock) {
  for (const char* name : {"topk:block=1024,fraction=0.01", "topk:block=64,fraction=0.25",
                           "topk:block=100,fraction=0.1", "topk:block=64,fraction=1"}) {
    const CodecSpec s = parse_codec(name);
    for (int64_t n : {int64_t(1), int64_t(s.block - 1), int64_t(s.block + 1), int64_t(3 * s.block + 7)}) {
      auto x = normal_data(size_t(n), uint64_t(n) + 1);
      for (size_t i = 0; i < x.size(); i += 7) x[i] = std::round(x[i]);  // ties
      if (n > 20) x[20] = -kInf;
      const auto w = enc(s, x);
      const auto y = dec(s, w, x.size());
      int64_t total = 0;
      for (size_t at = 0; at < x.size(); at += size_t(s.block)) {
        const int len = int(std::min<size_t>(size_t(s.block), x.size() - at));
        const int k = std::min(len, std::max(1, int(std::ceil(s.fraction * len))));
        total += k;
        const auto keep = topk_ref(x, at, len, k);
        std::vector<bool> kept(size_t(len), false);
        for (int i : keep) kept[size_t(i)] = true;
        for (int i = 0; i < len; ++i) {
          if (kept[size_t(i)]) {
            ASSERT_EQ(bits(y[at + size_t(i)]), bits(x[at + size_t(i)])) << name << " n=" << n << " i=" << at + i;
          } else {
            ASSERT_EQ(y[at + size_t(i)], 0.0f) << name << " n=" << n << " i=" << at + i;
          }
        }
      }
      ASSERT_EQ(w.size(), size_t(6 * total));
    }
  }
}

TEST(Topk, TiesGoToLowerIndexAndNaNIsKept) {
  const CodecSpec s = parse_codec("topk:block=64,fraction=0.05");  // k = 4
  std::vector<float> x(64, 1.0f);
  auto y = roundtrip(s, x);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(y[size_t(i)], i < 4 ? 1.0f : 0.0f) << i;
  x[50] = kNaN;
  x[60] = -5.0f;
  const auto w = enc(s, x);
  uint16_t idx[4];
  std::memcpy(idx, w.data(), 8);
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 1);
  EXPECT_EQ(idx[2], 50);
  EXPECT_EQ(idx[3], 60);
  y = dec(s, w, 64);
  EXPECT_TRUE(std::isnan(y[50]));
  EXPECT_EQ(y[60], -5.0f);
}

TEST(Malformed, TopkIndicesRejected) {
  const CodecSpec s = parse_codec("topk:block=64,fraction=0.1");  // k = 7
  const auto x = normal_data(64 + 10, 3);                           // tail of 10: k = 1
  const auto w = enc(s, x);
  ASSERT_EQ(w.size(), 6u * 8u);
  std::vector<float> y(x.size());
  auto set_idx = [](std::vector<uint8_t> b, int j, uint16_t v) {
    std::memcpy(b.data() + 2 * j, &v, 2);
    return b;
  };
  EXPECT_THROW(decode(s, set_idx(w, 6, 64).data(), w.size(), 74, y.data()), CodecError);  // out of block
  EXPECT_THROW(decode(s, set_idx(w, 7, 10).data(), w.size(), 74, y.data()), CodecError);  // tail has 10
  uint16_t i0;
  std::memcpy(&i0, w.data(), 2);
  EXPECT_THROW(decode(s, set_idx(w, 1, i0).data(), w.size(), 74, y.data()), CodecError);  // repeat
  auto swapped = w;
  std::swap_ranges(swapped.begin(), swapped.begin() + 2, swapped.begin() + 2);
  EXPECT_THROW(decode(s, swapped.data(), w.size(), 74, y.data()), CodecError);  // decreasing
  EXPECT_NO_THROW(decode(s, set_idx(w, 7, 9).data(), w.size(), 74, y.data()));
  EXPECT_THROW(decode(s, w.data(), w.size() + 6, 74, y.data()), CodecError);
}

// ---- fuzz ---------------------------------------------------------------------------------

TEST(Malformed, RandomBytesNeverCrash) {
  std::mt19937_64 rng(99);
  const std::vector<std::string> names = {"fp32", "fp16", "bf16", "int8:block=64", "int8:block=100,scale=fp16",
                                          "int4:block=64", "int4:block=65,scale=fp16",
                                          "topk:block=64,fraction=0.1", "topk:block=1024,fraction=0.01"};
  int decoded = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const CodecSpec s = parse_codec(names[rng() % names.size()]);
    const int64_t n = int64_t(rng() % 700);
    size_t nbytes = encoded_bytes(s, n);
    if (rng() % 8 == 0) nbytes = size_t(rng() % (nbytes + 10));  // usually the right size
    std::vector<uint8_t> b(nbytes);
    if (rng() % 2 && nbytes == encoded_bytes(s, n)) {  // mutate a valid encoding
      const auto x = normal_data(size_t(n), rng());
      encode(s, x.data(), n, b.data());
      for (int m = 0; m < 3 && !b.empty(); ++m) b[rng() % b.size()] ^= uint8_t(1u << (rng() % 8));
    } else {
      for (auto& v : b) v = uint8_t(rng());
    }
    std::vector<float> y(size_t(n) + 1);
    try {
      decode(s, b.data(), b.size(), n, y.data());
      ++decoded;
    } catch (const CodecError&) {
      ++rejected;
    }
  }
  EXPECT_GT(decoded, 0);
  EXPECT_GT(rejected, 0);
}

// ---- error feedback -----------------------------------------------------------------------

TEST(ErrorFeedback, ConservesMassExactly) {
  for (const char* name : {"topk:block=1024,fraction=0.01", "topk:block=64,fraction=0.1",
                           "int8:block=64", "int4:block=128,scale=fp16", "bf16", "fp16", "fp32"}) {
    const CodecSpec s = parse_codec(name);
    ErrorFeedback ef;
    const int64_t n = 3000;
    std::vector<double> total_in(size_t(n), 0.0), total_sent(size_t(n), 0.0);
    std::vector<uint8_t> w(encoded_bytes(s, n));
    std::vector<float> sent(static_cast<size_t>(n));
    for (int round = 0; round < 6; ++round) {
      const auto g = normal_data(size_t(n), uint64_t(round) + 40, 0.01f);
      const std::vector<float> old = ef.residual("w") ? *ef.residual("w") : std::vector<float>(size_t(n), 0.0f);
      ef.encode("w", s, g.data(), n, w.data());
      decode(s, w.data(), w.size(), n, sent.data());
      const auto& res = *ef.residual("w");
      for (int64_t i = 0; i < n; ++i) {
        const float t = g[size_t(i)] + old[size_t(i)];
        ASSERT_EQ(bits(sent[size_t(i)] + res[size_t(i)]), bits(t)) << name << " round " << round << " i " << i;
        total_in[size_t(i)] += g[size_t(i)];
        total_sent[size_t(i)] += sent[size_t(i)];
      }
    }
    // Over rounds, what was sent plus what is still owed equals what came in (up to fp32 adds).
    const auto& res = *ef.residual("w");
    for (int64_t i = 0; i < n; ++i)
      ASSERT_NEAR(total_sent[size_t(i)] + res[size_t(i)], total_in[size_t(i)], 1e-5) << name;
  }
}

TEST(ErrorFeedback, TopkEventuallySendsEverything) {
  const CodecSpec s = parse_codec("topk:block=64,fraction=0.25");
  ErrorFeedback ef;
  const std::vector<float> g = normal_data(64, 1);
  std::vector<uint8_t> w(encoded_bytes(s, 64));
  ef.encode("p", s, g.data(), 64, w.data());
  const std::vector<float> zero(64, 0.0f);
  for (int r = 0; r < 3; ++r) ef.encode("p", s, zero.data(), 64, w.data());  // 4 rounds x 16 = 64
  for (float v : *ef.residual("p")) EXPECT_EQ(v, 0.0f);
}

TEST(ErrorFeedback, KeysResetAndSizeMismatch) {
  const CodecSpec s = parse_codec("int8:block=64");
  ErrorFeedback ef;
  const auto g = normal_data(100, 2);
  std::vector<uint8_t> w(encoded_bytes(s, 100));
  ef.encode("a", s, g.data(), 100, w.data());
  ef.encode("b", s, g.data(), 100, w.data());
  EXPECT_EQ(ef.size(), 2u);
  EXPECT_EQ(ef.residual("zzz"), nullptr);
  EXPECT_THROW(ef.encode("a", s, g.data(), 99, w.data()), CodecError);
  ef.reset("a");
  EXPECT_EQ(ef.residual("a"), nullptr);
  EXPECT_NO_THROW(ef.encode("a", s, g.data(), 99, w.data()));
  ef.reset();
  EXPECT_EQ(ef.size(), 0u);
}

TEST(ErrorFeedback, NonFiniteInputDoesNotPoisonLaterRounds) {
  const CodecSpec s = parse_codec("topk:block=64,fraction=0.1");
  ErrorFeedback ef;
  auto g = normal_data(64, 8);
  g[3] = kNaN;
  g[4] = kInf;
  std::vector<uint8_t> w(encoded_bytes(s, 64));
  ef.encode("p", s, g.data(), 64, w.data());
  for (float v : *ef.residual("p")) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace swarm::compression
