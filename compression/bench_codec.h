// bench_codec.h: the codec throughput benchmark behind `swarm bench codec [--json]`.
//
// Defines run_codec_bench: single-thread encode/decode GB/s (of fp32 input bytes), wire ratio
// and error of each codec on a 64 MiB fp32 tensor (normal data with 0.1% outliers, fixed seed),
// against memcpy of the same 64 MiB measured in the same run. Best of several repeats.
#pragma once

#include <iosfwd>

#include <nlohmann/json.hpp>

namespace swarm::compression {

// json_lines: one JSON object per codec on `out`; otherwise a readable table. Either way returns
// {"bench":"codec","figures":{name:{"value":x,"target":">= 0.2"|"report"},...},"raw":{...}}.
nlohmann::json run_codec_bench(bool json_lines, std::ostream& out);

}  // namespace swarm::compression
