// test_gpu.cpp: the GPU path end to end where a CUDA device is present, and what the CPU can check.
// - GpuSwarm.OneStageMatchesTheGpuReferenceInFp32: a 1-stage swarm with its stage server on
//   cuda:0 trains 10 steps with losses within 1e-3 (relative) of `swarm reference --device
//   cuda:0`, both in fp32. Skipped (quickly) where `swarm reference` says there is no CUDA device.
// - GpuPeaks: the peak table behind `swarm bench gpu`'s mfu.
// - BenchGpu.RefusesClearlyWithoutAGpu: on a machine or build without CUDA the bench says so, exit 2.
// - Gpt2Example: examples/gpt2_small validates (both files) and its first step trains on the CPU.
#include <cmath>
#include <fstream>

#include "runtime/job_spec.h"
#include "swarm_test_util.h"
#include "tools/gpu_peaks.h"

namespace swarm::testing {
namespace {

// The "done" line of a `--json` command's output.
json done_line(const std::string& out) {
  json done;
  for (size_t a = 0, b; (b = out.find('\n', a)) != std::string::npos; a = b + 1) {
    json j = json::parse(out.substr(a, b - a), nullptr, false);
    if (j.is_object() && j.value("event", "") == "done") done = j;
  }
  return done;
}

TEST(GpuSwarm, OneStageMatchesTheGpuReferenceInFp32) {
  const std::string dir = temp_dir();
  json spec = tiny_job(write_text(dir), 1, 10, "sync");
  spec["model"] = {{"vocab_size", 256}, {"d_model", 256}, {"n_head", 8}, {"n_layer", 4}, {"seq_len", 128}, {"precision", "fp32"}};
  spec["batch"] = {{"batch_size", 32}, {"microbatch_size", 8}};
  const std::string path = dir + "/job.json";
  std::ofstream(path) << spec.dump();
  auto [rc, out] = run(kBuild + "/swarm reference " + path + " --device cuda:0 --json");
  if (rc == 2 && out.find("no CUDA device") != std::string::npos) GTEST_SKIP() << "no CUDA device: " << out;
  ASSERT_EQ(rc, 0) << out;
  const json ref = done_line(out);
  ASSERT_EQ(ref["losses"].size(), 10u) << out;

  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  swarm.start_stage(0, "gpu0", 1, {"--device", "cuda:0"});
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 1);
  FollowOptions fo;
  fo.quiet = true;
  fo.timeout_s = 300;
  const json st = follow_job(c, submit(c, spec), fo);
  ASSERT_EQ(st["state"], "done") << st.dump();
  const std::vector<double> losses = train_losses(st);
  ASSERT_EQ(losses.size(), 10u);
  for (size_t i = 0; i < losses.size(); ++i) {
    const double r = ref["losses"][i].get<double>();
    EXPECT_NEAR(losses[i], r, 1e-3 * std::abs(r)) << "step " << i + 1;
  }
}

TEST(GpuPeaks, KnownDevicesAndTheMostSpecificRow) {
  EXPECT_EQ(gpu_peak("NVIDIA H200")->bf16_tflops, 989);
  EXPECT_EQ(gpu_peak("NVIDIA H100 80GB HBM3")->model, "H100 SXM");
  EXPECT_EQ(gpu_peak("NVIDIA H100 PCIe")->bf16_tflops, 756);
  EXPECT_EQ(gpu_peak("NVIDIA A100-SXM4-80GB")->bf16_tflops, 312);
  EXPECT_EQ(gpu_peak("NVIDIA A10G")->model, "A10G");
  const auto t4 = gpu_peak("Tesla T4");
  ASSERT_TRUE(t4);
  EXPECT_EQ(t4->bf16_tflops, 0);  // no bf16: the bench runs fp16 there
  EXPECT_EQ(t4->fp16_tflops, 65);
  EXPECT_FALSE(gpu_peak("cpu"));
}

TEST(BenchGpu, RefusesClearlyWithoutAGpu) {
  auto [rc, out] = run(kBuild + "/swarm reference " + kSource + "/examples/tiny_gpt/job.json --device cuda:0 --steps 1");
  if (rc == 0) GTEST_SKIP() << "a CUDA device is present: tools/gpu-check.sh runs the bench";
  auto [brc, bout] = run(kBuild + "/swarm bench gpu --json");
  EXPECT_EQ(brc, 2) << bout;
  EXPECT_NE(bout.find("needs a CUDA device"), std::string::npos) << bout;
  EXPECT_NE(bout.find("-DSWARM_CUDA=ON"), std::string::npos) << bout;
}

TEST(Gpt2Example, ValidatesAndTrainsItsFirstStepOnTheCpu) {
  // The token-data variant names a file the user prepares: it parses, its files are not checked.
  const JobSpec bpe = parse_job_spec_text(run("cat " + kSource + "/examples/gpt2_small/job_openwebtext.json").second, false);
  EXPECT_EQ(bpe.model.vocab_size, 50304);
  const std::string path = kSource + "/examples/gpt2_small/job.json";
  const JobSpec s = parse_job_spec_text(run("cat " + path).second, true);
  EXPECT_EQ(s.model.d_model, 768);
  EXPECT_EQ(s.model.n_layer, 12);
  EXPECT_EQ(s.model.n_head, 12);
  EXPECT_EQ(s.model.seq_len, 1024);
  EXPECT_EQ(s.partition.stages, 4);
  // One step of the full shape on 2 cores: 8 microbatches of 8 x 1024 tokens, far too slow here.
  // The same model (every weight, 1024 positions) on 1 sample of 128 tokens per step, 2 steps.
  json j = json::parse(run("cat " + path).second);
  j["model"]["seq_len"] = 128;
  j["model"]["max_seq_len"] = 1024;
  j["batch"] = {{"batch_size", 1}, {"microbatch_size", 1}};
  j["eval"] = {{"every_steps", 0}, {"batches", 1}};
  const std::string dir = temp_dir();
  std::ofstream(dir + "/job.json") << j.dump();
  auto [rc, out] = run(kBuild + "/swarm reference " + dir + "/job.json --steps 2 --json");
  ASSERT_EQ(rc, 0) << out;
  const json done = done_line(out);
  ASSERT_EQ(done["losses"].size(), 2u) << out;
  // Untrained: the loss of a uniform guess over 256 bytes, about ln 256 = 5.55.
  EXPECT_NEAR(done["losses"][0].get<double>(), std::log(256.0), 0.3);
  EXPECT_TRUE(std::isfinite(done["val_loss"].get<double>()));
}

}  // namespace
}  // namespace swarm::testing
