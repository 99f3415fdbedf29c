// sim_cli.h: `swarm sim SCENARIO.json [--json] [--seed N]` (docs/scale.md): runs a scenario in
// the simulator (sim/simulator.h) and prints its trace, as JSON lines or as readable lines.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace swarm {

// Returns the exit code: 0 when the run met the scenario's expectations (or it has none), 1 when
// it missed one (each is printed), 2 for a scenario that does not parse.
int run_sim(const std::string& path, bool json, std::optional<uint64_t> seed, int threads = 0);

}  // namespace swarm
