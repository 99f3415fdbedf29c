// gpu_peaks.h: dense tensor-core peaks of known GPUs, for `swarm bench gpu`'s `mfu` figure.
//
// Defines swarm::GpuPeak and `gpu_peak` (a CUDA device name as the runtime reports it, e.g.
// "NVIDIA H100 80GB HBM3", to its dense bf16 and fp16 peak from the vendor's data sheet, without
// structured sparsity). No libtorch, no CUDA.
#pragma once

#include <optional>
#include <string>

namespace swarm {

struct GpuPeak {
  std::string model;        // the table's row, e.g. "H100 SXM"
  double bf16_tflops = 0;   // dense; 0: no bf16 tensor cores
  double fp16_tflops = 0;   // dense, fp32 accumulation
};

// The first row whose pattern the name contains (case-sensitive, most specific first); nullopt
// for a device not in the table.
std::optional<GpuPeak> gpu_peak(const std::string& device_name);

}  // namespace swarm
