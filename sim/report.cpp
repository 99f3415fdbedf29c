// report.cpp: what the simulator writes down (sim/world.h): trace samples (virtual tokens per
// second against the ideal bound, peers per stage, the job's counters), events read from the
// router's log (moves with their reasons, quarantines, the job's end), pauses, the summary and
// the scenario's expectations.
//
// The ideal bound: the tokens per second the live peers would reach if every one computed all
// the time on a perfect fractional assignment, with no link, latency or router in the way. A
// microbatch costs 3 forward-equivalents on every stage (forward 1 + backward 2 with its graph
// cached, or the last stage's forward-and-loss 3), so the bound is
//   sum over live peers of FLOP/s  /  (3 * sum over stages of a forward's FLOPs)  * B * T.
// No integer assignment of the peers beats it.
//
// Where the rest went, per sample: `hop_share` is the FLOPs of the hops the peers computed over
// the live peers' FLOPs (1 - hop_share: idle, waiting on links, per-request overhead, the rounds'
// and loads' work), and `recompute_share` the part of it that recomputed a forward whose graph
// was not cached. Completed microbatches count 3 units a stage, so vs_ideal is about
// hop_share - recompute_share, less hops whose results were not used (timeouts, duplicates).
// `busy` says, per peer group, the share of its live peers' time spent computing (hops, loads,
// rounds): a group well below the others is starved by the pipeline or by its links.
#include <algorithm>
#include <cstdio>

#include "sim/world.h"

namespace swarm::sim {

namespace {

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
  }
  return "?";
}

uint64_t count(const nlohmann::json& j, const char* group, const char* key) {
  if (!j.is_object() || !j.contains(group) || !j[group].is_object() || !j[group].contains(key) || !j[group][key].is_number()) return 0;
  return j[group][key].get<uint64_t>();
}

}  // namespace

void World::line(nlohmann::json j) {
  if (opt.on_line) opt.on_line(j);
}

double World::ideal_tokens_per_s() const {
  return costs.fwd_flops_sum > 0 ? ideal_flops / (3.0 * costs.fwd_flops_sum) * double(costs.B * costs.T) : 0.0;
}

void World::ideal_changed() {
  win.ideal_integral += ideal_tokens_per_s() * (now - ideal_mark_s);
  for (size_t g = 0; g < group_alive.size(); ++g) win.group_alive_s[g] += double(group_alive[g]) * (now - ideal_mark_s);
  ideal_mark_s = now;
}

void World::note_log(const router::Log& l) {
  // The router's side: what it logged, read as a person reads the log.
  log_counts[level_name(l.level)]++;
  if (sc.trace_logs) router_line({{"event", "log"}, {"t_s", rnow}, {"level", level_name(l.level)}, {"text", l.text}});
  const std::string& t = l.text;
  if (t.rfind("rebalance: moving peer", 0) == 0) {
    moves++;
    pause_check = true;
    router_line({{"event", "move"}, {"t_s", rnow}, {"text", t.substr(11)}});
  } else if (t.find(" quarantined (") != std::string::npos) {
    quarantined++;
    pause_check = true;
    router_line({{"event", "quarantine"}, {"t_s", rnow}, {"text", t}});
  } else if (t.find(" is gone: ") != std::string::npos) {
    pause_check = true;
  } else if (t.find(" restarts from its snapshot") != std::string::npos) {
    router_line({{"event", "stage_restore"}, {"t_s", rnow}, {"text", t}});
  } else if (job_id && t.rfind("job " + std::to_string(job_id) + " ", 0) == 0) {
    const std::string rest = t.substr(5 + std::to_string(job_id).size());
    if (rest == "running") {
      job_running = true;
      router_line({{"event", "running"}, {"t_s", rnow}});
    }
    for (const char* end : {"done", "failed", "cancelled"})
      if (rest.rfind(end, 0) == 0) {
        job_ended = true;
        router_line({{"event", "job_end"}, {"t_s", rnow}, {"text", t}});
      }
  }
}

