// bench_hosts.cpp: `swarm bench hosts`: one job on namespaced hosts with shaped links
// (tools/hosts.h), hops through the router and peer to peer (docs/hosts.md).
//
// Defines run_hosts_bench (bench.h). Every run makes fresh hosts: the router on host 0 and
// each stage server on a host of its own, every link shaped by tbf to the same rate each way.
// Three runs of the same job, each on its own fresh hosts: 4 stages x 2 peers with
// `routing.hops: "hub"`, the same with "p2p", and 4 stages x 1 peer with "p2p". The model is
// small and its hops large for its compute (the bundled example's d_model 128 blocks, one a
// stage, fp32 activations of 4 x 64 tokens: 128 KiB a hop), and the rate low enough that the
// links, not the 2 cores, set the pace: each run reports the compute its processes spent per
// second of the window and every link's bytes per second, so that what binds is on record.
// Hops are kept small against the rate (one crosses a link in 65 ms) because hop deadlines
// follow a peer's measured speed slowly: at 0.5 MiB a hop and 1 MB/s the hub's queued hops
// passed their deadlines and were re-sent over and over (docs/hosts.md). Figures:
// router_link_share (bytes on the router's link ÷ tensor bytes moved, peer to peer, the whole
// run), p2p_vs_hub, two_pipelines_vs_one, diloco_max_peer_share (the job ends with one DiLoCo
// round), lost.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <thread>

#include "runtime/client.h"
#include "tools/bench.h"
#include "tools/bench_common.h"
#include "tools/hosts.h"
#include "tools/local_swarm.h"

