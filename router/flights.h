// flights.h: microbatches in flight: the hop state machine, where each hop goes, its deadline.
//
// Defines swarm::router::Flight, Slot, Held, FlightConfig and Flights. A training microbatch is
// FORWARD through stages 0..S-2, FORWARD_LOSS on stage S-1, then BACKWARD through S-2..0; an
// evaluation microbatch is EVAL through 0..S-1; a transport-benchmark microbatch is one FORWARD
// to an echo peer. Every stage input and every gradient of a microbatch is kept until the
// microbatch completes, so any live peer of a stage can take a hop, and a hop whose input a
// receiver rejects goes back one stage to the peer that made that input's stage again.
//
// Where a tensor is kept: by the router (tokens, targets, and everything under routing.hops
// "hub" or from a relayed peer), or, peer to peer, by the peer that made it (a Held reference:
// the hop that needs it names its holder, and the receiver fetches it; RELEASE tells the holder
// when it is no longer needed). A tensor whose holder is gone is made again one stage back (a
// stage input by the previous stage's forward, then the hop resumes where it was; an output
// gradient by the next stage's backward). A holder a receiver cannot reach relays the tensor
// through the router (FETCH from the router) and, once two receivers could not reach it, is
// relayed for a while (Registry::relay): its outputs come inline. A holder on a busy link (the
// receiver heard from it lately: FetchMiss::kBusyLink) gets the hop sent again directly first.
//
// Routing: among the ready, unbanned peers of the stage with room in their queue
// (routing.max_queued_s), dispatch.h's least expected completion time (or the fixed pipeline,
// under routing.mode "static"); with no peer's queue open, the hop waits at the router. Deadline:
// timing::deadline_s of the peer's queue plus this hop at its measured speed, capped by the
// job's timeouts. A failed hop is re-sent after timing::backoff_s (50 ms doubling to 2 s),
// preferring peers that have not failed it; after timeouts.max_attempts the job fails.
//
// A receiver that reports a stage input or gradient as bad (ERROR bad_tensor naming the
// tensor) is not believed alone: the hop is tried on another peer of the stage first. If that
// peer rejects the same tensor too, its producer is blamed (an integrity failure) and the hop
// goes back one stage; if it accepts it, the first receiver is blamed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "router/dispatch.h"
#include "router/job.h"
#include "runtime/flat_map.h"
#include "runtime/job_spec.h"

namespace swarm::router {

enum class HopKind { kForward, kForwardLoss, kBackward, kEval };
const char* hop_kind_name(HopKind k);   // "forward", "forward_loss", "backward", "eval": metric labels

// What a microbatch's flight knows of one stage.
struct FlightStage {
  // The stage's input, once known. Stage 0's (the tokens) is empty where the job samples them as
  // they are sent (FlightConfig::tokens).
  Slot input;
  Slot grad;            // the gradient of the stage's output, once known
  PeerId fwd_peer;      // who ran the stage's forward (made the next stage's input; affinity)
  PeerId grad_peer;     // who made grad (the next stage's backward or loss)
};

struct Flight {
  uint64_t index = 0;                 // data index (train) or validation batch index (eval)
  bool eval = false;
  int stage = 0;                      // the stage of the current hop
  HopKind kind = HopKind::kForward;
  // [S] what it knows of each stage, side by side: a hop at stage s reads and writes stage s's
  // and its neighbour's, two or three cache lines rather than one in each of four arrays.
  std::vector<FlightStage> at;
  bool loss_recorded = false;
  // The current hop's request (req_id 0: none in flight, dispatch when a peer is free).
  uint64_t req_id = 0;
  uint32_t attempts = 0;
  std::set<PeerId> tried;             // peers that failed this hop
  double not_before_s = 0;
  int suspect_tensor = -1;            // a receiver reported this request tensor bad...
  PeerId suspect_reporter;            // ...this one; a second opinion decides
  // A backward whose stage input was lost runs the forward before it again, then resumes here.
  int resume_stage = -1;
  bool busy_link = false;             // this hop was sent again once because a busy link held up a fetch (FetchMiss::kBusyLink)
  uint64_t upload_req = 0;            // a FETCH relaying a held tensor of the current hop through the router
  // The request whose output its maker pushes, as soon as it is made, to ahead_to: the peer
  // expected to take the next hop (a backward's next goes to the peer of that stage's forward).
  uint64_t ahead_key = 0;
  PeerId ahead_to;
  int queued_at = -1;                 // the stage whose queue of flights to send holds it (Flights::track); -1: none
};

struct FlightConfig {
  uint64_t job = 0;
  int stages = 1;
  int64_t B = 1, T = 1, d_model = 1;              // activation shape [B, T, d_model]
  compression::CodecSpec act_codec, grad_codec;   // what returned activations and gradients must use
  double forward_cap_s = 30, backward_cap_s = 60;
  int max_attempts = 8;
  RoutingMode mode = RoutingMode::kSwarm;
  bool echo = false;                              // transport benchmark: a FORWARD's result completes
  bool p2p = false;                               // routing.hops "p2p": peers that listen hold what they make
  double max_queued_s = 0;                        // routing.max_queued_s: a peer's queue bound (dispatch.h); 0: none (static routing)
  // async: microbatches per job step; a backward hop that is the step's last at its stage says
  // so (Hop::closes_step). 0: never.
  int closes_steps_of = 0;
  // A microbatch's tokens ([B, T] u16, or i32 above a vocabulary of 65,536; targets: the last
  // stage's targets), sampled each time a hop carries them: the router keeps no tokens per
  // microbatch in flight, since sampling is a function of the job's seed and the index. Unset (the
  // transport benchmark): stage 0's input is at[0].input's bytes, and no hop carries targets.
  std::function<wire::Tensor(uint64_t index, bool eval, bool targets)> tokens;
};

// What a hop's result did.
struct HopOutcome {
  enum What { kIgnored, kAdvanced, kCompleted, kEvalDone, kRejected } what = kIgnored;
  uint64_t key = 0;
  uint64_t index = 0;
  std::optional<double> loss;     // a training loss (FORWARD_LOSS) or an eval batch's loss
  int trained_stage = -1;         // a BACKWARD or FORWARD_LOSS accepted: the peer accumulated B samples
  PeerId blame;                   // an integrity failure to record against this peer
  std::string why;
  std::vector<double> codec_us;   // the peer's codec time for this hop [us], when it said
  bool overflow = false;          // the backward's gradients overflowed (mixed precision)
  std::string exhausted;          // kRejected and out of attempts: why the job fails
};

// What a failed hop did.
struct HopFailure {
  bool exhausted = false;         // out of attempts: the job fails
  PeerId blame;                   // an integrity failure to record
  std::string why;
};

class Flights {
 public:
  explicit Flights(FlightConfig cfg)
      : cfg_(std::move(cfg)), backward_units_(size_t(std::max(cfg_.stages, 1)), 2.0), waiting_(size_t(std::max(cfg_.stages, 1))) {}
  const FlightConfig& config() const { return cfg_; }

