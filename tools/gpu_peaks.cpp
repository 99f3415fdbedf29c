// gpu_peaks.cpp: the table behind gpu_peak (see gpu_peaks.h). Figures: NVIDIA data sheets, dense
// (the "with sparsity" figures halved), tensor cores with fp32 accumulation.
#include "tools/gpu_peaks.h"

namespace swarm {
namespace {

struct Row {
  const char* pattern;
  GpuPeak peak;
};

// Most specific patterns first: "H100 PCIe" before "H100".
const Row kRows[] = {
    {"GH200", {"GH200", 989, 989}},
    {"H200", {"H200 SXM", 989, 989}},
    {"H100 PCIe", {"H100 PCIe", 756, 756}},
    {"H100 NVL", {"H100 NVL", 835, 835}},
    {"H100", {"H100 SXM", 989, 989}},
    {"A100", {"A100", 312, 312}},
    {"A800", {"A800", 312, 312}},
    {"L40S", {"L40S", 362, 362}},
    {"L40", {"L40", 181, 181}},
    {"L4", {"L4", 121, 121}},
    {"A10G", {"A10G", 70, 70}},
    {"A10", {"A10", 125, 125}},
    {"RTX 4090", {"GeForce RTX 4090", 165, 165}},
    {"RTX 3090", {"GeForce RTX 3090", 71, 71}},
    {"V100", {"V100", 0, 125}},
    {"T4", {"T4", 0, 65}},
};

}  // namespace

std::optional<GpuPeak> gpu_peak(const std::string& device_name) {
  for (const Row& r : kRows)
    if (device_name.find(r.pattern) != std::string::npos) return r.peak;
  return std::nullopt;
}

}  // namespace swarm
