// test_schedules.cpp: the schedules on real swarms (docs/schedules.md). Under `async` each peer of
// a two-peer group steps once per job step on its share of it, where `async_local` steps once
// per inner_batch of its own samples (about every second job step); both keep the groups equal
// and lose nothing, the warm start included.
#include <gtest/gtest.h>

#include <set>

#include "runtime/checkpoint.h"
#include "runtime/client.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;

namespace {

constexpr int kSteps = 24;

// 2 stages x 2 peers, 24 steps (a warm start of 4), one checkpoint at the end: its stages'
// AdamW step counts (one donor peer each).
std::vector<int64_t> adam_steps_after(const std::string& schedule) {
  const std::string dir = temp_dir();
  json spec = tiny_job(write_text(dir), 2, kSteps, schedule);
  spec["diloco"]["warm_start_steps"] = 4;
  // Both peers of each stage serve from the first step and share the work evenly (fixed
  // pipelines: microbatch k on pipeline k mod 2): the counts below depend on who served what.
  // With `swarm` routing a 24-step job (half a second) once ran almost all on one peer.
  spec["routing"] = {{"mode", "static"}, {"start_peers", 2}};
  spec["checkpoint"] = {{"dir", dir + "/ckpt"}};
  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 2; ++i) swarm.start_stage(s, "s" + std::to_string(s) + "-" + std::to_string(i), 1);
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 4);
  FollowOptions fo;
  fo.quiet = true;
  fo.timeout_s = 180;
  const json st = follow_job(c, submit(c, spec), fo);
  EXPECT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_LT(st["val_loss"].get<double>(), st["unigram_loss"].get<double>());
  // No backward failed: a weight-stashed recompute must not spoil the cached graphs of others.
  for (const auto& p : c.peers()["peers"]) EXPECT_EQ(p["heartbeat"]["errors"], 0) << p["name"] << ": compute errors";
  for (const auto& stage : st["state_hashes"]) {
    std::set<uint64_t> distinct;
    for (const auto& [peer, h] : stage.items()) distinct.insert(h.get<uint64_t>());
    EXPECT_EQ(distinct.size(), 1u) << st["state_hashes"].dump();
  }
  char step_dir[32];
  std::snprintf(step_dir, sizeof(step_dir), "/step-%08d", kSteps);
  std::vector<int64_t> steps;
  for (const StageState& s : read_checkpoint(dir + "/ckpt" + step_dir).stages) steps.push_back(s.adam_step);
  return steps;
}

}  // namespace

TEST(Schedules, AsyncStepsOncePerJobStepAsyncLocalPerInnerBatch) {
  // 4 dense steps, then 20 of 4 microbatches over 2 fixed pipelines: under async a peer steps at
  // every job step it served a microbatch of (every step, 24 in all, unless a hop was resent);
  // under async_local every batch_size (16) of its own samples: 320 samples over 2 peers, 10
  // times each (14 in all).
  for (int64_t n : adam_steps_after("async")) {
    EXPECT_GE(n, 4 + 14) << "async";
    EXPECT_LE(n, kSteps) << "async";
  }
  for (int64_t n : adam_steps_after("async_local")) EXPECT_LE(n, 4 + 13) << "async_local";
}
