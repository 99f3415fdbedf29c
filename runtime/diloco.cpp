// diloco.cpp: see diloco.h.
#include "runtime/diloco.h"

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

}  // namespace swarm::diloco
