// device_info.cpp: query_device for the CPU, and the CUDA entry point's stand-in in builds
// without -DSWARM_CUDA=ON (see device_info.h).
#include "stages/device_info.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace swarm {
namespace {

// MemAvailable of /proc/meminfo [bytes]: what the kernel can give without swapping. -1 if absent.
int64_t mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream in(line.substr(13));
    int64_t kib = -1;
    in >> kib;
    return kib >= 0 ? kib * 1024 : -1;
  }
  return -1;
}

}  // namespace

#ifndef SWARM_CUDA
bool query_cuda_device(int, DeviceInfo*) { return false; }
#endif

DeviceInfo query_device(const std::string& device) {
  DeviceInfo out;
  if (device.rfind("cuda", 0) == 0) {
    out.cuda = true;
    out.name = device;
    int index = 0;
    if (device.size() > 5 && device[4] == ':') index = std::atoi(device.c_str() + 5);
    query_cuda_device(index, &out);
    return out;
  }
  out.name = "cpu";
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE), avail = sysconf(_SC_AVPHYS_PAGES);
  if (pages > 0 && page > 0) out.total_bytes = int64_t(pages) * int64_t(page);
  out.free_bytes = mem_available();
  if (out.free_bytes < 0 && avail > 0 && page > 0) out.free_bytes = int64_t(avail) * int64_t(page);
  return out;
}

int64_t usable_bytes(const DeviceInfo& d, int64_t limit_bytes) {
  if (limit_bytes < 0) return d.free_bytes;
  return d.free_bytes < 0 ? limit_bytes : std::min(d.free_bytes, limit_bytes);
}

}  // namespace swarm
