// rng.h: the simulator's one random source, and its distributions written out here.
//
// Defines swarm::sim::Rng: std::mt19937_64 (whose output sequence the C++ standard fixes) with
// uniform, exponential, normal and log-normal draws implemented in this file, because the
// standard library's distributions may differ between library versions. Every random decision
// of a simulation comes from one Rng seeded by the scenario, drawn in event order, so a seed
// replays the same run on any platform.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

namespace swarm::sim {

class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}

  // Uniform in [0, 1): the top 53 bits of one draw.
  double uniform() { return double(g_() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n), n > 0 (the modulo bias is below 2^-40 for n < 2^24).
  uint64_t below(uint64_t n) { return n ? g_() % n : 0; }
  bool chance(double p) { return p > 0 && uniform() < p; }
  // Exponential with the given mean (inverse transform).
  double exponential(double mean) { return -mean * std::log1p(-uniform()); }
  // Standard normal by Box-Muller (one of the pair; the other is dropped, keeping each draw
  // one call).
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // A multiplicative jitter with mean 1 and coefficient of variation `cv` (log-normal);
  // exactly 1 when cv is 0.
  double jitter(double cv) {
    if (!(cv > 0)) return 1.0;
    const double s2 = std::log1p(cv * cv);
    return std::exp(std::sqrt(s2) * normal() - 0.5 * s2);
  }

 private:
  std::mt19937_64 g_;
};

}  // namespace swarm::sim
