// stage_metrics.h: a stage server's /metrics page (swarm-stage --http).
//
// Defines swarm::StageFigures (what the I/O thread gathers when a scrape asks: its own counters,
// the compute thread's SharedStats, the held tensors and peer-to-peer traffic, the device's
// memory), `gather_stage_figures` and `stage_exposition`, the pure function that writes them in Prometheus' text format
// (runtime/metrics.h; names in docs/observability.md). Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace swarm {

struct StageFigures {
  std::string name, device, precision;
  std::string emulated;                  // the emulation profile or factor, "" for none
  int stage = -1;                        // -1: no stage loaded
  uint64_t job = 0;
  bool ready = false;
  double seconds_per_unit = 0;           // EMA of compute time per work unit (0: not measured)
  double compute_s = 0;                  // hops' compute time so far [s]
  uint64_t forwards = 0, backwards = 0, cache_hits = 0, recomputes = 0, steps = 0, errors = 0;
  int64_t cache_entries = -1;            // the affinity cache's size for the loaded stage (-1: none loaded)
  uint64_t overflows = 0, skipped_steps = 0;
  double loss_scale = 0;                 // 0: no loss scaling
  uint64_t queued = 0;                   // requests waiting for the compute thread
  uint64_t held_bytes = 0, held_tensors = 0, held_evictions = 0;
  uint64_t fetches = 0, fetched_bytes = 0, fetch_failures = 0, served = 0, served_bytes = 0, relayed = 0;
  uint64_t pushes = 0, pushed_bytes = 0, pushed_in = 0, push_late = 0;
  std::map<std::string, uint64_t> fetched_from;   // holder address -> wire bytes fetched from it
  int64_t device_memory_bytes = -1, device_memory_free_bytes = -1;   // -1: unknown
};

// The page: these figures and the process's own (resident memory, CPU time, start time).
std::string stage_exposition(const StageFigures& f);

struct SharedStats;
class Holdings;
class PeerLink;
// The figures the compute thread's counters, the held tensors and the peer-to-peer link hold
// now (read on the I/O thread, which owns `holdings` and `link`); the caller adds the rest
// (name, device and its memory, queue, relays).
StageFigures gather_stage_figures(const SharedStats& stats, const Holdings& holdings, const PeerLink& link);

}  // namespace swarm
