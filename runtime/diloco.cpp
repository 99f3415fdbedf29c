// diloco.cpp: see diloco.h.
#include "runtime/diloco.h"

#include <algorithm>
#include <cmath>

namespace swarm::diloco {

void accumulate(std::vector<float>& sum, const float* d, size_t n, float w) {
  if (sum.empty()) sum.assign(n, 0.f);
  for (size_t i = 0; i < n; ++i) sum[i] += w * d[i];
}

void outer_step(float* theta_g, float* momentum, const float* d, size_t n, float lr, float mu, bool nesterov) {
  for (size_t i = 0; i < n; ++i) {
    const float m = mu * momentum[i] + d[i];
    momentum[i] = m;
    const float upd = nesterov ? d[i] + mu * m : m;
    theta_g[i] = theta_g[i] - lr * upd;
  }
}

std::pair<size_t, size_t> fragment_range(size_t P, int F, int f) {
  const auto lo = static_cast<size_t>((static_cast<unsigned __int128>(P) * unsigned(f)) / unsigned(F));
  const auto hi = static_cast<size_t>((static_cast<unsigned __int128>(P) * unsigned(f + 1)) / unsigned(F));
  return {lo, hi};
}

int fragment_due(int steps_done, int H, int F) {
  if (steps_done <= 0 || H <= 0 || F <= 0) return -1;
  for (int f = 0; f < F; ++f) {
    const int offset = (f + 1) * H / F;
    if (offset > 0 && steps_done >= offset && (steps_done - offset) % H == 0) return f;
  }
  return -1;
}

Outliers outliers(const std::vector<std::vector<float>>& ds, const std::vector<double>& weights, bool grad_sums) {
  Outliers out;
  if (ds.size() < 2) return out;
  // Δs by their norms, not norms per sample: an inner step divides its gradient sum by the samples
  // it saw, so a Δ grows with the inner steps taken (the same for the group), not with the samples
  // served. Per sample, a peer that served few microbatches looked like a liar.
  std::vector<double> scores(ds.size(), 0.0), w(ds.size(), 0.0);
  std::vector<bool> counted(ds.size(), false);
  double max_w = 0;
  size_t n_counted = 0;
  for (size_t k = 0; k < ds.size(); ++k) {
    double s = 0;
    for (float v : ds[k]) s += double(v) * double(v);
    w[k] = k < weights.size() ? weights[k] : 0.0;
    scores[k] = grad_sums ? std::sqrt(s) / std::sqrt(std::max(w[k], 1.0)) : std::sqrt(s);
    counted[k] = (grad_sums || w[k] > 0) && std::isfinite(scores[k]);
    if (counted[k]) {
      n_counted++;
      max_w = std::max(max_w, w[k]);
    }
  }
  // The yardstick is the peers that trained about as much as the most (half its samples or
  // more): one that joined late took fewer inner steps, and its small Δ must not make the
  // others look outsized.
  std::vector<double> reference;
  for (size_t k = 0; k < ds.size(); ++k)
    if (counted[k] && scores[k] > 0 && w[k] >= 0.5 * max_w) reference.push_back(scores[k]);
  std::sort(reference.begin(), reference.end());
  const double median = n_counted >= 2 && !reference.empty() ? reference[(reference.size() - 1) / 2] : HUGE_VAL;
  for (size_t k = 0; k < ds.size(); ++k) {
    const bool finite = std::isfinite(scores[k]);
    if (!finite || (counted[k] && scores[k] > kOutlierFactor * median)) out.left_out.push_back(k);
    if (!finite || (counted[k] && scores[k] > kBlameFactor * median)) out.far.push_back(k);
  }
  return out;
}

}  // namespace swarm::diloco
