// bench_cuda.cu: time_encode_vs_d2d (see bench_cuda.h).
#include "compression/cuda/bench_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "compression/cuda/codec_cuda.h"

namespace swarm::compression::cuda {
namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("bench_cuda: ") + what + ": " + cudaGetErrorString(e));
}

// Deterministic normal-ish values (sum of uniforms), so the encode sees realistic blocks.
__global__ void fill_kernel(float* x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = uint32_t(i) * 2654435761u + 12345u;
  float s = 0;
  for (int k = 0; k < 4; ++k) {
    h ^= h << 13;
    h ^= h >> 17;
    h ^= h << 5;
    s += float(h & 0xffffff) / float(0x1000000);
  }
  x[i] = s - 2.0f;
}

template <typename F>
double median_seconds(int reps, cudaEvent_t a, cudaEvent_t b, F&& f) {
  f();  // warm-up
  ok(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    ok(cudaEventRecord(a), "event");
    f();
    ok(cudaEventRecord(b), "event");
    ok(cudaEventSynchronize(b), "event sync");
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(double(ms) / 1000.0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

EncodeTiming time_encode_vs_d2d(const CodecSpec& spec, int64_t values, int reps) {
  if (!device_available()) throw std::runtime_error("no CUDA device");
  EncodeTiming out;
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0), "device properties");
  out.device = prop.name;
  out.values = values;
  out.reps = std::max(1, reps);
  const size_t nbytes = encoded_bytes(spec, values);
  float *x = nullptr, *y = nullptr;
  uint8_t* enc = nullptr;
  ok(cudaMalloc(reinterpret_cast<void**>(&x), size_t(values) * 4), "cudaMalloc");
  ok(cudaMalloc(reinterpret_cast<void**>(&y), size_t(values) * 4), "cudaMalloc");
  ok(cudaMalloc(reinterpret_cast<void**>(&enc), nbytes), "cudaMalloc");
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "event");
  ok(cudaEventCreate(&b), "event");
  try {
    fill_kernel<<<unsigned((values + 255) / 256), 256>>>(x, values);
    ok(cudaGetLastError(), "fill");
    out.encode_s = median_seconds(out.reps, a, b, [&] { encode(spec, x, values, enc, nullptr); });
    out.copy_s = median_seconds(out.reps, a, b, [&] {
      ok(cudaMemcpyAsync(y, x, size_t(values) * 4, cudaMemcpyDeviceToDevice, nullptr), "copy");
    });
  } catch (...) {
    cudaFree(x), cudaFree(y), cudaFree(enc), cudaEventDestroy(a), cudaEventDestroy(b);
    throw;
  }
  cudaFree(x), cudaFree(y), cudaFree(enc), cudaEventDestroy(a), cudaEventDestroy(b);
  return out;
}

}  // namespace swarm::compression::cuda