namespace swarm {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kStages = 4;
constexpr double kRateMbit = 16;         // every link, each way: 2 MB/s
constexpr double kPollS = 1.0;           // status polls: they cross the router's link too
// The router's liveness: a peer silent for 20 s is gone (the default is 1.5 s). Through the
// hub a heartbeat waits behind the tensors queued on the same connection (at 0.5 MiB a hop,
// 16 in flight and 1 MB/s: seconds, and the default declared live peers dead over and over);
// both modes run with the same setting.
// The client submits from another host, so the router reads data only under --data-root: the
// bundled example's folder (docs/security.md).
const std::vector<std::string> kRouterArgs = {"--heartbeat-ms", "1000", "--liveness", "20", "--data-root", "/usr/share/games/fortunes"};
// The measured window: from the microbatch this share of the run's total completed to this one
// (start-up, the pipeline filling and draining, and the final round left out).
constexpr double kWindowFrom = 0.15, kWindowTo = 0.85;

json bench_job() {
  json j = example_job();
  j["name"] = "bench_hosts";
  j["batch"] = {{"batch_size", 16}, {"microbatch_size", 4}};
  j["schedule"] = "async";
  j["max_inflight"] = 24;  // 12 left two pipelines' links idler (two_pipelines_vs_one 1.54 against 1.71 to 1.77)
  j["eval"] = {{"every_steps", 0}, {"batches", 2}};
  j["compression"] = {{"activations", "fp32"}, {"gradients", "fp32"}, {"outer", "fp32"}};
  // One round at the end, as measured: the job's default warm start (a third of the steps
  // syncing every step, flushing the pipeline each time) would put the stage groups' exchanges
  // on these links at every step of the first third.
  j["diloco"]["warm_start_steps"] = 0;
  return j;
}

struct Case {
  const char* name;
  const char* hops;
  int peers;  // per stage
  int steps;
};

// CPU seconds (user + system) the processes have used so far; a process gone counts 0.
double cpu_seconds(const std::vector<pid_t>& pids) {
  double sum = 0;
  for (pid_t p : pids)
    if (p) sum += swarm::cpu_seconds("/proc/" + std::to_string(p) + "/stat");
  return sum;
}

json link_json(const LinkBytes& b) { return json{{"sent", b.sent}, {"received", b.received}}; }
LinkBytes minus(const LinkBytes& a, const LinkBytes& b) { return LinkBytes{a.sent - b.sent, a.received - b.received}; }

// One run on fresh hosts. Returns the figures' inputs and the raw numbers.
json run_case(const Case& cs, bool as_json) {
  HostsOptions ho;
  ho.count = 1 + kStages * cs.peers;
  ho.rate_mbit = kRateMbit;
  Hosts hosts(ho);
  auto place = [&](size_t i) { return Place{hosts.exec_prefix(i), hosts.address(i)}; };
  LocalSwarm swarm(temp_dir("hosts"));
  swarm.start_router(kRouterArgs, place(0));
  for (int s = 0; s < kStages; ++s)
    for (int k = 0; k < cs.peers; ++k)
      swarm.start_stage(s, "stage" + std::to_string(s) + "-" + std::to_string(k), 1, {}, place(size_t(1 + s * cs.peers + k)));
  Client c(swarm.router_endpoint());
  const size_t want = size_t(kStages * cs.peers);
  for (int i = 0; c.request_body(wire::MsgType::kPeers, json::object())["peers"].size() < want; ++i) {
    if (i == 600)
      throw std::runtime_error(std::string("hosts bench: the ") + cs.name + " run's stage servers did not all register within 30 s; see " +
                               swarm.log_dir());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  json j = bench_job();
  j["steps"] = cs.steps;
  j["routing"]["hops"] = cs.hops;
  j["diloco"]["inner_steps"] = cs.steps;  // one round, at the end
  const int tokens_per_mb = j["batch"]["microbatch_size"].get<int>() * j["model"]["seq_len"].get<int>();

  std::vector<LinkBytes> at_start;
  for (size_t i = 0; i < hosts.size(); ++i) at_start.push_back(hosts.bytes(i));
  const LinkBytes client_start = hosts.root_bytes();
  const uint64_t id = c.request_body(wire::MsgType::kSubmit, json{{"spec", j}}).at("job_id").get<uint64_t>();
  std::vector<std::pair<double, double>> trace;  // (seconds since submit, microbatches completed)
  std::vector<std::vector<LinkBytes>> link_trace;
  std::vector<double> cpu_trace;  // CPU seconds of the router and the stage servers
  std::vector<double> tensor_trace;  // hop tensor bytes moved so far (wire_bytes: activations + gradients)
  std::vector<LinkBytes> client_trace;  // this process's own traffic with the router so far
  std::vector<pid_t> pids = {swarm.router_pid()};
  for (const auto& p : swarm.stages()) pids.push_back(p.pid);
  const auto t0 = Clock::now();
  json st;
  for (;;) {
    st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    trace.emplace_back(t, st["microbatches"].value("completed", 0.0));
    std::vector<LinkBytes> links;
    for (size_t i = 0; i < hosts.size(); ++i) links.push_back(hosts.bytes(i));
    link_trace.push_back(links);
    cpu_trace.push_back(cpu_seconds(pids));
    tensor_trace.push_back(st["wire_bytes"].value("activations", 0.0) + st["wire_bytes"].value("gradients", 0.0));
    client_trace.push_back(hosts.root_bytes());
    const std::string state = st.value("state", std::string());
    if (state == "done" || state == "failed" || state == "cancelled") break;
    if (t > 900) throw std::runtime_error(std::string("hosts bench: the ") + cs.name + " run did not finish in 900 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(int(kPollS * 1000)));
  }
  const LinkBytes client = minus(hosts.root_bytes(), client_start);
  std::vector<LinkBytes> link(hosts.size());
  for (size_t i = 0; i < hosts.size(); ++i) link[i] = minus(hosts.bytes(i), at_start[i]);
  swarm.stop_all();
  if (st.value("state", std::string()) != "done")
    throw std::runtime_error(std::string("hosts bench: the ") + cs.name + " run failed: " + st.value("reason", std::string()));

  // The window: microbatches per second between the polls where the run had completed
  // kWindowFrom and kWindowTo of its microbatches.
  const double total = trace.back().second;
  size_t a = 0, b = trace.size() - 1;
  while (a < trace.size() && trace[a].second < kWindowFrom * total) ++a;
  while (b > 0 && trace[b - 1].second >= kWindowTo * total) --b;
  if (a >= b) throw std::runtime_error(std::string("hosts bench: the ") + cs.name + " run was too short to measure");
  const double window_s = trace[b].first - trace[a].first;
  const double tokens_per_s = (trace[b].second - trace[a].second) * tokens_per_mb / window_s;
  // Each link's bytes per second over the window, each way: what the links carried while
  // the rate was measured, against what tbf lets through.
  json link_rates = json::array();
  double busiest = 0;
  for (size_t i = 0; i < hosts.size(); ++i) {
    const LinkBytes d = minus(link_trace[b][i], link_trace[a][i]);
    const double out = double(d.sent) / window_s, in = double(d.received) / window_s;
    busiest = std::max({busiest, out, in});
    link_rates.push_back({{"host", i}, {"out_bytes_per_s", out}, {"in_bytes_per_s", in}});
  }
  const double cores_busy = (cpu_trace[b] - cpu_trace[a]) / window_s;
  // The same share over the window alone: training hops only (no start, no round, no snapshot).
  const double window_tensor = tensor_trace[b] - tensor_trace[a];
  const double window_router = double(minus(link_trace[b][0], link_trace[a][0]).total()) -
                               double(minus(client_trace[b], client_trace[a]).total());
  // The router's link before the window (loading the stages, the pipeline filling) and after
  // it (draining, the round, the snapshot after it, the final evaluation), polls left out.
  const double head_router = double(minus(link_trace[a][0], at_start[0]).total()) - double(minus(client_trace[a], client_start).total());
  const json& wb = st["wire_bytes"];
  const double tensor_bytes = wb.value("activations", 0.0) + wb.value("gradients", 0.0) + wb.value("outer", 0.0);
  // The router's link, less this process's own status polls (the bridge's counters: the
  // root namespace talks to the router only).
  const double router_link = double(link[0].total()), router_link_less_client = router_link - double(client.total());
  // DiLoCo: the most any one peer sent + received in the job's last round ÷ the group's average.
  double max_share = 0;
  json share_by_stage = json::array();
  {
    std::map<int, std::vector<double>> per_stage;  // stage -> each peer's sent + received
    for (const auto& [name, by] : st["outer_peer_bytes"].items()) {
      const int s = std::atoi(name.c_str() + 5);  // "stageS-K"
      per_stage[s].push_back(by.value("sent", 0.0) + by.value("received", 0.0));
    }
    for (const auto& [s, v] : per_stage) {
      double sum = 0, mx = 0;
      for (double x : v) sum += x, mx = std::max(mx, x);
      const double share = sum > 0 ? mx / (sum / double(v.size())) : 0.0;
      max_share = std::max(max_share, share);
      share_by_stage.push_back({{"stage", s}, {"peers", v.size()}, {"max_share", share}});
    }
  }
  const json& mb = st["microbatches"];
  json out{{"case", cs.name},
           {"hops", cs.hops},
           {"stages", kStages},
           {"peers_per_stage", cs.peers},
           {"rate_mbit", kRateMbit},
           {"steps", cs.steps},
           {"tokens_per_s", tokens_per_s},
           {"window_s", window_s},
           {"elapsed_s", st["elapsed_s"]},
           {"tensor_bytes", tensor_bytes},
           {"wire_bytes", wb},
           {"hops_status", st["hops"]},
           {"router_link_bytes", link_json(link[0])},
           {"client_bytes", link_json(client)},
           {"router_link_share", tensor_bytes > 0 ? router_link_less_client / tensor_bytes : 0.0},
           {"router_link_share_with_client", tensor_bytes > 0 ? router_link / tensor_bytes : 0.0},
           {"window_router_link_bytes", window_router},
           {"window_tensor_bytes", window_tensor},
           {"window_router_link_share", window_tensor > 0 ? window_router / window_tensor : 0.0},
           {"head_router_link_bytes", head_router},
           {"tail_router_link_bytes", router_link_less_client - head_router - window_router},
           {"busiest_link_bytes_per_s", busiest},
           {"cores_busy", cores_busy},
           {"cores", std::thread::hardware_concurrency()},
           {"link_limit_bytes_per_s", kRateMbit * 1e6 / 8},
           {"link_bytes_per_s", link_rates},
           {"outer_peer_bytes", st["outer_peer_bytes"]},
           {"diloco_max_peer_share", max_share},
           {"diloco_share_by_stage", share_by_stage},
           {"microbatches", mb},
           {"val_loss", st["val_loss"]},
           {"lost", mb.value("lost", 0)}};
  char text[512];
  std::snprintf(text, sizeof(text),
                "%-10s %d x %d, hops %-3s: %7.0f tokens/s over %.0f s; router link %.1f MB (%.1f MB less this bench's polls), tensors "
                "moved %.1f MB; busiest link %.0f%% of its rate, %.2f cores busy; lost %d",
                cs.name, kStages, cs.peers, cs.hops, tokens_per_s, window_s, router_link / 1e6, router_link_less_client / 1e6,
                tensor_bytes / 1e6, 100 * busiest / (kRateMbit * 1e6 / 8), cores_busy, mb.value("lost", 0));
  json line{{"bench", "hosts"}};
  line.update(out);
  emit(as_json, line, text);
  return out;
}

}  // namespace

int run_hosts_bench(bool as_json) {
  const std::string why = Hosts::probe();
  if (!why.empty()) {
    std::cerr << "swarm bench hosts: cannot make namespaced hosts here: " << why << std::endl;
    return 1;
  }
  const Case cases[] = {{"hub", "hub", 2, 24}, {"p2p", "p2p", 2, 80}, {"p2p_4x1", "p2p", 1, 40}};
  json raw = json::object();
  for (const Case& cs : cases) raw[cs.name] = run_case(cs, as_json);
  auto tps = [&](const char* c) { return raw[c]["tokens_per_s"].get<double>(); };
  const int lost = raw["hub"]["lost"].get<int>() + raw["p2p"]["lost"].get<int>() + raw["p2p_4x1"]["lost"].get<int>();
  json summary{{"bench", "hosts"},
               {"figures", {{"router_link_share", {{"value", raw["p2p"]["router_link_share"]}, {"target", "<= 0.02"}}},
                            {"p2p_vs_hub", {{"value", tps("p2p") / tps("hub")}, {"target", ">= 1.8"}}},
                            {"two_pipelines_vs_one", {{"value", tps("p2p") / tps("p2p_4x1")}, {"target", ">= 1.7"}}},
                            {"diloco_max_peer_share", {{"value", raw["p2p"]["diloco_max_peer_share"]}, {"target", "<= 2.5"}}},
                            {"lost", {{"value", lost}, {"target", "0"}}}}},
               {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

}  // namespace swarm
