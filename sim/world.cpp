// world.cpp: the simulator's event loop, on one thread or two, and the router's side of the world
// (sim/simulator.h): the core and its restarts, the router's link, its disk (in memory), the
// client that submits the job, and `simulate`.
//
// Two sides (sim/world.h): the router's and the peers'. Each takes its own events in order; what
// one does to the other is a cross-event that lands there at least `lookahead_in` later, because
// it crosses a link. On two threads a side takes its next event at t only while the other can no
// longer send it anything before t: the other publishes a bound (no event of its own before it)
// and anything it sends lands at least the lookahead after that bound. Cross-events are ordered
// by (time, Lamport sequence, side), all three fixed by the sender, so each side takes the same
// events in the same order whether the sides run on two threads or interleave on one, and the
// trace (written by the peers' side alone) is the same byte for byte.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <thread>

#include "runtime/errors.h"
#include "sim/world.h"

namespace swarm::sim {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

Host host_of(const LinkSpec& l) {
  Host h;
  h.up.bps = l.up_bps;
  h.down.bps = l.down_bps;
  h.latency_s = l.latency_s;
  return h;
}

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

void EventQueue::push(const Event& e) {
  heap_.push_back(e);
  size_t i = heap_.size() - 1;
  while (i > 0) {
    const size_t parent = (i - 1) / 4;
    if (!(heap_[parent] > e)) break;
    heap_[i] = heap_[parent];
    i = parent;
  }
  heap_[i] = e;
}

void EventQueue::pop() {
  const Event last = heap_.back();
  heap_.pop_back();
  const size_t n = heap_.size();
  if (n == 0) return;
  size_t i = 0;
  for (;;) {
    const size_t first = 4 * i + 1;
    if (first >= n) break;
    size_t least = first;
    for (size_t c = first + 1; c < std::min(first + 4, n); ++c)
      if (heap_[least] > heap_[c]) least = c;
    if (!(last > heap_[least])) break;
    heap_[i] = heap_[least];
    i = least;
  }
  heap_[i] = last;
}

uint32_t SlotPool::put(Slot s) {
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
    slots_[i] = std::move(s);
  } else {
    i = uint32_t(slots_.size());
    slots_.push_back(std::move(s));
  }
  return i;
}

Slot SlotPool::take(uint32_t i) {
  Slot s = std::move(slots_[i]);   // what is left there is overwritten by the next put
  free_.push_back(i);
  return s;
}

World::World(const Scenario& s, const SimOptions& o) : sc(s), opt(o), rng(o.seed.value_or(s.seed)), costs(job_costs(s.job)) {
  router_side.id = SideId::kRouter;
  peers_side.id = SideId::kPeers;
  core_opt.heartbeat_ms = s.heartbeat_ms;
  core_opt.liveness = s.liveness;
  if (s.state_dir) core_opt.state_dir = "/sim/state";
  core = std::make_unique<router::RouterCore>(core_opt);
  router_host = host_of(s.router_link);
  end_s = s.duration_s;
  double least_latency = kNever;
  for (size_t g = 0; g < s.groups.size(); ++g) {
    const PeerGroup& grp = s.groups[g];
    if (grp.count > 0) least_latency = std::min(least_latency, grp.link.latency_s);
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
  for (const SimPeer& p : peers) {
    if (!p.listen.empty()) by_listen[p.listen] = p.index;
    peer_links.push_back({p.host.down.bps, p.host.latency_s});
  }
  // What the peers send reaches the router at least their link's latency later; what the router
  // sends reaches a peer at least its own.
  router_side.lookahead_in = peers.empty() ? kNever : least_latency;
  peers_side.lookahead_in = router_host.latency_s;
  group_alive.assign(s.groups.size(), 0);
  open_window();
}

Side& World::other(Side& s) { return s.id == SideId::kRouter ? peers_side : router_side; }

Event World::stamp(Side& from, double t, Ev kind, int peer) {
  Event e;
  e.t = t;
  e.seq = ++from.clock;
  e.from = from.id;
  e.kind = kind;
  e.peer = peer;
  return e;
}

void World::at(Side& s, double t, Ev kind, int peer, uint32_t slot) {
  Event e = stamp(s, t, kind, peer);
  e.session = s.id == SideId::kPeers ? (peer >= 0 ? peers[size_t(peer)].session : 0) : router_session;
  e.slot = slot;
  s.queue.push(e);
}

void World::cross(Side& from, double t, Ev kind, int peer, Slot slot) {
  Side& to = other(from);
  SWARM_CHECK(t >= from.now + to.lookahead_in, "a cross-event lands within the lookahead (" + std::to_string(t) + " < " +
                                                    std::to_string(from.now) + " + " + std::to_string(to.lookahead_in) + ")");
  const Event e = stamp(from, t, kind, peer);
  if (threaded) from.outbox.emplace_back(e, std::move(slot));   // handed over when this side next publishes its bound
  else deliver(to, e, std::move(slot));
}

void World::deliver(Side& to, Event e, Slot slot) {
  if (to.done) return;
  e.slot = to.slots.put(std::move(slot));
  to.queue.push(e);
}

void World::publish(Side& s, double bound) {
  if (!s.outbox.empty()) {
    Side& to = other(s);
    std::lock_guard<std::mutex> lock(to.mu);
    if (to.inbox.empty()) to.inbox.swap(s.outbox);
    else std::move(s.outbox.begin(), s.outbox.end(), std::back_inserter(to.inbox));
    to.arrived.store(true, std::memory_order_release);
  }
  s.outbox.clear();
  s.bound.store(bound, std::memory_order_release);
}

void World::drain(Side& s) {
  if (!s.arrived.load(std::memory_order_acquire)) return;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.received.swap(s.inbox);
    s.arrived.store(false, std::memory_order_relaxed);
  }
  for (auto& [e, slot] : s.received) deliver(s, e, std::move(slot));
  s.received.clear();
}

