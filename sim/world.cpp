// world.cpp: the simulator's event loop and the router's side of the world (sim/simulator.h):
// the core and its restarts, the router's link, its disk (in memory), the client that submits the
// job, and `simulate`.

#include <algorithm>
#include <chrono>

#include "sim/world.h"

namespace swarm::sim {

namespace {

Host host_of(const LinkSpec& l) {
  Host h;
  h.up.bps = l.up_bps;
  h.down.bps = l.down_bps;
  h.latency_s = l.latency_s;
  return h;
}

}  // namespace

World::World(const Scenario& s, const SimOptions& o) : sc(s), opt(o), rng(o.seed.value_or(s.seed)), costs(job_costs(s.job)) {
  core_opt.heartbeat_ms = s.heartbeat_ms;
  core_opt.liveness = s.liveness;
  if (s.state_dir) core_opt.state_dir = "/sim/state";
  core = std::make_unique<router::RouterCore>(core_opt);
  router_host = host_of(s.router_link);
  end_s = s.duration_s;
  for (size_t g = 0; g < s.groups.size(); ++g) {
    const PeerGroup& grp = s.groups[g];
    for (int i = 0; i < grp.count; ++i) {
      SimPeer p;
      p.index = int(peers.size());
      p.group = int(g);
      p.within = i;
      p.name = grp.name + "-" + std::to_string(i);
      p.dev = grp.device;
      p.host = host_of(grp.link);
      if (grp.listen) p.listen = "tcp://" + p.name + ":7000";
      peers.push_back(std::move(p));
    }
  }
  for (const SimPeer& p : peers)
    if (!p.listen.empty()) by_listen[p.listen] = p.index;
  group_alive.assign(s.groups.size(), 0);
  open_window(0);
}

void World::schedule(double t, Ev kind, int peer, uint32_t slot) {
  Event e;
  e.t = t;
  e.seq = seq++;
  e.kind = kind;
  e.peer = peer;
  e.session = peer >= 0 ? peers[size_t(peer)].session : 0;
  e.epoch = router_session;
  e.slot = slot;
  queue.push(e);
}

uint32_t World::stash(wire::Message m) {
  uint32_t i;
  if (!free_slots.empty()) {
    i = free_slots.back();
    free_slots.pop_back();
  } else {
    i = uint32_t(slots.size());
    slots.emplace_back();
  }
  slots[i] = Slot{};
  slots[i].m = std::move(m);
  return i;
}

Slot World::release_slot(uint32_t i) {
  Slot s = std::move(slots[i]);
  slots[i] = Slot{};
  free_slots.push_back(i);
  return s;
}

double World::transfer(Host& a, Host& b, uint64_t bytes, double t) {
  const double dur = double(bytes) * 8.0 / std::min(a.up.bps, b.down.bps);
  if (bytes <= kControlBytes) {
    // A control message (HELLO, heartbeat, a result's references) travels on its own connection,
    // its packets interleaved with bulk transfers: it is not queued behind them.
    a.up.bytes += bytes;
    b.down.bytes += bytes;
    return t + dur + a.latency_s + b.latency_s;
  }
  // Bulk: both ends carry it at the slower one's rate, sharing each with what it carries already.
  const double end = std::max(a.up.carry(t, dur), b.down.carry(t, dur));
  a.up.bytes += bytes;
  b.down.bytes += bytes;
  return end + a.latency_s + b.latency_s;
}

double Pipe::carry(double t, double dur) {
  ends.erase(std::remove_if(ends.begin(), ends.end(), [t](double e) { return e <= t; }), ends.end());
  const double fair = t + double(ends.size() + 1) * dur;
  const double after_queue = std::max(t, free_s) + dur;
  free_s = after_queue;
  busy_s += dur;
  const double end = std::min(fair, after_queue);
  ends.push_back(end);
  return end;
}

template <class F>
void World::call(const char* what, F&& f) {
  // A monotonic clock (30 ns a read here; the thread's CPU clock is a 1.4 us system call). The
  // process has one thread, so this is the core's CPU time unless the OS preempts it, which
  // only makes the figure worse.
  const auto t0 = opt.measure_cpu ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  router::Actions a = f();
  if (opt.measure_cpu) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    core_cpu_s += s;
    CoreCost& k = core_by_event[what];
    k.events++;
    k.s += s;
  }
  core_events++;
  take(std::move(a));
}

