// fault.h: the fault injector: seeded, replayable faults a stage server applies to itself.
//
// Defines swarm::FaultPoint (where a fault is checked), FaultAction (what it does), FaultSpec
// (one fault: action, point, triggers, parameters; text form `ACTION[,key=value...]` and a JSON
// form), FaultPlan (a seed and a list of faults, from a file), FaultInjector (thread-safe: it
// decides at each opportunity which faults fire and keeps the freeze/partition/zombie state),
// and two frame helpers the stage server uses on raw messages (`peek_type`,
// `corrupt_frames`). Compiled in everywhere, inert until a fault is added. The syntax and the
// semantics are documented in docs/faults.md, "Injecting faults".
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

namespace swarm {

// Where a fault is checked. Each check is one "opportunity":
//   before_send     each reply the stage server sends (not heartbeats, HELLO, BYE)
//   after_recv      each request it receives (not the router's heartbeats, WELCOME, ERROR, BYE, CHAOS)
//   before_compute  each request the compute thread takes up
//   after_compute   each request the compute thread has computed, before its reply is encoded
//   heartbeat       each heartbeat the stage server sends (one per heartbeat_ms)
enum class FaultPoint { kBeforeSend, kAfterRecv, kBeforeCompute, kAfterCompute, kHeartbeat };

enum class FaultAction {
  kCrash,      // raise(SIGKILL) on itself
  kFreeze,     // stop everything (heartbeats too) for duration_s, then carry on
  kZombie,     // keep heartbeating, answer nothing, for duration_s
  kSlow,       // pad the compute time of a hop to `factor` times
  kDrop,       // the message is lost
  kDelay,      // the message is held back delay_ms
  kDuplicate,  // the message goes out (or is taken in) twice
  kCorrupt,    // one byte of the message is flipped so that the receiver's checks catch it
  kPartition,  // no traffic in or out, heartbeats included, for duration_s
  kNan,        // the reply's output tensor (and loss) is NaN/Inf
  kLie,        // the reply is a plausible lie (stages/liar.h): a wrong parameter count, outsized
               // outputs or outer gradients, inflated samples, a false hash, a bad donor state
  kOverflow,   // the backward of a FORWARD_LOSS or BACKWARD overflows, as fp16 gradients can:
               // its gradients become non-finite (what loss scaling must catch; docs/gpu.md)
};

const char* fault_point_name(FaultPoint p);
const char* fault_action_name(FaultAction a);

// One fault. Triggers are all optional and combine with AND: the fault is eligible at an
// opportunity of its point once every trigger given holds; then it fires with probability p,
// at most `count` times.
struct FaultSpec {
  FaultAction action = FaultAction::kCrash;
  FaultPoint point = FaultPoint::kBeforeCompute;
  int on = 0;               // only at messages of this wire::MsgType ("on=round_begin"); 0: any
  uint64_t after = 0;       // requests received since the fault was armed, at least (0: no condition)
  uint64_t step = 0;        // the peer's optimizer steps taken, at least (0: no condition)
  double after_s = 0;       // seconds since the fault was armed, at least (0: no condition)
  double p = 1.0;           // probability of firing at each eligible opportunity, in [0, 1]
  uint64_t count = 1;       // most firings; 0 = unlimited
  double duration_s = 0;    // freeze, zombie, partition: how long, in s; 0 = forever
  double factor = 4.0;      // slow: compute time multiplier, >= 1
  double delay_ms = 200.0;  // delay: how long a message is held back

