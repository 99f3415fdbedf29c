// quant.cu: implements compression/cuda/codec_cuda.h: int8/int4 blockwise absmax encode and
// decode kernels, bit-identical to compression/codec.cpp (layout and rounding in
// docs/compression.md). Every FP operation that matters is spelled with an explicit IEEE
// rounding intrinsic (__fmul_rn, __fdiv_rn, ...) so that no compiler flag (FMA contraction,
// fast division, flush-to-zero) can change a byte.
//
// Encode: one thread block per codec block finds the absmax and writes the stored scale; then
// one thread per output byte quantises (int4: two values per byte, which may lie in different
// codec blocks when the block size is odd). Decode: one thread per value.
#include "compression/cuda/codec_cuda.h"

#include <cuda_runtime.h>

#include <cfloat>
#include <stdexcept>
#include <string>

#include "runtime/errors.h"

namespace swarm::compression::cuda {
namespace {

constexpr float kTinyScale = 0x1p-96f;   // same as codec.cpp: outside [tiny, huge] use double
constexpr float kHugeScale = 0x1p100f;
constexpr int kThreads = 256;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA codec: ") + what + ": " + cudaGetErrorString(e));
}

// ---- the same bit recipes as codec.cpp ----------------------------------------------------

__device__ __forceinline__ uint32_t select(bool c, uint32_t a, uint32_t b) { return c ? a : b; }

__device__ uint16_t f32_to_f16(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t normal = (a - 0x37fff001u + ((a >> 13) & 1u)) >> 13;
  const uint32_t sub = __float_as_uint(__fadd_rn(__uint_as_float(a), 0.5f)) - 0x3f000000u;
  const uint32_t special = 0x7c00u | (uint32_t(a > 0x7f800000u) << 9);
  return uint16_t(select(a >= 0x47800000u, special, select(a < 0x38800000u, sub, normal)) | sign);
}

__device__ float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t normal = (em << 13) + 0x38000000u;
  const uint32_t sub = __float_as_uint(__fmul_rn(__int2float_rn(int(em)), 0x1p-24f));
  const uint32_t special = (em << 13) | 0x7f800000u;
  return __uint_as_float(select(em >= 0x7c00u, special, select(em >= 0x0400u, normal, sub)) | sign);
}

__device__ uint16_t f16_ceil(float a) {
  uint16_t h = f32_to_f16(a);
  if (f16_to_f32(h) < a) ++h;
  return h;
}

// Stored scale of block b as float; sets bit 1 of *bad (if given) for a negative one.
__device__ float load_scale(const uint8_t* scales, int64_t b, bool fp16, int* bad) {
  if (fp16) {
    const uint16_t h = uint16_t(scales[2 * b] | (scales[2 * b + 1] << 8));
    if ((h & 0x8000u) && bad) atomicOr(bad, 1);
    return f16_to_f32(h);
  }
  const uint32_t u = uint32_t(scales[4 * b]) | (uint32_t(scales[4 * b + 1]) << 8) |
                     (uint32_t(scales[4 * b + 2]) << 16) | (uint32_t(scales[4 * b + 3]) << 24);
  if ((u & 0x80000000u) && bad) atomicOr(bad, 1);
  return __uint_as_float(u);
}

template <int L>
__device__ int quantize(float x, float s) {
  if (!(s <= FLT_MAX) || s == 0.0f) return 0;  // non-finite block (NaN/Inf scale) or all zero
  if (s < kTinyScale || s > kHugeScale) {
    double r = rint(__ddiv_rn(__dmul_rn(double(x), double(L)), double(s)));
    r = fmin(fmax(r, -double(L)), double(L));
    return int(r);
  }
  const float inv = __fdiv_rn(float(L), s);
  const int q = __float2int_rn(__fmul_rn(x, inv));
  return min(max(q, -L), L);
}

template <int L>
__device__ float dequantize(int q, float s) {
  if (!(s <= FLT_MAX)) return __uint_as_float(0x7fc00000u);
  if (s < kTinyScale || s > kHugeScale)
    return __double2float_rn(__ddiv_rn(__dmul_rn(double(q), double(s)), double(L)));
  return __fmul_rn(__int2float_rn(q), __fdiv_rn(s, float(L)));
}

// ---- kernels --------------------------------------------------------------------------------

// grid: one thread block per codec block.
__global__ void scale_kernel(const float* __restrict__ src, int64_t n, int block, bool fp16,
                             uint8_t* __restrict__ scales) {
  const int64_t b = blockIdx.x;
  const int64_t at = b * block;
  const int len = n - at < block ? int(n - at) : block;
  uint32_t m = 0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) m = max(m, __float_as_uint(src[at + i]) & 0x7fffffffu);
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, off));
  __shared__ uint32_t warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < int(blockDim.x >> 5); ++w) m = max(m, warp_max[w]);
  if (fp16) {
    const uint16_t h = m >= 0x7f800000u ? uint16_t(0x7e00u) : f16_ceil(__uint_as_float(m));
    scales[2 * b] = uint8_t(h);
    scales[2 * b + 1] = uint8_t(h >> 8);
  } else {
    const uint32_t u = m >= 0x7f800000u ? 0x7fc00000u : m;
    for (int k = 0; k < 4; ++k) scales[4 * b + k] = uint8_t(u >> (8 * k));
  }
}