void World::take(router::Actions actions) {
  std::vector<router::PeerId> unreachable;
  for (router::Action& a : actions) {
    if (auto* s = std::get_if<router::Send>(&a)) {
      if (s->to == client_id) {
        // The client: the job's id, or why it was refused.
        if (s->msg.type == wire::MsgType::kSubmitted) {
          job_id = msg::read<msg::Submitted>(s->msg).job_id;
          line({{"event", "submitted"}, {"t_s", now}, {"job_id", job_id}});
        } else if (s->msg.type == wire::MsgType::kError) {
          submit_error = msg::read<msg::Error>(s->msg).message;
        }
        continue;
      }
      const int p = peer_of(s->to);
      if (p < 0 || !peers[size_t(p)].alive) {
        unreachable.push_back(s->to);   // its process is gone: the send fails (ROUTER_MANDATORY)
        continue;
      }
      if (s->msg.type == wire::MsgType::kHeartbeat) {
        heartbeats_out++;   // the router's liveness beat: nothing for a simulated peer to do
        continue;
      }
      msgs_from_router++;
      if (s->msg.type == wire::MsgType::kPush) {
        push(p, s->msg);
        continue;
      }
      SimPeer& peer = peers[size_t(p)];
      const double at = transfer(router_host, peer.host, message_bytes(s->msg), now);
      schedule(at, Ev::kToPeer, p, stash(std::move(s->msg)));
    } else if (auto* l = std::get_if<router::Log>(&a)) {
      note_log(*l);
    } else if (auto* f = std::get_if<router::WriteFile>(&a)) {
      files[f->path] = std::move(f->content);
    } else if (auto* lj = std::get_if<router::LoadJob>(&a)) {
      // The disk: the job's data (read once, or made up when its files are not here) and, for a
      // job picked up again, its newest checkpoint.
      router::JobLoaded r;
      r.job = lj->job;
      try {
        if (!data) {
          const JobSpec& js = *lj->spec;
          data = std::make_shared<TokenData>(sc.synthetic_data ? TokenData::synthetic(js.data, js.model.seq_len, js.model.vocab_size, 1 << 20, js.seed)
                                                               : TokenData::load(js.data, js.model.seq_len, js.model.vocab_size));
        }
        r.data = data;
      } catch (const InputError& e) {
        r.error = e.what();
      }
      const std::string dir = lj->resume.empty() ? lj->checkpoint_dir : lj->resume;
      if (auto it = checkpoints.find(dir); it != checkpoints.end() && !it->second.empty()) {
        LoadedCheckpoint lc;
        lc.ckpt = *it->second.back();
        lc.path = dir + "/step-" + std::to_string(lc.ckpt.step);
        if (auto pf = files.find(dir + "/progress.json"); pf != files.end()) {
          const nlohmann::json pj = nlohmann::json::parse(pf->second, nullptr, false);
          if (pj.is_object() && pj.contains("taken") && pj["taken"].is_number_integer())
            r.redone = std::max<int64_t>(0, pj["taken"].get<int64_t>() - int64_t(lc.ckpt.next_microbatch));
        }
        r.checkpoint = std::move(lc);
      }
      disk_loads.push_back(std::move(r));
      schedule(now + 0.05, Ev::kDisk, -1, uint32_t(disk_loads.size() - 1) << 1);
    } else if (auto* w = std::get_if<router::WriteCheckpoint>(&a)) {
      auto& kept = checkpoints[w->dir];
      kept.push_back(w->checkpoint);
      while (kept.size() > size_t(std::max(1, w->keep))) kept.erase(kept.begin());
      uint64_t bytes = 0;
      for (const auto& st : w->checkpoint->stages) bytes += 4 * (st.theta_g.size() + st.momentum.size() + st.theta.size() + st.adam_m.size() + st.adam_v.size());
      disk_writes.push_back(router::CheckpointWritten{w->job, w->checkpoint->step, w->dir + "/step-" + std::to_string(w->checkpoint->step), ""});
      schedule(now + 0.01 + double(bytes) / 1e9, Ev::kDisk, -1, (uint32_t(disk_writes.size() - 1) << 1) | 1);
    }
  }
  for (const router::PeerId& id : unreachable)
    if (router_alive && core->registry().find(id)) call("unreachable", [&] { return core->on_unreachable(id, now); });
}

