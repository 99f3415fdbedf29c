// scenario.h: what `swarm sim SCENARIO.json` runs, parsed and checked (docs/scale.md lists
// every field).
//
// Defines swarm::sim::Scenario and its parts: the job (any job spec, inline or a file), the swarm
// (groups of peers of a device profile, with links, where they start and when they join), the
// router (its link, liveness rule, whether it keeps a state dir), the faults (crash and rejoin
// rates, and timed events: stalls, slow-downs, corrupt or lying results, a whole stage lost,
// the router restarted) and what the run must show (`expect`, for the regression corpus).
// `parse_scenario` throws ScenarioError (an InputError) naming the field and what to change.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "sim/costs.h"

namespace swarm::sim {

class ScenarioError : public InputError {
 public:
  using InputError::InputError;
};

struct LinkSpec {
  double up_bps = 1e9, down_bps = 1e9;   // bits per second each way
  double latency_s = 0.010;              // one way, from the host to the network's core
};

struct PeerGroup {
  std::string name;                // peers are named NAME-0, NAME-1, ...
  int count = 1;
  std::string profile;
  Profile device;                  // the profile, resolved (calibrated to the job when measured)
  LinkSpec link;
  bool listen = true;              // takes fetches (peer to peer); false: relayed
  bool says_memory = true;         // HELLO reports the profile's memory (false: unknown, placed anywhere)
  bool has_data = true;            // its host holds the job's data: as the first or last stage it samples its own tokens (swarm-stage --data-root)
  int stage = -1;                  // --stage (pinned)
  int prefer_lo = -1, prefer_hi = -1;  // --prefer-stage, spread round-robin over [lo, hi]
  double join_s = 0, join_spread_s = 0;  // joins at join_s + uniform [0, spread)
};

struct FaultEvent {
  enum class Kind { kStall, kSlow, kCorrupt, kLie, kKillStage, kCrash, kRestartRouter } kind = Kind::kCrash;
  double at_s = 0;
  int peers = 1;                   // how many peers it hits (chosen by the seeded draw among live ones)
  std::string group;               // only peers of this group ("" any)
  int stage = -1;                  // only peers of this stage (-1 any; kKillStage: the stage)
  double for_s = 0;                // stall, slow: how long; restart_router: down time
  double factor = 1;               // slow: compute takes this many times longer
  double probability = 1;          // corrupt: the fraction of its results that arrive corrupt
  std::string how;                 // lie: "wrong_shape", "bad_inputs", "fast_claims"
  double rejoin_after_s = -1;      // kill_stage, crash: the peers come back after this (-1: never)
};

struct Faults {
  double crash_per_hour = 0;       // per peer: crashes a peer-hour (exponential gaps)
  double rejoin_after_s = 60;      // a crashed peer's process restarts after this (mean; exponential)
  std::vector<FaultEvent> events;  // in time order
};

struct Expect {
  std::optional<std::string> job;  // "done", "running", ... at the end
  std::optional<uint64_t> lost;
  std::optional<double> min_tokens_per_s;     // over the last sample window
  std::optional<double> min_vs_ideal;         // the same, over the ideal bound
  std::optional<bool> paused;                 // the job paused (a stage with no peer) at some point
  std::optional<uint64_t> min_moves;          // rebalancer moves
  std::optional<uint64_t> min_quarantined;
  std::optional<uint64_t> min_rounds;
  std::optional<uint64_t> max_timeouts;       // requests that passed their deadline
};

struct Scenario {
  std::string name;
  std::string dir;                 // the scenario file's folder (relative paths resolve from it)
  uint64_t seed = 1;
  double duration_s = 3600;        // virtual seconds; the run also ends when the job does
  double sample_s = 60;            // a trace sample every this many virtual seconds
  double submit_s = -1;            // when the job is submitted (-1: once every peer of join_s 0 has joined)
  nlohmann::json job_json;         // the job spec as given (files resolved)
  JobSpec job;
  bool synthetic_data = false;     // the job's data files are not at hand: tokens made up
  std::vector<PeerGroup> groups;
  LinkSpec router_link{10e9, 10e9, 0.001};
  int heartbeat_ms = 500, liveness = 3;
  bool state_dir = false;          // the router keeps jobs and checkpoints (in the simulator's memory)
  double tick_s = 0.005;           // the router's poll period
  Faults faults;
  Expect expect;
  bool trace_logs = false;         // every line the router logs goes into the trace
  int total_peers() const;
};

// `text`: the scenario JSON; `dir`: where relative paths (job files, data) resolve from.
Scenario parse_scenario(const nlohmann::json& j, const std::string& dir);
Scenario load_scenario(const std::string& path);

}  // namespace swarm::sim