void World::step(Side& s) {
  const Event e = s.queue.top();
  s.queue.pop();
  s.now = e.t;
  s.clock = std::max(s.clock, e.seq);
  s.events++;
  if (s.id == SideId::kRouter) router_event(e);
  else peers_event(e);
}

void World::run_interleaved() {
  for (;;) {
    Side* next = nullptr;
    for (Side* s : {&router_side, &peers_side})
      if (!s->done && !s->queue.empty() && (!next || next->queue.top() > s->queue.top())) next = s;
    if (!next || next->queue.top().t > end_s) return;
    step(*next);
  }
}

void World::run_side(Side& s) {
  Side& o = other(s);
  try {
    int idle = 0;
    std::chrono::steady_clock::time_point waiting;
    while (!failed.load(std::memory_order_relaxed)) {
      const double theirs = o.bound.load(std::memory_order_acquire);
      drain(s);
      // Whatever the other side sends from now on lands at `limit` or later.
      const double limit = theirs + s.lookahead_in;
      for (int taken = 0; !failed.load(std::memory_order_relaxed); ++taken) {   // the other side threw: stop
        const double head = s.done || s.queue.empty() ? kNever : s.queue.top().t;
        if (s.done || (head > end_s && limit > end_s)) {
          publish(s, kNever);
          return;
        }
        if (!(head < limit && head <= end_s)) {
          publish(s, std::min(head, limit));
          break;
        }
        // The other side waits on this bound only when it has caught up: publishing it (and
        // handing over what was sent) every few events is enough.
        if (taken % 16 == 0) publish(s, head);
        if (idle) s.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
        idle = 0;
        step(s);
      }
      if (!idle) waiting = std::chrono::steady_clock::now();
      if (++idle > 20000) std::this_thread::yield();   // about a millisecond of spinning first
      else relax();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mu);
    if (!error) error = std::current_exception();
    failed = true;
  }
  s.bound.store(kNever, std::memory_order_release);
}

void World::run_threads() {
  std::thread router_thread([this] { run_side(router_side); });
  run_side(peers_side);
  router_thread.join();
  if (error) std::rethrow_exception(error);
}

// ---- The router's side ----

