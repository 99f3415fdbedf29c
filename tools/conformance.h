// conformance.h: `swarm conformance`, the kit that checks a stage server against the peer
// contract (docs/model.md, docs/protocol.md#conformance).
//
// Defines swarm::ConformanceOptions, ConformanceCheck and run_conformance. The kit plays the
// router for two peers at once: a reference `swarm-stage` and the peer under test, both loaded
// with the same stage of a small job. It sends both the same messages (HELLO/WELCOME,
// heartbeats, LOAD_STAGE, the work requests, STEP, a round, a state transfer) and compares
// every answer; then it sends the peer under test damaged and misplaced messages and checks
// the typed errors. Each check has a name and a sentence; no torch here (tensors compare as
// fp32 bytes).
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace swarm {

struct ConformanceOptions {
  std::string peer_command;       // shell command; "{router}" becomes the kit's endpoint
  std::string reference_command;  // the same for the reference; "" -> swarm-stage beside this binary
  int stage = 1;                  // the stage of the 3-stage test job the peer serves (0, 1 or 2)
  double reply_timeout_s = 60;    // a request unanswered this long fails its check
  std::string log_dir;            // the peers' logs; "" -> a new folder under /tmp
};

struct ConformanceCheck {
  std::string name;    // e.g. "forward", "round_apply_hash"
  bool ok = false;
  std::string detail;  // what was expected and what came, or what was measured
};

// Runs every check in order, calling `report` as each completes; returns them all. Throws
// InputError when the kit itself cannot start (a bad option, no socket).
std::vector<ConformanceCheck> run_conformance(const ConformanceOptions& opt,
                                              const std::function<void(const ConformanceCheck&)>& report);

}  // namespace swarm
