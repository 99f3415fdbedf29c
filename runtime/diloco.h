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

// Bounds every contribution of a round (docs/security.md): with two or more contributions of
// positive weight, one whose L2 norm exceeds kClipFactor times the group's lower median norm per
// unit of weight, times its own weight, is scaled down to that bound (a non-finite one to
// zeros). Returns the indices scaled. Honest
// peers of a group train on the same data distribution from the same weights, so their norms
// are within a small factor of each other; a liar's outsized vector moves the mean by at most
// kClipFactor honest norms.
constexpr double kClipFactor = 4.0;
std::vector<size_t> clip_to_median(std::vector<std::vector<float>>& ds, const std::vector<double>& weights);

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