void World::check_pause() {
  pause_check = false;
  if (!router_alive || !job_running || job_ended) return;
  std::vector<int> empty;
  for (int s = 0; s < sc.job.partition.stages; ++s)
    if (!core->registry().any_ready(job_id, s)) empty.push_back(s);
  if (!empty.empty() && paused_since < 0) {
    paused_since = rnow;
    pauses++;
    router_line({{"event", "paused"}, {"t_s", rnow}, {"stages", empty}});
  } else if (empty.empty() && paused_since >= 0) {
    paused_total_s += rnow - paused_since;
    router_line({{"event", "resumed"}, {"t_s", rnow}, {"after_s", rnow - paused_since}});
    paused_since = -1;
  }
  if (paused_since >= 0) at(router_side, rnow + 0.25, Ev::kPauseCheck);
}

nlohmann::json World::router_half() {
  // The router's side at the sample's time: the job's counters, the microbatches completed since
  // the last sample, its link.
  nlohmann::json st = router_alive && job_id ? core->status_json(job_id, rnow) : nlohmann::json();
  const uint64_t completed = count(st, "microbatches", "completed");
  nlohmann::json h{{"completed", completed > completed0 ? completed - completed0 : 0},
                   {"router", router_alive ? "up" : "down"},
                   {"moves", moves},
                   {"router_link", {{"up_bytes", router_host.up.bytes}, {"down_bytes", router_host.down.bytes}}}};
  completed0 = completed;
  if (st.is_object() && st.contains("state")) {
    last_state = st["state"].get<std::string>();
    last_reason = st.value("reason", std::string());
    h["status"] = std::move(st);
  }
  return h;
}

void World::peers_half() {
  ideal_changed();
  win.t1 = now;
  for (const SimPeer& p : peers) win.alive += p.alive;
  halves.push_back(std::move(win));
  open_window();
}

void World::sample(const nlohmann::json& r) {
  Window w = std::move(halves.front());
  halves.pop_front();
  const double dt = w.t1 - w.t0;
  const double tokens = double(r["completed"].get<uint64_t>()) * double(costs.B * costs.T);
  const double tps = dt > 0 ? tokens / dt : 0.0, ideal = dt > 0 ? w.ideal_integral / dt : 0.0;
  // The live peers' FLOPs over the interval: what the ideal bound turns into tokens.
  const double capacity = w.ideal_integral * 3.0 * costs.fwd_flops_sum / double(costs.B * costs.T);
  nlohmann::json s{{"event", "sample"},
                   {"t_s", w.t1},
                   {"window_s", dt},
                   {"tokens_per_s", tps},
                   {"ideal_tokens_per_s", ideal},
                   {"vs_ideal", ideal > 0 ? tps / ideal : 0.0},
                   {"hop_share", capacity > 0 ? w.hop_flops / capacity : 0.0},
                   {"recompute_share", capacity > 0 ? w.recompute_flops / capacity : 0.0},
                   {"busy", busy_by_group(w.group_alive_s, w.group_busy_s)},
                   {"router", r["router"]},
                   {"peers_alive", w.alive}};
  if (r.contains("status")) {
    const nlohmann::json& st = r["status"];
    s["state"] = st["state"];
    s["reason"] = st.value("reason", std::string());
    s["step"] = st.value("step", 0);
    s["peers_per_stage"] = st["peers_per_stage"];
    s["microbatches"] = st["microbatches"];
    s["rounds"] = st.value("rounds", 0);
    s["moves"] = r["moves"];
  }
  s["router_link"] = r["router_link"];
  line(s);
  samples.push_back(s);
  sampled.push_back(std::move(w));
}

void World::finish_samples() {
  // After both sides stopped. What the router sent by the end is still on its way to the peers'
  // side: its halves of samples and its trace lines are written now, in order.
  if (!peers_side.done) {
    drain(peers_side);
    while (!peers_side.queue.empty()) {
      const Event e = peers_side.queue.top();
      peers_side.queue.pop();
      if (e.kind == Ev::kRouterHalf) sample(*peers_side.slots.take(e.slot).j);
      else if (e.kind == Ev::kLine) line(std::move(*peers_side.slots.take(e.slot).j));
    }
  }
  // A sample the peers took after the job ended (within the lookahead of its end) has no router
  // half: its window joins the last one.
  while (!halves.empty()) {
    Window& h = halves.back();
    win.t0 = h.t0;
    win.ideal_integral += h.ideal_integral;
    win.hop_flops += h.hop_flops;
    win.recompute_flops += h.recompute_flops;
    for (size_t g = 0; g < win.group_alive_s.size(); ++g) {
      win.group_alive_s[g] += h.group_alive_s[g];
      win.group_busy_s[g] += h.group_busy_s[g];
    }
    halves.pop_back();
  }
  if (now > win.t0) {
    peers_half();
    sample(router_half());
  }
}