__global__ void int8_encode_kernel(const float* __restrict__ src, int64_t n, int block, bool fp16,
                                   uint8_t* __restrict__ dst, int64_t nb) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = load_scale(dst, i / block, fp16, nullptr);
  dst[nb * (fp16 ? 2 : 4) + i] = uint8_t(int8_t(quantize<127>(src[i], s)));
}

__global__ void int4_encode_kernel(const float* __restrict__ src, int64_t n, int block, bool fp16,
                                   uint8_t* __restrict__ dst, int64_t nb) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // output byte
  if (2 * j >= n) return;
  const int64_t i0 = 2 * j, i1 = 2 * j + 1;
  const int q0 = quantize<7>(src[i0], load_scale(dst, i0 / block, fp16, nullptr));
  const int q1 = i1 < n ? quantize<7>(src[i1], load_scale(dst, i1 / block, fp16, nullptr)) : 0;
  dst[nb * (fp16 ? 2 : 4) + j] = uint8_t((q0 & 0x0f) | ((q1 & 0x0f) << 4));
}

__global__ void int8_decode_kernel(const uint8_t* __restrict__ src, int64_t n, int block, bool fp16,
                                   int64_t nb, float* __restrict__ dst, int* bad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = load_scale(src, i / block, fp16, bad);
  const int q = int8_t(src[nb * (fp16 ? 2 : 4) + i]);
  if (q == -128) atomicOr(bad, 2);
  dst[i] = dequantize<127>(q, s);
}

__global__ void int4_decode_kernel(const uint8_t* __restrict__ src, int64_t n, int block, bool fp16,
                                   int64_t nb, float* __restrict__ dst, int* bad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = load_scale(src, i / block, fp16, bad);
  const uint8_t byte = src[nb * (fp16 ? 2 : 4) + i / 2];
  const uint8_t nib = (i & 1) ? uint8_t(byte >> 4) : uint8_t(byte & 0x0f);
  if (nib == 0x08) atomicOr(bad, 2);
  if ((i & 1) == 0 && i + 1 == n && (byte >> 4) != 0) atomicOr(bad, 4);
  dst[i] = dequantize<7>(int(int8_t(uint8_t(nib << 4))) >> 4, s);
}

unsigned grid_for(int64_t items) { return unsigned((items + kThreads - 1) / kThreads); }

void check_quantized(const CodecSpec& spec) {
  if (spec.codec != Codec::kInt8 && spec.codec != Codec::kInt4)
    throw CodecError("CUDA codec: " + spec.name() +
                     " is not implemented on the GPU (int8 and int4 are); encode it on the CPU");
}

}  // namespace

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void encode(const CodecSpec& spec, const float* d_src, int64_t n, uint8_t* d_dst, void* stream) {
  check_quantized(spec);
  encoded_bytes(spec, n);  // validates spec and n
  if (n == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  const int64_t nb = (n + spec.block - 1) / spec.block;
  if (nb > int64_t(INT32_MAX)) throw CodecError("CUDA codec: too many blocks for one grid");
  scale_kernel<<<unsigned(nb), kThreads, 0, st>>>(d_src, n, spec.block, spec.fp16_scales, d_dst);
  check(cudaGetLastError(), "scale kernel launch");
  if (spec.codec == Codec::kInt8) {
    int8_encode_kernel<<<grid_for(n), kThreads, 0, st>>>(d_src, n, spec.block, spec.fp16_scales, d_dst, nb);
  } else {
    int4_encode_kernel<<<grid_for((n + 1) / 2), kThreads, 0, st>>>(d_src, n, spec.block, spec.fp16_scales,
                                                                   d_dst, nb);
  }
  check(cudaGetLastError(), "encode kernel launch");
}

void decode(const CodecSpec& spec, const uint8_t* d_src, size_t nbytes, int64_t n, float* d_dst,
            void* stream) {
  check_quantized(spec);
  const size_t want = encoded_bytes(spec, n);
  if (nbytes != want)
    throw CodecError("CUDA codec " + spec.name() + ": " + std::to_string(n) + " values need " +
                     std::to_string(want) + " encoded bytes, got " + std::to_string(nbytes));
  if (n == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  const int64_t nb = (n + spec.block - 1) / spec.block;
  int* d_bad = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&d_bad), sizeof(int), st), "cudaMallocAsync");
  check(cudaMemsetAsync(d_bad, 0, sizeof(int), st), "cudaMemsetAsync");
  if (spec.codec == Codec::kInt8) {
    int8_decode_kernel<<<grid_for(n), kThreads, 0, st>>>(d_src, n, spec.block, spec.fp16_scales, nb, d_dst, d_bad);
  } else {
    int4_decode_kernel<<<grid_for(n), kThreads, 0, st>>>(d_src, n, spec.block, spec.fp16_scales, nb, d_dst, d_bad);
  }
  check(cudaGetLastError(), "decode kernel launch");
  int bad = 0;
  check(cudaMemcpyAsync(&bad, d_bad, sizeof(int), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
  check(cudaFreeAsync(d_bad, st), "cudaFreeAsync");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  if (bad & 1) throw CodecError("malformed " + spec.name() + " encoding: a block has a negative scale");
  if (bad & 2) throw CodecError("malformed " + spec.name() + " encoding: a value is outside -L..L");
  if (bad & 4) throw CodecError("malformed int4 encoding: the padding nibble after the last value is not 0");
}

}  // namespace swarm::compression::cuda
