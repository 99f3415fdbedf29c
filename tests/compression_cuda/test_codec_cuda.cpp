// test_codec_cuda.cpp: the CUDA int8/int4 kernels (compression/cuda/codec_cuda.h) against the
// CPU codec: encoded bytes identical, decoded floats bit-identical, malformed input rejected.
// Skips itself when no GPU is present. Built only with -DSWARM_CUDA=ON.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "compression/cuda/codec_cuda.h"
#include "runtime/errors.h"

namespace swarm::compression {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// Device buffer that frees itself.
template <typename T>
struct DeviceBuf {
  T* p = nullptr;
  explicit DeviceBuf(size_t n) { cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)); }
  ~DeviceBuf() { cudaFree(p); }
};

// Normal data with outliers, zeros, tiny, subnormal and huge values; NaN/Inf if `specials`.
std::vector<float> data(size_t n, uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  for (size_t i = 0; i < n; i += 97) x[i] *= 1000.0f;
  const float scales[] = {0.0f, 1e-30f, 1e-40f, 1e-45f, 1e30f, 1e4f};
  for (size_t b = 0; b * 64 < n; ++b) {  // some whole blocks at one magnitude
    const float s = scales[b % 6];
    if (b % 3 == 0)
      for (size_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) x[i] *= s;
  }
  if (specials && n > 300) {
    x[200] = std::numeric_limits<float>::quiet_NaN();
    x[290] = std::numeric_limits<float>::infinity();
  }
  return x;
}

TEST(CudaCodec, MatchesCpuBitForBit) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  for (const char* name : {"int8:block=64", "int8:block=100,scale=fp16", "int8:block=4096",
                           "int4:block=64", "int4:block=65,scale=fp16", "int4:block=4096"}) {
    const CodecSpec s = parse_codec(name);
    for (int64_t n : {int64_t(1), int64_t(63), int64_t(64), int64_t(65), int64_t(3 * s.block + 7),
                      int64_t(100003)}) {
      const auto x = data(size_t(n), uint64_t(n) * 7 + s.block, true);
      const size_t nbytes = encoded_bytes(s, n);
      std::vector<uint8_t> cpu(nbytes), gpu(nbytes);
      encode(s, x.data(), n, cpu.data());
      DeviceBuf<float> dx{static_cast<size_t>(n)}, dy{static_cast<size_t>(n)};
      DeviceBuf<uint8_t> dw(nbytes);
      CUDA_OK(cudaMemcpy(dx.p, x.data(), 4 * size_t(n), cudaMemcpyHostToDevice));
      cuda::encode(s, dx.p, n, dw.p);
      CUDA_OK(cudaMemcpy(gpu.data(), dw.p, nbytes, cudaMemcpyDeviceToHost));
      ASSERT_EQ(cpu, gpu) << name << " n=" << n;
      std::vector<float> ycpu(static_cast<size_t>(n)), ygpu(static_cast<size_t>(n));
      decode(s, cpu.data(), nbytes, n, ycpu.data());
      cuda::decode(s, dw.p, nbytes, n, dy.p);
      CUDA_OK(cudaMemcpy(ygpu.data(), dy.p, 4 * size_t(n), cudaMemcpyDeviceToHost));
      ASSERT_EQ(0, std::memcmp(ycpu.data(), ygpu.data(), 4 * size_t(n))) << name << " n=" << n;
    }
  }
}

TEST(CudaCodec, RejectsMalformed) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const CodecSpec s8 = parse_codec("int8:block=64");
  const CodecSpec s4 = parse_codec("int4:block=64,scale=fp16");
  const int64_t n = 129;
  const auto x = data(size_t(n), 3, false);
  DeviceBuf<float> dy{static_cast<size_t>(n)};
  for (const CodecSpec& s : {s8, s4}) {
    std::vector<uint8_t> w(encoded_bytes(s, n));
    encode(s, x.data(), n, w.data());
    DeviceBuf<uint8_t> dw(w.size());
    EXPECT_THROW(cuda::decode(s, dw.p, w.size() + 1, n, dy.p), CodecError);
    auto neg = w;
    neg[s.fp16_scales ? 1 : 3] |= 0x80;
    CUDA_OK(cudaMemcpy(dw.p, neg.data(), w.size(), cudaMemcpyHostToDevice));
    EXPECT_THROW(cuda::decode(s, dw.p, w.size(), n, dy.p), CodecError);
    auto lo = w;
    lo[3 * (s.fp16_scales ? 2 : 4) + 1] = s.codec == Codec::kInt8 ? 0x80 : 0x08;
    CUDA_OK(cudaMemcpy(dw.p, lo.data(), w.size(), cudaMemcpyHostToDevice));
    EXPECT_THROW(cuda::decode(s, dw.p, w.size(), n, dy.p), CodecError);
    CUDA_OK(cudaMemcpy(dw.p, w.data(), w.size(), cudaMemcpyHostToDevice));
    EXPECT_NO_THROW(cuda::decode(s, dw.p, w.size(), n, dy.p));
  }
  DeviceBuf<uint8_t> dw(1024);
  EXPECT_THROW(cuda::encode(parse_codec("bf16"), dy.p, n, dw.p), CodecError);
}

}  // namespace
}  // namespace swarm::compression
