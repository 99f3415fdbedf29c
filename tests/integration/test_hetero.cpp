// test_hetero.cpp: a heterogeneous swarm started deliberately misassigned (both fast peers on
// stage 0 via --prefer-stage, slow emulated peers 2/2/2 on the others) is fixed by the
// router's rebalancer while it trains: a fast peer leaves stage 0, no stage is ever emptied,
// and both the router's modelled bottleneck and the measured throughput rise.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <thread>

#include "runtime/client.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

// One status poll: when, how many microbatches were done, the router's routing view.
struct Sample {
  double t_s = 0;
  uint64_t completed = 0;
  size_t moves = 0;
  double min_stage = 0;
  double ideal = 0;
  std::vector<int> ready_per_stage;
};

// Completed microbatches per second between the first sample at or after t0 and the last at or
// before t1; 0 when the window holds fewer than two samples.
double rate(const std::vector<Sample>& s, double t0, double t1) {
  const Sample* a = nullptr;
  const Sample* b = nullptr;
  for (const auto& x : s) {
    if (!a && x.t_s >= t0) a = &x;
    if (x.t_s <= t1) b = &x;
  }
  if (!a || !b || b->t_s - a->t_s < 0.5) return 0;
  return double(b->completed - a->completed) / (b->t_s - a->t_s);
}

}  // namespace

