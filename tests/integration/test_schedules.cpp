// test_schedules.cpp: the schedules on real swarms (docs/schedules.md). Under `async` each peer of
// a two-peer group steps once per job step on its share of it, where `async_local` steps once
// per inner_batch of its own samples (about every second job step); both keep the groups equal
// and lose nothing, the warm start included.
#include <gtest/gtest.h>

#include <set>

#include "runtime/checkpoint.h"
#include "runtime/client.h"
#include "runtime/http.h"
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

// Placement and dispatch weigh peers by the speed their results report. Under `async` a peer
// takes its inner step after its reply to the step's closing backward has gone out; that time
// was in no result, so a peer whose steps cost as much as its hops looked twice as fast as it
// was (docs/schedules.md). One stage of d_model 512 (3.4 M parameters for AdamW) under 8 tokens
// a microbatch, one microbatch a job step, one in flight: the peer's compute thread is busy with
// a hop or a step nearly all the time the job runs, and what it reports must say so.
TEST(Schedules, AnAsyncPeersInnerStepsAreInItsReportedCompute) {
  const std::string dir = temp_dir();
  json spec = tiny_job(write_text(dir), 1, 60, "async");
  spec["model"] = {{"vocab_size", 256}, {"d_model", 512}, {"n_head", 8}, {"n_layer", 1}, {"seq_len", 8}};
  spec["batch"] = {{"batch_size", 1}, {"microbatch_size", 1}};
  spec["max_inflight"] = 1;
  spec["diloco"]["inner_steps"] = 100000;   // no round inside the test
  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  swarm.start_stage(0, "s0", 1, {"--http", "127.0.0.1:0"});
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 1);
  const json st = follow_to_end(c, submit(c, spec), 120);
  ASSERT_EQ(st["state"], "done") << st.dump();
  const json peers = c.peers()["peers"];
  ASSERT_EQ(peers.size(), 1u);
  const http::Response page = http::get(peers[0]["metrics"].get<std::string>());
  ASSERT_EQ(page.status, 200);
  const double compute_s = metric_sample(page.body, "swarm_stage_compute_seconds_total");
  const double steps = metric_sample(page.body, "swarm_stage_optimizer_steps_total");
  const double elapsed_s = st["elapsed_s"].get<double>();
  std::cout << "compute reported " << compute_s << " s of the job's " << elapsed_s << " s, " << steps << " inner steps, "
            << peers[0]["ms_per_unit"] << " ms per unit" << std::endl;
  EXPECT_GE(steps, 59);
  // Measured here: hops alone 0.22 of the run (before the steps were counted), hops and steps
  // 0.68-0.72 (the rest: loading the stage, the evaluation, the round trips to the router).
  EXPECT_GT(compute_s, 0.45 * elapsed_s) << "the peer's inner steps are missing from its reported compute";
}
