// bench_cuda.h: timing the device codec against a plain device-to-device copy (`swarm bench gpu`'s
// int8_encode_vs_d2d figure). Built with the kernels (nvcc); no libtorch.
//
// Defines swarm::compression::cuda::EncodeTiming and `time_encode_vs_d2d`.
#pragma once

#include <cstdint>
#include <string>

#include "compression/codec.h"

namespace swarm::compression::cuda {

struct EncodeTiming {
  std::string device;       // the CUDA device's name
  int64_t values = 0;       // floats encoded per repetition
  int reps = 0;
  double encode_s = 0;      // median seconds of one encode of `values` floats
  double copy_s = 0;        // median seconds of one cudaMemcpy device-to-device of the same 4 x values bytes
  double encode_bytes_per_s() const { return encode_s > 0 ? 4.0 * double(values) / encode_s : 0; }
  double copy_bytes_per_s() const { return copy_s > 0 ? 4.0 * double(values) / copy_s : 0; }
};

// On device 0: `values` normal floats, encoded `reps` times with `spec` and copied `reps` times,
// each timed with CUDA events after a warm-up. Throws std::runtime_error when no device answers.
EncodeTiming time_encode_vs_d2d(const CodecSpec& spec, int64_t values, int reps);

}  // namespace swarm::compression::cuda
