// sim_cli.cpp: implements tools/sim_cli.h.
#include "tools/sim_cli.h"

#include <cstdio>
#include <iostream>

#include "sim/simulator.h"

namespace swarm {

namespace {

using nlohmann::json;

double num(const json& j, const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : 0.0; }

// One readable line per trace line that a person follows.
void print_line(const json& j) {
  const std::string ev = j.value("event", std::string());
  const double t = num(j, "t_s");
  if (ev == "start") {
    std::printf("sim %s: %d peers, %d stages, hops %s, seed %llu, %.0f s%s\n", j["scenario"].get<std::string>().c_str(), j["peers"].get<int>(),
                j["stages"].get<int>(), j["hops"].get<std::string>().c_str(), (unsigned long long)j["seed"].get<uint64_t>(), num(j, "duration_s"),
                j.value("synthetic_data", false) ? " (the job's data files are not here: made-up tokens)" : "");
  } else if (ev == "sample") {
    std::printf("t %8.1f s  %-8s step %-6d tokens/s %10.0f  ideal %10.0f  (%.2f; FLOPs to hops %.2f, recomputes %.2f)  peers %d  %s\n", t,
                j.value("state", std::string("-")).c_str(), j.value("step", 0), num(j, "tokens_per_s"), num(j, "ideal_tokens_per_s"),
                num(j, "vs_ideal"), num(j, "hop_share"), num(j, "recompute_share"), j.value("peers_alive", 0), j.value("reason", std::string()).c_str());
  } else if (ev == "move" || ev == "quarantine" || ev == "stage_restore" || ev == "job_end") {
    std::printf("t %8.1f s  %s: %s\n", t, ev.c_str(), j.value("text", std::string()).c_str());
  } else if (ev == "fault") {
    std::printf("t %8.1f s  fault %s: %s\n", t, j["kind"].get<std::string>().c_str(), j["peers"].dump().c_str());
  } else if (ev == "paused") {
    std::printf("t %8.1f s  paused: stage(s) %s have no ready peer\n", t, j["stages"].dump().c_str());
  } else if (ev == "resumed") {
    std::printf("t %8.1f s  resumed after %.1f s\n", t, num(j, "after_s"));
  } else if (ev == "router_down" || ev == "router_up" || ev == "running" || ev == "submitted") {
    std::printf("t %8.1f s  %s\n", t, ev.c_str());
  } else if (ev == "log") {
    std::printf("t %8.1f s  router %s: %s\n", t, j["level"].get<std::string>().c_str(), j["text"].get<std::string>().c_str());
  }
  // crash and rejoin lines are many in a large swarm: the summary counts them.
}

}  // namespace

int run_sim(const std::string& path, bool as_json, std::optional<uint64_t> seed, int threads) {
  sim::Scenario sc;
  try {
    sc = sim::load_scenario(path);
  } catch (const InputError& e) {
    std::cerr << "swarm sim: " << e.what() << std::endl;
    return 2;
  }
  sim::SimOptions o;
  o.seed = seed;
  o.threads = threads;
  o.on_line = [&](const json& j) {
    if (as_json) std::cout << j.dump() << "\n";
    else print_line(j);
  };
  sim::SimResult r;
  try {
    r = sim::simulate(sc, o);
  } catch (const sim::ScenarioError& e) {
    std::cerr << "swarm sim: " << e.what() << std::endl;
    return 2;
  }
  if (as_json) {
    std::cout << r.perf.dump() << std::endl;
  } else {
    const json& s = r.summary;
    const json& job = s["job"];
    std::printf("\njob %s after %.0f virtual s: %s%s\n", job.value("state", std::string("?")).c_str(), num(s, "virtual_s"),
                job.contains("microbatches") ? job["microbatches"].dump().c_str() : "", job.value("reason", std::string()).empty() ? "" : ("\n  " + job["reason"].get<std::string>()).c_str());
    std::printf("last hour: %.0f tokens/s, ideal %.0f, %.3f of it; moves %llu, quarantined %llu, paused %llu time(s)\n", num(s["last_hour"], "tokens_per_s"),
                num(s["last_hour"], "ideal_tokens_per_s"), num(s["last_hour"], "vs_ideal"), (unsigned long long)job.value("moves", 0ull),
                (unsigned long long)job.value("quarantined", 0ull), (unsigned long long)s["paused"].value("times", 0ull));
    std::printf("  of the live peers' FLOPs: %.3f to hops, %.3f of them recomputing forwards; time computing, by group:",
                num(s["last_hour"], "hop_share"), num(s["last_hour"], "recompute_share"));
    const json busy = s["last_hour"].value("busy", json::object());
    for (const auto& [group, share] : busy.items()) std::printf(" %s %.2f", group.c_str(), share.get<double>());
    std::printf("\n");
    std::printf("traffic: %s\n", s["traffic"].dump().c_str());
    std::printf("core: %.0f events per CPU second (%.2f us each), %.1f virtual s per wall s on %d thread(s)\n", num(r.perf, "core_events_per_cpu_s"),
                num(r.perf, "core_us_per_event"), num(r.perf, "virtual_per_wall"), int(num(r.perf, "threads")));
  }
  for (const std::string& u : r.unmet) std::cerr << "swarm sim: expectation missed: " << u << std::endl;
  return r.unmet.empty() ? 0 : 1;
}

}  // namespace swarm