  // A microbatch enters the pipeline at stage 0 (its at[0].input and targets filled).
  Flight& add(uint64_t key, Flight f);
  size_t size() const { return flights_.size(); }
  // Of size(), the flights whose hop waits at the router (for a peer with room, a ready peer, a backoff).
  size_t waiting() const {
    size_t n = 0;
    for (const StageQueue& q : waiting_) n += q.flights.size();
    return n;
  }
  bool empty() const { return flights_.empty(); }
  // Drops every flight; what peers hold for them is released.
  void clear(Ctx& c);
  const std::map<uint64_t, Flight>& all() const { return flights_; }

  // Sends every waiting flight whose backoff is over to a peer of its stage (none: it waits).
  // Visits only the flights waiting to be sent, stage by stage in key order, and skips a stage
  // whose every peer had its queue's worth (full) until one of them answers or the ready peers
  // change.
  void dispatch(Ctx& c);
  HopOutcome on_result(Ctx& c, Peer& p, const Pending& pd, wire::Message& m);
  HopFailure on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why);
  // The receiver could not fetch request tensor `slot` from its holder.
  HopFailure on_fetch_failed(Ctx& c, const Pending& pd, int slot, FetchMiss miss, const std::string& why);
  // The router's own FETCH of a held tensor (the relay) answered, or failed.
  HopOutcome on_uploaded(Ctx& c, Peer& p, const Pending& pd, wire::Message& m);
  void on_upload_failed(Ctx& c, const Pending& pd);
  // A peer is gone: what it held is lost (made again when needed).
  void on_peer_gone(const PeerId& peer);

  // Traffic and affinity counters, for the status. bytes_act/bytes_grad: tensor bytes of the
  // training hops that crossed a link (through the router, or fetched peer to peer as the
  // receivers report); bytes_relayed: the part that went through the router.
  uint64_t bytes_act = 0, bytes_grad = 0, bytes_relayed = 0, resent = 0, rejected = 0, cached = 0, recomputed = 0;
  uint64_t fetch_failures = 0, uploads = 0, remade = 0;
  uint64_t pushes = 0;   // held tensors their holder was asked to push to a hop's receiver (PUSH)
  // Bytes of the tokens and targets the router sent with hops (training and eval), and the
  // hops that went without theirs to a peer that samples its own (Hop.own_tokens).
  uint64_t bytes_tokens = 0, own_tokens = 0;
  // Hops by stage and kind, and their latency (router/metrics.h).
  HopMetrics hop_metrics;
  // A result to request `request` that was no longer pending.
  void duplicate(uint64_t request) { hop_metrics.duplicate(request); }

  // The work a microbatch costs stage `stage` over the 3 units placement counts (forward 1,
  // backward 2 with the forward's graph cached): above 1 where backwards recompute the forward,
  // because the graph was evicted (a deep pipeline's early stages wait long for their backwards)
  // or the hop went to another peer. A moving average over about the last twenty backwards (a
  // longer one kept the recomputes that follow a move, when the moved peer's graphs are gone,
  // for a minute and more in a small swarm).
  double work_factor(int stage) const {
    if (stage < 0 || stage >= cfg_.stages - 1) return 1.0;   // the last stage: forward-and-loss, 3 units
    return (kForwardUnits + backward_units_[size_t(stage)]) / (kForwardUnits + kBackwardCachedUnits);
  }

