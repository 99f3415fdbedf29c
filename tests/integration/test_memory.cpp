// test_memory.cpp: a stage server told it has little memory (swarm-stage --memory-mb) keeps only
// the forward graphs that fit in its affinity cache, says so in HELLO, in its heartbeats, on
// /metrics and in its log, and the swarm still trains to the end with nothing lost: the
// backwards whose graphs were not kept recompute their forwards.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "runtime/client.h"
#include "runtime/http.h"
#include "runtime/memory_estimate.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;

TEST(Memory, APeerWithLittleMemoryCachesWhatFitsAndTheSwarmStillTrains) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  const json job = tiny_job(data, 2, 40, "async");
  const JobSpec spec = parse_job_spec(job, /*check_files=*/false);
  ASSERT_GE(spec.max_inflight, 3);
  // Room for stage 0 with one graph cached and half another: the cache keeps one.
  const auto need = [&](int entries) {
    return estimate_stage_memory(spec, 0, Precision::kFp32, false, false, entries).need_bytes(false);
  };
  const int64_t limit = need(1) + (need(2) - need(1)) / 2;
  const double limit_mb = double(limit) / double(1 << 20);

  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  std::ostringstream mb;
  mb.precision(17);
  mb << limit_mb;
  swarm.start_stage(0, "small", 1, {"--memory-mb", mb.str(), "--http", "127.0.0.1:0"});
  swarm.start_stage(1, "s1", 1);
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 2);
  const uint64_t id = submit(c, job);
  // The small peer as the router sees it (its HELLO and its last heartbeat) and its own /metrics
  // page, once it has done backwards: a busy peer sends every fourth heartbeat only
  // (timing::next_heartbeat_s), so on a short job the first such heartbeat may come after it.
  json small;
  std::string page;
  auto look = [&] {
    const json peers = c.request_body(wire::MsgType::kPeers, json::object());
    for (const json& p : peers["peers"]) {
      if (p["name"] != "small" || p["heartbeat"]["backwards"].get<uint64_t>() == 0) continue;
      small = p;
      const http::Response r = http::get(p["metrics"].get<std::string>());
      if (r.status == 200) page = r.body;
    }
  };
  const json st = follow_to_end(c, id, 240, 100, [&](const json&) { look(); });
  ASSERT_EQ(st["state"], "done") << st.dump();
  for (int i = 0; i < 50 && small.is_null(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    look();
  }
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["microbatches"]["completed"], 40 * spec.microbatches_per_step());

  ASSERT_FALSE(small.is_null()) << "no heartbeat of the small peer with backwards done";
  EXPECT_EQ(small["stage"], 0);
  // HELLO says what --memory-mb allows, not what the machine has free.
  EXPECT_NEAR(small["device_memory_free_bytes"].get<double>(), double(limit), double(1 << 20)) << small.dump();
  // Its cache held one graph: with several microbatches in flight most backwards recomputed.
  const json& hb = small["heartbeat"];
  EXPECT_GT(hb["recomputes"].get<uint64_t>(), hb["cache_hits"].get<uint64_t>()) << hb.dump();
  EXPECT_EQ(hb["cache_entries"], 1) << hb.dump();
  ASSERT_FALSE(page.empty());
  EXPECT_EQ(metric_sample(page, "swarm_stage_graph_cache_entries"), 1) << page;
  EXPECT_GT(metric_sample(page, "swarm_stage_backward_graphs_total{graph=\"recomputed\"}"), 0) << page;
  std::ifstream log(swarm.log_dir() + "/small.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("affinity cache: 1 graph(s)"), std::string::npos) << text;
}
