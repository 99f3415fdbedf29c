// metrics.cpp: the router's /metrics page and http_sd targets from RouterMetrics (metrics.h).
#include "router/metrics.h"

#include <array>

namespace swarm::router {

using metrics::Exposition;
using metrics::Labels;
using metrics::Type;

HopCounts& HopMetrics::at(int stage, const char* kind) {
  HopCounts*& c = by_label_.at[Label{stage, kind}];
  if (!c) c = &counts_[{stage, kind}];
  return *c;
}

void HopMetrics::sent(uint64_t request, int stage, const char* kind) {
  at(stage, kind).sent++;
  if (recent_.empty()) recent_.resize(kRecent);
  recent_[request % kRecent] = Recent{request, Label{stage, kind}};
}

void HopMetrics::completed(int stage, const char* kind, double latency_s) {
  at(stage, kind).completed++;
  auto it = latency_.find(stage);
  if (it == latency_.end()) it = latency_.emplace(stage, metrics::Histogram(metrics::latency_buckets())).first;
  it->second.observe(latency_s);
}

void HopMetrics::failed(int stage, const char* kind, bool rejected) {
  HopCounts& h = at(stage, kind);
  h.resent++;
  if (rejected) h.rejected++;
}

void HopMetrics::duplicate(uint64_t request) {
  const Recent* r = recent_.empty() ? nullptr : &recent_[request % kRecent];
  if (!r || r->request != request) at(-1, "unknown").duplicated++;
  else at(r->label.stage, r->label.kind).duplicated++;
}

namespace {

std::string stage_label(int s) { return s >= 0 ? std::to_string(s) : "none"; }

void peers_section(Exposition& out, const RouterMetrics& m) {
  // Peers by stage and state, every state shown (0 included) for the stages that have peers.
  std::map<std::pair<int, std::string>, int> by;
  static const char* states[] = {"idle", "loading", "syncing", "ready", "quarantined"};
  for (const PeerMetrics& p : m.peers)
    for (const char* s : states) by[{p.stage, s}] += p.state == s;
  out.family("swarm_peers", Type::kGauge, "Stage servers registered with the router, by the stage they serve and their state.");
  for (const auto& [k, n] : by) out.sample({{"stage", stage_label(k.first)}, {"state", k.second}}, n);

  auto labels = [](const PeerMetrics& p) { return Labels{{"peer", p.name}, {"peer_id", p.id}, {"stage", stage_label(p.stage)}}; };
  out.family("swarm_peer_info", Type::kGauge, "A stage server: its device and, for an emulated one, its emulation label (always 1).");
  for (const PeerMetrics& p : m.peers) {
    Labels l = labels(p);
    l.push_back({"device", p.device});
    l.push_back({"emulated", p.label});
    l.push_back({"relayed", p.relayed ? "true" : "false"});
    out.sample(l, 1);
  }
  struct Gauge {
    const char* name;
    const char* help;
    double (*get)(const PeerMetrics&);
  };
  const Gauge gauges[] = {
      {"swarm_peer_seconds_per_unit", "The peer's measured compute time per unit of work (a forward is 1, a backward 2.5); 0 until measured.",
       [](const PeerMetrics& p) { return p.seconds_per_unit; }},
      {"swarm_peer_queued_units", "Work units the router sent the peer that it has not answered yet.",
       [](const PeerMetrics& p) { return p.queued_units; }},
      {"swarm_peer_inbox_requests", "Requests waiting in the peer's queue, as its last heartbeat said.",
       [](const PeerMetrics& p) { return double(p.inbox); }},
      {"swarm_peer_heartbeat_age_seconds", "Seconds since the router last heard from the peer.",
       [](const PeerMetrics& p) { return p.heartbeat_age_s; }},
      {"swarm_peer_banned", "1 while the peer gets no new work after an error.", [](const PeerMetrics& p) { return p.banned ? 1.0 : 0.0; }},
  };
  for (const Gauge& g : gauges) {
    out.family(g.name, Type::kGauge, g.help);
    for (const PeerMetrics& p : m.peers) out.sample(labels(p), g.get(p));
  }
  const Gauge counters[] = {
      {"swarm_peer_results_total", "Replies the peer sent to the router's requests.", [](const PeerMetrics& p) { return double(p.results); }},
      {"swarm_peer_failures_total", "Requests the peer failed (errors, malformed or rejected replies).",
       [](const PeerMetrics& p) { return double(p.failures); }},
      {"swarm_peer_timeouts_total", "Requests to the peer that passed their deadline.", [](const PeerMetrics& p) { return double(p.timeouts); }},
      {"swarm_peer_integrity_failures_total", "Corrupt, misshapen or non-finite outputs held against the peer.",
       [](const PeerMetrics& p) { return double(p.integrity_failures); }},
  };
  for (const Gauge& g : counters) {
    out.family(g.name, Type::kCounter, g.help);
    for (const PeerMetrics& p : m.peers) out.sample(labels(p), g.get(p));
  }
}

void job_section(Exposition& out, const JobMetrics& j) {
  const Labels job{{"job_id", std::to_string(j.id)}};
  auto with = [&](std::initializer_list<std::pair<std::string, std::string>> more) {
    Labels l = job;
    l.insert(l.end(), more.begin(), more.end());
    return l;
  };
  out.family("swarm_job_info", Type::kGauge, "The job the router shows: its name and kind (always 1).")
      .sample(with({{"name", j.name}, {"kind", j.kind}}), 1);
  out.family("swarm_job_state", Type::kGauge, "1 for the job's current state, 0 for the others.");
  for (const char* s : {"queued", "loading", "running", "done", "failed", "cancelled"}) out.sample(with({{"state", s}}), j.state == s);
  out.family("swarm_job_step", Type::kGauge, "Optimizer steps the job has completed.").sample(job, j.step);
  out.family("swarm_job_steps", Type::kGauge, "Optimizer steps the job will take in all.").sample(job, j.steps);

  const std::pair<const char*, uint64_t> mbs[] = {{"taken", j.taken},     {"completed", j.completed}, {"resent", j.resent},
                                                  {"duplicated", j.duplicates}, {"rejected", j.rejected}, {"lost", j.lost}};
  const char* mb_help[] = {"Microbatches the job took from its data.",
                           "Microbatches that completed every stage, forward and backward.",
                           "Hops of microbatches sent again after a failure or a deadline.",
                           "Results that answered no pending request (late or sent twice).",
                           "Hops whose peer answered with an error or an unacceptable result.",
                           "Microbatches taken and never completed (counted when the job is done; must stay 0)."};
  for (size_t i = 0; i < 6; ++i)
    out.family(std::string("swarm_microbatches_") + mbs[i].first + "_total", Type::kCounter, mb_help[i]).sample(job, double(mbs[i].second));

  struct HopFig {
    const char* name;
    const char* help;
    uint64_t HopCounts::*field;
  };
  const HopFig hop_figs[] = {{"swarm_hops_sent_total", "Hops sent to a peer, by stage and kind.", &HopCounts::sent},
                             {"swarm_hops_completed_total", "Hops whose result was accepted, by stage and kind.", &HopCounts::completed},
                             {"swarm_hops_resent_total", "Hops that failed (error, deadline, peer gone) and went out again.", &HopCounts::resent},
                             {"swarm_hops_duplicated_total", "Results for hops no longer pending (late or sent twice).", &HopCounts::duplicated},
                             {"swarm_hops_rejected_total", "Hops answered with an error or an unacceptable result.", &HopCounts::rejected}};
  for (const HopFig& f : hop_figs) {
    out.family(f.name, Type::kCounter, f.help);
    for (const auto& [k, c] : j.hops.counts()) out.sample(with({{"stage", stage_label(k.first)}, {"kind", k.second}}), double(c.*f.field));
  }
  out.family("swarm_hop_latency_seconds", Type::kHistogram, "Seconds from sending a hop to its accepted result, by stage.");
  for (const auto& [s, h] : j.hops.latency()) out.histogram(with({{"stage", stage_label(s)}}), h);

  if (!std::isnan(j.train_loss)) out.family("swarm_train_loss", Type::kGauge, "The last completed step's mean training loss [nats/token].").sample(job, j.train_loss);
  if (!std::isnan(j.val_loss)) out.family("swarm_validation_loss", Type::kGauge, "The last evaluation's validation loss [nats/token].").sample(job, j.val_loss);
  out.family("swarm_tokens_per_second", Type::kGauge, "Training tokens per second since the job started running (as swarm status says).")
      .sample(job, j.tokens_per_s);
  out.family("swarm_train_tokens_total", Type::kCounter, "Training tokens of completed microbatches since this router took the job.")
      .sample(job, double(j.tokens));
  out.family("swarm_rounds_total", Type::kCounter, "DiLoCo rounds (outer steps) begun.").sample(job, double(j.rounds));
  out.family("swarm_round_duration_seconds", Type::kHistogram, "Seconds from a round's start to its last stage's vote, by kind (delta: DiLoCo; grad: a summed-gradient step).");
  for (const auto& [k, h] : j.round_seconds) out.histogram(with({{"kind", k}}), h);

  out.family("swarm_wire_bytes_total", Type::kCounter, "Tensor bytes of training that crossed a link, by direction and codec.")
      .sample(with({{"direction", "activations"}, {"codec", j.codec_activations}}), double(j.bytes_activations))
      .sample(with({{"direction", "gradients"}, {"codec", j.codec_gradients}}), double(j.bytes_gradients))
      .sample(with({{"direction", "outer"}, {"codec", j.codec_outer}}), double(j.bytes_outer));
  out.family("swarm_router_relayed_bytes_total", Type::kCounter, "The part of the activation and gradient bytes that went through the router.")
      .sample(job, double(j.bytes_through_router));
  out.family("swarm_codec_seconds_total", Type::kCounter, "Seconds the peers spent encoding and decoding hops' tensors, by direction.");
  const std::array<std::pair<const char*, const char*>, 4> codec = {{{"activations", "encode"}, {"activations", "decode"},
                                                                     {"gradients", "encode"}, {"gradients", "decode"}}};
  for (size_t i = 0; i < 4; ++i) out.sample(with({{"direction", codec[i].first}, {"op", codec[i].second}}), j.codec_s[i]);
  out.family("swarm_backwards_total", Type::kCounter, "Backward hops by whether the peer had the forward's graph cached or recomputed it.")
      .sample(with({{"graph", "cached"}}), double(j.backward_cached))
      .sample(with({{"graph", "recomputed"}}), double(j.backward_recomputed));
  const std::tuple<const char*, const char*, uint64_t> plain[] = {
      {"swarm_fetch_failures_total", "Held tensors a peer could not fetch from their holder.", j.fetch_failures},
      {"swarm_relayed_tensors_total", "Held tensors the router relayed for peers that could not reach their holder.", j.relayed_by_router},
      {"swarm_remade_tensors_total", "Tensors made again because their holder was gone.", j.remade},
      {"swarm_integrity_failures_total", "Corrupt, misshapen or non-finite outputs detected.", j.integrity_failures},
      {"swarm_request_timeouts_total", "Requests that passed their deadline.", j.timeouts},
      {"swarm_quarantines_total", "Peers quarantined for repeated integrity failures.", j.quarantines},
      {"swarm_skipped_steps_total", "Steps every stage skipped because a backward overflowed (fp16).", j.skipped_steps},
      {"swarm_checkpoints_written_total", "Checkpoints written to disk.", j.checkpoints_written},
      {"swarm_checkpoint_failures_total", "Checkpoints that could not be written.", j.checkpoint_failures},
  };
  for (const auto& [name, help, v] : plain) out.family(name, Type::kCounter, help).sample(job, double(v));
  out.family("swarm_checkpoint_write_seconds", Type::kHistogram, "Seconds to write one checkpoint on the router's disk thread.")
      .histogram(job, j.checkpoint_seconds);
  out.family("swarm_rebalancer_moves_total", Type::kCounter, "Peers the rebalancer moved, by stages and reason (bottleneck, empty_stage).");
  for (const auto& [k, n] : j.moves)
    out.sample(with({{"from", std::to_string(std::get<0>(k))}, {"to", std::to_string(std::get<1>(k))}, {"reason", std::get<2>(k)}}), double(n));
  out.family("swarm_stage_samples_per_second", Type::kGauge, "Each stage's throughput as the router models it from its peers' measured speeds.");
  for (size_t s = 0; s < j.stage_samples_per_s.size(); ++s) out.sample(with({{"stage", std::to_string(s)}}), j.stage_samples_per_s[s]);
}

}  // namespace

std::string exposition(const RouterMetrics& m) {
  Exposition out;
  out.family("swarm_router_uptime_seconds", Type::kGauge, "Seconds since the router started.").sample({}, m.uptime_s);
  out.family("swarm_router_bad_messages_total", Type::kCounter, "Messages the router dropped because they broke the protocol.")
      .sample({}, double(m.bad_messages));
  out.family("swarm_router_bans_total", Type::kCounter, "Times a peer was banned from new work after an error.").sample({}, double(m.bans));
  out.family("swarm_router_clients", Type::kGauge, "Client sessions (swarm CLI) the router knows.").sample({}, double(m.clients));
  out.family("swarm_router_jobs", Type::kGauge, "Jobs the router holds, finished ones included.").sample({}, double(m.jobs));
  out.family("swarm_router_messages_total", Type::kCounter, "Messages the router received from peers and clients (in) and sent (out).")
      .sample({{"direction", "in"}}, double(m.server.messages_in))
      .sample({{"direction", "out"}}, double(m.server.messages_out));
  out.family("swarm_router_core_seconds_total", Type::kCounter, "Seconds the router spent deciding (inside its core), of its process CPU time.")
      .sample({}, m.server.core_s);
  peers_section(out, m);
  if (m.has_job) job_section(out, m.job);
  metrics::process_metrics(out);
  return out.text();
}

nlohmann::json http_targets(const std::vector<PeerMetrics>& peers) {
  nlohmann::json out = nlohmann::json::array();
  for (const PeerMetrics& p : peers) {
    // http://HOST:PORT/PATH -> the target HOST:PORT and its metrics path.
    const std::string& u = p.metrics_url;
    const size_t scheme = u.find("://");
    if (scheme == std::string::npos) continue;
    const size_t slash = u.find('/', scheme + 3);
    const std::string target = u.substr(scheme + 3, slash == std::string::npos ? std::string::npos : slash - scheme - 3);
    const std::string path = slash == std::string::npos ? "/metrics" : u.substr(slash);
    out.push_back({{"targets", {target}},
                   {"labels", {{"peer", p.name}, {"peer_id", p.id}, {"stage", stage_label(p.stage)}, {"__metrics_path__", path},
                               {"__scheme__", u.substr(0, scheme)}}}});
  }
  return out;
}

}  // namespace swarm::router
