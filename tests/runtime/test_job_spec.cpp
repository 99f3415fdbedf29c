// test_job_spec.cpp: the job spec parser (runtime/job_spec.h): defaults, derived fields, the
// canonical round trip, and every rejection with the content of its message.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "runtime/limits.h"

using nlohmann::json;
using swarm::JobSpec;
using swarm::SpecError;

namespace {

json minimal() { return json{{"data", {{"path", "/nonexistent/corpus.txt"}}}}; }

// Parses without touching the file system; returns the SpecError message ("" if it parsed).
std::string error_of(const json& j, bool check_files = false) {
  try {
    swarm::parse_job_spec(j, check_files);
  } catch (const SpecError& e) {
    return e.what();
  }
  return "";
}

std::string error_of_text(const std::string& text) {
  try {
    swarm::parse_job_spec_text(text, false);
  } catch (const SpecError& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(msg, part) EXPECT_NE(std::string(msg).find(part), std::string::npos) << "message: " << (msg)

// A job JSON with `path` (e.g. "model.n_head") set to `value`.
json with(json j, const std::string& path, const json& value) {
  json* cur = &j;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) {
      (*cur)[key] = value;
      return j;
    }
    cur = &(*cur)[key];
    start = dot + 1;
  }
}

std::string temp_path(const std::string& name) {
  return testing::TempDir() + "swarm_spec_" + std::to_string(getpid()) + "_" + name;
}

}  // namespace

