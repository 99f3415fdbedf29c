// stage_faults.h: what each injected fault does to a stage server process.
//
// Defines swarm::StageFaults, the stage server's wrapper around runtime/fault.h's
// FaultInjector. The I/O thread passes every raw message through it (incoming requests,
// outgoing replies, heartbeats) and gets back the copies to handle or send now (none when
// dropped, zombie or partitioned; two when duplicated; delayed ones come back later from
// `due_incoming`/`due_outgoing`); the compute thread asks it, around each request, for the
// slowdown and whether to poison the output with NaN. Crash raises SIGKILL here; freeze pauses
// the calling thread in `wait_while_frozen`. Torch-free; the NaN itself is written by the caller.
// Semantics: docs/faults.md, "Injecting faults".
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "runtime/fault.h"

namespace swarm {

using Frames = std::vector<zmq::message_t>;

class StageFaults {
 public:
  // Arms `faults` with `seed`; `steps` is the peer's optimizer step counter; `stop` ends any
  // freeze early (shutdown).
  StageFaults(const std::vector<FaultSpec>& faults, uint64_t seed, const std::atomic<uint64_t>& steps,
              const std::atomic<bool>& stop);

  bool armed() const { return inj_.armed(); }
  bool frozen() const { return inj_.frozen(); }
  bool partitioned() const { return inj_.partitioned(); }
  // How long the partition lasted, in s, once, at the first call after it has ended (the I/O
  // thread calls this every loop); nullopt otherwise.
  std::optional<double> partition_healed();
  // Blocks the calling thread while a freeze lasts (or until stop). Returns true if it waited.
  bool wait_while_frozen();

  // ---- I/O thread ----
  struct Delivery {
    Frames frames;
    uint64_t seq = 0;  // the request's number (1, 2, ...); 0 for session messages
  };
  // A message from the router. Returns false when it never arrived (partitioned): the caller
  // must not count it as heard. Else `out` gets 0, 1 or 2 copies to handle now.
  bool incoming(Frames frames, std::vector<Delivery>& out);
  // A reply (or an error answer) to the router: the copies to send now.
  std::vector<Frames> outgoing(Frames frames);
  // One of our heartbeats: the copies to send now.
  std::vector<Frames> heartbeat(Frames frames);
  // Messages whose delay has passed.
  std::vector<Delivery> due_incoming();
  std::vector<Frames> due_outgoing();
  // The I/O thread's poll timeout: `ms`, or less when a delayed message is due sooner.
  int poll_ms(int ms) const;
  // CHAOS from the router: its fault, "SPEC" or {...}. Throws InputError.
  void add_live(const nlohmann::json& fault);
  uint64_t requests() const { return requests_; }

  // ---- compute thread ----
  struct Compute {
    double slow = 1.0;  // compute time multiplier
    bool nan = false;   // poison the output (and the loss)
    bool overflow = false;  // the backward overflows (its seed becomes +inf)
    bool lie = false;       // the reply is falsified (stages/liar.h)
  };
  // Around one request the compute thread handles: may crash, or freeze before returning.
  Compute before_compute(int msg_type, uint64_t seq, bool has_output);
  Compute after_compute(int msg_type, uint64_t seq, bool has_output);

 private:
  using Clock = std::chrono::steady_clock;
  struct Delayed {
    Clock::time_point due;
    Delivery d;
  };
  FaultContext context(uint64_t requests, int msg_type, bool has_output = true) const;
  // Carries out crash and the message actions of `hits` on `frames`; returns the copies to
  // pass on now (delayed ones go to `later`).
  std::vector<Frames> apply(const std::vector<FaultHit>& hits, Frames frames, uint64_t seq, std::deque<Delayed>& later);
  Compute compute_effects(const std::vector<FaultHit>& hits);

  FaultInjector inj_;
  const std::atomic<uint64_t>& steps_;
  const std::atomic<bool>& stop_;
  std::atomic<uint64_t> requests_{0};
  bool was_partitioned_ = false;
  Clock::time_point partition_began_;
  std::deque<Delayed> later_in_, later_out_;  // I/O thread only
};

}  // namespace swarm