  // SWARM_CHECKs: every flight waiting on a request has it pending, to the peer it names.
  void check(const Requests& r) const;

  // A stage with more ready peers than this is dispatched among kSampled of them drawn at
  // random, plus the peer holding the microbatch's forward graph (power of k choices): a hop's
  // dispatch then costs the same at 300 peers per stage as at 30.
  static constexpr size_t kSampleAbove = 64;
  static constexpr size_t kSampled = 16;

 private:
  // Sends the flight's current hop, unless every peer that could take it has its queue's worth
  // (dispatch.h's bound): then it waits, and the result is false when no peer of the stage has room
  // (the rest of its stage waits too).
  bool send_hop(Ctx& c, uint64_t key, Flight& f);
  // The hop's last reference (to `s`'s holder): the holder is asked to push it to `to` now (PUSH),
  // and the reference says so; or it did already, as it made it (push ahead). Not when `to`
  // holds it, or fetched it for its own forward.
  void push(Ctx& c, const Flight& f, const Slot& s, Peer& to, wire::Message& m);
  // The peer a backward's (or loss's) output should be pushed to as it is made: the peer that
  // ran the forward at the stage before, when it takes pushes; else null.
  Peer* ahead_target(Ctx& c, const Flight& f, const Peer& to);
  // `to` reported n pushes late: past a few, and most of them, it is no longer pushed to.
  void late_pushes(Ctx& c, Peer& to, uint64_t n);
  std::vector<Peer*> candidates(Ctx& c, const Flight& f);
  // Goes back one stage: the tensor `bad` of the current hop is remade by its producer's stage.
  void go_back(Ctx& c, Flight& f, int bad);
  // Whether the current hop has every tensor it needs; if not, it goes back to remake one.
  bool repair(Flight& f);
  Slot* slot_of(Flight& f, int slot);
  void release_all(Ctx& c, Flight& f);
  // Stage f.stage's backward (or loss) is done on `p`: the copies of the stage's input and output
  // gradient that `p` and the peer of the stage's forward kept.
  void release_copies(Ctx& c, const Flight& f, Peer& p);
  // The current hop failed at `pd.peer` and goes out again: the copies that peer fetched or was
  // pushed for it, and the output it was told to push ahead (when it made it after all), are
  // not read where they are.
  void release_failed_copies(Ctx& c, const Flight& f, const Pending& pd);
  // The copies of stage f.stage's input and output gradient at `at` (not what it holds itself).
  static void release_stage_copies(Ctx& c, const Flight& f, Peer& at);
  const char* kind_label(const Flight& f) const { return cfg_.echo ? "echo" : hop_kind_name(f.kind); }
  // A hop that failed and goes out again: counted, and on the timeline.
  void resent_hop(Ctx& c, const Flight& f, const Pending& pd, bool error, const std::string& why);
  // A flight waits to be sent when it has no request in flight (req_id 0) and relays nothing
  // (upload_req 0): waiting_[its stage] holds exactly those, by key, so dispatch visits only
  // them. Called after any change to a flight's request or stage.
  void track(uint64_t key, Flight& f) {
    const int at = f.req_id == 0 && f.upload_req == 0 ? f.stage : -1;
    if (at == f.queued_at) return;
    if (f.queued_at >= 0) waiting_[size_t(f.queued_at)].flights.erase(key);
    if (at >= 0) waiting_[size_t(at)].flights.emplace(key, &f);
    f.queued_at = at;
  }
  // A hop at `stage` ended (answered, failed, timed out): its peer has room again.
  void room_at(int stage) {
    if (stage >= 0 && stage < cfg_.stages) waiting_[size_t(stage)].full = false;
  }
  using FlightMap = std::map<uint64_t, Flight>;
  // A flight by key without walking flights_ (kept in add, clear and on completion).
  FlightMap::iterator locate(uint64_t key) {
    const FlightMap::iterator* w = where_.find(key);
    return w ? *w : flights_.end();
  }
  FlightConfig cfg_;
  std::vector<double> backward_units_;   // [stages] see work_factor
  FlightMap flights_;
  FlatMap<FlightMap::iterator> where_;
  struct StageQueue {
    std::map<uint64_t, Flight*> flights;   // map nodes do not move: the pointers stay valid
    bool full = false;                     // every peer of the stage had its queue's worth...
    uint64_t full_since = 0;               // ...when the registry's ready_changes() was this
  };
  std::vector<StageQueue> waiting_;        // [stages]
  std::vector<Candidate> cands_;           // send_hop's scratch: kept, so a hop allocates none
  // async (closes_steps_of > 0): per job step, the backwards sent to each stage.
  std::map<uint64_t, std::vector<int>> backwards_sent_;
  // Counts a training backward sent (first attempts only); true when it is its step's last at its stage.
  bool count_backward(const Flight& f);
};

constexpr uint64_t kEvalBit = uint64_t(1) << 62;   // eval microbatch keys: kEvalBit | batch index

}  // namespace swarm::router
