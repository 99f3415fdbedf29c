// worker.h: the compute side of a stage server: the stage's model, its inner optimizer, and
// the peer's side of the within-stage round.
//
// Defines swarm::SharedStats (what the compute thread tells the I/O thread for heartbeats) and
// swarm::Worker, which answers one request at a time with one reply: LOAD_STAGE, the hops
// (FORWARD, FORWARD_LOSS, BACKWARD, EVAL), STEP, the round (ROUND_BEGIN, ROUND_REDUCE,
// ROUND_APPLY) and the state transfers (STATE_REQUEST, STATE_LOAD). Bad input is answered with
// an ERROR that names the request tensor at fault, when it is one (docs/protocol.md); the
// process is never harmed by it. Injected faults (stages/stage_faults.h) act around each request.
#pragma once

#include <atomic>
#include <chrono>
#include <list>
#include <map>
#include <memory>
#include <mutex>

#include "runtime/codec_spec.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "runtime/messages.h"
#include "runtime/precision.h"
#include "stages/stage_faults.h"
#include "stages/stage_server.h"

namespace swarm {

class StageModel;
class AdamW;
namespace compression {
class ErrorFeedback;
}

// What the I/O thread needs to make the tokens and targets of a hop the router sent without
// them (Hop.own_tokens): the loaded job's data, when this stage samples its own (its load found
// the router's data under --data-root).
struct OwnTokens {
  std::shared_ptr<const TokenData> data;
  uint64_t job = 0, seed = 0;
  int samples = 0, seq_len = 0, stage = -1, stages = 0;
};

struct SharedStats {
  std::atomic<int> stage{-1};
  std::atomic<uint64_t> job_id{0};
  std::atomic<bool> ready{false};
  std::atomic<double> ms_per_unit{0};
  std::atomic<uint64_t> forwards{0}, backwards{0}, cache_hits{0}, recomputes{0}, steps{0}, errors{0};
  std::atomic<uint64_t> overflows{0}, skipped_steps{0};  // mixed precision (stages/precision.h)
  std::atomic<double> loss_scale{0};                      // 0: no loss scaling
  std::atomic<double> compute_s{0};                       // hops' compute time so far [s] (written by the compute thread only)
  std::atomic<int64_t> cache_entries{-1};                 // graphs the affinity cache may keep for the loaded stage; -1: none loaded
  std::mutex own_mu;                                      // guards own: the compute thread sets it at each load
  std::shared_ptr<const OwnTokens> own;                   // null: the router sends this stage its tokens
};

class Worker {
 public:
  Worker(const StageOptions& opt, SharedStats& stats, StageFaults& faults, const DeviceCaps& caps);
  ~Worker();
  // Handles one request (number `seq` since the process started, for fault triggers) and returns
  // the reply: an ERROR for bad input.
  wire::Message handle(wire::Message& req, uint64_t seq = 0);
  // After the reply to handle() went out: work that no reply waits for (async: the step a
  // backward marked `closes_step` ended).
  void after_reply();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace swarm
