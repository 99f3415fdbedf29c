// bench_sim.cpp: `swarm bench sim` (see bench.h): the simulator (sim/simulator.h) against a real
// swarm, and at scale.
//
// sim_vs_real: the bundled example on 4 stages x 2 peers, run for real (`swarm local`'s
//   processes, tools/local_swarm.h); each peer's speed, the slower of its own compute figure
//   (its heartbeat's ms per work unit) and the router's turnaround per unit for it, each its
//   mean rate over the run, becomes a measured profile; the simulator runs the same job on those profiles; its tokens/s / the
//   real one.
// sim_vs_real_hetero: the same with the hetero bench's emulated mix (2 a100-like peers,
//   --emulate 2, and 6 t4-like, --emulate 8), pinned to the best assignment of that mix
//   (one a100-like on each of stages 0 and 1, three t4-like on each of stages 2 and 3).
// sim_1000_vs_ideal, virtual_per_wall, core_events_per_s: examples/sim/scale/swarm_1000.json
//   (1,000 peers, 25% a100-like, 75% t4-like, started badly placed, 32 stages, churn, 1 Gbit/s
//   links) for its simulated hour (SWARM_SIM_BENCH_S sets another length: 600 takes a minute
//   here); tokens/s over the last simulated hour (the whole run, its start included) / the ideal
//   bound. The second half's figure, which the bench reported before the simulator ran on two
//   threads, is in `raw`.
// core_events_per_s_10000: examples/sim/scale/swarm_10000.json, reported (SWARM_SIM_BENCH_10000=0
//   skips it).
// lost: the most microbatches lost in any of these runs.
#include <chrono>
#include <map>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "runtime/client.h"
#include "runtime/job_spec.h"
#include "sim/simulator.h"
#include "tools/bench.h"
#include "tools/local_swarm.h"

