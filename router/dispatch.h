// dispatch.h: the dispatcher's decision, as a pure function of the candidates and the clock.
//
// Defines swarm::Candidate and `choose_peer`: among the live, unbanned peers of a stage, the
// one with the least expected completion time, (queued work + this work) * seconds per unit
// of work (an EMA of what the peer delivered; a peer not yet measured enters at the current
// minimum so that it gets tried). A BACKWARD on the peer that ran the microbatch's forward
// costs 2 units (its autograd graph is cached); anywhere else 3 (forward recomputed), and
// the recomputed unit counts three times in the comparison, being capacity the stage loses.
// A peer whose queue is at its bound (`queue_bound_units`) takes nothing more: the hop waits at
// the router for a peer with room, so that the first peers ready, or one that slowed down, do not
// hold work the others could do.
#pragma once

#include <cstddef>
#include <vector>

namespace swarm {

// Candidates go in the stage's peer order; the choice is an index into it.
struct Candidate {
  double queued_units = 0;   // work already sent to it and not yet answered
  double ms_per_unit = 0;    // 0: not measured yet
  bool affinity = false;     // ran this microbatch's forward (backward only)
  bool excluded = false;     // banned, or already failed this hop
  bool full = false;         // its queue is at its bound: eligible, but not now
};

constexpr double kForwardUnits = 1.0;
constexpr double kBackwardCachedUnits = 2.0;
constexpr double kBackwardRecomputeUnits = 3.0;
constexpr double kForwardLossUnits = 3.0;

// The most work units the dispatcher queues at a peer: `max_queued_s` of its work at `ms_per_unit`
// (0: not measured), and at least kMinQueuedUnits; `max_queued_s` 0: no bound.
constexpr double kMinQueuedUnits = 4.0;
double queue_bound_units(double ms_per_unit, double max_queued_s);

// Returns the index of the chosen candidate, or -1 when none is eligible and open (not full). `units` is the
// cost of the hop on a peer without affinity; `affinity_units` on the affinity peer.
int choose_peer(const std::vector<Candidate>& peers, double units, double affinity_units);

// Expected seconds for `c` to finish `units` more work after its queue.
double expected_ms(const Candidate& c, double units, double default_ms_per_unit);

}  // namespace swarm
