// test_bench_codec.cpp: run_codec_bench (compression/bench_codec.h) returns the summary shape
// `swarm bench codec --json` prints, with one JSON line per codec. Runs the real 64 MiB bench
// (about 2 s).
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "compression/bench_codec.h"

namespace swarm::compression {
namespace {

TEST(CodecBench, SummaryShapeAndJsonLines) {
  std::ostringstream out;
  const nlohmann::json s = run_codec_bench(true, out);
  EXPECT_EQ(s["bench"], "codec");
  for (const char* k : {"int8_encode_vs_memcpy", "int8_decode_vs_memcpy", "bf16_encode_vs_memcpy",
                        "bf16_decode_vs_memcpy", "int4_encode_vs_memcpy", "int4_decode_vs_memcpy"}) {
    ASSERT_TRUE(s["figures"].contains(k)) << k;
    EXPECT_GT(s["figures"][k]["value"].get<double>(), 0.0) << k;
    EXPECT_TRUE(s["figures"][k]["target"].is_string()) << k;
  }
  EXPECT_EQ(s["figures"]["int8_encode_vs_memcpy"]["target"], ">= 0.2");
  EXPECT_GT(s["raw"]["memcpy_gbs"].get<double>(), 0.0);
  EXPECT_EQ(s["raw"]["codecs"].size(), 6u);
  EXPECT_EQ(s["raw"]["codecs"]["fp32"]["max_abs_err"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(s["raw"]["codecs"]["int8:block=64"]["ratio"].get<double>(), 64.0 / 17.0);
  std::istringstream lines(out.str());
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    const auto row = nlohmann::json::parse(line);
    EXPECT_TRUE(row.contains("codec"));
    EXPECT_TRUE(row.contains("encode_gbs"));
    ++n;
  }
  EXPECT_EQ(n, 6);
}

}  // namespace
}  // namespace swarm::compression