template <class F>
void World::call(const char* what, F&& f) {
  // A monotonic clock (30 ns a read here; the thread's CPU clock is a 1.4 us system call). The
  // core has a thread of its own, so this is its CPU time unless the OS preempts it, which only
  // makes the figure worse.
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

void World::router_line(nlohmann::json j) {
  Slot s;
  s.j = std::make_unique<nlohmann::json>(std::move(j));
  cross(router_side, rnow + peers_side.lookahead_in, Ev::kLine, -1, std::move(s));
}

void World::send_to_peer(int p, router::PeerId to, wire::Message m) {
  // The router's uplink here; the peer's downlink on its side (kFromRouterBulk) or, for a control
  // message that queues behind nothing, no work at all.
  const PeerLink& h = peer_links[size_t(p)];   // not peers[p]: the peers' thread writes there
  Slot s;
  s.bytes = message_bytes(m);
  s.m = std::move(m);
  s.id = std::move(to);
  const double dur = double(s.bytes) * 8.0 / std::min(router_host.up.bps, h.down_bps);
  router_host.up.bytes += s.bytes;
  if (s.bytes <= kControlBytes) return cross(router_side, rnow + dur + router_host.latency_s + h.latency_s, Ev::kToPeer, p, std::move(s));
  s.up_end = router_host.up.carry(rnow, dur) + router_host.latency_s;
  s.dur = dur;
  cross(router_side, rnow + router_host.latency_s, Ev::kFromRouterBulk, p, std::move(s));
}

void World::take(router::Actions actions) {
  std::vector<router::PeerId> unreachable;
  for (router::Action& a : actions) {
    if (auto* s = std::get_if<router::Send>(&a)) {
      if (s->to == client_id) {
        // The client: the job's id, or why it was refused.
        if (s->msg.type == wire::MsgType::kSubmitted) {
          job_id = msg::read<msg::Submitted>(s->msg).job_id;
          router_line({{"event", "submitted"}, {"t_s", rnow}, {"job_id", job_id}});
        } else if (s->msg.type == wire::MsgType::kError) {
          submit_error = msg::read<msg::Error>(s->msg).message;
        }
        continue;
      }
      auto it = peer_by_id.find(s->to);
      if (it == peer_by_id.end()) {
        unreachable.push_back(s->to);   // no process ever said HELLO with that id
        continue;
      }
      if (s->msg.type == wire::MsgType::kHeartbeat) heartbeats_out++;   // the router's liveness beat: a dead peer's send fails
      else msgs_from_router++;
      send_to_peer(it->second, std::move(s->to), std::move(s->msg));
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
      at(router_side, rnow + 0.05, Ev::kDisk, -1, uint32_t(disk_loads.size() - 1) << 1);
    } else if (auto* w = std::get_if<router::WriteCheckpoint>(&a)) {
      auto& kept = checkpoints[w->dir];
      kept.push_back(w->checkpoint);
      while (kept.size() > size_t(std::max(1, w->keep))) kept.erase(kept.begin());
      uint64_t bytes = 0;
      for (const auto& st : w->checkpoint->stages) bytes += 4 * (st.theta_g.size() + st.momentum.size() + st.theta.size() + st.adam_m.size() + st.adam_v.size());
      disk_writes.push_back(router::CheckpointWritten{w->job, w->checkpoint->step, w->dir + "/step-" + std::to_string(w->checkpoint->step), ""});
      at(router_side, rnow + 0.01 + double(bytes) / 1e9, Ev::kDisk, -1, (uint32_t(disk_writes.size() - 1) << 1) | 1);
    }
  }
  for (const router::PeerId& id : unreachable)
    if (router_alive && core->registry().find(id)) call("unreachable", [&] { return core->on_unreachable(id, rnow); });
}

void World::core_message(int p, const std::string& id, wire::Message m) {
  msgs_to_router++;
  if (m.type == wire::MsgType::kHeartbeat) heartbeats_in++;
  if (m.type == wire::MsgType::kHello) peer_by_id[id] = p;   // where the router's answers go
  // As the server: nothing but HELLO from a stranger is even decoded.
  if (!core->accepts(id, m.type)) m = wire::Message(m.type, m.id, m.attempt);
  call(wire::msg_type_name(m.type), [&] { return core->on_message(id, std::move(m), rnow); });
}

void World::router_down(double down_s) {
  router_restarts++;
  router_line({{"event", "router_down"}, {"t_s", rnow}, {"for_s", down_s}});
  router_alive = false;      // killed: no goodbye to anyone
  router_session++;          // its timers and disk results die with it
  core.reset();
  at(router_side, rnow + down_s, Ev::kRouterUp);
}

void World::router_up() {
  core = std::make_unique<router::RouterCore>(core_opt);
  router_alive = true;
  router_up_s = rnow;        // whatever was sent to the old one is lost
  router_host.up.free_s = router_host.down.free_s = rnow;
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
  router_line({{"event", "router_up"}, {"t_s", rnow}, {"jobs_restored", stored.size()}});
  call("restore", [&] { return core->restore(std::move(stored), rnow); });
}

void World::router_event(const Event& e) {
  SlotPool& slots = router_side.slots;
  switch (e.kind) {
    case Ev::kTick:
      if (router_alive) call("tick", [&] { return core->tick(rnow); });
      at(router_side, rnow + sc.tick_s, Ev::kTick);
      break;
    case Ev::kToRouterBulk: {
      // A large message down the router's link, shared with what it carries already.
      Slot& s = slots[e.slot];
      router_host.down.bytes += s.bytes;
      const double end = std::max(s.up_end, router_host.down.carry(rnow, s.dur)) + router_host.latency_s;
      at(router_side, end, Ev::kToRouter, e.peer, e.slot);
      break;
    }
    case Ev::kToRouter: {
      Slot s = slots.take(e.slot);
      if (e.from == SideId::kPeers) router_host.down.bytes += s.bytes;   // small: it queued behind nothing
      if (!router_alive || s.depart_s < router_up_s) break;              // sent to a router that is gone: lost
      if (!s.corrupt) {
        core_message(e.peer, s.id, std::move(s.m));
      } else {
        msgs_to_router++;
        const WireError err(WireErrc::kChecksum, "tensor 0: checksum mismatch (the payload changed on the way)");
        call("undecodable", [&] { return core->on_undecodable(s.id, err, s.m.id, rnow); });
      }
      break;
    }
    case Ev::kUnreachable: {
      const Slot s = slots.take(e.slot);
      if (router_alive && core->registry().find(s.id)) call("unreachable", [&] { return core->on_unreachable(s.id, rnow); });
      break;
    }
    case Ev::kRouterDown: {
      const FaultEvent& f = sc.faults.events[e.slot];
      if (router_alive) router_down(f.for_s);
      router_line({{"event", "fault"}, {"t_s", rnow}, {"kind", "restart_router"}, {"peers", nlohmann::json::array()}});
      break;
    }
    case Ev::kRouterUp: router_up(); break;
    case Ev::kDisk:
      if (e.session != router_session || !router_alive) break;   // the router that asked is gone
      if (e.slot & 1) {
        router::CheckpointWritten w = *disk_writes[e.slot >> 1];
        disk_writes[e.slot >> 1].reset();
        call("checkpoint_written", [&] { return core->on_checkpoint_written(w, rnow); });
      } else {
        router::JobLoaded r = std::move(*disk_loads[e.slot >> 1]);
        disk_loads[e.slot >> 1].reset();
        call("job_loaded", [&] { return core->on_job_loaded(std::move(r), rnow); });
      }
      break;
    case Ev::kSubmit: {
      if (!router_alive) {
        at(router_side, rnow + 1, Ev::kSubmit);
        break;
      }
      msg::Hello h;
      h.role = msg::Role::kClient;
      h.version = wire::kVersion;
      call("client", [&] { return core->on_message(client_id, msg::make(h, 1), rnow); });
      call("client", [&] { return core->on_message(client_id, wire::json_message(wire::MsgType::kSubmit, 2, 0, {{"spec", sc.job_json}}), rnow); });
      if (!submit_error.empty()) throw ScenarioError("the router refused the scenario's job: " + submit_error);
      break;
    }
    case Ev::kRouterSample: {
      Slot s;
      s.j = std::make_unique<nlohmann::json>(router_half());
      cross(router_side, rnow + peers_side.lookahead_in, Ev::kRouterHalf, -1, std::move(s));
      at(router_side, rnow + sc.sample_s, Ev::kRouterSample);
      break;
    }
    case Ev::kPauseCheck: check_pause(); break;
    default: SWARM_CHECK(false, "a peers' event on the router's side");
  }
  if (pause_check) check_pause();
  if (job_ended && !router_side.done) {
    // Nothing more happens: the peers' side stops when this reaches it.
    job_end_s = rnow;
    cross(router_side, rnow + peers_side.lookahead_in, Ev::kStop, -1, Slot());
    router_side.done = true;
  }
}

// ---- The peers' side ----

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

void World::to_router(int p, wire::Message m, double depart_s, bool corrupt) {
  // The peer's uplink here; the router's downlink on its side (kToRouterBulk), or nothing to
  // queue behind for a control message.
  SimPeer& peer = peers[size_t(p)];
  peer.last_sent_s = std::max(peer.last_sent_s, depart_s);
  Slot s;
  s.bytes = message_bytes(m);
  s.m = std::move(m);
  s.id = peer.id;
  s.depart_s = depart_s;
  s.corrupt = corrupt;
  const double dur = double(s.bytes) * 8.0 / std::min(peer.host.up.bps, router_host.down.bps);
  peer.host.up.bytes += s.bytes;
  if (s.bytes <= kControlBytes) return cross(peers_side, depart_s + dur + peer.host.latency_s + router_host.latency_s, Ev::kToRouter, p, std::move(s));
  s.up_end = peer.host.up.carry(depart_s, dur) + peer.host.latency_s;
  s.dur = dur;
  cross(peers_side, depart_s + peer.host.latency_s, Ev::kToRouterBulk, p, std::move(s));
}

void World::peers_event(const Event& e) {
  SlotPool& slots = peers_side.slots;
  // Events a crashed process scheduled for itself die with it.
  const bool stale_peer = e.from == SideId::kPeers && e.peer >= 0 && e.session != peers[size_t(e.peer)].session;
  switch (e.kind) {
    case Ev::kFromRouterBulk: {
      // A large message down the peer's link, shared with what it carries already.
      Slot& s = slots[e.slot];
      SimPeer& p = peers[size_t(e.peer)];
      p.host.down.bytes += s.bytes;
      const double end = std::max(s.up_end, p.host.down.carry(now, s.dur)) + p.host.latency_s;
      at(peers_side, end, Ev::kToPeer, e.peer, e.slot);
      break;
    }
    case Ev::kToPeer: {
      SimPeer& p = peers[size_t(e.peer)];
      if (e.from == SideId::kRouter) p.host.down.bytes += slots[e.slot].bytes;   // small: it queued behind nothing
      if (!p.alive || p.id != slots[e.slot].id) {
        // Its process is gone: the router's send fails (ROUTER_MANDATORY) as the connection's end reaches it.
        Slot s = slots.take(e.slot);
        Slot back;
        back.id = std::move(s.id);
        cross(peers_side, now + p.host.latency_s, Ev::kUnreachable, e.peer, std::move(back));
        break;
      }
      if (now < p.stall_until) {   // stopped: read later
        at(peers_side, p.stall_until, Ev::kToPeer, e.peer, e.slot);
        break;
      }
      wire::Message m = slots.take(e.slot).m;
      if (m.type == wire::MsgType::kPush) push(e.peer, m);
      else peer_receives(e.peer, std::move(m));
      break;
    }
    case Ev::kWhole:
      if (stale_peer) slots.take(e.slot);
      else request_whole(e.peer, e.slot);
      break;
    case Ev::kComputed:
      if (stale_peer) slots.take(e.slot);
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
    case Ev::kSample:
      peers_half();
      at(peers_side, now + sc.sample_s, Ev::kSample);
      break;
    case Ev::kRouterHalf: sample(*slots.take(e.slot).j); break;
    case Ev::kLine: line(std::move(*slots.take(e.slot).j)); break;
    case Ev::kStop: peers_side.done = true; break;
    default: SWARM_CHECK(false, "a router's event on the peers' side");
  }
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
    at(peers_side, t, Ev::kJoin, p.index);
  }
  at(router_side, sc.submit_s >= 0 ? sc.submit_s : last_join + 0.5, Ev::kSubmit);
  at(router_side, 0, Ev::kTick);
  at(router_side, sc.sample_s, Ev::kRouterSample);
  at(peers_side, sc.sample_s, Ev::kSample);
  for (size_t i = 0; i < sc.faults.events.size(); ++i) {
    const bool router_fault = sc.faults.events[i].kind == FaultEvent::Kind::kRestartRouter;
    at(router_fault ? router_side : peers_side, sc.faults.events[i].at_s, router_fault ? Ev::kRouterDown : Ev::kFault, -1, uint32_t(i));
  }

  const double lookahead = router_side.lookahead_in + peers_side.lookahead_in;
  threaded = opt.threads == 2 || (opt.threads == 0 && lookahead > 0 && std::thread::hardware_concurrency() >= 2);
  if (threaded && !(lookahead > 0)) throw ScenarioError("two threads need links with latency: messages between the router and the peers take no time here");
  if (threaded) run_threads();
  else run_interleaved();

  // The end: the job's, or the scenario's duration.
  now = rnow = job_ended ? std::max(job_end_s, now) : end_s;
  finish_samples();
  SimResult r;
  r.summary = summary();
  line(r.summary);
  r.unmet = check_expectations(r.summary);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  r.perf = {{"event", "perf"},
            {"note", "CPU and wall time of this run on this machine: not part of the deterministic trace"},
            {"threads", threaded ? 2 : 1},
            {"core_events", core_events},
            {"core_cpu_s", core_cpu_s},
            {"core_events_per_cpu_s", core_cpu_s > 0 ? double(core_events) / core_cpu_s : 0.0},
            {"core_us_per_event", core_events ? 1e6 * core_cpu_s / double(core_events) : 0.0},
            {"sim_events", router_side.events + peers_side.events},
            {"wait_s", {{"router", router_side.wait_s}, {"peers", peers_side.wait_s}}},
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
