// bench_codec.cpp: implements compression/bench_codec.h (run_codec_bench).
#include "compression/bench_codec.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <ostream>
#include <random>
#include <sstream>
#include <vector>

#include "compression/codec.h"

namespace swarm::compression {
namespace {

constexpr int64_t kBytes = int64_t(64) << 20;  // the fp32 tensor: 64 MiB
constexpr int64_t kN = kBytes / 4;
constexpr int kRepeats = 5;

// Best wall time (seconds) of `repeats` runs of fn.
template <typename Fn>
double best_seconds(int repeats, Fn fn) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// Normal(0, 1) activations with 0.1% outliers of magnitude ~50; fixed seed.
std::vector<float> make_data() {
  std::vector<float> x(kN);
  std::mt19937_64 rng(20240611);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (auto& v : x) {
    v = normal(rng);
    if (uni(rng) < 0.001f) v *= 50.0f;
  }
  return x;
}

// Keeps the optimiser from dropping a result nobody reads.
volatile float g_sink;

}  // namespace

nlohmann::json run_codec_bench(bool json_lines, std::ostream& out) {
  const std::vector<float> x = make_data();
  std::vector<float> y(kN);
  std::vector<uint8_t> wire(encoded_bytes(parse_codec("fp32"), kN));
  // Touch every page before timing anything.
  std::memset(y.data(), 0, kBytes);
  std::memset(wire.data(), 0, wire.size());

  const double memcpy_s = best_seconds(kRepeats, [&] {
    std::memcpy(y.data(), x.data(), kBytes);
    g_sink = y[kN / 2];
  });
  const double memcpy_gbs = kBytes / memcpy_s / 1e9;

  const char* names[] = {"fp32", "fp16", "bf16", "int8:block=64", "int4:block=64",
                         "topk:block=1024,fraction=0.01"};
  nlohmann::json raw = {{"tensor_bytes", kBytes}, {"elements", kN}, {"threads", 1},
                        {"repeats", kRepeats}, {"memcpy_gbs", memcpy_gbs}, {"codecs", nlohmann::json::object()}};
  if (!json_lines) {
    out << "codec bench: 64 MiB fp32 tensor, one thread, best of " << kRepeats
        << "; memcpy " << std::fixed << std::setprecision(2) << memcpy_gbs << " GB/s\n";
    out << std::left << std::setw(32) << "codec" << std::right << std::setw(10) << "enc GB/s"
        << std::setw(10) << "dec GB/s" << std::setw(9) << "enc/cpy" << std::setw(9) << "dec/cpy"
        << std::setw(8) << "ratio" << std::setw(12) << "max err" << std::setw(12) << "rms err" << "\n";
  }
  for (const char* name : names) {
    const CodecSpec spec = parse_codec(name);
    const size_t nbytes = encoded_bytes(spec, kN);
    const int repeats = spec.codec == Codec::kTopk ? 2 : kRepeats;  // topk is slow and not a target
    const double enc_s = best_seconds(repeats, [&] { encode(spec, x.data(), kN, wire.data()); });
    const double dec_s = best_seconds(repeats, [&] {
      decode(spec, wire.data(), nbytes, kN, y.data());
      g_sink = y[kN / 2];
    });
    double max_err = 0, sum_sq = 0;
    for (int64_t i = 0; i < kN; ++i) {
      const double e = std::fabs(double(x[i]) - double(y[i]));
      max_err = std::max(max_err, e);
      sum_sq += e * e;
    }
    nlohmann::json row = {{"codec", spec.name()},
                          {"encode_gbs", kBytes / enc_s / 1e9},
                          {"decode_gbs", kBytes / dec_s / 1e9},
                          {"encode_vs_memcpy", memcpy_s / enc_s},
                          {"decode_vs_memcpy", memcpy_s / dec_s},
                          {"wire_bytes", nbytes},
                          {"ratio", double(kBytes) / double(nbytes)},
                          {"max_abs_err", max_err},
                          {"rms_err", std::sqrt(sum_sq / double(kN))}};
    raw["codecs"][spec.name()] = row;
    if (json_lines) {
      out << row.dump() << "\n";
    } else {
      out << std::left << std::setw(32) << spec.name() << std::right << std::fixed
          << std::setprecision(2) << std::setw(10) << row["encode_gbs"].get<double>()
          << std::setw(10) << row["decode_gbs"].get<double>() << std::setw(9)
          << row["encode_vs_memcpy"].get<double>() << std::setw(9)
          << row["decode_vs_memcpy"].get<double>() << std::setw(8) << row["ratio"].get<double>()
          << std::scientific << std::setprecision(2) << std::setw(12) << max_err << std::setw(12)
          << row["rms_err"].get<double>() << "\n";
      out << std::defaultfloat;
    }
    out.flush();
  }
  auto fig = [&](const char* codec, const char* what, const char* target) {
    return nlohmann::json{{"value", raw["codecs"][codec][what]}, {"target", target}};
  };
  nlohmann::json figures = {
      {"int8_encode_vs_memcpy", fig("int8:block=64", "encode_vs_memcpy", ">= 0.2")},
      {"int8_decode_vs_memcpy", fig("int8:block=64", "decode_vs_memcpy", ">= 0.4")},
      {"bf16_encode_vs_memcpy", fig("bf16", "encode_vs_memcpy", ">= 0.4")},
      {"bf16_decode_vs_memcpy", fig("bf16", "decode_vs_memcpy", ">= 0.4")},
      {"int4_encode_vs_memcpy", fig("int4:block=64", "encode_vs_memcpy", "report")},
      {"int4_decode_vs_memcpy", fig("int4:block=64", "decode_vs_memcpy", "report")},
  };
  return {{"bench", "codec"}, {"figures", figures}, {"raw", raw}};
}

}  // namespace swarm::compression
