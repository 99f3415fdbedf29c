// random.h: the project's one counter-based generator. Every seeded decision (model
// initialisation, the data sampler, injected faults, chaos plans) is a pure function of its
// inputs through splitmix64, so any process computes the same draw without shared state.
#pragma once

#include <cstddef>
#include <cstdint>

namespace swarm {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Draw number k of item `index` in stream `stream` of a seed.
inline uint64_t counter_draw(uint64_t seed, size_t index, uint64_t k, uint64_t stream) {
  return splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ index) ^ k) ^ stream);
}

}  // namespace swarm
