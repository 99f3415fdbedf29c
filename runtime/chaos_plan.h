// chaos_plan.h: process-level chaos for whole-system tests: what to kill, stop, resume or
// restart, and when.
//
// Defines swarm::ChaosAction, ChaosEvent (one-shot at `at_s`, or periodic every `every_s`),
// ChaosPlan (a seed, the events, and per-peer faults given to peers as --fault at start),
// `parse_chaos_plan`/`load_chaos_plan` (JSON, throwing InputError that names the bad key), and
// the pure, seeded helpers the runner uses: `chaos_fire_time` (when a periodic event fires the
// k-th time, jitter included) and `chaos_pick` (which of n candidate peers "random" means).
// tools/local_swarm.h runs a plan against real processes; the format is in docs/faults.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/fault.h"

namespace swarm {

enum class ChaosAction {
  kKill,     // SIGKILL (SIGCONT first if stopped); restart_after_s > 0 starts it again later
  kStop,     // SIGSTOP; duration_s > 0 sends SIGCONT that much later
  kCont,     // SIGCONT
  kRestart,  // SIGKILL if running, then start it again with the same arguments
};
const char* chaos_action_name(ChaosAction a);

struct ChaosEvent {
  ChaosAction action = ChaosAction::kKill;
  std::string peer = "random";  // a peer name ("stage1-0") or "random": one picked from the seed
  double at_s = -1;             // one-shot: seconds after the chaos starts; -1 when periodic
  double every_s = 0;           // periodic: seconds between firings; 0 when one-shot
  double start_s = -1;          // periodic: first firing; -1: at every_s
  uint64_t count = 0;           // periodic: most firings; 0 = until the chaos stops
  double jitter_s = 0;          // each firing moves later by a seeded draw in [0, jitter_s)
  double duration_s = 0;        // stop: resume after this many s; 0: until a cont event or the end
  double restart_after_s = 0;   // kill: start it again after this many s; 0: it stays down

  bool periodic() const { return every_s > 0; }
};

struct ChaosPlan {
  uint64_t seed = 1;
  std::vector<ChaosEvent> events;
  std::map<std::string, std::vector<FaultSpec>> faults;  // peer name -> faults it starts with

  // The swarm-stage arguments for a peer of this name: "--fault SPEC"... and a
  // "--fault-seed N" derived from the plan's seed and the name; empty when it has no faults.
  std::vector<std::string> stage_args(const std::string& peer) const;
};

ChaosPlan parse_chaos_plan(const nlohmann::json& j);
ChaosPlan load_chaos_plan(const std::string& path);  // throws InputError

// When firing k (0, 1, ...) of event `index` is due, in seconds after the chaos starts.
double chaos_fire_time(const ChaosPlan& plan, size_t index, uint64_t k);
// Which of n candidates (n > 0) firing k of event `index` picks when its peer is "random".
size_t chaos_pick(uint64_t seed, size_t index, uint64_t k, size_t n);

}  // namespace swarm