// Real compute of the slow peers is padded 16x and of the fast ones 4x (4:1), so the whole swarm
// needs under one core even after rebalancing: on a 2-core machine a CPU-bound swarm could not
// get faster by moving peers. The measured numbers are printed for the log.
TEST(Hetero, RebalancerFixesAMisassignedSwarm) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  // The default schedule. It pinned `async_local` while it asked the router's model to rise,
  // which under `async` once rose only 1.5% over the moves; asking the measured rate, it passed
  // sixteen runs of sixteen under `async` (docs/schedules.md, "Steps in a peer's measured speed").
  json spec = tiny_job(data, 4, 100000, "async");
  spec["model"] = {{"vocab_size", 256}, {"d_model", 96}, {"n_head", 4}, {"n_layer", 4}, {"seq_len", 48}};
  spec["batch"] = {{"batch_size", 64}, {"microbatch_size", 8}};
  spec["max_inflight"] = 16;
  spec["diloco"]["inner_steps"] = 100000;  // no round, so no barrier, inside the test
  spec["eval"] = {{"every_steps", 0}, {"batches", 1}};
  // A check every 2 s (two agree before a move): the pipeline of 16× slowed peers completes its
  // first microbatches before the first move, so "before" has something to measure (with 1.5 s
  // the first move came at 3.2 s and "before" was once 0). Not much later: with 3 s the first
  // move once came at 21 s, by when the router's model of the misplaced swarm had risen to
  // within 10% of the rebalanced one's.
  spec["routing"] = {{"mode", "swarm"}, {"rebalance", true}, {"rebalance_period_s", 2.0}, {"cooldown_s", 1.5}, {"min_gain", 0.1}};

  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  for (int i = 0; i < 2; ++i) swarm.start_stage(-1, "fast" + std::to_string(i), 1, {"--prefer-stage", "0", "--emulate", "4"});
  for (int s = 1; s < 4; ++s)
    for (int i = 0; i < 2; ++i)
      swarm.start_stage(-1, "slow" + std::to_string(s) + std::to_string(i), 1, {"--prefer-stage", std::to_string(s), "--emulate", "16"});
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 8);
  const uint64_t job = submit(c, spec);

  // Phase 1: until the job runs with every peer ready. Phase 2 ("before", after half a second
  // of warm-up): until the first move. Phase 3: until no move for 5 s, every peer is ready
  // again and the rebalancer has nothing more to move. Phase 4 ("after"): 5 s more; a move inside it starts phase 3 again. The whole test
  // is bounded by 75 s (about 25 s when all goes well).
  const auto t0 = Clock::now();
  auto now_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  std::vector<Sample> samples;
  json last;
  double running_s = -1, first_move_s = -1, last_move_s = -1, settled_s = -1, before_min = 0, before_ideal = 0;
  size_t moves_seen = 0;
  bool emptied = false;
  while (now_s() < 75) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    last = c.request_body(wire::MsgType::kStatus, json{{"job_id", job}});
    const std::string state = last.value("state", std::string());
    ASSERT_TRUE(state == "loading" || state == "running") << last.dump();
    if (state != "running") continue;
    Sample x;
    x.t_s = now_s();
    x.completed = last["microbatches"]["completed"].get<uint64_t>();
    x.moves = last["routing"]["moves"].size();
    x.min_stage = last["routing"].value("min_stage_samples_per_s", 0.0);
    x.ideal = last["routing"].value("ideal_samples_per_s", 0.0);
    x.ready_per_stage = last["peers_per_stage"].get<std::vector<int>>();
    samples.push_back(x);
    int ready = 0;
    for (int n : x.ready_per_stage) ready += n;
    if (running_s < 0 && ready == 8) running_s = x.t_s;
    if (running_s < 0) continue;
    if (*std::min_element(x.ready_per_stage.begin(), x.ready_per_stage.end()) == 0) emptied = true;
    if (x.moves > moves_seen) {
      if (first_move_s < 0) first_move_s = x.t_s;
      last_move_s = x.t_s;
      moves_seen = x.moves;
      settled_s = -1;  // a move inside the measuring window: settle and measure again
    }
    if (first_move_s < 0) before_min = x.min_stage, before_ideal = x.ideal;
    // Settled: no move for 5 s, every peer ready, and the last check found nothing to move (a
    // plan of several moves takes two checks per move, so quiet alone is not enough).
    const bool nothing_to_move = last["routing"].value("rebalance", std::string()).rfind("no move", 0) == 0;
    if (first_move_s >= 0 && settled_s < 0 && ready == 8 && x.t_s - last_move_s >= 5 && nothing_to_move) settled_s = x.t_s;
    if (settled_s >= 0 && x.t_s - settled_s >= 5) break;
    if (first_move_s < 0 && x.t_s - running_s > 30) break;  // no move: the assertions say so
  }
  const json peers = c.request_body(wire::MsgType::kPeers, json::object())["peers"];
  c.request_body(wire::MsgType::kCancel, json{{"job_id", job}});
  const json& routing = last["routing"];
  const double before = first_move_s > 0 ? rate(samples, running_s + 0.5, first_move_s - 0.2) : 0;
  const double after = settled_s > 0 ? rate(samples, settled_s, 1e9) : 0;
  std::cout << "hetero: running at " << running_s << " s, first move at " << first_move_s << " s, last at " << last_move_s
            << " s, settled at " << settled_s << " s; microbatches/s before " << before << ", after " << after
            << "; router min stage samples/s before " << before_min << ", after " << routing.value("min_stage_samples_per_s", 0.0)
            << "; ideal " << before_ideal << " before, " << routing.value("ideal_samples_per_s", 0.0) << " after\nmoves " << routing["moves"].dump() << "\nlast reason: "
            << routing.value("rebalance", std::string()) << std::endl;

  ASSERT_GT(running_s, 0) << "the job never ran with all 8 peers ready: " << last.dump();
  ASSERT_GT(first_move_s, 0) << "no move within 30 s; last reason: " << routing.value("rebalance", std::string());
  ASSERT_GT(settled_s, 0) << "the rebalancer kept moving peers: " << routing["moves"].dump();
  EXPECT_FALSE(emptied) << "a stage had no ready peer at some poll";
  bool left_stage0 = false;
  for (const auto& m : routing["moves"])
    if (m["from"] == 0 && m["to"] != 0 && m["peer"].get<std::string>().rfind("fast", 0) == 0) left_stage0 = true;
  EXPECT_TRUE(left_stage0) << "no fast peer moved out of stage 0: " << routing["moves"].dump();
  int fast_on_0 = 0;
  for (const auto& p : peers)
    if (p["name"].get<std::string>().rfind("fast", 0) == 0 && p["stage"] == 0) fast_on_0++;
  EXPECT_LT(fast_on_0, 2) << "both fast peers are on stage 0 at the end: " << peers.dump();
  // The measured rate, not the router's model of it, is what is asked to have risen. The model's
  // figures are the peers' measured speeds, which move with the machine's load: it rose 5% in a
  // run whose measured rate rose 59%, and in CI it stood at 91.2 samples/s before the first move
  // (at 6.2 s) and 70.1 after settling (its ideal 99.9 then), in a run whose measured rate rose
  // 18% (8.7 -> 10.3 microbatches/s). Both figures are printed above for a failure's reader.
  ASSERT_GT(before, 0);
  EXPECT_GT(after, 1.1 * before) << "microbatches/s before " << before << ", after " << after;
}
