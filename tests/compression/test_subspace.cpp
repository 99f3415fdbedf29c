// test_subspace.cpp: tests for compression/subspace.h and the subspace codec's grammar and
// sizes in compression/codec.h: canonical text, the errors a user or a peer gets, the byte
// layout (ids then coefficients), the seeded basis, the job-level checks and the deterministic
// projections.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "compression/subspace.h"
#include "runtime/errors.h"

namespace swarm::compression {
namespace {

std::vector<float> normal(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

std::string error_of(const std::string& text) {
  try {
    parse_codec(text);
  } catch (const CodecError& e) {
    return e.what();
  }
  return "";
}

TEST(SubspaceCodec, TextIsCanonicalAndRoundTrips) {
  EXPECT_EQ(parse_codec("subspace:k=16").name(), "subspace:k=16,coef=fp32");
  EXPECT_EQ(parse_codec("subspace:coef=int8,k=8").name(), "subspace:k=8,coef=int8,block=64");
  EXPECT_EQ(parse_codec("subspace:k=8,coef=int4,block=256,scale=fp16,entropy=zstd").name(),
            "subspace:k=8,coef=int4,block=256,scale=fp16,entropy=zstd");
  EXPECT_EQ(parse_codec("subspace:k=16,coef=bf16,dim=128,ids=u8").name(), "subspace:k=16,coef=bf16,dim=128,ids=u8");
  for (const char* t : {"subspace:k=16,coef=fp32", "subspace:k=8,coef=int8,block=64", "subspace:k=3,coef=fp16,dim=40,ids=u32",
                        "subspace:k=8,coef=int4,block=256,scale=fp16,dim=512,ids=u16,entropy=zstd"}) {
    const CodecSpec s = parse_codec(t);
    EXPECT_EQ(s.name(), t);
    EXPECT_EQ(parse_codec(s.name()), s);
  }
  // Other codecs are unchanged by the new fields.
  EXPECT_EQ(parse_codec("int8").name(), "int8:block=64");
}

TEST(SubspaceCodec, BadTextSaysWhatToFix) {
  EXPECT_NE(error_of("subspace").find("needs k"), std::string::npos);
  EXPECT_NE(error_of("subspace:coef=bf16").find("needs k"), std::string::npos);
  EXPECT_NE(error_of("subspace:k=0").find("1..65536"), std::string::npos);
  EXPECT_NE(error_of("subspace:k=16,coef=int2").find("coef must be"), std::string::npos);
  EXPECT_NE(error_of("subspace:k=16,block=64").find("int8/int4 coefficients"), std::string::npos);
  EXPECT_NE(error_of("subspace:k=16,k=8").find("twice"), std::string::npos);
  EXPECT_NE(error_of("subspace:k=16,dim=16").find("below dim"), std::string::npos);
  EXPECT_NE(error_of("subspace:k=16,ids=u64").find("u8, u16 or u32"), std::string::npos);
  EXPECT_NE(error_of("int8:k=16").find("unknown parameter"), std::string::npos);
  EXPECT_NE(error_of("fp32:k=16").find("no parameters"), std::string::npos);
}

TEST(SubspaceCodec, SizeIsIdsPlusCoefficientCodes) {
  CodecSpec s = parse_codec("subspace:k=16,dim=128,ids=u8");
  EXPECT_EQ(encoded_bytes(s, 8 * 64 * 128), size_t(8 * 64) * (1 + 16 * 4));
  s = parse_codec("subspace:k=16,coef=int8,dim=128");  // a gradient: no ids
  EXPECT_EQ(encoded_bytes(s, 512 * 128), size_t(512 * 16 + (512 * 16 / 64) * 4));
  s = parse_codec("subspace:k=8,coef=bf16,dim=512,ids=u16");
  EXPECT_EQ(encoded_bytes(s, 10 * 512), size_t(10 * (2 + 8 * 2)));
  EXPECT_EQ(encoded_bytes(s, 0), 0u);
  // Not whole tokens, or not bound to a model: a CodecError, before any allocation.
  EXPECT_THROW(encoded_bytes(s, 10 * 512 + 1), CodecError);
  EXPECT_THROW(encoded_bytes(parse_codec("subspace:k=8"), 512), CodecError);
  // The plain encode/decode refuse: the payload is coefficients.
  std::vector<float> x(512);
  std::vector<uint8_t> b(encoded_bytes(s, 512));
  EXPECT_THROW(encode(s, x.data(), 512, b.data()), CodecError);
  EXPECT_THROW(decode(s, b.data(), b.size(), 512, x.data()), CodecError);
}

TEST(SubspaceCodec, PayloadIsIdsThenCoefficientsLittleEndian) {
  const CodecSpec s = parse_codec("subspace:k=2,dim=4,ids=u16");
  const std::vector<float> coef = {1.5f, -2.0f, 0.25f, 3.0f};  // 2 tokens x 2
  const std::vector<int64_t> ids = {0x1234, 7};
  std::vector<uint8_t> b(encoded_bytes(s, 8));
  ASSERT_EQ(b.size(), 2u * 2 + 4u * 4);
  encode_subspace(s, coef.data(), ids.data(), 8, b.data());
  EXPECT_EQ(b[0], 0x34);
  EXPECT_EQ(b[1], 0x12);
  EXPECT_EQ(b[2], 7);
  EXPECT_EQ(b[3], 0);
  float f;
  std::memcpy(&f, &b[4], 4);
  EXPECT_EQ(f, 1.5f);
  std::memcpy(&f, &b[16], 4);
  EXPECT_EQ(f, 3.0f);
  std::vector<float> c2(4);
  std::vector<int64_t> id2(2);
  decode_subspace(s, b.data(), b.size(), 8, c2.data(), id2.data());
  EXPECT_EQ(c2, coef);
  EXPECT_EQ(id2, ids);
  // Wrong byte count; an id too wide for its width.
  EXPECT_THROW(decode_subspace(s, b.data(), b.size() - 1, 8, c2.data(), id2.data()), CodecError);
  const std::vector<int64_t> wide = {70000, 1};
  EXPECT_THROW(encode_subspace(s, coef.data(), wide.data(), 8, b.data()), CodecError);
}

TEST(SubspaceCodec, QuantizedCoefficientsKeepTheirCodecsBound) {
  for (const char* text : {"subspace:k=16,coef=bf16,dim=64,ids=u8", "subspace:k=16,coef=int8,dim=64,ids=u8",
                           "subspace:k=16,coef=int4,dim=64,ids=u8"}) {
    const CodecSpec s = parse_codec(text);
    const int64_t tokens = 100, n = tokens * 64;
    const std::vector<float> coef = normal(size_t(tokens * 16), 5);
    std::vector<int64_t> ids(tokens);
    for (int64_t t = 0; t < tokens; ++t) ids[t] = (t * 37) % 256;
    std::vector<uint8_t> b(encoded_bytes(s, n));
    encode_subspace(s, coef.data(), ids.data(), n, b.data());
    std::vector<float> back(coef.size());
    std::vector<int64_t> id2(tokens);
    decode_subspace(s, b.data(), b.size(), n, back.data(), id2.data());
    EXPECT_EQ(id2, ids) << text;
    // The coefficient codec's own round trip, bit for bit.
    const CodecSpec c = s.coefficients();
    std::vector<uint8_t> cb(encoded_bytes(c, int64_t(coef.size())));
    encode(c, coef.data(), int64_t(coef.size()), cb.data());
    std::vector<float> want(coef.size());
    decode(c, cb.data(), cb.size(), int64_t(coef.size()), want.data());
    EXPECT_EQ(back, want) << text;
  }
}

TEST(SubspaceBasis, OrthonormalAndAPureFunctionOfTheSeed) {
  for (auto [dim, k] : {std::pair<int, int>{128, 16}, {512, 32}, {7, 6}}) {
    const std::vector<float> U = subspace_basis(dim, k, 42);
    ASSERT_EQ(U.size(), size_t(dim) * k);
    for (int a = 0; a < k; ++a)
      for (int b = 0; b < k; ++b) {
        double dot = 0;
        for (int r = 0; r < dim; ++r) dot += double(U[size_t(r) * k + a]) * U[size_t(r) * k + b];
        EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-6) << dim << "x" << k << " columns " << a << "," << b;
      }
    EXPECT_EQ(subspace_basis(dim, k, 42), U);
    EXPECT_NE(subspace_basis(dim, k, 43), U);
  }
}

TEST(SubspaceProjection, ColumnsAndRowsLandInTheConstraintSetAndStay) {
  const int dim = 64, k = 8;
  const std::vector<float> U = subspace_basis(dim, k, 9);
  // Columns: W [dim, 40] -> U U^T W; projecting again changes nothing (up to rounding).
  std::vector<float> W = normal(size_t(dim) * 40, 1);
  project_columns(U.data(), dim, k, W.data(), 40);
  std::vector<float> again = W;
  project_columns(U.data(), dim, k, again.data(), 40);
  for (size_t i = 0; i < W.size(); ++i) EXPECT_NEAR(again[i], W[i], 1e-5);
  // Each column is in span(U): its residual after removing U U^T is zero.
  for (int c = 0; c < 40; ++c) {
    std::vector<double> z(k, 0.0);
    for (int r = 0; r < dim; ++r)
      for (int j = 0; j < k; ++j) z[j] += double(U[size_t(r) * k + j]) * W[size_t(r) * 40 + c];
    for (int r = 0; r < dim; ++r) {
      double v = 0;
      for (int j = 0; j < k; ++j) v += double(U[size_t(r) * k + j]) * z[j];
      EXPECT_NEAR(v, W[size_t(r) * 40 + c], 1e-5);
    }
  }
  // Rows with an offset: W [5, dim] -> W U U^T + E, with E orthogonal to U: a second projection
  // gives the same rows, and the rows' out-of-span part is E.
  std::vector<float> E = normal(size_t(5) * dim, 2);
  project_rows(U.data(), dim, k, E.data(), 5, nullptr);  // E's part in span(U) ...
  std::vector<float> raw = normal(size_t(5) * dim, 2);
  for (size_t i = 0; i < E.size(); ++i) E[i] = raw[i] - E[i];  // ... removed
  std::vector<float> R = normal(size_t(5) * dim, 3);
  project_rows(U.data(), dim, k, R.data(), 5, E.data());
  std::vector<float> R2 = R;
  project_rows(U.data(), dim, k, R2.data(), 5, E.data());
  for (size_t i = 0; i < R.size(); ++i) EXPECT_NEAR(R2[i], R[i], 1e-5);
  std::vector<float> inspan = R;
  project_rows(U.data(), dim, k, inspan.data(), 5, nullptr);
  for (size_t i = 0; i < R.size(); ++i) EXPECT_NEAR(R[i] - inspan[i], E[i], 1e-5);
}

TEST(SubspaceJob, BindsTheCodecsToTheModelAndRefusesWhatCannotWork) {
  EXPECT_FALSE(subspace_job("fp32", "int8", "fp32", 128, 256).has_value());
  auto j = subspace_job("subspace:k=16,coef=int8", "subspace:k=16,coef=bf16", "int8", 128, 256);
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->k, 16);
  EXPECT_EQ(j->activations->name(), "subspace:k=16,coef=int8,block=64,dim=128,ids=u8");
  EXPECT_EQ(j->gradients->name(), "subspace:k=16,coef=bf16,dim=128");
  EXPECT_EQ(subspace_job("subspace:k=4", "fp32", "fp32", 64, 50304)->activations->id_bytes, 2);
  EXPECT_EQ(subspace_job("subspace:k=4", "fp32", "fp32", 64, 70000)->activations->id_bytes, 4);
  EXPECT_FALSE(subspace_job("fp32", "subspace:k=4", "fp32", 64, 256)->activations.has_value());
  auto err = [](auto f) {
    try {
      f();
    } catch (const CodecError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err([] { subspace_job("fp32", "fp32", "subspace:k=4", 64, 256); }).find("compression.outer"), std::string::npos);
  EXPECT_NE(err([] { subspace_job("subspace:k=8", "subspace:k=16", "fp32", 64, 256); }).find("one subspace"), std::string::npos);
  EXPECT_NE(err([] { subspace_job("subspace:k=64", "fp32", "fp32", 64, 256); }).find("below d_model"), std::string::npos);
  EXPECT_NE(err([] { subspace_job("subspace:k=8,dim=32", "fp32", "fp32", 64, 256); }).find("d_model 64"), std::string::npos);
  EXPECT_NE(err([] { subspace_job("subspace:k=8,ids=u8", "fp32", "fp32", 64, 256); }).find("leave ids out"), std::string::npos);
}

}  // namespace
}  // namespace swarm::compression
