// device_info_cuda.cpp: query_cuda_device through the CUDA runtime (built with -DSWARM_CUDA=ON;
// see device_info.h). Plain C++ against cuda_runtime.h: no libtorch.
#include <cuda_runtime.h>

#include "stages/device_info.h"

namespace swarm {

bool query_cuda_device(int index, DeviceInfo* out) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || index < 0 || index >= count) {
    cudaGetLastError();  // clear the sticky error of a machine without a driver
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return false;
  out->name = prop.name;
  out->cc_major = prop.major;
  out->cc_minor = prop.minor;
  out->total_bytes = int64_t(prop.totalGlobalMem);
  int previous = 0;
  size_t free_b = 0, total_b = 0;
  // cudaMemGetInfo answers for the current device: switch to `index` and back.
  if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(index) == cudaSuccess) {
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      out->free_bytes = int64_t(free_b);
      out->total_bytes = int64_t(total_b);
    }
    cudaSetDevice(previous);
  }
  return true;
}

}  // namespace swarm