void World::open_window() {
  win = Window{};
  win.t0 = now;
  win.group_alive_s.assign(sc.groups.size(), 0.0);
  win.group_busy_s.assign(sc.groups.size(), 0.0);
  ideal_mark_s = now;
}

nlohmann::json World::busy_by_group(const std::vector<double>& alive_s, const std::vector<double>& busy_s) const {
  // The share of each group's live time its peers spent computing (1 - it: idle or waiting).
  nlohmann::json busy = nlohmann::json::object();
  for (size_t g = 0; g < sc.groups.size(); ++g) busy[sc.groups[g].name] = alive_s[g] > 0 ? busy_s[g] / alive_s[g] : 0.0;
  return busy;
}

nlohmann::json World::summary() const {
  nlohmann::json st = router_alive && job_id ? core->status_json(job_id, now) : nlohmann::json();
  // The last simulated hour (or all of a shorter run), time-weighted over the samples in it.
  double tok = 0, ideal = 0, span = 0, hop = 0, recompute = 0;
  std::vector<double> alive_s(sc.groups.size(), 0.0), busy_s(sc.groups.size(), 0.0);
  const double from = std::max(0.0, now - 3600.0);
  for (size_t i = 0; i < samples.size(); ++i) {
    const nlohmann::json& s = samples[i];
    const double t = s["t_s"].get<double>(), w = s["window_s"].get<double>();
    if (t - w < from - 1e-9) continue;
    const double capacity = s["ideal_tokens_per_s"].get<double>() * w;
    tok += s["tokens_per_s"].get<double>() * w;
    ideal += capacity;
    hop += s["hop_share"].get<double>() * capacity;
    recompute += s["recompute_share"].get<double>() * capacity;
    span += w;
    for (size_t g = 0; g < sc.groups.size(); ++g) {
      alive_s[g] += sampled[i].group_alive_s[g];
      busy_s[g] += sampled[i].group_busy_s[g];
    }
  }
  const uint64_t taken = count(st, "microbatches", "taken"), completed = count(st, "microbatches", "completed");
  const uint64_t in_flight = count(st, "microbatches", "in_flight");
  uint64_t peer_bytes = 0;
  double busiest_up = 0;
  for (const SimPeer& p : peers) {
    peer_bytes += p.host.up.bytes;
    busiest_up = std::max(busiest_up, p.host.up.busy_s);
  }
  nlohmann::json job{{"id", job_id}, {"state", st.value("state", last_state)}, {"reason", st.value("reason", last_reason)}};
  if (st.is_object() && st.contains("microbatches")) {
    job["step"] = st["step"];
    job["steps"] = st["steps"];
    job["microbatches"] = st["microbatches"];
    // Taken and neither completed nor in flight: lost (the router's own figure counts only at the end).
    job["microbatches"]["lost"] = taken >= completed + in_flight ? taken - completed - in_flight : 0;
    job["rounds"] = st["rounds"];
    job["timeouts"] = st["timeouts"];
    job["integrity_failures"] = st["integrity_failures"];
    job["stage_restores"] = st["stage_restores"].size();
    job["wire_bytes"] = st["wire_bytes"];
    job["hops"] = st["hops"];
    job["tokens_per_s"] = st["tokens_per_s"];
    job["train_tokens_per_s_router"] = st["tokens_per_s"];
  }
  job["moves"] = moves;
  job["quarantined"] = quarantined;
  const double T = std::max(now, 1e-9);
  return {{"event", "summary"},
          {"scenario", sc.name},
          {"seed", opt.seed.value_or(sc.seed)},
          {"virtual_s", now},
          {"peers", peers.size()},
          {"job", job},
          {"last_hour", {{"from_s", now - span}, {"tokens_per_s", span > 0 ? tok / span : 0.0}, {"ideal_tokens_per_s", span > 0 ? ideal / span : 0.0},
                         {"vs_ideal", ideal > 0 ? tok / ideal : 0.0}, {"hop_share", ideal > 0 ? hop / ideal : 0.0},
                         {"recompute_share", ideal > 0 ? recompute / ideal : 0.0}, {"busy", busy_by_group(alive_s, busy_s)}}},
          {"paused", {{"times", pauses}, {"total_s", paused_total_s + (paused_since >= 0 ? now - paused_since : 0.0)}}},
          {"faults", {{"crashes", crashes}, {"rejoins", rejoins}, {"router_restarts", router_restarts}, {"corrupt_replies", corrupt_sent}}},
          {"traffic", {{"router_link", {{"up_bytes", router_host.up.bytes}, {"down_bytes", router_host.down.bytes},
                                        {"up_busy_share", router_host.up.busy_s / T}, {"down_busy_share", router_host.down.busy_s / T}}},
                       {"peer_uplinks", {{"bytes", peer_bytes}, {"busiest_share", busiest_up / T}}},
                       {"fetches", fetches}, {"fetch_failures", fetch_failures}, {"pushes", pushes}, {"pushes_used", pushes_used},
                       {"messages_to_router", msgs_to_router}, {"messages_from_router", msgs_from_router},
                       {"heartbeats_to_router", heartbeats_in}, {"heartbeats_from_router", heartbeats_out},
                       {"heartbeats_to_router_per_s", double(heartbeats_in) / T}, {"messages_to_router_per_s", double(msgs_to_router) / T}}},
          {"memory", {{"peak_held_bytes_one_peer", peak_held_bytes}}},
          {"logs", log_counts}};
}

