// test_memory_estimate.cpp: estimate_stage_memory: parameter counts of the GPT-2 small shape,
// each term by hand on a small job, how precision, flash attention, the in-flight window and
// the device kind move the estimate, and how many graphs an affinity cache keeps in the memory free.
#include <gtest/gtest.h>

#include "runtime/memory_estimate.h"

namespace swarm {
namespace {

JobSpec gpt2_small(const std::string& precision = "auto") {
  return parse_job_spec(nlohmann::json{{"name", "gpt2"},
                                       {"model", {{"vocab_size", 50304}, {"d_model", 768}, {"n_head", 12}, {"n_layer", 12},
                                                  {"seq_len", 1024}, {"precision", precision}}},
                                       {"partition", {{"stages", 4}}},
                                       {"data", {{"format", "bin"}, {"path", "unused.bin"}}},
                                       {"batch", {{"batch_size", 32}, {"microbatch_size", 4}}},
                                       {"max_inflight", 8}},
                        /*check_files=*/false);
}

TEST(MemoryEstimate, ParametersOfGpt2SmallStages) {
  const JobSpec s = gpt2_small();
  const int64_t block = 12 * 768 * 768 + 13 * 768;  // weights and biases of one block
  EXPECT_EQ(stage_parameters(s, 0), 3 * block + 50304 * 768 + 1024 * 768);
  EXPECT_EQ(stage_parameters(s, 1), 3 * block);
  EXPECT_EQ(stage_parameters(s, 3), 3 * block + 2 * 768 + 50304 * 768);
  int64_t total = 0;
  for (int st = 0; st < 4; ++st) total += stage_parameters(s, st);
  EXPECT_EQ(total, 12 * block + 2 * 50304 * 768 + 1024 * 768 + 2 * 768);  // 163M: lm_head is untied
}

TEST(MemoryEstimate, TermsByHandOnAMiddleStage) {
  JobSpec s = gpt2_small("fp32");
  const StageMemory m = estimate_stage_memory(s, 1, Precision::kFp32, /*flash=*/false, /*cuda=*/false);
  const int64_t P = stage_parameters(s, 1);
  EXPECT_EQ(m.weights, 4 * P);
  EXPECT_EQ(m.grads, 4 * P);
  EXPECT_EQ(m.adam, 8 * P);
  EXPECT_EQ(m.host, 12 * P);
  EXPECT_EQ(m.runtime, 0);
  EXPECT_EQ(m.inflight, 8);
  const int64_t N = 4 * 1024, C = 768;
  const int64_t per_graph = 3 * ((8 + 14 * 4) * N * C + 4 * 12 * 1024 * 1024 * 4);
  EXPECT_EQ(m.graphs, 8 * per_graph);
  // async (the default): 8 in flight is one job step of 8 microbatches; its version and the
  // current one, the last update and a step's copy.
  EXPECT_EQ(m.versions, 4 * 4 * P);
  const int64_t sum = m.weights + m.grads + m.adam + m.graphs + m.versions + m.transient;
  EXPECT_EQ(m.device_bytes(), sum + sum / 10);
  EXPECT_EQ(m.need_bytes(false), m.device_bytes() + m.host);
  EXPECT_EQ(m.need_bytes(true), m.device_bytes());
}

TEST(MemoryEstimate, PrecisionFlashWindowAndDevice) {
  JobSpec s = gpt2_small();
  const StageMemory f32 = estimate_stage_memory(s, 1, Precision::kFp32, false, true);
  const StageMemory b16 = estimate_stage_memory(s, 1, Precision::kBf16, false, true);
  const StageMemory flash = estimate_stage_memory(s, 1, Precision::kBf16, true, true);
  const StageMemory flash32 = estimate_stage_memory(s, 1, Precision::kFp32, true, true);
  EXPECT_LT(flash.graphs, flash32.graphs);      // half-size activations, plus one weight copy per graph
  EXPECT_LT(flash.graphs, b16.graphs);          // no [T, T] attention matrix
  // The math attention keeps its fp32 softmax and a bf16 copy: at T = 1024 that outweighs the
  // halved activations.
  EXPECT_GT(b16.graphs, f32.graphs);
  EXPECT_EQ(f32.weights + f32.adam, b16.weights + b16.adam);  // master weights and AdamW stay fp32
  EXPECT_GT(f32.runtime, 0);
  // The last stage runs each backward at once: one graph, whatever the window.
  EXPECT_EQ(estimate_stage_memory(s, 3, Precision::kFp32, false, false).inflight, 1);
  EXPECT_EQ(estimate_stage_memory(s, 3, Precision::kFp32, false, false).versions, 0);  // runs each backward at once
  s.schedule = Schedule::kSync;
  EXPECT_EQ(estimate_stage_memory(s, 1, Precision::kFp32, false, false).versions, 0);  // steps at barriers only
  s.max_inflight = 2;
  EXPECT_LT(estimate_stage_memory(s, 1, Precision::kFp32, false, true).graphs, f32.graphs);
  EXPECT_NE(b16.describe(true).find("GiB"), std::string::npos);
}

TEST(MemoryEstimate, TheAffinityCacheIsSizedToTheMemoryFree) {
  const JobSpec s = gpt2_small("fp32");
  const auto need = [&](int entries) { return estimate_stage_memory(s, 1, Precision::kFp32, false, false, entries).need_bytes(false); };
  // Each cached graph adds one graph to what the stage needs; the job's window bounds them.
  EXPECT_EQ(estimate_stage_memory(s, 1, Precision::kFp32, false, false, 0).inflight, 1);
  EXPECT_EQ(estimate_stage_memory(s, 1, Precision::kFp32, false, false, 3).inflight, 4);
  EXPECT_EQ(estimate_stage_memory(s, 1, Precision::kFp32, false, false, 40).inflight, 8);
  const int64_t graph = need(1) - need(0);
  EXPECT_GT(graph, 0);
  // What fits: exactly the entries whose need is within the free bytes.
  EXPECT_EQ(cache_entries_that_fit(s, 1, Precision::kFp32, false, false, need(0) - 1), -1);
  EXPECT_EQ(cache_entries_that_fit(s, 1, Precision::kFp32, false, false, need(0)), 0);
  EXPECT_EQ(cache_entries_that_fit(s, 1, Precision::kFp32, false, false, need(3) + graph / 2), 3);
  EXPECT_EQ(cache_entries_that_fit(s, 1, Precision::kFp32, false, false, need(7)), int(kGraphCacheEntries));  // the window's 8 fit: all do
  // The cache's size: at most the configured bound, the bound where the memory is unknown, and
  // none (not -1) where even the stage alone does not fit.
  EXPECT_EQ(graph_cache_entries(s, 1, Precision::kFp32, false, false, need(3)), 3u);
  EXPECT_EQ(graph_cache_entries(s, 1, Precision::kFp32, false, false, need(7), 5), 5u);
  EXPECT_EQ(graph_cache_entries(s, 1, Precision::kFp32, false, false, -1), kGraphCacheEntries);
  EXPECT_EQ(graph_cache_entries(s, 1, Precision::kFp32, false, false, need(0) / 2), 0u);
  // async with 8 job steps in flight: a weight version per step, but only while a cached graph
  // ran on it, so a small cache keeps fewer.
  JobSpec deep = s;
  deep.max_inflight = 64;
  const int64_t P = stage_parameters(s, 1);
  EXPECT_EQ(estimate_stage_memory(deep, 1, Precision::kFp32, false, false).versions, (8 + 3) * 4 * P);
  EXPECT_EQ(estimate_stage_memory(deep, 1, Precision::kFp32, false, false, 1).versions, (2 + 3) * 4 * P);
}

TEST(MemoryEstimate, HumanBytes) {
  EXPECT_EQ(human_bytes(512), "512 bytes");
  EXPECT_EQ(human_bytes(int64_t(3) << 20), "3 MiB");
  EXPECT_EQ(human_bytes(int64_t(3) << 29), "1.50 GiB");
}

}  // namespace
}  // namespace swarm