  // A spec of this action with that action's defaults (point, count).
  static FaultSpec defaults(FaultAction action);
  bool operator==(const FaultSpec& o) const;
  bool operator!=(const FaultSpec& o) const { return !(*this == o); }
};

// The action's default point and count: crash and overflow before_compute, slow/nan after_compute,
// drop/delay/duplicate/corrupt before_send, freeze/zombie/partition after_recv; count 1 for
// crash/freeze/zombie/partition/overflow, unlimited for the rest.
FaultPoint default_point(FaultAction a);
uint64_t default_count(FaultAction a);

// "slow,factor=10", "corrupt,p=0.05,point=after_recv". Throws InputError naming the bad
// key or value and what is allowed.
FaultSpec parse_fault(const std::string& text);
// {"action": "slow", "factor": 10}, or a string in the text form.
FaultSpec parse_fault_json(const nlohmann::json& j);
// Canonical text: the action, then only the keys that differ from its defaults (slow always
// shows factor, delay always shows delay_ms). parse_fault(to_string(s)) == s.
std::string to_string(const FaultSpec& s);
// Every key that applies to the action. parse_fault_json(to_json(s)) == s.
nlohmann::json to_json(const FaultSpec& s);

// A plan file: {"seed": 7, "faults": [ {"action": ...} or "ACTION,...", ... ]}.
struct FaultPlan {
  uint64_t seed = 1;
  std::vector<FaultSpec> faults;
};
FaultPlan parse_fault_plan(const nlohmann::json& j);
FaultPlan load_fault_plan(const std::string& path);  // throws InputError (missing file, bad JSON, bad fault)

// What the injector knows about an opportunity.
struct FaultContext {
  uint64_t requests = 0;    // requests received so far (the one at hand included)
  uint64_t step = 0;        // the peer's optimizer steps taken
  int msg_type = 0;         // wire::MsgType of the message at hand; 0 when none
  bool has_output = true;   // the reply will carry an output (nan applies only then)
};

// A fault that fired, with what the caller needs to carry it out.
struct FaultHit {
  FaultAction action = FaultAction::kCrash;
  size_t index = 0;         // the spec's index in the injector
  std::string spec;         // to_string of the spec, for logs
  double duration_s = 0, factor = 1, delay_ms = 0;
  uint64_t random = 0;      // a seeded draw for the caller's own choices (which byte to corrupt)
};

class FaultInjector {
 public:
  using ClockFn = std::function<double()>;  // monotonic seconds
  // All randomness derives from `seed`; `clock` defaults to std::chrono::steady_clock.
  explicit FaultInjector(uint64_t seed, ClockFn clock = nullptr);

  // Arms a fault now: its after_s and after count from this call. `requests_now` is the
  // number of requests received so far (its `after` counts requests beyond it). Returns its index.
  size_t add(const FaultSpec& spec, uint64_t requests_now = 0);
  bool armed() const { return armed_; }
  std::vector<FaultSpec> specs() const;
  uint64_t fired(size_t index) const;  // firings so far of spec `index`
  uint64_t seed() const { return seed_; }

  // The faults that fire at this opportunity, in the order they were added. Logs each at warn
  // level. Freeze, partition and zombie firings also start that state (see below).
  std::vector<FaultHit> check(FaultPoint point, const FaultContext& ctx);

  // States started by freeze, partition and zombie firings; each ends on its own.
  bool frozen() const;
  bool partitioned() const;
  bool zombie() const;
  double frozen_until() const;       // clock seconds; +inf: forever; <= now(): not frozen
  double partitioned_until() const;
  double now() const;

 private:
  struct Armed {
    FaultSpec spec;
    std::string text;
    double armed_at = 0;
    uint64_t requests_at = 0;
    uint64_t opportunities = 0;  // eligible opportunities seen: the draw's counter
    uint64_t fired = 0;
  };
  bool applies(const Armed& a, FaultPoint point, const FaultContext& ctx) const;
  bool eligible(const Armed& a, const FaultContext& ctx, double now) const;
  void start_state(const FaultSpec& s, double now);

  const uint64_t seed_;
  ClockFn clock_;
  std::atomic<bool> armed_{false};
  mutable std::mutex mu_;
  std::vector<Armed> faults_;
  double frozen_until_ = -std::numeric_limits<double>::infinity();
  double partitioned_until_ = -std::numeric_limits<double>::infinity();
  double zombie_until_ = -std::numeric_limits<double>::infinity();
};

// The message type in a raw message's envelope (frame 0), or nullopt when it has none.
std::optional<int> peek_type(const std::vector<zmq::message_t>& frames);

// Flips one byte of a raw message so that its receiver rejects it: a byte of a tensor frame
// (the frame's checksum no longer matches) when there is one, else the first byte of the body
// (the msgpack map header), which then no longer parses as a map. `random` picks the frame,
// the byte and the bit pattern. The frame is copied first: a shared payload is never touched.
void corrupt_frames(std::vector<zmq::message_t>& frames, uint64_t random);

}  // namespace swarm
