// placement.h: where the peers of a heterogeneous swarm serve, as pure functions of the registry.
//
// Defines the throughput model (PeerView, Registry, stage_throughputs), `place_peer` (the stage
// for a peer that did not pin one), `plan_rebalance` (at most one move, from spare throughput to
// the bottleneck), `ideal_min_throughput` (the best assignment, the benchmarks' "ideal"), and the
// fixed pipelines of the `static` routing mode (static_pipelines, static_pipeline_for). No clock,
// no I/O, no randomness: the caller passes the time and the random draw, and logs the reason.
//
// Throughput model. A peer has a speed v: samples per second on a stage of relative cost 1.
// Stage s has a relative cost c_s (work per sample; only ratios matter). The peer serves v / c_s
// samples/s on stage s; a stage serves the sum over its peers; the pipeline runs at the minimum
// over stages, the bottleneck. A stage with no peer serves 0. See docs/heterogeneous.md.
//
// Memory. When the registry knows each stage's need (StageNeed, from runtime/memory_estimate.h)
// and a peer its free memory, no stage is ever placed on, or moved to, a peer that cannot hold
// it; heavier stages go to bigger devices when throughputs tie; `memory_shortfalls` names the
// stages no peer can hold (the job waits, saying why). Unknown memory (-1) fits anything.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "runtime/job_spec.h"