namespace swarm {

namespace {

using nlohmann::json;

const std::string kSource = SWARM_SOURCE_DIR;

void say(bool as_json, const json& j, const std::string& text) {
  if (as_json) std::cout << j.dump() << std::endl;
  else std::cout << text << std::endl;
}

// The bundled example as the real run and the simulation both train it: async, no round or
// evaluation inside the measured steps.
json example_job(int steps) {
  json j = sim::load_scenario(kSource + "/examples/sim/tiny_local.json").job_json;
  j["steps"] = steps;
  j["schedule"] = "async";
  j["diloco"]["inner_steps"] = 1000;
  j["eval"] = {{"every_steps", 0}, {"batches", 2}};
  return j;
}

// The real swarm: tokens/s of its training (the router's figure) and, for each peer, its stage,
// its own ms per work unit (from its heartbeat: compute only) and the router's turnaround per
// unit (request to reply: compute, decoding and encoding, fetches, and the wait for a core).
struct RealRun {
  struct Peer {
    int stage = -1;
    double compute_ms = 0, turnaround_ms = 0;
  };
  double tokens_per_s = 0;
  std::vector<Peer> peers;        // each peer over the whole run: the harmonic mean of its polled figures
  std::vector<Peer> last_poll;    // each peer at the last poll (the calibration before; for comparison)
  uint64_t lost = 0;
};

// A real peer: its stage and the arguments it starts with.
struct RealPeer {
  int stage;
  std::vector<std::string> args;
};

RealRun real_run(const json& job, const std::vector<RealPeer>& peers) {
  char tmpl[] = "/tmp/swarm-bench-sim-XXXXXX";
  const std::string dir = mkdtemp(tmpl) ? tmpl : "/tmp";
  LocalSwarm swarm(dir);
  swarm.start_router();
  for (size_t i = 0; i < peers.size(); ++i) swarm.start_stage(peers[i].stage, "peer" + std::to_string(i), 1, peers[i].args);
  Client c(swarm.router_endpoint());
  for (int i = 0; i < 400 && c.request_body(wire::MsgType::kPeers, json::object())["peers"].size() < peers.size(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const uint64_t id = c.request_body(wire::MsgType::kSubmit, json{{"spec", job}}).at("job_id").get<uint64_t>();
  // Polled until done; the peers' speeds are read while they work. The real tokens/s is the
  // run's average, so each peer's speed is too: the mean of its polled rates (1 / ms per unit),
  // not the figure of one moment, which moves with this machine's load.
  struct Rates {
    int stage = -1;
    double compute = 0, turnaround = 0;   // sums of 1 / ms per unit
    int n = 0;
  };
  std::map<std::string, Rates> rates;
  json st;
  RealRun r;
  for (int i = 0; i < 1800; ++i) {
    st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
    const std::string state = st.value("state", std::string());
    if (state == "done" || state == "failed" || state == "cancelled") break;
    if (state == "running") {
      const json peers = c.request_body(wire::MsgType::kPeers, json{{"offset", 0}, {"limit", 100}})["peers"];
      std::vector<RealRun::Peer> now;
      for (const json& p : peers) {
        // Its own figure (compute only); else what the router measured (transfers included).
        const double ms = p["heartbeat"].value("ms_per_unit", 0.0) > 0 ? p["heartbeat"]["ms_per_unit"].get<double>() : p.value("ms_per_unit", 0.0);
        const double turnaround = p.value("turnaround_ms", 0.0);
        if (ms > 0 && p["stage"].get<int>() >= 0) now.push_back({p["stage"].get<int>(), ms, turnaround > 0 ? turnaround : ms});
      }
      if (now.size() == peers.size()) {
        r.last_poll = now;
        for (size_t k = 0; k < now.size(); ++k) {
          Rates& a = rates[peers[k].value("name", std::to_string(k))];
          if (a.stage != now[k].stage) a = Rates{now[k].stage};   // moved: its figures start again
          a.compute += 1.0 / now[k].compute_ms;
          a.turnaround += 1.0 / now[k].turnaround_ms;
          a.n++;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  for (const auto& [name, a] : rates) r.peers.push_back({a.stage, a.n / a.compute, a.n / a.turnaround});
  r.tokens_per_s = st.value("tokens_per_s", 0.0);
  r.lost = st["microbatches"].value("lost", uint64_t(0));
  swarm.stop_all();
  if (st.value("state", std::string()) != "done") throw std::runtime_error("the real run failed: " + st.value("reason", std::string()));
  return r;
}

// The same swarm simulated: one measured profile per real peer, pinned to its stage. A unit of
// its work costs the slower of its compute figure and its turnaround, as the router's deadlines
// count it (Peer::deadline_ms_per_unit): the simulator's peers pay nothing for decoding, encoding
// and checksums and never wait for a core, and here eight peers and the router share two.
// `compute_only`: at the compute figure alone (the calibration before turnarounds), for comparison.
json simulated(const json& job, const RealRun& real, bool compute_only, uint64_t* lost) {
  json sc = json::parse(R"({"name": "sim_vs_real", "seed": 1, "duration_s": 3600, "sample_s": 5})");
  sc["job"] = job;
  sc["router"] = {{"link", {{"gbps", 40}, {"latency_ms", 0.05}}}};
  sc["profiles"] = json::object();
  sc["peers"] = json::array();
  for (size_t i = 0; i < real.peers.size(); ++i) {
    const int stage = real.peers[i].stage;
    const double ms = compute_only ? real.peers[i].compute_ms : std::max(real.peers[i].compute_ms, real.peers[i].turnaround_ms);
    const std::string name = "measured" + std::to_string(i);
    sc["profiles"][name] = {{"base", "cpu"}, {"ms_per_unit", ms > 0 ? ms : 1.0}, {"on_stage", stage}};
    sc["peers"].push_back({{"name", "peer" + std::to_string(i)}, {"profile", name}, {"stage", stage}, {"link", {{"gbps", 40}, {"latency_ms", 0.05}}}});
  }
  sim::SimOptions o;
  o.measure_cpu = false;
  if (real.peers.empty()) throw std::runtime_error("the real swarm listed no peers");
  const sim::SimResult r = sim::simulate(sim::parse_scenario(sc, kSource + "/examples/sim"), o);
  *lost = std::max(*lost, r.summary["job"]["microbatches"].value("lost", uint64_t(0)));
  return r.summary;
}

// A scale scenario for `seconds` of virtual time: its summary, its perf line and tokens/s over
// the ideal across the samples of its second half.
struct ScaleRun {
  json summary, perf;
  double vs_ideal = 0;
  // Over the same half, the share of the live peers' FLOPs that went to hops, and to forwards
  // recomputed for backwards whose graph was not cached (sim/report.cpp).
  double hop_share = 0, recompute_share = 0;
};

ScaleRun scale_run(const std::string& file, double seconds) {
  sim::Scenario s = sim::load_scenario(kSource + "/examples/sim/scale/" + file);
  if (seconds > 0) s.duration_s = seconds;
  std::vector<json> samples;
  sim::SimOptions o;
  o.on_line = [&](const json& j) {
    if (j.value("event", std::string()) == "sample") samples.push_back(j);
  };
  const sim::SimResult r = sim::simulate(s, o);
  double tok = 0, ideal = 0, hop = 0, recompute = 0;
  for (const json& j : samples) {
    if (j["t_s"].get<double>() - j["window_s"].get<double>() < s.duration_s / 2 - 1e-9) continue;
    const double w = j["ideal_tokens_per_s"].get<double>() * j["window_s"].get<double>();   // the capacity's weight
    tok += j["tokens_per_s"].get<double>() * j["window_s"].get<double>();
    ideal += w;
    hop += j.value("hop_share", 0.0) * w;
    recompute += j.value("recompute_share", 0.0) * w;
  }
  return ScaleRun{r.summary, r.perf, ideal > 0 ? tok / ideal : 0.0, ideal > 0 ? hop / ideal : 0.0, ideal > 0 ? recompute / ideal : 0.0};
}

}  // namespace

int run_sim_bench(bool as_json) {
  uint64_t lost = 0;
  // 1. The simulator against the real thing: 4 x 2 one-thread peers, and the emulated mix.
  const json job = example_job(60);
  const int S = job["partition"]["stages"].get<int>();
  std::vector<RealPeer> even, mix;
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < 2; ++i) even.push_back({s, {}});
  for (int s : {0, 1}) mix.push_back({s, {"--emulate", "2"}});
  for (int s : {2, 2, 2, 3, 3, 3}) mix.push_back({s, {"--emulate", "8"}});
  struct Calibration {
    const char* name;
    RealRun real;
    double sim_tps = 0, ratio = 0;
  };
  std::vector<Calibration> cal;
  for (const auto& [name, peers] : {std::pair<const char*, const std::vector<RealPeer>&>{"sim_vs_real", even}, {"sim_vs_real_hetero", mix}}) {
    Calibration k{name, real_run(job, peers)};
    lost = std::max(lost, k.real.lost);
    k.sim_tps = simulated(job, k.real, false, &lost)["job"].value("tokens_per_s", 0.0);
    k.ratio = k.real.tokens_per_s > 0 ? k.sim_tps / k.real.tokens_per_s : 0.0;
    // The calibration before turnarounds counted, for comparison: each peer at its compute figure.
    const double compute_only = simulated(job, k.real, true, &lost)["job"].value("tokens_per_s", 0.0);
    // And before the run's mean: each peer at its figures of the last poll.
    RealRun at_last = k.real;
    at_last.peers = k.real.last_poll;
    const double last_poll = simulated(job, at_last, false, &lost)["job"].value("tokens_per_s", 0.0);
    json measured = json::array();
    for (const RealRun::Peer& p : k.real.peers)
      measured.push_back({{"stage", p.stage}, {"ms_per_unit", p.compute_ms}, {"turnaround_ms", p.turnaround_ms}});
    say(as_json, {{"bench", "sim"}, {"case", name}, {"real_tokens_per_s", k.real.tokens_per_s}, {"sim_tokens_per_s", k.sim_tps},
                  {"sim_tokens_per_s_compute_only", compute_only}, {"sim_tokens_per_s_last_poll", last_poll}, {"peers", measured}},
        std::string(name) + ": real " + std::to_string(k.real.tokens_per_s) + " tokens/s, simulated " + std::to_string(k.sim_tps) + " (" +
            std::to_string(k.ratio) + "; at compute speeds alone " + std::to_string(compute_only) + ", at the last poll's speeds " +
            std::to_string(last_poll) + ")");
    cal.push_back(std::move(k));
  }

  // 2. A thousand peers, and ten thousand.
  const char* env = std::getenv("SWARM_SIM_BENCH_S");
  const ScaleRun k1 = scale_run("swarm_1000.json", env ? std::atof(env) : 0.0);
  lost = std::max(lost, k1.summary["job"]["microbatches"].value("lost", uint64_t(0)));
  const double seconds = k1.summary.value("virtual_s", 0.0);
  const double last_hour = k1.summary["last_hour"].value("vs_ideal", 0.0);
  say(as_json, {{"bench", "sim"}, {"case", "swarm_1000"}, {"virtual_s", seconds}, {"vs_ideal_last_hour", last_hour}, {"vs_ideal_second_half", k1.vs_ideal},
                 {"hop_share_second_half", k1.hop_share}, {"recompute_share_second_half", k1.recompute_share}, {"summary", k1.summary}, {"perf", k1.perf}},
      "1,000 peers, " + std::to_string(int(seconds)) + " virtual s: " + std::to_string(last_hour) + " of the ideal over the last hour (" +
          std::to_string(k1.vs_ideal) + " over the second half); core " +
          std::to_string(k1.perf.value("core_events_per_cpu_s", 0.0)) + " events per CPU s; " + std::to_string(k1.perf.value("virtual_per_wall", 0.0)) +
          " virtual s per wall s; of the peers' FLOPs " + std::to_string(k1.hop_share) + " went to hops, " +
          std::to_string(k1.recompute_share) + " of them to recomputed forwards");
  // The 10,000-peer run's 60 virtual s take about 8 s here (docs/scale.md): SWARM_SIM_BENCH_10000=0
  // leaves it out.
  ScaleRun k10;
  k10.perf = json::object();
  const char* ten = std::getenv("SWARM_SIM_BENCH_10000");
  if (!ten || std::string(ten) != "0") {
    k10 = scale_run("swarm_10000.json", 0);
    lost = std::max(lost, k10.summary["job"]["microbatches"].value("lost", uint64_t(0)));
    say(as_json, {{"bench", "sim"}, {"case", "swarm_10000"}, {"summary", k10.summary}, {"perf", k10.perf}},
        "10,000 peers: core " + std::to_string(k10.perf.value("core_events_per_cpu_s", 0.0)) + " events per CPU s");
  }

  json summary{{"bench", "sim"},
               {"figures",
                {{"sim_vs_real", {{"value", cal[0].ratio}, {"target", "0.85 to 1.15"}}},
                 {"sim_vs_real_hetero", {{"value", cal[1].ratio}, {"target", "0.85 to 1.15"}}},
                 {"sim_1000_vs_ideal", {{"value", last_hour}, {"target", ">= 0.85 (the last simulated hour" + std::string(seconds < 3600 ? ": the whole " + std::to_string(int(seconds)) + " s run" : "") + ")"}}},
                 {"core_events_per_s", {{"value", k1.perf.value("core_events_per_cpu_s", 0.0)}, {"target", ">= 200000 (1,000 peers)"}}},
                 {"core_events_per_s_10000", {{"value", k10.perf.value("core_events_per_cpu_s", 0.0)}, {"target", "report (10,000 peers)"}}},
                 {"virtual_per_wall", {{"value", k1.perf.value("virtual_per_wall", 0.0)}, {"target", ">= 60 (1,000 peers)"}}},
                 {"lost", {{"value", lost}, {"target", "0"}}}}},
               {"raw", {{"real_tokens_per_s", cal[0].real.tokens_per_s}, {"sim_tokens_per_s", cal[0].sim_tps},
                        {"hetero_real_tokens_per_s", cal[1].real.tokens_per_s}, {"hetero_sim_tokens_per_s", cal[1].sim_tps}, {"sim_1000_virtual_s", seconds},
                        {"sim_1000_vs_ideal_second_half", k1.vs_ideal}, {"sim_1000_hop_share", k1.hop_share}, {"sim_1000_recompute_share", k1.recompute_share}, {"perf_1000", k1.perf}, {"perf_10000", k10.perf}, {"last_hour_1000", k1.summary["last_hour"]}}}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

}  // namespace swarm