void World::to_router(int p, wire::Message m, double depart_s) {
  SimPeer& peer = peers[size_t(p)];
  peer.last_sent_s = std::max(peer.last_sent_s, depart_s);
  const double at = transfer(peer.host, router_host, message_bytes(m), depart_s);
  schedule(at, Ev::kToRouter, p, stash(std::move(m)));
}

void World::core_message(int p, wire::Message m) {
  const router::PeerId& id = peers[size_t(p)].id;
  msgs_to_router++;
  if (m.type == wire::MsgType::kHeartbeat) heartbeats_in++;
  // As the server: nothing but HELLO from a stranger is even decoded.
  if (!core->accepts(id, m.type)) m = wire::Message(m.type, m.id, m.attempt);
  call(wire::msg_type_name(m.type), [&] { return core->on_message(id, std::move(m), now); });
}

void World::router_down(double down_s) {
  router_restarts++;
  line({{"event", "router_down"}, {"t_s", now}, {"for_s", down_s}});
  router_alive = false;      // killed: no goodbye to anyone
  router_session++;          // whatever was on its way to it is lost
  core.reset();
  schedule(now + down_s, Ev::kRouterUp);
}

void World::router_up() {
  core = std::make_unique<router::RouterCore>(core_opt);
  router_alive = true;
  router_host.up.free_s = router_host.down.free_s = now;
  router_host.up.ends.clear();
  router_host.down.ends.clear();
  // The state dir as the server reads it: <state dir>/jobs/<id>/job.json.
  std::vector<router::StoredJob> stored;
  const std::string prefix = core_opt.state_dir + "/jobs/";
  for (const auto& [path, content] : files) {
    if (path.rfind(prefix, 0) != 0 || path.size() < 9 || path.compare(path.size() - 9, 9, "/job.json") != 0) continue;
    const nlohmann::json j = nlohmann::json::parse(content, nullptr, false);
    if (!j.is_object()) continue;
    router::StoredJob sj;
    sj.id = j.value("id", uint64_t(0));
    sj.state = j.value("state", std::string());
    sj.spec = j.value("spec", nlohmann::json());
    sj.checkpoint_dir = j.value("checkpoint_dir", std::string());
    stored.push_back(std::move(sj));
  }
  line({{"event", "router_up"}, {"t_s", now}, {"jobs_restored", stored.size()}});
  call("restore", [&] { return core->restore(std::move(stored), now); });
}