namespace swarm {

constexpr double kNever = -std::numeric_limits<double>::infinity();

struct PeerView {
  std::string id;              // unique and stable (the peer's routing id); the last tie-break
  std::string name;            // what messages call it (its HELLO name); "": its id
  int stage = -1;              // 0 .. stages-1
  double speed = 0;            // samples/s at stage cost 1; <= 0: not measured (counted at the median)
  bool pinned = false;         // asked for its stage (--stage): never moved
  bool movable = true;         // the caller allows moving it now (serving this job, not loading)
  bool ready = true;           // serving now; a loading peer counts toward its stage's throughput
                               // but is never a stage's only peer for "never empties a stage"
  double last_moved_s = kNever;  // when the rebalancer last moved it, on the caller's clock [s]
  int last_from = -1;          // the stage it was last moved from; -1: never moved
  int64_t memory_bytes = -1;   // free memory of its device when it said HELLO [bytes]; -1: unknown
  bool cuda = false;           // a GPU peer (StageNeed::cuda); else its device is the host (StageNeed::cpu)
  Precision precision = Precision::kAuto;  // its compute type for the job (the job's pin, else HELLO's); kAuto: unknown
};

// What serving a stage takes [bytes], by the peer's compute precision ([0] fp32, [1] bf16,
// [2] fp16): on a CUDA peer its device's share (the host's RAM holds θ_g and the momentum
// besides), on a CPU peer all of it. 0: no constraint.
struct StageNeed {
  std::array<int64_t, 3> cuda{}, cpu{};
  // The need of a peer of this kind and precision; kAuto: the most over the three.
  int64_t of(bool cuda_peer, Precision p) const;
};

// A move a check planned and did not make yet (see RebalanceParams::checks_to_move).
struct Proposal {
  int from = -1, to = -1;
  int checks = 0;            // consecutive checks that planned a move into `to` (see plan_rebalance)
  std::vector<int> targets;  // the stages its whole plan moved peers into
};

struct Registry {
  int stages = 0;
  std::vector<double> stage_cost;  // [stages] relative cost per sample, > 0; empty: all 1
  std::vector<PeerView> peers;     // in join order (static pipelines follow it)
  std::vector<StageNeed> stage_need;  // [stages] or empty (memory not considered); see stage_needs
  double last_move_s = kNever;     // the rebalancer's last move of any peer, alive or gone [s]
  Proposal proposal;               // the previous check's Rebalance::proposal
};

struct RebalanceParams {
  double min_gain = 0.10;          // the min stage throughput must rise by this fraction (the margin)...
  int margin_peers = 4;            // ...where the bottleneck has at most this many ready peers; with n more,
                                   // min_gain x sqrt(margin_peers / n): a stage's throughput sums its
                                   // peers' measured speeds, whose errors average out as 1/sqrt(n)
  double cooldown_s = 300;         // no move this soon after the last move (of any peer)
  double reverse_gain = 0.50;      // the margin for a move that has not settled (below)
  double settle_s = 3600;          // for this long after a move, moving that peer again, or a peer at least
                                   // half as fast back the other way between the same stages, needs reverse_gain
  int checks_to_move = 2;          // consecutive checks that must plan the same move (from, to) before it is made
  double period_s = 180;           // mean time between rebalance checks
  double period_jitter = 0.25;     // each period is period_s * (1 ± jitter), uniform
};

struct Move {
  std::string peer;
  int from = -1, to = -1;
  double min_before = 0, min_after = 0;  // predicted min stage throughput before and after it [samples/s]
  int plan_moves = 1;                    // moves in the plan this one starts (> 1: stages near-tie at the bottleneck)
  double plan_min_after = 0;             // predicted min stage throughput after the whole plan [samples/s]
  bool target_empty = false;             // `to` has no peer: no donor, restore it from the snapshot
  std::string reason;                    // one line for the log
};

// What a rebalance check decided.
struct Rebalance {
  std::optional<Move> move;  // make this move now
  Proposal proposal;         // store in Registry::proposal for the next check (empty unless proposing)
  std::string reason;        // why: the move, the proposal, or why nothing moves
};

// Stage throughputs [samples/s], [stages]; unmeasured peers count at the median measured speed.
std::vector<double> stage_throughputs(const Registry& reg);

// The stage for a new peer of speed `speed` (<= 0: unknown, counted at the median): a stage with
// no peer first (lowest index); else the stage whose sorted throughputs after adding it are
// lexicographically largest (the minimum rises most; among equal minimums, the next-lowest
// stage, and so on); ties: fewest peers, then lowest index. -1 when reg.stages is 0.
int place_peer(const Registry& reg, double speed, std::string* reason = nullptr);
// The same for a peer whose memory is known (`peer`: its speed, memory_bytes and cuda; its
// stage is ignored): only stages it can hold are candidates; a peer of known memory takes the
// heaviest empty stage it can hold, and among stages whose throughputs tie the heaviest; -1
// when it can hold none (the reason says how much the lightest stage needs and what it has).
int place_peer(const Registry& reg, const PeerView& peer, std::string* reason = nullptr);

// True when `peer` can hold stage `stage` (always, without needs or with unknown memory).
// The caller checks pinned (--stage) and preferred stages with it before it assigns them.
bool peer_fits(const Registry& reg, const PeerView& peer, int stage);

// Peers in the order a job start should place them: most memory first (unknown memory last),
// then fastest, then id; with place_peer that sends the heaviest stages to the biggest devices.
std::vector<size_t> placement_order(const std::vector<PeerView>& peers);

// A stage that no registered peer can hold: what the job's status says while it waits.
struct MemoryShortfall {
  int stage = -1;
  int64_t need = 0;             // bytes the largest peer would need for it
  std::string largest_peer;     // the peer with the most free memory, by name ("" when no peer is known)
  int64_t largest_bytes = -1;
  std::string reason;           // "stage 3 needs 5.20 GiB, but the largest peer, t4-a, has 4.10 GiB free: ..."
};
// Empty when every stage fits some peer, or nothing is known about memory.
std::vector<MemoryShortfall> memory_shortfalls(const Registry& reg);

// Every stage's need for the job (runtime/memory_estimate.h), for each precision (all three at
// the job's when it pins model.precision): on a CUDA peer with scaled-dot-product attention (the
// CUDA build is against libtorch 2.x), on a CPU peer with the [T, T] attention matrix (libtorch
// 1.13's attention).
std::vector<StageNeed> stage_needs(const JobSpec& spec);

// One rebalance check: at most one move (TrainingJob makes more of a confirmed plan in a large
// swarm by calling it again). A stage with no peer is filled at once (cooldowns,
// margins and checks waived). Otherwise, past the global cooldown, greedy moves into the
// bottleneck (the peer whose move leaves the sorted throughputs largest) are planned until the
// min stage throughput has risen by min_gain; the plan's first move is made once
// checks_to_move consecutive checks have planned it (a plan has more than one move when several
// stages sit near the bottleneck, or when a stage has so many peers that one move cannot lift it
// by min_gain; every check re-plans). The margin shrinks with the bottleneck's ready peers (see
// margin_peers). A moved peer is movable, unpinned,
// measured, never its stage's last ready peer, and able to hold its new stage; a move that has
// not settled (see settle_s) needs reverse_gain.
Rebalance plan_rebalance(const Registry& reg, const RebalanceParams& params, double now_s);

// Seconds until the next rebalance check, for a uniform draw u in [0, 1): the period, jittered
// so that routers restarted together do not check in step.
double next_rebalance_delay_s(const RebalanceParams& params, double u);

// The best minimum stage throughput [samples/s] over all assignments of peers of these speeds to
// stages of these costs, every stage with at least one peer (0 when fewer peers than stages).
// Exact (dynamic programme over subsets) up to kIdealExactMaxPeers peers; beyond, the greedy
// placement improved by zero-margin rebalancing: a lower bound.
constexpr size_t kIdealExactMaxPeers = 14;
double ideal_min_throughput(const std::vector<double>& speeds, const std::vector<double>& stage_cost);

// Static routing (fixed pipelines, as GPipe or DeepSpeed run them): pipeline i chains the i-th
// peer of each stage; there are min over stages of the peer count of them; extra peers idle.
// `stage_peers[s]`: the ids of stage s's peers in join order. Result: [pipelines][stages].
std::vector<std::vector<std::string>> static_pipelines(const std::vector<std::vector<std::string>>& stage_peers);
// The pipeline of microbatch `microbatch` (round robin), -1 when there is none.
int static_pipeline_for(uint64_t microbatch, size_t pipelines);
// The throughput [samples/s] static routing predicts for reg (pipelines in join order): each
// pipeline gets an equal share of the microbatches, so the slowest pipeline sets the pace.
double static_min_throughput(const Registry& reg);

// Helpers to fill a Registry from what the router measures.
// A peer's speed from its ms per work unit on a stage of cost `stage_cost`, with
// `samples_per_unit` samples per unit (a microbatch crosses a stage in 3 units: forward 1 and
// backward 2 with a cached graph, or forward-and-loss 3 on the last stage; so B / 3).
double peer_speed(double ms_per_unit, double stage_cost, double samples_per_unit);
// Relative stage costs from parameter counts (the flops per token of a transformer slice are
// about 6x its parameters), normalised to mean 1; a count <= 0 (not known yet) gets cost 1.
std::vector<double> stage_costs_from_params(const std::vector<int64_t>& params);

}  // namespace swarm
