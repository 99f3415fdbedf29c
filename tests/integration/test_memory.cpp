// test_memory.cpp: a stage server told it has little memory (swarm-stage --memory-mb) keeps only
// the forward graphs that fit in its affinity cache, says so in HELLO, in its heartbeats, on
// /metrics and in its log, and the swarm still trains to the end with nothing lost: the
// backwards whose graphs were not kept recompute their forwards. And what stage servers keep for
// one another peer to peer is all released by the end of a job.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
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

// Peer to peer, a stage server keeps what it made for others to fetch, and a copy of what its
// training hops fetched or were pushed (a BACKWARD that comes back to the peer of its forward
// finds its input there). The router releases all of it as the microbatches' stages are done, so
// once the job ends the servers hold nothing: not the copies (they would otherwise wait for
// --cache-ttl-s, 120 s, hundreds of tensors a server on the bundled example), not a gradient pushed
// ahead to a peer whose backward went elsewhere, not what an EVAL was pushed.
TEST(Memory, StageServersHoldNothingOnceTheirJobIsDone) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json job = tiny_job(data, 2, 40, "async");
  job["eval"] = {{"every_steps", 10}, {"batches", 4}};
  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 2; ++i) swarm.start_stage(s, "s" + std::to_string(s) + "-" + std::to_string(i), 1, {"--http", "127.0.0.1:0"});
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 4);
  const uint64_t id = submit(c, job);
  const json st = follow_to_end(c, id, 240);
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["hops"]["mode"], "p2p");

  // The last RELEASEs go out within a quarter of a second of the job's end.
  std::vector<std::string> urls;
  const json peers = c.request_body(wire::MsgType::kPeers, json::object());
  for (const json& p : peers["peers"]) urls.push_back(p.value("metrics", std::string()));
  ASSERT_EQ(urls.size(), 4u) << peers.dump();
  std::map<std::string, std::string> pages;
  double held = -1, fetches = 0;
  for (int i = 0; i < 50 && held != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    held = fetches = 0;
    for (const std::string& u : urls) {
      const http::Response r = http::get(u);
      ASSERT_EQ(r.status, 200) << u;
      pages[u] = r.body;
      ASSERT_GE(metric_sample(r.body, "swarm_stage_held_tensors"), 0) << u << " does not say what it holds\n" << r.body;
      held += metric_sample(r.body, "swarm_stage_held_tensors");
      fetches += metric_sample(r.body, "swarm_stage_fetches_total");
    }
  }
  EXPECT_GT(fetches, 0) << "no tensor went peer to peer";
  // A hop sent again elsewhere (its deadline passed on a busy machine) has its first peer's copies
  // released, but a push still on its way to that peer arrives after the RELEASE and waits for its
  // time to live. Nothing else stays.
  const double resent = st["microbatches"]["resent"].get<double>() + st["microbatches"]["duplicates"].get<double>();
  EXPECT_LE(held, 2 * resent) << "resent " << resent << "; " << st["microbatches"].dump();
  if (held > 2 * resent)
    for (const auto& [u, page] : pages) ADD_FAILURE() << u << "\n" << page;
}
