// stage_metrics.cpp: a stage server's /metrics page (stage_metrics.h).
#include "stages/stage_metrics.h"

#include "runtime/metrics.h"
#include "stages/holdings.h"
#include "stages/peer_link.h"
#include "stages/worker.h"

namespace swarm {

using metrics::Type;

std::string stage_exposition(const StageFigures& f) {
  metrics::Exposition out;
  out.family("swarm_stage_info", Type::kGauge, "This stage server: its name, device, precision, emulation label and the stage it serves (always 1).")
      .sample({{"peer", f.name}, {"device", f.device}, {"precision", f.precision}, {"emulated", f.emulated},
               {"stage", f.stage >= 0 ? std::to_string(f.stage) : "none"}, {"job_id", std::to_string(f.job)}},
              1);
  out.family("swarm_stage_ready", Type::kGauge, "1 once a stage is loaded and the server takes hops.").sample({}, f.ready ? 1 : 0);
  out.family("swarm_stage_hops_total", Type::kCounter, "Hops computed, by kind (the last stage's forward with its loss and backward is one backward).")
      .sample({{"kind", "forward"}}, double(f.forwards))
      .sample({{"kind", "backward"}}, double(f.backwards));
  out.family("swarm_stage_backward_graphs_total", Type::kCounter,
             "Backwards by whether the forward's graph was still cached (affinity) or the forward was recomputed.")
      .sample({{"graph", "cached"}}, double(f.cache_hits))
      .sample({{"graph", "recomputed"}}, double(f.recomputes));
  if (f.cache_entries >= 0)
    out.family("swarm_stage_graph_cache_entries", Type::kGauge,
               "Forward graphs the affinity cache may keep for the loaded stage: what fits in the memory free when it loaded, at most the configured bound.")
        .sample({}, double(f.cache_entries));
  out.family("swarm_stage_compute_seconds_total", Type::kCounter, "Seconds spent computing hops (emulation padding included) and the inner steps taken between them.")
      .sample({}, f.compute_s);
  out.family("swarm_stage_seconds_per_unit", Type::kGauge, "Moving average of compute seconds per work unit (forward 1, backward 2.5).")
      .sample({}, f.seconds_per_unit);
  out.family("swarm_stage_queued_requests", Type::kGauge, "Requests waiting for the compute thread.").sample({}, double(f.queued));
  out.family("swarm_stage_optimizer_steps_total", Type::kCounter, "Inner optimizer steps taken.").sample({}, double(f.steps));
  out.family("swarm_stage_errors_total", Type::kCounter, "Requests answered with an error, and messages dropped as unreadable.")
      .sample({}, double(f.errors));
  out.family("swarm_stage_overflows_total", Type::kCounter, "Backwards whose gradients overflowed (fp16 loss scaling).")
      .sample({}, double(f.overflows));
  out.family("swarm_stage_skipped_steps_total", Type::kCounter, "Optimizer steps skipped after an overflow.").sample({}, double(f.skipped_steps));
  if (f.loss_scale > 0) out.family("swarm_stage_loss_scale", Type::kGauge, "The dynamic loss scale (fp16).").sample({}, f.loss_scale);
  out.family("swarm_stage_held_bytes", Type::kGauge, "Bytes of tensors kept for other peers to fetch.").sample({}, double(f.held_bytes));
  out.family("swarm_stage_held_tensors", Type::kGauge, "Tensors kept for other peers to fetch.").sample({}, double(f.held_tensors));
  out.family("swarm_stage_held_evictions_total", Type::kCounter, "Held tensors dropped to stay within --hold-mb.")
      .sample({}, double(f.held_evictions));
  out.family("swarm_stage_fetches_total", Type::kCounter, "Tensors fetched from the peers that hold them.").sample({}, double(f.fetches));
  out.family("swarm_stage_fetched_bytes_total", Type::kCounter, "Wire bytes fetched from other peers, by the holder's address.");
  for (const auto& [addr, n] : f.fetched_from) out.sample({{"holder", addr}}, double(n));
  out.family("swarm_stage_fetch_failures_total", Type::kCounter, "Requests failed because a referenced tensor did not arrive from its holder.")
      .sample({}, double(f.fetch_failures));
  out.family("swarm_stage_served_total", Type::kCounter, "Held tensors served to other peers and to the router.").sample({}, double(f.served));
  out.family("swarm_stage_served_bytes_total", Type::kCounter, "Wire bytes of held tensors served.").sample({}, double(f.served_bytes));
  out.family("swarm_stage_pushes_total", Type::kCounter, "Held tensors pushed to a hop's receiver on the router's PUSH.").sample({}, double(f.pushes));
  out.family("swarm_stage_pushed_bytes_total", Type::kCounter, "Wire bytes of held tensors pushed.").sample({}, double(f.pushed_bytes));
  out.family("swarm_stage_pushes_received_total", Type::kCounter, "Tensors other peers pushed here.").sample({}, double(f.pushed_in));
  out.family("swarm_stage_pushes_late_total", Type::kCounter, "Pushed references fetched after all, their push not there in time.")
      .sample({}, double(f.push_late));
  out.family("swarm_stage_relayed_total", Type::kCounter, "Held tensors the router fetched to relay to a peer that could not reach this one.")
      .sample({}, double(f.relayed));
  if (f.device_memory_bytes >= 0)
    out.family("swarm_stage_device_memory_bytes", Type::kGauge, "The device's total memory.").sample({}, double(f.device_memory_bytes));
  if (f.device_memory_free_bytes >= 0)
    out.family("swarm_stage_device_memory_free_bytes", Type::kGauge, "The device's free memory.").sample({}, double(f.device_memory_free_bytes));
  metrics::process_metrics(out);
  return out.text();
}

StageFigures gather_stage_figures(const SharedStats& stats, const Holdings& holdings, const PeerLink& link) {
  StageFigures f;
  f.stage = stats.stage.load();
  f.job = stats.job_id.load();
  f.ready = stats.ready.load();
  f.seconds_per_unit = stats.ms_per_unit.load() / 1000;
  f.compute_s = stats.compute_s.load();
  f.forwards = stats.forwards.load();
  f.backwards = stats.backwards.load();
  f.cache_hits = stats.cache_hits.load();
  f.recomputes = stats.recomputes.load();
  f.cache_entries = stats.cache_entries.load();
  f.steps = stats.steps.load();
  f.errors = stats.errors.load();
  f.overflows = stats.overflows.load();
  f.skipped_steps = stats.skipped_steps.load();
  f.loss_scale = stats.loss_scale.load();
  f.held_bytes = holdings.bytes();
  f.held_tensors = holdings.size();
  f.held_evictions = holdings.evicted();
  f.fetches = link.fetches;
  f.fetched_bytes = link.fetch_bytes;
  f.fetch_failures = link.failed;
  f.served = link.served;
  f.served_bytes = link.served_bytes;
  f.fetched_from = link.fetched_from;
  f.pushes = link.pushes;
  f.pushed_bytes = link.push_bytes;
  f.pushed_in = link.pushed_in;
  f.push_late = link.push_late;
  return f;
}

}  // namespace swarm