SimResult World::run() {
  const auto wall0 = std::chrono::steady_clock::now();
  line({{"event", "start"}, {"scenario", sc.name}, {"seed", opt.seed.value_or(sc.seed)}, {"peers", peers.size()},
        {"stages", sc.job.partition.stages}, {"hops", hops_name(sc.job.routing.hops)}, {"synthetic_data", sc.synthetic_data},
        {"duration_s", sc.duration_s}});
  // Joins, the job, the router's loop, samples, faults.
  double last_join = 0;
  for (SimPeer& p : peers) {
    const PeerGroup& g = sc.groups[size_t(p.group)];
    const double t = g.join_s + (g.join_spread_s > 0 ? rng.uniform(0, g.join_spread_s) : 0.0);
    if (g.join_s == 0) last_join = std::max(last_join, t);
    schedule(t, Ev::kJoin, p.index);
  }
  schedule(sc.submit_s >= 0 ? sc.submit_s : last_join + 0.5, Ev::kSubmit);
  schedule(0, Ev::kTick);
  schedule(sc.sample_s, Ev::kSample);
  for (size_t i = 0; i < sc.faults.events.size(); ++i) schedule(sc.faults.events[i].at_s, Ev::kFault, -1, uint32_t(i));

  while (!queue.empty()) {
    const Event e = queue.top();
    if (e.t > end_s) break;
    queue.pop();
    now = e.t;
    sim_events++;
    const bool stale_peer = e.peer >= 0 && e.session != peers[size_t(e.peer)].session;
    switch (e.kind) {
      case Ev::kTick:
        if (router_alive) call("tick", [&] { return core->tick(now); });
        schedule(now + sc.tick_s, Ev::kTick);
        break;
      case Ev::kToRouter: case Ev::kCorrupt: {
        Slot s = release_slot(e.slot);
        if (stale_peer || e.epoch != router_session || !router_alive) break;
        if (e.kind == Ev::kToRouter) {
          core_message(e.peer, std::move(s.m));
        } else {
          const router::PeerId& id = peers[size_t(e.peer)].id;
          msgs_to_router++;
          const WireError err(WireErrc::kChecksum, "tensor 0: checksum mismatch (the payload changed on the way)");
          call("undecodable", [&] { return core->on_undecodable(id, err, s.m.id, now); });
        }
        break;
      }
      case Ev::kToPeer:
        if (stale_peer) {
          release_slot(e.slot);
        } else if (now < peers[size_t(e.peer)].stall_until) {
          queue.push(Event{peers[size_t(e.peer)].stall_until, seq++, e.kind, e.peer, e.session, e.epoch, e.slot});  // stopped: read later
        } else {
          peer_receives(e.peer, release_slot(e.slot).m);
        }
        break;
      case Ev::kWhole:
        if (stale_peer) release_slot(e.slot);
        else request_whole(e.peer, e.slot);
        break;
      case Ev::kComputed:
        if (stale_peer) release_slot(e.slot);
        else computed(e.peer, e.slot);
        break;
      case Ev::kHeartbeat:
        if (!stale_peer) heartbeat(e.peer);
        break;
      case Ev::kJoin:
        if (!stale_peer) join(e.peer);
        break;
      case Ev::kCrash:
        if (!stale_peer && peers[size_t(e.peer)].alive) crash(e.peer, "crash (rate " + std::to_string(sc.faults.crash_per_hour) + "/h)", rng.exponential(sc.faults.rejoin_after_s));
        break;
      case Ev::kFault: fault(e.slot); break;
      case Ev::kFaultEnd:
        if (!stale_peer) fault_end(e.peer);
        break;
      case Ev::kRouterUp: router_up(); break;
      case Ev::kDisk:
        if (e.epoch != router_session || !router_alive) break;   // the router that asked is gone
        if (e.slot & 1) {
          router::CheckpointWritten w = *disk_writes[e.slot >> 1];
          disk_writes[e.slot >> 1].reset();
          call("checkpoint_written", [&] { return core->on_checkpoint_written(w, now); });
        } else {
          router::JobLoaded r = std::move(*disk_loads[e.slot >> 1]);
          disk_loads[e.slot >> 1].reset();
          call("job_loaded", [&] { return core->on_job_loaded(std::move(r), now); });
        }
        break;
      case Ev::kSubmit: {
        if (!router_alive) {
          schedule(now + 1, Ev::kSubmit);
          break;
        }
        msg::Hello h;
        h.role = msg::Role::kClient;
        h.version = wire::kVersion;
        call("client", [&] { return core->on_message(client_id, msg::make(h, 1), now); });
        call("client", [&] { return core->on_message(client_id, wire::json_message(wire::MsgType::kSubmit, 2, 0, {{"spec", sc.job_json}}), now); });
        if (!submit_error.empty()) throw ScenarioError("the router refused the scenario's job: " + submit_error);
        break;
      }
      case Ev::kSample:
        sample();
        schedule(now + sc.sample_s, Ev::kSample);
        break;
      case Ev::kPauseCheck: check_pause(); break;
    }
    if (pause_check) check_pause();
    if (job_ended) break;
  }
  if (!job_ended) now = end_s;
  if (now > win.t0) sample();
  SimResult r;
  r.summary = summary();
  line(r.summary);
  r.unmet = check_expectations(r.summary);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  r.perf = {{"event", "perf"},
            {"note", "CPU and wall time of this run on this machine: not part of the deterministic trace"},
            {"core_events", core_events},
            {"core_cpu_s", core_cpu_s},
            {"core_events_per_cpu_s", core_cpu_s > 0 ? double(core_events) / core_cpu_s : 0.0},
            {"core_us_per_event", core_events ? 1e6 * core_cpu_s / double(core_events) : 0.0},
            {"sim_events", sim_events},
            {"wall_s", wall},
            {"virtual_s", now},
            {"virtual_per_wall", wall > 0 ? now / wall : 0.0},
            {"router_cpu_share", now > 0 ? core_cpu_s / now : 0.0}};
  nlohmann::json by = nlohmann::json::object();
  for (const auto& [what, k] : core_by_event)
    by[what] = {{"events", k.events}, {"us_each", 1e6 * k.s / double(std::max<uint64_t>(1, k.events))}, {"share", core_cpu_s > 0 ? k.s / core_cpu_s : 0.0}};
  r.perf["core_by_event"] = std::move(by);
  return r;
}

SimResult simulate(const Scenario& s, const SimOptions& opt) {
  World w(s, opt);
  return w.run();
}

}  // namespace swarm::sim
