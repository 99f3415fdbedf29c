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

std::vector<size_t> clip_to_median(std::vector<std::vector<float>>& ds, const std::vector<double>& weights) {
  // Per unit of weight: a peer that trained more samples has a larger honest Δ, so each bound is
  // the group's lower median norm per sample times the peer's own (router-counted) samples.
  std::vector<double> norms(ds.size(), 0.0), per_weight;
  for (size_t k = 0; k < ds.size(); ++k) {
    double s = 0;
    for (float v : ds[k]) s += double(v) * double(v);
    norms[k] = std::sqrt(s);
    if (k < weights.size() && weights[k] > 0 && std::isfinite(norms[k]) && norms[k] > 0) per_weight.push_back(norms[k] / weights[k]);
  }
  std::vector<size_t> clipped;
  if (per_weight.size() < 2) return clipped;
  std::sort(per_weight.begin(), per_weight.end());
  const double median = per_weight[(per_weight.size() - 1) / 2];
  for (size_t k = 0; k < ds.size(); ++k) {
    const double w = k < weights.size() ? std::max(weights[k], 0.0) : 0.0;
    const double bound = kClipFactor * median * w;
    if (std::isfinite(norms[k]) && norms[k] <= bound) continue;
    if (std::isfinite(norms[k]) && w == 0) continue;   // weight 0: it does not enter the mean
    const float scale = std::isfinite(norms[k]) && norms[k] > 0 ? float(bound / norms[k]) : 0.f;
    for (float& v : ds[k]) v = std::isfinite(norms[k]) ? v * scale : 0.f;
    clipped.push_back(k);
  }
  return clipped;
}

}  // namespace swarm::diloco