TEST(JobSpec, DefaultsFromMinimalSpec) {
  JobSpec s = swarm::parse_job_spec(minimal(), false);
  EXPECT_EQ(s.name, "job");
  EXPECT_EQ(s.seed, 1u);
  EXPECT_EQ(s.steps, 100);
  EXPECT_EQ(s.schedule, swarm::Schedule::kAsync);
  EXPECT_EQ(s.model.vocab_size, 256);
  EXPECT_EQ(s.model.d_model, 128);
  EXPECT_EQ(s.model.n_head, 4);
  EXPECT_EQ(s.model.n_layer, 4);
  EXPECT_EQ(s.model.seq_len, 128);
  EXPECT_EQ(s.model.max_seq_len, 128);  // 0 -> seq_len
  EXPECT_TRUE(s.model.bias);
  EXPECT_EQ(s.partition.stages, 1);
  EXPECT_EQ(s.partition.layers_per_stage, std::vector<int>({4}));
  EXPECT_EQ(s.max_inflight, 4);  // 0 -> one job step: 32 / 8 microbatches
  EXPECT_EQ(s.data.format, "text");
  EXPECT_EQ(s.data.paths, std::vector<std::string>({"/nonexistent/corpus.txt"}));
  EXPECT_DOUBLE_EQ(s.data.val_fraction, 0.1);
  EXPECT_EQ(s.batch.batch_size, 32);
  EXPECT_EQ(s.batch.microbatch_size, 8);
  EXPECT_EQ(s.batch.inner_batch, 32);  // 0 -> batch_size
  EXPECT_EQ(s.microbatches_per_step(), 4);
  EXPECT_DOUBLE_EQ(s.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(s.optimizer.min_lr, 1e-4);
  EXPECT_EQ(s.optimizer.warmup_steps, 10);
  EXPECT_DOUBLE_EQ(s.optimizer.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(s.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(s.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(s.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(s.optimizer.grad_clip, 1.0);
  EXPECT_EQ(s.diloco.inner_steps, 10);
  EXPECT_DOUBLE_EQ(s.diloco.outer_lr, 0.7);
  EXPECT_DOUBLE_EQ(s.diloco.outer_momentum, 0.9);
  EXPECT_TRUE(s.diloco.nesterov);
  EXPECT_DOUBLE_EQ(s.diloco.deadline_s, 30.0);
  EXPECT_EQ(s.diloco.warm_start_steps, 33);  // the derived warm start: a third of the default 100 steps
  EXPECT_EQ(s.compression.activations, "fp32");
  EXPECT_EQ(s.compression.gradients, "fp32");
  EXPECT_EQ(s.compression.outer, "fp32");
  EXPECT_EQ(s.eval.every_steps, 0);
  EXPECT_EQ(s.eval.batches, 8);
  EXPECT_DOUBLE_EQ(s.timeouts.forward_s, 30.0);
  EXPECT_DOUBLE_EQ(s.timeouts.backward_s, 60.0);
  EXPECT_EQ(s.timeouts.max_attempts, 8);
}

TEST(JobSpec, ReadsEveryField) {
  json j = {
      {"name", "full"}, {"seed", 18446744073709551615ull}, {"steps", 7}, {"schedule", "sync"}, {"max_inflight", 5},
      {"model", {{"vocab_size", 50304}, {"d_model", 96}, {"n_head", 3}, {"n_layer", 7}, {"seq_len", 32},
                 {"max_seq_len", 64}, {"bias", false}}},
      {"partition", {{"stages", 4}, {"layers_per_stage", {2, 2, 2, 1}}}},
      {"data", {{"format", "bin"}, {"path", {"a.bin", "b.bin"}}, {"val_fraction", 0.25}}},
      {"batch", {{"batch_size", 24}, {"microbatch_size", 4}, {"inner_batch", 8}}},
      {"optimizer", {{"lr", 0.01}, {"min_lr", 0.0}, {"warmup_steps", 0}, {"weight_decay", 0.0}, {"beta1", 0.0},
                     {"beta2", 0.99}, {"eps", 1e-6}, {"grad_clip", 0.0}}},
      {"diloco", {{"inner_steps", 1}, {"outer_lr", 1.0}, {"outer_momentum", 0.0}, {"nesterov", false},
                  {"deadline_s", 2.5}}},
      {"compression", {{"activations", "int8:block=64"}, {"gradients", "bf16"}, {"outer", "topk:fraction=0.01"}}},
      {"eval", {{"every_steps", 3}, {"batches", 2}}},
      {"timeouts", {{"forward_s", 1.5}, {"backward_s", 3.0}, {"max_attempts", 1}}},
  };
  JobSpec s = swarm::parse_job_spec(j, false);
  EXPECT_EQ(s.name, "full");
  EXPECT_EQ(s.seed, 18446744073709551615ull);
  EXPECT_EQ(s.steps, 7);
  EXPECT_EQ(s.schedule, swarm::Schedule::kSync);
  EXPECT_EQ(s.max_inflight, 5);
  EXPECT_EQ(s.model.vocab_size, 50304);
  EXPECT_EQ(s.model.max_seq_len, 64);
  EXPECT_FALSE(s.model.bias);
  EXPECT_EQ(s.partition.layers_per_stage, std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(s.data.paths, std::vector<std::string>({"a.bin", "b.bin"}));
  EXPECT_EQ(s.batch.inner_batch, 8);
  EXPECT_EQ(s.microbatches_per_step(), 6);
  EXPECT_DOUBLE_EQ(s.optimizer.beta2, 0.99);
  EXPECT_FALSE(s.diloco.nesterov);
  EXPECT_EQ(s.compression.activations, "int8:block=64");
  EXPECT_EQ(s.compression.outer, "topk:fraction=0.01");
  EXPECT_EQ(s.eval.every_steps, 3);
  EXPECT_EQ(s.timeouts.max_attempts, 1);
  EXPECT_EQ(s.first_layer(0), 0);
  EXPECT_EQ(s.first_layer(1), 2);
  EXPECT_EQ(s.first_layer(2), 4);
  EXPECT_EQ(s.first_layer(3), 6);
  EXPECT_EQ(s.first_layer(4), 7);  // one past the last stage: n_layer
}

TEST(JobSpec, EvenSplitFilledWhenAbsent) {
  JobSpec s = swarm::parse_job_spec(with(with(minimal(), "model.n_layer", 12), "partition.stages", 4), false);
  EXPECT_EQ(s.partition.layers_per_stage, std::vector<int>({3, 3, 3, 3}));
  EXPECT_EQ(s.max_inflight, 4);  // one job step, 4 microbatches, one per stage
  EXPECT_EQ(s.first_layer(2), 6);
  // More stages than microbatches per step: one per stage, so every stage can be busy.
  JobSpec deep = swarm::parse_job_spec(with(with(with(minimal(), "model.n_layer", 12), "partition.stages", 6), "batch.batch_size", 16), false);
  EXPECT_EQ(deep.max_inflight, 6);
}

TEST(JobSpec, RoundTripThroughCanonicalJson) {
  JobSpec a = swarm::parse_job_spec(with(with(minimal(), "partition.stages", 2), "optimizer.lr", 3e-3), false);
  json canon = swarm::to_json(a);
  // Every default is written out.
  for (const char* key : {"name", "seed", "steps", "schedule", "max_inflight", "model", "partition", "data", "batch",
                          "optimizer", "diloco", "compression", "eval", "timeouts"}) {
    EXPECT_TRUE(canon.contains(key)) << key;
  }
  EXPECT_EQ(canon["partition"]["layers_per_stage"], json({2, 2}));
  EXPECT_EQ(canon["data"]["path"], json({"/nonexistent/corpus.txt"}));
  JobSpec b = swarm::parse_job_spec(canon, false);
  EXPECT_TRUE(a == b);
  EXPECT_EQ(swarm::to_json(b), canon);
  // Through text as well (doubles survive dump and parse exactly).
  JobSpec c = swarm::parse_job_spec_text(canon.dump(2), false);
  EXPECT_EQ(c, a);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-3);

  JobSpec d = b;
  d.optimizer.beta2 = 0.999;
  EXPECT_TRUE(d != b);
}

TEST(JobSpec, WholeNumberFloatsAcceptedAsIntegers) {
  JobSpec s = swarm::parse_job_spec(with(minimal(), "steps", 1e3), false);
  EXPECT_EQ(s.steps, 1000);
}

TEST(JobSpec, DataPathRequired) {
  EXPECT_HAS(error_of(json::object()), "data");
  EXPECT_HAS(error_of(json::object()), "required");
  std::string msg = error_of(json{{"data", {{"format", "text"}}}});
  EXPECT_HAS(msg, "data.path");
  EXPECT_HAS(msg, "required");
  EXPECT_HAS(error_of(json{{"data", {{"path", json::array()}}}}), "empty list");
  EXPECT_HAS(error_of(json{{"data", {{"path", ""}}}}), "empty string");
  msg = error_of(json{{"data", {{"path", {"ok.txt", 3}}}}});
  EXPECT_HAS(msg, "data.path[1]");
  EXPECT_HAS(msg, "must be a file path");
}

TEST(JobSpec, UnknownKeysWithSuggestion) {
  std::string msg = error_of(with(minimal(), "model.n_heads", 4));
  EXPECT_HAS(msg, "model.n_heads");
  EXPECT_HAS(msg, "unknown key");
  EXPECT_HAS(msg, "did you mean \"model.n_head\"?");

  msg = error_of(with(minimal(), "stpes", 4));
  EXPECT_HAS(msg, "did you mean \"steps\"?");

  msg = error_of(json{{"data", {{"paths", "x.txt"}}}});
  EXPECT_HAS(msg, "did you mean \"data.path\"?");

  msg = error_of(with(minimal(), "timeouts.forward", 3));
  EXPECT_HAS(msg, "did you mean \"timeouts.forward_s\"?");

  msg = error_of(with(minimal(), "optimizer.learning_rate", 0.1));
  EXPECT_HAS(msg, "optimizer.learning_rate");
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
  EXPECT_HAS(msg, "the keys allowed here are");
  EXPECT_HAS(msg, "lr");
}

TEST(JobSpec, WrongTypes) {
  std::string msg = error_of(with(minimal(), "model.d_model", "128"));
  EXPECT_HAS(msg, "model.d_model");
  EXPECT_HAS(msg, "must be an integer");
  msg = error_of(with(minimal(), "model.n_layer", 2.5));
  EXPECT_HAS(msg, "model.n_layer");
  EXPECT_HAS(msg, "whole number");
  EXPECT_HAS(error_of(with(minimal(), "optimizer.lr", "0.001")), "optimizer.lr: must be a number");
  EXPECT_HAS(error_of(with(minimal(), "model.bias", 1)), "model.bias: must be true or false");
  EXPECT_HAS(error_of(with(minimal(), "schedule", 1)), "schedule: must be a string");
  EXPECT_HAS(error_of(with(minimal(), "model", 5)), "model: must be an object");
  EXPECT_HAS(error_of(with(minimal(), "seed", -1)), "seed: must be a non-negative integer");
  EXPECT_HAS(error_of(with(minimal(), "steps", json())), "steps: is null");
  EXPECT_HAS(error_of(with(minimal(), "steps", 1e12)), "too large");
  EXPECT_HAS(error_of(with(minimal(), "partition.layers_per_stage", "4")), "must be a list of integers");
  EXPECT_HAS(error_of(with(minimal(), "partition.layers_per_stage", {"4"})), "partition.layers_per_stage[0]");
  EXPECT_HAS(error_of(json::array()), "must be an object");
}

TEST(JobSpec, NonPositiveDims) {
  for (const char* f : {"model.vocab_size", "model.d_model", "model.n_head", "model.n_layer", "model.seq_len"}) {
    for (int v : {0, -3}) {
      std::string msg = error_of(with(minimal(), f, v));
      EXPECT_HAS(msg, f);
      EXPECT_HAS(msg, "must be at least 1");
    }
  }
  EXPECT_HAS(error_of(with(minimal(), "steps", 0)), "steps: must be at least 1");
  EXPECT_HAS(error_of(with(minimal(), "partition.stages", 0)), "partition.stages: must be at least 1");
  EXPECT_HAS(error_of(with(minimal(), "model.max_seq_len", -1)), "model.max_seq_len");
  EXPECT_HAS(error_of(with(minimal(), "max_inflight", -1)), "max_inflight");
}

TEST(JobSpec, HeadsMustDivideDModel) {
  std::string msg = error_of(with(with(minimal(), "model.d_model", 130), "model.n_head", 4));
  EXPECT_HAS(msg, "model.n_head");
  EXPECT_HAS(msg, "model.d_model 130 is not divisible by model.n_head 4");
}

TEST(JobSpec, UnevenLayersNeedLayersPerStage) {
  std::string msg = error_of(with(with(minimal(), "model.n_layer", 7), "partition.stages", 4));
  EXPECT_HAS(msg, "partition.layers_per_stage");
  EXPECT_HAS(msg, "7 layers over 4 stages do not split evenly: set partition.layers_per_stage, e.g. [2, 2, 2, 1]");
  msg = error_of(with(with(minimal(), "model.n_layer", 2), "partition.stages", 4));
  EXPECT_HAS(msg, "partition.stages");
  EXPECT_HAS(msg, "at least one layer each");
}

TEST(JobSpec, LayersPerStageRules) {
  json base = with(with(minimal(), "model.n_layer", 7), "partition.stages", 4);
  std::string msg = error_of(with(base, "partition.layers_per_stage", {3, 4}));
  EXPECT_HAS(msg, "partition.layers_per_stage: has 2 entries but partition.stages is 4");
  msg = error_of(with(base, "partition.layers_per_stage", {2, 2, 2, 2}));
  EXPECT_HAS(msg, "[2, 2, 2, 2] sums to 8 layers but model.n_layer is 7");
  msg = error_of(with(base, "partition.layers_per_stage", {4, 0, 2, 1}));
  EXPECT_HAS(msg, "partition.layers_per_stage[1]");
  EXPECT_HAS(msg, "at least 1 layer");
  msg = error_of(with(base, "partition.layers_per_stage", {4, -1, 3, 1}));
  EXPECT_HAS(msg, "partition.layers_per_stage[1]");
}

TEST(JobSpec, TooManyStages) {
  int s = swarm::limits::kMaxStages + 1;
  std::string msg = error_of(with(with(minimal(), "model.n_layer", s), "partition.stages", s));
  EXPECT_HAS(msg, "partition.stages");
  EXPECT_HAS(msg, "over the limit of " + std::to_string(swarm::limits::kMaxStages));
}

TEST(JobSpec, SeqLenOverMax) {
  std::string msg = error_of(with(with(minimal(), "model.seq_len", 512), "model.max_seq_len", 256));
  EXPECT_HAS(msg, "model.seq_len 512 is over the model's maximum model.max_seq_len 256: ");
  EXPECT_HAS(msg, "lower model.seq_len or raise model.max_seq_len");
}

TEST(JobSpec, BatchMustBeWholeMicrobatches) {
  std::string msg = error_of(with(with(minimal(), "batch.batch_size", 30), "batch.microbatch_size", 8));
  EXPECT_HAS(msg, "batch.batch_size 30 is not divisible by batch.microbatch_size 8");
  EXPECT_HAS(error_of(with(minimal(), "batch.microbatch_size", 0)), "batch.microbatch_size: must be at least 1");
  msg = error_of(with(minimal(), "batch.inner_batch", 12));
  EXPECT_HAS(msg, "batch.inner_batch 12 is not divisible by batch.microbatch_size 8");
  EXPECT_HAS(error_of(with(minimal(), "batch.inner_batch", -8)), "batch.inner_batch");
}

TEST(JobSpec, ScheduleAndFormat) {
  std::string msg = error_of(with(minimal(), "schedule", "pipelined"));
  EXPECT_HAS(msg, "schedule: must be \"async\"");
  EXPECT_HAS(msg, "\"sync\"");
  EXPECT_HAS(msg, "\"async_local\"");
  EXPECT_EQ(swarm::parse_job_spec(with(minimal(), "schedule", "async_local"), false).schedule, swarm::Schedule::kAsyncLocal);
  EXPECT_EQ(swarm::to_json(swarm::parse_job_spec(with(minimal(), "schedule", "async_local"), false))["schedule"], "async_local");
  EXPECT_HAS(msg, "pipelined");
  msg = error_of(with(minimal(), "data.format", "jsonl"));
  EXPECT_HAS(msg, "data.format");
  EXPECT_HAS(msg, "\"text\"");
  EXPECT_HAS(msg, "\"bin\"");
}

TEST(JobSpec, TextFormatNeedsVocab256) {
  std::string msg = error_of(with(minimal(), "model.vocab_size", 50257));
  EXPECT_HAS(msg, "model.vocab_size");
  EXPECT_HAS(msg, "every byte");
  EXPECT_HAS(msg, "256");
  EXPECT_HAS(msg, "\"bin\"");
  // bin: any vocabulary up to 65536.
  EXPECT_EQ(error_of(with(with(minimal(), "data.format", "bin"), "model.vocab_size", 50257)), "");
  EXPECT_HAS(error_of(with(with(minimal(), "data.format", "bin"), "model.vocab_size", 70000)), "uint16");
}

TEST(JobSpec, ValFraction) {
  for (double v : {0.0, 1.0, -0.5, 1.5}) {
    std::string msg = error_of(with(minimal(), "data.val_fraction", v));
    EXPECT_HAS(msg, "data.val_fraction");
    EXPECT_HAS(msg, "between 0 and 1");
  }
}

TEST(JobSpec, OptimizerRules) {
  EXPECT_HAS(error_of(with(minimal(), "optimizer.lr", 0.0)), "optimizer.lr: must be > 0");
  EXPECT_HAS(error_of(with(minimal(), "optimizer.lr", -1e-3)), "optimizer.lr: must be > 0");
  std::string msg = error_of(with(with(minimal(), "optimizer.lr", 1e-3), "optimizer.min_lr", 2e-3));
  EXPECT_HAS(msg, "optimizer.min_lr 0.002 is above optimizer.lr 0.001");
  EXPECT_HAS(msg, "min_lr <= lr");
  for (const char* f : {"optimizer.beta1", "optimizer.beta2"}) {
    for (double v : {1.0, -0.1, 1.5}) {
      msg = error_of(with(minimal(), f, v));
      EXPECT_HAS(msg, f);
      EXPECT_HAS(msg, "[0, 1)");
    }
  }
  EXPECT_HAS(error_of(with(minimal(), "optimizer.eps", 0.0)), "optimizer.eps");
  EXPECT_HAS(error_of(with(minimal(), "optimizer.weight_decay", -0.1)), "optimizer.weight_decay");
  EXPECT_HAS(error_of(with(minimal(), "optimizer.grad_clip", -1.0)), "optimizer.grad_clip");
  EXPECT_HAS(error_of(with(minimal(), "optimizer.warmup_steps", -1)), "optimizer.warmup_steps");
  EXPECT_HAS(error_of(with(minimal(), "optimizer.min_lr", -1e-5)), "optimizer.min_lr: must be >= 0");
}

TEST(JobSpec, DilocoEvalTimeoutRules) {
  EXPECT_HAS(error_of(with(minimal(), "diloco.inner_steps", 0)), "diloco.inner_steps: must be at least 1");
  EXPECT_HAS(error_of(with(minimal(), "diloco.outer_lr", 0.0)), "diloco.outer_lr");
  EXPECT_HAS(error_of(with(minimal(), "diloco.outer_momentum", 1.0)), "diloco.outer_momentum");
  EXPECT_HAS(error_of(with(minimal(), "diloco.deadline_s", 0.0)), "diloco.deadline_s");
  EXPECT_HAS(error_of(with(minimal(), "diloco.warm_start_steps", -2)), "diloco.warm_start_steps: must be >= 0");
  // Every schedule flushes the pipeline during the warm start; "every_step" has no warm start.
  EXPECT_EQ(swarm::parse_job_spec(with(with(minimal(), "schedule", "async"), "diloco.warm_start_steps", 5), false).diloco.warm_start_steps, 5);
  EXPECT_EQ(swarm::parse_job_spec(with(with(minimal(), "schedule", "sync"), "diloco.sync", "every_step"), false).diloco.warm_start_steps, 0);
  EXPECT_EQ(swarm::parse_job_spec(with(minimal(), "diloco.warm_start_steps", 0), false).diloco.warm_start_steps, 0);
  // Rounds alongside training: by default only where more than one job step is in flight; never under sync.
  EXPECT_HAS(error_of(with(minimal(), "diloco.rounds", "sometimes")), "diloco.rounds");
  EXPECT_HAS(error_of(with(with(minimal(), "schedule", "sync"), "diloco.rounds", "alongside")), "diloco.rounds: \"alongside\"");
  const auto async_with = [&](int inflight) { return with(with(minimal(), "schedule", "async"), "max_inflight", inflight); };
  EXPECT_FALSE(swarm::rounds_alongside(swarm::parse_job_spec(async_with(4), false)));   // one job step of 4
  EXPECT_TRUE(swarm::rounds_alongside(swarm::parse_job_spec(async_with(8), false)));
  EXPECT_TRUE(swarm::rounds_alongside(swarm::parse_job_spec(with(async_with(4), "diloco.rounds", "alongside"), false)));
  EXPECT_FALSE(swarm::rounds_alongside(swarm::parse_job_spec(with(async_with(8), "diloco.rounds", "at_barrier"), false)));
  EXPECT_FALSE(swarm::rounds_alongside(swarm::parse_job_spec(with(with(async_with(8), "schedule", "sync"), "diloco.rounds", "auto"), false)));
  EXPECT_HAS(error_of(with(minimal(), "eval.batches", 0)), "eval.batches: must be at least 1");
  EXPECT_HAS(error_of(with(minimal(), "eval.every_steps", -1)), "eval.every_steps");
  EXPECT_HAS(error_of(with(minimal(), "timeouts.forward_s", 0.0)), "timeouts.forward_s: must be > 0");
  EXPECT_HAS(error_of(with(minimal(), "timeouts.backward_s", -2.0)), "timeouts.backward_s: must be > 0");
  EXPECT_HAS(error_of(with(minimal(), "timeouts.max_attempts", 0)), "timeouts.max_attempts: must be at least 1");
  EXPECT_HAS(error_of(with(minimal(), "routing.start_peers", 0)), "routing.start_peers: must be 1 to 4096");
  EXPECT_HAS(error_of(with(minimal(), "routing.start_wait_s", -1.0)), "routing.start_wait_s: must be 0 to 86400");
  EXPECT_EQ(swarm::parse_job_spec(with(minimal(), "routing.start_peers", 3), false).routing.start_peers, 3);
}

TEST(JobSpec, CompressionNamesNonEmptyStrings) {
  for (const char* f : {"compression.activations", "compression.gradients", "compression.outer"}) {
    std::string msg = error_of(with(minimal(), f, ""));
    EXPECT_HAS(msg, f);
    EXPECT_HAS(msg, "must name a codec");
    EXPECT_HAS(error_of(with(minimal(), f, 8)), "must be a string");
  }
  EXPECT_HAS(error_of(with(minimal(), "name", "")), "name: must not be empty");
}

TEST(JobSpec, MissingFilesOnlyWhenChecked) {
  json j = minimal();
  EXPECT_EQ(error_of(j, false), "");
  std::string msg = error_of(j, true);
  EXPECT_HAS(msg, "data.path");
  EXPECT_HAS(msg, "/nonexistent/corpus.txt");
  EXPECT_HAS(msg, "cannot read");

  msg = error_of(json{{"data", {{"path", {"/usr/share/games/fortunes/__missing__"}}}}}, true);
  EXPECT_HAS(msg, "tools/install-deps.sh");
  EXPECT_HAS(msg, "fortunes");

  std::string ok = temp_path("present.txt");
  { std::ofstream(ok) << "hello"; }
  msg = error_of(json{{"data", {{"path", {ok, "/nonexistent/b.txt"}}}}}, true);
  EXPECT_HAS(msg, "data.path[1]");
  EXPECT_HAS(msg, "/nonexistent/b.txt");
  EXPECT_EQ(error_of(json{{"data", {{"path", ok}}}}, true), "");
  EXPECT_HAS(error_of(json{{"data", {{"path", testing::TempDir()}}}}, true), "is a directory");
  std::remove(ok.c_str());
}

TEST(JobSpec, TextSizeLimitAndSyntaxErrors) {
  std::string big(swarm::limits::kMaxJobSpecBytes + 1, ' ');
  std::string msg = error_of_text(big);
  EXPECT_HAS(msg, "over the limit of " + std::to_string(swarm::limits::kMaxJobSpecBytes));

  msg = error_of_text("{\n  \"steps\": 10,\n  \"data\": {\"path\": \"x\"\n}");
  EXPECT_HAS(msg, "not valid JSON");
  EXPECT_HAS(msg, "line 4");
  msg = error_of_text("{\"steps\": 10,, }");
  EXPECT_HAS(msg, "line 1, column 14");

  EXPECT_EQ(error_of_text("{\"data\": {\"path\": \"x\"}}"), "");
}

TEST(JobSpec, BundledExampleParses) {
  std::string path = std::string(SWARM_SOURCE_DIR) + "/examples/tiny_gpt/job.json";
  std::ifstream f(path);
  ASSERT_TRUE(f) << path;
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  JobSpec s = swarm::parse_job_spec_text(text, /*check_files=*/false);
  EXPECT_EQ(s.partition.stages, 4);
  EXPECT_EQ(s.model.vocab_size, 256);
  EXPECT_EQ(s.data.format, "text");
  EXPECT_GE(s.data.paths.size(), 2u);
  // With the data installed (tools/install-deps.sh), the files must be found too.
  if (std::ifstream(s.data.paths[0])) {
    EXPECT_NO_THROW(swarm::parse_job_spec_text(text, true));
  }
}

TEST(JobSpec, DataFilesMustBeFewAndRegular) {
  json j = minimal();
  j["data"]["path"] = std::vector<std::string>(257, "/etc/hostname");
  EXPECT_HAS(error_of(j), "has 257 files, over the limit of 256");
  j["data"]["path"] = "/dev/zero";
  try {
    swarm::parse_job_spec(j, /*check_files=*/true);
    FAIL() << "accepted /dev/zero";
  } catch (const SpecError& e) {
    EXPECT_HAS(e.what(), "is not a regular file");
  }
}

// A spec that arrives as msgpack (SUBMIT, LOAD_STAGE) may hold strings that are not UTF-8.
// Quoting such a value in a message must neither throw nlohmann's type_error (it escaped
// parse_job_spec: found by tests/fuzz/fuzz_wire_decode) nor put broken UTF-8 in the message;
// nor may cutting a long key in a message split a character.
TEST(JobSpec, NonUtf8ValuesGiveSpecErrorsWithUtf8Messages) {
  const json bad = std::string("\xae\xff");
  const std::vector<std::pair<std::string, json>> cases = {
      {"steps", bad},
      {"seed", bad},
      {"optimizer.lr", bad},
      {"model.bias", bad},
      {"partition.layers_per_stage", json::array({bad})},
      {"data.path", json{{"file", bad}}},
      {"data.path", json::array({json{{"file", bad}}})},
  };
  for (const auto& [path, value] : cases) {
    const std::string msg = error_of(with(minimal(), path, value));
    EXPECT_HAS(msg, path);
    EXPECT_NO_THROW((void)json(msg).dump()) << path << ": the message is not UTF-8";
  }
  std::string long_key;
  for (int i = 0; i < 60; ++i) long_key += "\xc3\xa9";   // "é" x 60: 120 bytes, cut at 80
  const std::string msg = error_of(with(minimal(), long_key, 1));
  EXPECT_HAS(msg, "unknown key");
  EXPECT_NO_THROW((void)json(msg).dump()) << "the cut key is not UTF-8";
}

// A number past a double's range is the parser's out_of_range, not a parse_error: it escaped
// parse_job_spec_text (found by tests/fuzz/fuzz_job_spec).
TEST(JobSpec, NumberOutOfDoubleRangeIsASpecError) {
  const std::string msg = error_of_text(R"({"steps": 1e309, "data": {"path": "x"}})");
  EXPECT_HAS(msg, "not valid JSON");
  EXPECT_HAS(msg, "1e309");
}

// A value nested 400,000 deep (800 KB of brackets, under the 1 MiB text limit) quoted in a
// message: dump() recursed once per level and overflowed the stack (found by fuzzing).
TEST(JobSpec, DeeplyNestedValueIsQuotedWithoutRecursion) {
  const size_t depth = 400000;
  const std::string text = R"({"steps": )" + std::string(depth, '[') + std::string(depth, ']') + R"(, "data": {"path": "x"}})";
  ASSERT_LT(text.size(), swarm::limits::kMaxJobSpecBytes);
  const std::string msg = error_of_text(text);
  EXPECT_HAS(msg, "steps: must be an integer, got a list [[[...]]]");
}
