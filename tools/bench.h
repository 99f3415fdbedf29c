// bench.h: `swarm bench NAME [--json]`, each benchmark against a reference measured in the
// same run (docs/benchmarks.md). With --json: JSON lines, the last one the summary
// {"bench": NAME, "figures": {FIGURE: {"value": x, "target": "..."}}, "raw": {...}}.
#pragma once

#include <string>

namespace swarm {

// Returns the process exit code (2 for an unknown name).
int run_bench(const std::string& name, bool json);

// `swarm bench gpu` (bench_gpu.cpp): 2 without a CUDA device or a -DSWARM_CUDA=ON build.
int run_gpu_bench(bool json);

// `swarm bench sim` (bench_sim.cpp): the simulator against a real swarm, at 1,000 peers, and the
// router core's CPU per event at 1,000 and 10,000 peers.
int run_sim_bench(bool json);
// `swarm bench router` (bench_router.cpp): the real router process under 100 and 1,000 peers
// that are sockets of this process: its CPU per message, the core's share, its idle load.
int run_router_bench(bool json);
// `swarm bench hosts` (bench_hosts.cpp): 1 where namespaced hosts cannot be made (not root).
int run_hosts_bench(bool json);

}  // namespace swarm
