// simulator.h: `swarm sim`: the router's real core (router/core.h) against simulated stage
// servers, in virtual time, in one process (docs/scale.md), on up to two threads.
//
// Defines swarm::sim::SimOptions, SimResult and `simulate`. The core is the one swarm-router
// runs; around it the simulator plays the world: stage servers that answer with tensors of the
// right description after the time their device profile says (sim/costs.h, sim/stage_replies.h),
// links with bandwidth and latency that every message's bytes cross (the sender's uplink and
// the receiver's downlink; through the router under routing.hops "hub", holder to receiver
// under "p2p"), heartbeats, a client that submits the job, an in-memory disk for the state dir,
// and the scenario's faults. Every random draw comes from one seeded generator in event order,
// time is virtual, and containers whose order matters are ordered: the same scenario and seed
// give the same trace, byte for byte. Only `SimResult::perf` (the core's CPU time per event,
// wall time) differs between runs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/scenario.h"

namespace swarm::sim {

struct SimOptions {
  std::optional<uint64_t> seed;                            // overrides the scenario's seed
  std::function<void(const nlohmann::json&)> on_line;      // every trace line, as it is made
  bool measure_cpu = true;                                 // time each call into the core (a monotonic clock)
  // The router's side and the peers' side on two threads (2) or interleaved on one (1); 0: two
  // where the links' latencies allow it (a message between the sides takes time) and the machine
  // has two cores. The trace is the same either way.
  int threads = 0;
};

struct SimResult {
  nlohmann::json summary;            // the trace's last line: what happened (deterministic)
  nlohmann::json perf;               // the core's CPU per event, wall time, virtual time per wall second
  std::vector<std::string> unmet;    // the scenario's `expect` entries the run missed, each a sentence
};

// Runs the scenario to its duration or the job's end. Throws ScenarioError for a scenario the
// router refuses (its job spec), InternalError for a broken invariant of the core.
SimResult simulate(const Scenario& s, const SimOptions& opt = {});

}  // namespace swarm::sim