std::vector<std::string> World::check_expectations(const nlohmann::json& s) const {
  std::vector<std::string> out;
  const Expect& e = sc.expect;
  const nlohmann::json& job = s["job"];
  auto num = [](double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.4g", v);
    return std::string(b);
  };
  if (e.job && job.value("state", std::string()) != *e.job)
    out.push_back("the job ended " + job.value("state", std::string("unknown")) + " (expected " + *e.job + "): " + job.value("reason", std::string()));
  const uint64_t lost = job.contains("microbatches") ? job["microbatches"].value("lost", uint64_t(0)) : 0;
  if (e.lost && lost != *e.lost) out.push_back(std::to_string(lost) + " microbatches lost (expected " + std::to_string(*e.lost) + ")");
  const double last = samples.empty() ? 0.0 : samples.back()["tokens_per_s"].get<double>();
  if (e.min_tokens_per_s && last < *e.min_tokens_per_s)
    out.push_back("the last window ran at " + num(last) + " tokens/s (expected at least " + num(*e.min_tokens_per_s) + ")");
  const double vs = s["last_hour"]["vs_ideal"].get<double>();
  if (e.min_vs_ideal && vs < *e.min_vs_ideal) out.push_back("tokens/s over the ideal bound " + num(vs) + " (expected at least " + num(*e.min_vs_ideal) + ")");
  if (e.paused && (pauses > 0) != *e.paused) out.push_back(std::string("the job ") + (pauses ? "paused" : "never paused") + " (expected " + (*e.paused ? "a pause" : "none") + ")");
  if (e.min_moves && moves < *e.min_moves) out.push_back(std::to_string(moves) + " rebalancer moves (expected at least " + std::to_string(*e.min_moves) + ")");
  if (e.min_quarantined && quarantined < *e.min_quarantined)
    out.push_back(std::to_string(quarantined) + " peers quarantined (expected at least " + std::to_string(*e.min_quarantined) + ")");
  const uint64_t rounds = job.value("rounds", uint64_t(0));
  if (e.min_rounds && rounds < *e.min_rounds) out.push_back(std::to_string(rounds) + " rounds (expected at least " + std::to_string(*e.min_rounds) + ")");
  const uint64_t timeouts = job.value("timeouts", uint64_t(0));
  if (e.max_timeouts && timeouts > *e.max_timeouts)
    out.push_back(std::to_string(timeouts) + " requests passed their deadline (expected at most " + std::to_string(*e.max_timeouts) + ")");
  return out;
}

}  // namespace swarm::sim
