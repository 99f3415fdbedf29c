// test_sim.cpp: the simulator (sim/simulator.h) with the router's real core: the same seed gives
// the same trace byte for byte, a stage that loses its last peer pauses the job and resumes it,
// scenarios are checked field by field, and every scenario of the regression corpus
// (examples/sim/*.json) meets its own `expect`; a link shares its rate between transfers.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/memory_estimate.h"
#include "sim/simulator.h"
#include "sim/world.h"

namespace swarm::sim {
namespace {

using nlohmann::json;

const std::string kCorpus = std::string(SWARM_SOURCE_DIR) + "/examples/sim";

// A link carries transfers side by side, as TCP flows share it: a small transfer that starts
// behind a large one ends long before it, and the large one ends when both would have ended one
// after the other (the link's work is conserved).
TEST(Sim, ALinkSharesItsRateSoASmallTransferDoesNotWaitBehindALargeOne) {
  Pipe link;
  const double big = link.carry(0.0, 8.0);     // 8 s alone
  const double small = link.carry(1.0, 0.01);  // 10 ms alone, starting 1 s later
  EXPECT_DOUBLE_EQ(big, 8.0);
  EXPECT_NEAR(small, 1.02, 1e-9);              // half the rate while the large one lasts
  EXPECT_LT(small, big);
  EXPECT_NEAR(link.free_s, 8.01, 1e-9);
  // Once everything ended, a transfer has the link to itself again.
  EXPECT_NEAR(link.carry(20.0, 1.0), 21.0, 1e-9);
  EXPECT_NEAR(link.busy_s, 9.01, 1e-9);
}

// The whole trace of a run, one JSON line per event.
std::string trace_of(const Scenario& s, std::optional<uint64_t> seed = std::nullopt, int threads = 0) {
  std::string out;
  SimOptions o;
  o.seed = seed;
  o.threads = threads;
  o.measure_cpu = false;
  o.on_line = [&](const json& j) { out += j.dump() + "\n"; };
  simulate(s, o);
  return out;
}

// A small swarm with churn and faults: what a replay must reproduce.
Scenario churny() {
  Scenario s = load_scenario(kCorpus + "/churn.json");
  s.trace_logs = true;   // every line the router logged is in the trace too
  return s;
}

TEST(Sim, TheSameSeedGivesTheSameTraceByteForByte) {
  const Scenario s = churny();
  const std::string a = trace_of(s), b = trace_of(s);
  EXPECT_GT(a.size(), 5000u);
  EXPECT_NE(a.find("\"event\":\"crash\""), std::string::npos);   // the seeded churn happened
  EXPECT_EQ(a, b);
  // And the seed matters: another one crashes other peers at other times.
  EXPECT_NE(a, trace_of(s, 99));
}

// The router's side and the peers' side on two threads take the same events in the same order
// as on one: churn and faults, a restarted router, tensors through the router, a rebalancing
// swarm with pushes peer to peer, and churn again with no latency on one side of the links.
TEST(Sim, TwoThreadsGiveTheSameTraceAsOne) {
  std::vector<Scenario> cases{churny(), load_scenario(kCorpus + "/router_restart.json"), load_scenario(kCorpus + "/hub.json"),
                              load_scenario(kCorpus + "/rebalance_many.json")};
  cases[3].duration_s = 120;
  // With no latency one way, the other way's is the whole lookahead.
  Scenario instant_router = churny(), instant_peers = churny();
  instant_router.router_link.latency_s = 0;
  for (PeerGroup& g : instant_peers.groups) g.link.latency_s = 0;
  cases.push_back(instant_router);
  cases.push_back(instant_peers);
  for (const Scenario& s : cases) {
    SCOPED_TRACE(s.name);
    const std::string one = trace_of(s, std::nullopt, 1), two = trace_of(s, std::nullopt, 2);
    EXPECT_GT(one.size(), 2000u);
    EXPECT_EQ(one, two);
  }
  // Without latency between the router and the peers there is nothing to run ahead on.
  Scenario instant = load_scenario(kCorpus + "/tiny_local.json");
  instant.router_link.latency_s = 0;
  for (PeerGroup& g : instant.groups) g.link.latency_s = 0;
  try {
    trace_of(instant, std::nullopt, 2);
    ADD_FAILURE() << "two threads ran without a lookahead";
  } catch (const ScenarioError& e) {
    EXPECT_NE(std::string(e.what()).find("latency"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(trace_of(instant).empty());   // the default interleaves them
}

TEST(Sim, AStageThatLosesItsLastPeerPausesTheJobAndResumesWhenPeersReturn) {
  Scenario s = load_scenario(kCorpus + "/kill_stage.json");
  std::vector<json> lines;
  SimOptions o;
  o.measure_cpu = false;
  o.on_line = [&](const json& j) { lines.push_back(j); };
  const SimResult r = simulate(s, o);
  EXPECT_TRUE(r.unmet.empty()) << r.unmet.front();
  double paused = -1, resumed = -1;
  for (const json& j : lines) {
    if (j["event"] == "paused" && paused < 0) {
      paused = j["t_s"].get<double>();
      EXPECT_EQ(j["stages"], json::array({2}));
    }
    if (j["event"] == "resumed" && paused >= 0 && resumed < 0) resumed = j["t_s"].get<double>();
  }
  // Killed at 8 s, back 6 s later: paused within the liveness window, resumed once they reload.
  EXPECT_GE(paused, 8.0);
  EXPECT_LT(paused, 10.0);
  EXPECT_GT(resumed, 14.0);
  EXPECT_LT(resumed, 30.0);
  const json& job = r.summary["job"];
  EXPECT_EQ(job["state"], "done");
  EXPECT_EQ(job["microbatches"]["lost"], 0);
  EXPECT_EQ(job["microbatches"]["completed"], job["microbatches"]["taken"]);
}

TEST(Sim, ABadScenarioSaysWhatToFix) {
  const json job = json::parse(R"({"data": {"path": "x.txt"}, "partition": {"stages": 2}, "model": {"n_layer": 2}})");
  auto err = [&](json j) {
    try {
      parse_scenario(j, "");
    } catch (const ScenarioError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  json ok{{"job", job}, {"peers", json::array({{{"count", 2}}})}};
  EXPECT_NO_THROW(parse_scenario(ok, ""));
  json typo = ok;
  typo["peers"][0]["cuont"] = 2;
  EXPECT_NE(err(typo).find("unknown key \"cuont\": did you mean \"count\"?"), std::string::npos) << err(typo);
  json prof = ok;
  prof["peers"][0]["profile"] = "h100";
  EXPECT_NE(err(prof).find("profile \"h100\" is not known"), std::string::npos) << err(prof);
  json stage = ok;
  stage["peers"][0]["stage"] = 5;
  EXPECT_NE(err(stage).find("stage must be an integer in [-1, 1]"), std::string::npos) << err(stage);
  json fault = ok;
  fault["faults"] = {{"events", json::array({{{"kind", "explode"}}})}};
  EXPECT_NE(err(fault).find("kind must be one of"), std::string::npos) << err(fault);
  json nopeers = ok;
  nopeers.erase("peers");
  EXPECT_NE(err(nopeers).find("peers must be a non-empty array"), std::string::npos) << err(nopeers);
}

// Peers whose memory holds their stage and one saved graph: their affinity caches keep one, as a
// stage server sizes its own, the backwards whose graphs were dropped recompute their forwards,
// and the same job takes longer but ends with nothing lost.
TEST(Sim, APeerWithLittleMemoryCachesFewerGraphsAndRecomputes) {
  const Scenario roomy = load_scenario(kCorpus + "/tiny_local.json");
  Scenario tight = roomy;
  for (PeerGroup& g : tight.groups) {
    ASSERT_GE(g.stage, 0);
    const auto need = [&](int entries) {
      return estimate_stage_memory(tight.job, g.stage, Precision::kFp32, false, false, entries).need_bytes(false);
    };
    g.says_memory = true;
    g.device.memory_bytes = need(1) + (need(2) - need(1)) / 2;
  }
  SimOptions o;
  o.measure_cpu = false;
  const SimResult a = simulate(roomy, o), b = simulate(tight, o);
  for (const SimResult* r : {&a, &b}) {
    EXPECT_EQ(r->summary["job"]["state"], "done") << r->summary.dump();
    EXPECT_EQ(r->summary["job"]["microbatches"]["lost"], 0);
  }
  // A recomputed forward adds a unit to a 2.5-unit backward on stages 0-2: the run is longer.
  EXPECT_GT(b.summary["virtual_s"].get<double>(), 1.1 * a.summary["virtual_s"].get<double>())
      << a.summary["virtual_s"] << " vs " << b.summary["virtual_s"];
  // Where the peers' capacity went says so: the tight swarm spent a share of it recomputing
  // forwards (a tenth of its hops' FLOPs here), the roomy one next to none; neither delivered more than the hops it computed.
  const nlohmann::json& ra = a.summary["last_hour"];
  const nlohmann::json& rb = b.summary["last_hour"];
  EXPECT_LT(ra["recompute_share"].get<double>(), 0.01) << ra.dump();
  EXPECT_GT(rb["recompute_share"].get<double>(), 0.05 * rb["hop_share"].get<double>()) << rb.dump();
  for (const nlohmann::json* r : {&ra, &rb}) {
    EXPECT_LE((*r)["hop_share"].get<double>(), 1.0) << r->dump();
    EXPECT_LE((*r)["vs_ideal"].get<double>(), (*r)["hop_share"].get<double>() - (*r)["recompute_share"].get<double>() + 0.02) << r->dump();
  }
}

// Two fast peers on stage 0 feed six four-times-slower ones on stages 1-3, the rebalancer off
// and 16 microbatches in flight: the pipeline runs at the slow stages' pace, and the trace says
// so per group. Each peer does the same work per microbatch, so the fast ones, four times as
// fast, compute about a quarter of the time the slow ones do.
TEST(Sim, EachGroupsBusyShareShowsWhichPeersThePipelineStarves) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream(kCorpus + "/hetero_rebalance.json"));
  j["job_patch"]["routing"]["rebalance"] = false;
  j["job_patch"]["batch"] = {{"batch_size", 128}};
  j["job_patch"]["max_inflight"] = 16;
  j["duration_s"] = 300;
  SimOptions o;
  o.measure_cpu = false;
  const SimResult r = simulate(parse_scenario(j, kCorpus), o);
  EXPECT_EQ(r.summary["job"]["microbatches"]["lost"], 0) << r.summary.dump();
  const nlohmann::json& busy = r.summary["last_hour"]["busy"];
  ASSERT_TRUE(busy.contains("fast") && busy.contains("slow")) << busy.dump();
  const double fast = busy["fast"].get<double>(), slow = busy["slow"].get<double>();
  EXPECT_GT(slow, 0.4) << busy.dump();
  EXPECT_LE(slow, 1.0) << busy.dump();
  EXPECT_GT(fast, 0.0) << busy.dump();
  EXPECT_LT(fast, 0.4 * slow) << busy.dump();
}

TEST(Sim, EveryScenarioOfTheCorpusMeetsItsExpectations) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(kCorpus))
    if (e.path().extension() == ".json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 5u);
  for (const std::string& f : files) {
    SCOPED_TRACE(f);
    const Scenario s = load_scenario(f);
    SimOptions o;
    o.measure_cpu = false;
    const SimResult r = simulate(s, o);
    for (const std::string& u : r.unmet) ADD_FAILURE() << f << ": " << u;
    EXPECT_EQ(r.summary["job"]["microbatches"]["lost"], 0) << f;
  }
}

}  // namespace
}  // namespace swarm::sim
