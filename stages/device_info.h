// device_info.h: what a stage server's device is: its name, memory and CUDA compute capability.
//
// Defines swarm::DeviceInfo and `query_device`. The CPU: "cpu", the host's RAM (sysconf) and
// what is available now (MemAvailable of /proc/meminfo, else free pages). A CUDA device, in a
// build with -DSWARM_CUDA=ON: the CUDA runtime's name, total and free memory
// (cudaMemGetInfo) and compute capability (stages/device_info_cuda.cpp); in other builds the
// device string and unknowns. No libtorch: HELLO is built from this before any model exists.
#pragma once

#include <cstdint>
#include <string>

namespace swarm {

struct DeviceInfo {
  std::string name;            // "cpu", "NVIDIA H200", or the device string when unknown
  bool cuda = false;
  int64_t total_bytes = -1;    // -1: unknown
  int64_t free_bytes = -1;     // at the time of the query; -1: unknown
  int cc_major = 0, cc_minor = 0;  // CUDA compute capability; 0: unknown or CPU
};

// `device`: "cpu", "cuda" or "cuda:N".
DeviceInfo query_device(const std::string& device);

// What a stage server may use of `d`: its free memory, capped at `limit_bytes` (--memory-mb;
// -1: no cap). -1 when neither is known.
int64_t usable_bytes(const DeviceInfo& d, int64_t limit_bytes);

// The CUDA runtime's view of device `index` (device_info_cuda.cpp; without SWARM_CUDA an
// all-unknown answer). Returns false when the runtime cannot answer (no driver, bad index).
bool query_cuda_device(int index, DeviceInfo* out);

}  // namespace swarm
