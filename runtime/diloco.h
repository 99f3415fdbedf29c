// diloco.h: the arithmetic of the within-stage outer step (DiLoCo, Douillard et al. 2023) and
// of its streaming variant (Streaming DiLoCo, Douillard et al. 2025), shared by the router
// (which averages) and the stage servers (which apply). No libtorch.
//
// Every peer of a stage group applies `outer_step` to its copy of theta_g with the same mean
// outer gradient, in fp32, element by element in index order: the same bits on every peer, so
// a hash of theta_g and the momentum proves the group agrees. docs/diloco.md has the protocol.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace swarm::diloco {

// sum[i] += w * d[i]. A peer's outer gradient enters the group's mean with its sample count.
void accumulate(std::vector<float>& sum, const float* d, size_t n, float w);

// The contributions a round leaves out (docs/security.md): with two or more contributions, any
// non-finite one and one whose score exceeds kOutlierFactor times the lower median score of the
// contributions that trained at least half as much as the most (by weight). The score of an outer
// gradient Δ is its L2 norm, counted only at positive weight (weight 0: it is not in the mean):
// honest peers of a group take the same inner steps from the same weights on the same data, so
// their norms are within a small factor of each other. The score of a gradient sum (`grad_sums`,
// weights the samples the router counted) is its norm over sqrt(max(samples, 1)): a sum of n
// per-sample gradients grows between sqrt(n) (noise) and n (a common direction), so honest scores
// differ by at most sqrt of the ratio of samples served. A liar's outsized vector does not move
// the mean at all (scaling it down to the bound instead still let it pull every round its way).
// Left out of the mean is not proof of a lie: a newcomer's first rounds, with an optimizer state
// fresh from a donor, measured over 4x the others'. What the router counts against a peer is a
// score over kBlameFactor times the yardstick (or not finite), far past any honest spread.
constexpr double kOutlierFactor = 4.0;
constexpr double kBlameFactor = 1000.0;
struct Outliers {
  std::vector<size_t> left_out;   // over kOutlierFactor x the yardstick, or not finite
  std::vector<size_t> far;        // of those, over kBlameFactor x (or not finite)
};
Outliers outliers(const std::vector<std::vector<float>>& ds, const std::vector<double>& weights, bool grad_sums = false);

// m <- mu * m + d; theta_g <- theta_g - lr * (nesterov ? d + mu * m : m). With lr 1 and mu 0
// that is theta_g <- theta_g - d: for d = theta_g - theta, the plain (weighted) average of the
// peers' weights.
void outer_step(float* theta_g, float* momentum, const float* d, size_t n, float lr, float mu, bool nesterov);

// Fragment f of F over P flat parameters: [P*f/F, P*(f+1)/F). Every peer and the router
// compute the same ranges from P alone.
std::pair<size_t, size_t> fragment_range(size_t P, int F, int f);

// The fragment whose sync starts when `steps_done` optimizer steps are complete, or -1.
// Fragment f syncs at steps where (steps - offset_f) is a multiple of H, offset_f = (f+1)*H/F
// (integer division): each fragment exactly once every H steps, spread evenly; with F = 1 at
// every multiple of H.
int fragment_due(int steps_done, int H, int F);

}  // namespace swarm::diloco
