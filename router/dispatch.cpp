// dispatch.cpp: choose_peer (see dispatch.h).
#include "router/dispatch.h"

#include <algorithm>
#include <limits>

namespace swarm {

double expected_ms(const Candidate& c, double units, double default_ms_per_unit) {
  const double per = c.ms_per_unit > 0 ? c.ms_per_unit : default_ms_per_unit;
  return (c.queued_units + units) * per;
}

double queue_bound_units(double ms_per_unit, double max_queued_s) {
  if (!(max_queued_s > 0)) return std::numeric_limits<double>::infinity();
  return ms_per_unit > 0 ? std::max(kMinQueuedUnits, max_queued_s * 1000.0 / ms_per_unit) : kMinQueuedUnits;
}

int choose_peer(const std::vector<Candidate>& peers, double units, double affinity_units) {
  // Peers not measured yet enter at the fastest measured speed, so they get tried.
  double min_per = 0;
  for (const auto& c : peers)
    if (!c.excluded && c.ms_per_unit > 0 && (min_per == 0 || c.ms_per_unit < min_per)) min_per = c.ms_per_unit;
  if (min_per == 0) min_per = 1.0;
  // A backward away from the peer holding the forward's graph recomputes that forward: the
  // extra work is taken from the stage's capacity (and the holder's cached graph is wasted), so
  // it is charged three times against such a peer, and the graph's holder wins unless another
  // peer is clearly quicker.
  bool holder = false;
  for (const auto& c : peers) holder |= c.affinity && !c.excluded;
  const double elsewhere = holder ? units + 2 * (units - affinity_units) : units;
  int best = -1;
  double best_ms = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < peers.size(); ++i) {
    const auto& c = peers[i];
    if (c.excluded || c.full) continue;
    const double ms = expected_ms(c, c.affinity ? affinity_units : elsewhere, min_per);
    // Ties go to the earlier candidate (callers pass peers in a stable order).
    if (ms < best_ms) {
      best_ms = ms;
      best = int(i);
    }
  }
  return best;
}

}  // namespace swarm
